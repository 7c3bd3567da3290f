"""A pipelined run's last step as text, for a terminal without an image viewer (pipeline.png is the picture).

    python -m llmtrain.bench.pipeline_chart outputs/<run> [--width 120]

One row per pipeline rank; each column is a slice of the step's wall-clock time showing what ran there:
F forward, B backward (input gradient when the schedule splits it), W weight gradient, lower case for a rank's
later virtual stage, `.` idle. Below: the measured bubble against (p - 1)/(v·m) and the peak micro-batches alive.
"""

from __future__ import annotations

import argparse
import json
import os

from llmtrain.errors import closed_pipe_is_quiet


def text_gantt(events_per_rank: list[list[dict]], width: int) -> list[str]:
    start = min(e["start"] for events in events_per_rank for e in events)
    span = max(e["end"] for events in events_per_rank for e in events) - start
    n_ranks = len(events_per_rank)
    rows = []
    for rank, events in enumerate(events_per_rank):
        row = ["."] * width
        for e in events:
            first = int((e["start"] - start) / span * width)
            last = max(first + 1, int((e["end"] - start) / span * width))
            mark = e["kind"] if e["stage"] < n_ranks else e["kind"].lower()
            row[first:last] = mark * (min(last, width) - first)
        rows.append(f"rank {rank:<3} {''.join(row)}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--width", type=int, default=120, help="characters for the step's duration")
    args = parser.parse_args()
    with open(os.path.join(args.run_dir, "pipeline.json")) as f:
        pipeline = json.load(f)
    events = pipeline["events"]
    duration = max(e["end"] for r in events for e in r) - min(e["start"] for r in events for e in r)
    print(
        f"{pipeline['schedule']}: pp={pipeline['pp']}, {pipeline['microbatches']} micro-batches, "
        f"{pipeline['stages_per_rank']} stage(s)/rank, step {duration * 1e3:.1f} ms"
    )
    print("\n".join(text_gantt(events, args.width)))
    print(
        f"bubble (idle / compute): measured {pipeline['bubble_measured']:.2f}, (p-1)/(v·m) = "
        f"{pipeline['bubble_theory']:.2f}; peak micro-batches alive per rank {pipeline['peak_in_flight']}"
    )


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
