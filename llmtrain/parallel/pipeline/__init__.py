"""Pipeline parallelism: split.py (the stage cut), schedules.py (which schedule), reference.py (1F1B by hand),
p2p.py (messages between stages), timeline.py (what ran when: Gantt chart, bubble), parallel_model.py (the "pp"
layout's ParallelModel, imported when the registry is first asked for it)."""
