"""Measurements, each a `python -m llmtrain.bench.<name>` command that prints ratios against a baseline measured in
the same run: the planner's predictions against real layouts (layout_memory, comm_count, layout_benchmark,
activation_memory, tp_comms), collective bandwidth (comm_bench), the pipeline's schedule (pipeline_chart),
checkpoints, data, the trainer's overhead, ring attention's overlap and the mixture's cost. docs/benchmarks.md holds
their tables with the commands that made them; the user's commands are in llmtrain/tools/."""
