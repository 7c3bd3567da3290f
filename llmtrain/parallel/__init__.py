"""Parallel layouts: each row of llmtrain/catalog.py's LAYOUTS names its data-parallel mechanism, a ParallelModel
class in data_parallel.py (ddp, zero1, fsdp) or parallel_model.py (none), or a pipeline (pipeline/), which
registry.py (`parallelize`) builds. How a layout is applied to the model: layout.py, one
step per module (context.py, expert.py, tp.py, fsdp.py, ddp.py, zero.py); where a rank sits: mesh.py.

Nothing is imported with the package itself: a process that needs one piece (ring_attention.py in a test worker)
does not pay for every layout's imports (FSDP, DCP, pipelining: seconds per process)."""
