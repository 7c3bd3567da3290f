"""Pipeline parallelism: split.py (the stage cut), schedules.py (which schedule), reference.py (1F1B by hand),
p2p.py (messages between stages), timeline.py (what ran when: Gantt chart, bubble), strategy.py (the "pp" layout,
registered when the registry is first used)."""
