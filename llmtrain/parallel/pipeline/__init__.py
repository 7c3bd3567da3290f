"""Pipeline parallelism: split.py (the stage cut), schedules.py (which schedule), reference.py (1F1B by hand),
p2p.py (messages between stages), timeline.py (what ran when: Gantt chart, bubble), pipeline.py (this rank's
stages and the schedule that runs them: the executor a pipelined ParallelModel holds)."""
