"""Parallel layouts: `parallel.strategy` names a ParallelModel class in data_parallel.py (ddp, zero1, fsdp),
parallel_model.py (single, tp) or pipeline/ (pp, and the 3-D layouts pp_fsdp, pp_tp, 3d), looked up in
llmtrain/catalog.py's table by registry.py (`parallelize`). How a layout is applied to the model: layout.py, one
step per module (context.py, expert.py, tp.py, fsdp.py, ddp.py, zero.py); where a rank sits: mesh.py.

Nothing is imported with the package itself: a process that needs one piece (ring_attention.py in a test worker)
does not pay for every layout's imports (FSDP, DCP, pipelining: seconds per process)."""
