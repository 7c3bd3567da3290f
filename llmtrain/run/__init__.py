"""One job, the top floor under the commands: building it (build.py) and running it from start to exit (job.py),
the smaller micro-batch after running out of memory (retry.py), what rank 0 reports (reporting.py), how it ends
(exits.py), its workers (spawn.py) and a checkpoint laid out as its run trained it (laid_out.py). The process it runs
in is llmtrain/process/'s. Nothing is imported with the package itself."""
