"""The run's machinery, each module one job: the process's place and device (runtime.py), what its launcher says
(launch_env.py), its directory (run_dir.py) and what its attempts leave the next one (attempts.py); building a job
(build.py) and running it from start to exit (job.py), the smaller micro-batch after running out of memory
(retry.py), what rank 0 reports (reporting.py), how it ends (exits.py), its workers (spawn.py) and the entry points
around Hydra (entry.py). Nothing is imported with the package itself."""
