"""What a process is, the bottom floor every layer stands on: its place in the job and its device (runtime.py),
what its launcher says (launch_env.py), the run directory every rank agrees on (run_dir.py) and what an attempt
leaves the next one (attempts.py). Nothing here knows a model, a layout or a loop."""
