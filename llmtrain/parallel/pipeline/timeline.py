"""What the pipeline did, measured: when each micro-batch's forward (F), backward (B; the input-gradient half when
the schedule splits it) and weight-gradient (W) ran on each rank, how many micro-batches held activations at once,
the bubble, and a Gantt chart of one step.

On CPU the times are the host's wall clock. On a GPU the host only launches kernels, so a host clock would time
the launches: there each piece is bracketed by CUDA events recorded on the stream, read (one synchronisation) only
when the events are collected after the run, and placed on the wall clock from an event recorded at the step's
start. The previous step ended with a host synchronisation, so that anchor is off by at most the optimizer step's
launch time; times are comparable across the processes of one machine and, to NTP precision, across nodes. The
chart starts at the earliest event of the step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#c4a35a"}


@dataclass(frozen=True)
class Event:
    kind: str  # F, B or W
    stage: int
    micro_batch: int
    start: float
    end: float


class HostClock:
    """Marks are wall-clock seconds."""

    def begin_step(self) -> None:
        pass

    def mark(self) -> float:
        return time.time()

    def seconds(self, mark: float) -> float:
        return mark


class CudaClock:
    """Marks are CUDA events on the current stream: when the device reached that point of the work."""

    def __init__(self) -> None:
        self._origin: torch.cuda.Event | None = None
        self._origin_seconds = 0.0

    def begin_step(self) -> None:
        self._origin = self.mark()
        self._origin_seconds = time.time()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark: torch.cuda.Event) -> float:
        assert self._origin is not None, "marks are made within a step"
        mark.synchronize()
        return self._origin_seconds + self._origin.elapsed_time(mark) / 1e3


class Timeline:
    """One rank's record of the current step, and the peak number of (stage, micro-batch) pairs whose activations
    were alive at once over the whole run: alive from the end of F until the last backward piece (B, or W when
    the schedule splits the backward) has run."""

    def __init__(self, device: torch.device) -> None:
        self.clock: HostClock | CudaClock = CudaClock() if device.type == "cuda" else HostClock()
        self.peak_in_flight = 0
        self._marked: list[tuple[str, int, int, Any, Any]] = []  # (kind, stage, micro-batch, start, end marks)
        self._alive: set[tuple[int, int]] = set()

    def begin_step(self) -> None:
        self._marked = []
        self._alive.clear()
        self.clock.begin_step()

    @contextmanager
    def record(self, kind: str, stage: int, micro_batch: int) -> Iterator[None]:
        start = self.clock.mark()
        yield
        self._marked.append((kind, stage, micro_batch, start, self.clock.mark()))

    @property
    def events(self) -> list[Event]:
        """The current step's events in seconds (on a GPU this waits for them: read it after the run)."""
        seconds = self.clock.seconds
        return [Event(kind, stage, i, seconds(start), seconds(end)) for kind, stage, i, start, end in self._marked]

    def activations_saved(self, stage: int, micro_batch: int) -> None:
        self._alive.add((stage, micro_batch))
        self.peak_in_flight = max(self.peak_in_flight, len(self._alive))

    def activations_freed(self, stage: int, micro_batch: int) -> None:
        self._alive.discard((stage, micro_batch))


class TimedStage(PipelineStage):
    """torch's PipelineStage, recording each piece of work the schedule runs into a Timeline."""

    def __init__(self, *args, timeline: Timeline, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeline = timeline

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        with self.timeline.record("F", self.stage_index, fwd_chunk_id):
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.has_backward:
            self.timeline.activations_saved(self.stage_index, fwd_chunk_id)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        with self.timeline.record("B", self.stage_index, bwd_chunk_id):
            super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
        if full_backward:
            self.timeline.activations_freed(self.stage_index, bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with self.timeline.record("W", self.stage_index, bwd_chunk_id):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self.timeline.activations_freed(self.stage_index, bwd_chunk_id)


def bubble_fraction(events_per_rank: list[list[Event]]) -> float:
    """Idle time over compute time, averaged over ranks: the measured counterpart of (p - 1) / m. The step spans
    from the first event on any rank to the last; a rank's idle time is that span minus its own busy time (waiting
    for a neighbour's message counts as idle, as it does in the formula)."""
    start = min(e.start for events in events_per_rank for e in events)
    end = max(e.end for events in events_per_rank for e in events)
    ratios = []
    for events in events_per_rank:
        busy = sum(e.end - e.start for e in events)
        ratios.append((end - start - busy) / busy)
    return sum(ratios) / len(ratios)


def plot_gantt(events_per_rank: list[list[Event]], path: str, title: str, stages_per_rank: int) -> None:
    """Rows = pipeline ranks (rank 0 on top), one box per F / B / W, labelled with its micro-batch; with several
    stages per rank the later stages' boxes are hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(e.start for events in events_per_rank for e in events)
    span = max(e.end for events in events_per_rank for e in events) - origin
    n_ranks = len(events_per_rank)
    fig, ax = plt.subplots(figsize=(12, 0.6 * n_ranks + 1.6), dpi=110)
    for rank, events in enumerate(events_per_rank):
        for e in events:
            left, width = (e.start - origin) * 1e3, (e.end - e.start) * 1e3
            later_stage = stages_per_rank > 1 and e.stage >= n_ranks
            ax.barh(
                rank,
                width,
                left=left,
                height=0.8,
                color=COLOURS[e.kind],
                edgecolor="black",
                linewidth=0.4,
                hatch="//" if later_stage else None,
            )
            if width > span * 1e3 / 120:
                ax.text(left + width / 2, rank, str(e.micro_batch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time since the step's first event (ms)")
    ax.set_title(title, fontsize=10)
    legend = [
        Patch(color=COLOURS[k], label=label)
        for k, label in (("F", "forward"), ("B", "backward (input grad when split)"), ("W", "weight grad"))
    ]
    if stages_per_rank > 1:
        legend.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="later virtual stage"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(legend), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
