"""Profiling on demand (`profile.*`): torch.profiler over chosen training steps, a Chrome trace per rank, the
busiest operators for the end summary; and the CUDA allocator's history, written on an out-of-memory error or at
the end of the run. Measure first: where a step's time and memory go, on the run itself."""

from __future__ import annotations

import logging
import os

import torch

from llmtrain.config import ProfileConfig
from llmtrain.process.runtime import Runtime
from llmtrain.train.observers import StepObserver

log = logging.getLogger("llmtrain")
TOP_OPERATORS = 5


class StepProfiler(StepObserver):
    """Starts torch.profiler as step `first` begins and stops it as step `last` ends (profile.steps), writing
    `profile/trace-rank<r>.json`; with profile.memory on a GPU, records allocations from the start."""

    def __init__(self, cfg: ProfileConfig, runtime: Runtime, run_dir: str):
        self.span = tuple(cfg.steps) if cfg.steps is not None else None
        self.directory = os.path.join(run_dir, "profile")
        self.rank = runtime.rank
        self.device = runtime.device
        self.records_memory = cfg.memory and runtime.device.type == "cuda"
        self.top_operators: list[tuple[str, float]] = []  # (name, share of the recorded self time)
        self.trace_path: str | None = None
        self._profiler: torch.profiler.profile | None = None
        if self.records_memory:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def step_begins(self, step: int) -> None:
        if self.span is not None and step == self.span[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()

    def step_ends(self, step: int, seconds: float) -> None:
        if self._profiler is None or self.span is None or step != self.span[1]:
            return
        self._profiler.stop()
        os.makedirs(self.directory, exist_ok=True)
        self.trace_path = os.path.join(self.directory, f"trace-rank{self.rank}.json")
        self._profiler.export_chrome_trace(self.trace_path)
        self.top_operators = busiest_operators(self._profiler, on_device=self.device.type == "cuda")
        self._profiler = None

    def write_memory(self, why: str) -> str | None:
        """The allocator's recorded history (profile.memory on a GPU), written once; its path."""
        if not self.records_memory:
            return None
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"memory-rank{self.rank}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        self.records_memory = False
        log.warning(f"rank {self.rank}: CUDA memory history ({why}) written to {path}")
        return path

    def summary(self) -> dict | None:
        """What the end summary and summary.json say about the profile (None when no steps were recorded)."""
        if self.trace_path is None or self.span is None:
            return None
        return {
            "steps": list(self.span),
            "trace": os.path.relpath(self.trace_path, os.path.dirname(self.directory)),
            "top_operators": [{"name": name, "share": round(share, 4)} for name, share in self.top_operators],
        }


def busiest_operators(profiler: torch.profiler.profile, on_device: bool) -> list[tuple[str, float]]:
    """The operators with the most self time (device time on a GPU, host time otherwise) and their share of it."""
    averages = profiler.key_averages()
    attribute = "self_device_time_total" if on_device else "self_cpu_time_total"
    times = [(event.key, float(getattr(event, attribute))) for event in averages]
    total = sum(time for _, time in times) or 1.0
    busiest = sorted(times, key=lambda item: item[1], reverse=True)[:TOP_OPERATORS]
    return [(name, time / total) for name, time in busiest]
