"""gpu_check's scheduler and process runner: which rows run side by side within the budget, and each row's process
(a `train.py` run, torchrun's, or a tool's), stopped as a HANG past its timeout, its metrics read into a `Row`.

Most of a row's time is starting up (imports, building, compiling), not its steps, so rows share the GPU: the
correctness rows run side by side, then the speed rows start side by side too but take their steps after the first
one row at a time. Every row compiles into one cache, so a graph compiled once is loaded by the next row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtrain.tools.arithmetic_set import records
from llmtrain.tools.compare_runs import read_metrics
from llmtrain.tools.gpu_check_table import Check

REPO = Path(__file__).resolve().parents[2]
MIN_ROW_SECONDS = 20  # a row started with less of the budget left would be cut before it shows anything


@dataclass
class Row:
    name: str
    status: str = "ok"
    seconds: float = 0.0
    first_loss: float | None = None
    final_loss: float | None = None
    difference: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_gib: float | None = None
    reserved_gib: float | None = None
    gpu: str = ""  # how it shared the GPU: "alone" (its measured steps), or the rows that ran beside it
    notes: list[str] = field(default_factory=list)
    span: tuple[float, float] = (0.0, 0.0)  # when its process ran (monotonic seconds)


def run_dir(workdir: Path, check_name: str) -> Path:
    """Where a check's training run writes its metrics and checkpoints."""
    return workdir / check_name.replace(" ", "_")


class Schedule:
    """Runs the rows within the budget: the correctness rows side by side (`parallel` at a time: a row holds 8-17 GB
    of an H200's 141), then the speed rows, started side by side too but taking their measured steps in turn; a
    row that resumes another's checkpoint after that row. A row that would start with less than MIN_ROW_SECONDS of
    the budget left is not run; one the budget stops is cut."""

    def __init__(
        self, base: list[str], workdir: Path, *, parallel: int, timeout: float, budget: float, device: str
    ) -> None:
        """`base`: every run's overrides before its check's; `budget`: seconds for all the rows (0: no limit)."""
        self.base, self.workdir, self.parallel, self.timeout, self.device = base, workdir, parallel, timeout, device
        self.deadline = time.monotonic() + (budget or float("inf"))

    def run(self, checks: list[Check]) -> list[Row]:
        """Every check's row, in the checks' order, with the GPU column filled."""
        finished: dict[str, Future[Row]] = {}
        for speed in (False, True):
            with ThreadPoolExecutor(self.parallel) as pool:
                for check in checks:
                    if check.speed == speed:
                        source = finished.get(check.resume_from) if check.resume_from else None
                        finished[check.name] = pool.submit(self._row, check, source)
        rows = [finished[check.name].result() for check in checks]
        for check, row in zip(checks, rows):
            beside = sum(other is not row and _overlap(row.span, other.span) for other in rows)
            row.gpu = "" if not row.span[1] else "alone" if check.speed else f"with {beside}"
        return rows

    def _row(self, check: Check, source: Future[Row] | None) -> Row:
        if source is not None and source.result().status != "ok":
            return Row(check.name, status="not run (the row it resumes failed)")
        left = self.deadline - time.monotonic()
        if left < MIN_ROW_SECONDS:
            return Row(check.name, status="not run (--budget)")
        row = run_check(check, self.base, self.workdir, min(self.timeout, left), self.device)
        if row.status.startswith("HANG") and left < self.timeout:
            row.status = "cut (--budget)"
        print(f"{row.name}: {row.status} ({row.seconds:.0f}s)", file=sys.stderr, flush=True)
        return row


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[1] > 0 and b[1] > 0 and a[0] < b[1] and b[0] < a[1]


def run_check(check: Check, base: list[str], workdir: Path, timeout: float, device: str) -> Row:
    """One check in a process of its own, stopped after `timeout` seconds. Every run compiles into one cache
    (workdir/inductor: a graph compiled by one row is loaded by the next); a speed row takes its steps after the
    first in turn with the other speed rows (the gpu_turn point of llmtrain/faults.py)."""
    check_dir = run_dir(workdir, check.name)
    counts = {name: check_dir.with_name(f"{check_dir.name}.{name}") for name in ("host_reads", "device_syncs")}
    points = dict(counts) if check.counts_syncs else {}
    if check.speed:
        points["gpu_turn"] = workdir / "gpu.turn"
    env = {
        "LLMTRAIN_FAULTS": " ".join(f"{name}={path}" for name, path in points.items()),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    if check.module is not None:
        return _run_module(check, device, timeout, env, [*base, *check.overrides], check_dir.with_suffix(".json"))
    overrides = [*base, *check.overrides, f"hydra.run.dir={check_dir}"]
    if check.prompts:
        prompts = check_dir.with_suffix(".prompts.jsonl")
        prompts.write_text("".join(json.dumps(record) + "\n" for record in records(400, 0, 20, text=True)))
        overrides.append(f"data.path={prompts}")
    if check.steps is not None:
        overrides.append(f"train.steps={check.steps}")
    if check.resume_from:
        source = run_dir(workdir, check.resume_from) / "checkpoints" / "step-00000005"
        overrides.append(f"checkpoint.resume={source}")
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={check.nproc}"]
        if check.nproc
        else [sys.executable]
    )
    row, _ = _run(check.name, [*launcher, str(REPO / "train.py"), *overrides], timeout, env)
    if row.status != "ok":
        return row
    fill_row(row, read_metrics(str(check_dir)))
    if check.counts_syncs:
        count_syncs(row, *(_per_step(path) for path in counts.values()))
    return row


def _run(name: str, command: list[str], timeout: float, env: dict[str, str]) -> tuple[Row, str]:
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the whole group can be stopped on a hang
        env={**os.environ, "WANDB_MODE": "disabled", **{key: value for key, value in env.items() if value}},
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        ended = time.monotonic()
        return Row(name, status=f"HANG (>{timeout:.0f}s)", seconds=ended - started, span=(started, ended)), ""
    ended = time.monotonic()
    row = Row(name, seconds=ended - started, span=(started, ended))
    if process.returncode != 0:
        row.status = f"FAIL (exit {process.returncode})"
        lines = output.strip().splitlines() or ["no output"]
        # the run's own one-line error where there is one (torchrun ends its output with a box of its own)
        row.notes.append(next((line for line in reversed(lines) if line.startswith("error:")), lines[-1]))
    return row, output


def _run_module(
    check: Check, device: str, timeout: float, env: dict[str, str], overrides: list[str], result: Path
) -> Row:
    """A check that is a tool of its own: its exit status is the result, its output lines the notes. A benchmark
    times the run of `overrides` and writes its JSON to `result`: its tokens/s are its bare loop's
    (bench/overhead.py), its note each loop's time against it."""
    assert check.module is not None
    command = [sys.executable, "-m", check.module, "--device", device, *check.options]
    if check.benchmark:
        command += ["--out", str(result), *overrides]
    row, output = _run(check.name, command, timeout, env)
    if row.status.startswith("FAIL") or row.status == "ok":
        row.notes = [line for line in output.strip().splitlines() if line and "Warning" not in line][-8:]
    if check.benchmark and row.status == "ok":
        ladder = json.loads(result.read_text())
        row.tokens_per_s = ladder["tokens_per_step"] / ladder["s_per_step"]["bare"]
        row.notes = [
            ", ".join(f"{name} {ladder['ratio'][name]:.3f}x" for name in ladder["ratio"] if name != "bare")
            + f" of the bare loop's {ladder['s_per_step']['bare'] * 1e3:.1f} ms/step"
        ]
    return row


def _per_step(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def count_syncs(row: Row, reads: list[int], syncs: list[int]) -> None:
    """The steady steps' (after the second: the first compiles, warms up and infers shapes) host reads and device
    syncs: a sync beyond the planned reads fails the row."""
    steady_reads, steady_syncs = reads[2:], syncs[2:]
    row.notes.append(
        f"per step after the 2nd: host reads {sorted(set(steady_reads))}, device syncs {sorted(set(steady_syncs))}"
    )
    if not steady_reads or any(sync > read for sync, read in zip(steady_syncs, steady_reads)):
        row.status = "FAIL"
        row.notes.append("a step waited for the device more often than it read from it")


def fill_row(row: Row, records: list[dict[str, Any]]) -> None:
    """Loss, speed and memory columns from a run's metrics, and a failure when a step was skipped. Speed is over
    the steps after the second: the first compiles and warms up, the second may wait for its turn on the GPU."""
    row.first_loss, row.final_loss = records[0]["loss"], records[-1]["loss"]
    steady = records[2:] or records
    row.tokens_per_s = sum(r["tokens_per_s"] for r in steady) / len(steady)
    if steady[-1].get("mfu") is not None:
        row.mfu = sum(r["mfu"] for r in steady) / len(steady)
    if "peak_memory_gib" in records[-1]:
        row.peak_gib = max(r["peak_memory_gib"] for r in records)
        row.reserved_gib = max(r["peak_reserved_gib"] for r in records)
        if records[-1]["alloc_retries"]:
            row.notes.append(f"{records[-1]['alloc_retries']} allocation retries")
    skipped = [r["step"] for r in records if r.get("skipped")]
    if skipped:
        row.status = "FAIL"
        row.notes.append(f"non-finite steps {skipped}")
