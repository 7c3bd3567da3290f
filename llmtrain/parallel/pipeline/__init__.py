"""Pipeline parallelism's pieces, none of which knows a layout: split.py (the stage cut), schedules.py (which
schedule), reference.py (1F1B by hand), p2p.py (messages between stages), timeline.py (what ran when: Gantt chart,
bubble). The executor a pipelined ParallelModel holds, built from them, is ../pipelined.py."""
