"""Parallel layouts: a ParallelModel (parallel_model.py) lays out any row of llmtrain/catalog/layouts.py's LAYOUTS,
holding the row's data-parallel mechanism (data_parallel.py) and the executor that runs each step (executor.py:
accumulation.py's, or for a pipelined row pipelined.py's Pipeline, built on pipeline/'s pieces). How a layout is
applied to the model: layout.py, one step per module (context.py, expert.py, tp.py, fsdp.py, ddp.py, zero.py);
where a rank sits: mesh.py.

Nothing is imported with the package itself: a process that needs one piece (ring_attention.py in a test worker)
does not pay for every layout's imports (FSDP, DCP, pipelining: seconds per process)."""
