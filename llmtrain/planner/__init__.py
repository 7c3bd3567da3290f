"""The planner: for a model, a batch and the hardware, what each layout holds per rank, what it sends per step,
how long a step should take, and which layout to run ("measure first", then compute what fits).

    shapes.py      what a rank's part of the model holds, counted from the model config
    candidates.py  the layouts weighed for a world size (registered strategies with degrees)
    memory.py      model states (ZeRO) and activations (Korthikanti) per rank
    comm.py        bytes per collective and step, as llmtrain's layouts issue them
    links.py       seconds per collective, from conf/hardware/ or a measured comm_bench CSV
    plan.py        one layout's plan, predicted step time, and the choice among layouts
    inputs.py      the machine and workload of a composed config
    auto.py        parallel=auto
    resolve.py     the planner on a live run: its device's hardware, parallel=auto decided on rank 0 for every
                   rank, the end summary's prediction

Used by `python -m llmtrain.tools.plan`, by `parallel=auto` (resolve.py, from llmtrain/run/build.py) and by
llmtrain.bench.layout_memory, which measures what the plans predict.
"""
