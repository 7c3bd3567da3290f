"""Pipeline parallelism: split.py (the stage cut), schedules.py (which schedule), reference.py (1F1B by hand),
p2p.py (messages between stages), timeline.py (what ran when: Gantt chart, bubble), strategy.py (the layouts)."""

from llmtrain.parallel.pipeline import strategy  # noqa: F401  (registers "pp")
