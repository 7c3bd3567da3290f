"""What each attempt at a run ended with, kept in its run directory: a requeue or restart is for what the machine
did (a hang, a lost peer, a stop signal), never for a bug, and the end summary says what the run went through.

Every rank that ends a run other than by finishing appends one line to `<run dir>/attempts.jsonl`: the attempt
(host, launcher process and restart count: a restart by torchrun or train.py, a Slurm requeue and a rerun by hand
are each a new one), the rank, how it ended (its exit code and one line) and, for a crash, where: the exception's
type, the step and the innermost frame of its traceback. A crash of a rank that crashed in the same place, at the
same step, in an earlier attempt, is a bug that every restart would meet again: the run then ends with the
traceback and exit 1, tells the launcher not to restart it, and leaves `<run dir>/not-requeued` for
launch/slurm.sbatch, which requeues exit 1 otherwise. A rank out of memory in a step, where a smaller micro-batch
divides the batch, leaves that micro-batch in `<run dir>/smaller-micro-batch.json`: the next attempt resumes with
it (more gradient accumulation, the same global batch, so the same run).
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from typing import Any

from llmtrain.errors import failed_step
from llmtrain.files import write_json_atomic
from llmtrain.process.launch_env import restart_count, under_a_restarting_agent

ATTEMPTS = "attempts.jsonl"
NOT_REQUEUED = "not-requeued"
# The micro-batch a run that ran out of memory in a step resumes with (its restarts and requeues read it)
SMALLER_MICRO_BATCH = "smaller-micro-batch.json"
# The steps at which a run rolled back from a loss spike leaves out the batch it would take (train.on_spike=rollback)
LEFT_OUT_BATCHES = "left-out-batches.json"


def this_attempt() -> str:
    """This process's attempt at the run where its ranks have not agreed on a name (runtime.Runtime.attempt): its
    host, the launcher that started it (the agent under torchrun or train.py's launcher; else the process itself)
    and the agent's restart count."""
    launcher = os.getppid() if under_a_restarting_agent() else os.getpid()
    return f"{socket.gethostname()}:{launcher}:{restart_count()}"


def crash_site(error: BaseException) -> dict[str, Any]:
    """Where `error` happened: its type, the training step it ended (None outside the steps) and the innermost
    frame of its traceback (file:line in function)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{_short(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else "unknown"
    return {"error": type(error).__name__, "step": failed_step(error), "where": where}


def _short(filename: str) -> str:
    """A traceback's file from its package folder on (the same file wherever the package is installed)."""
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("llmtrain", "torch", "site-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) :])
    return filename


def record(
    run_dir: str, attempt: str, rank: int, exit_code: int, line: str, site: dict[str, Any] | None = None
) -> None:
    """Append how this rank's part of `attempt` ended. A lost run directory (a disk gone) loses only this record."""
    entry = {"attempt": attempt, "rank": rank, "exit_code": exit_code, "line": line, **(site or {})}
    try:
        with open(os.path.join(run_dir, ATTEMPTS), "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError:
        pass


def ended(run_dir: str) -> list[dict[str, Any]]:
    """Every attempt's end recorded in `run_dir`, oldest first (a line a crash cut short left out)."""
    try:
        with open(os.path.join(run_dir, ATTEMPTS), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return entries


def repeated_crash(run_dir: str, attempt: str, rank: int, site: dict[str, Any]) -> dict[str, Any] | None:
    """A crash of `rank` in an attempt other than `attempt` at the same step and place, with the same type of
    error, as `site`; None when this crash is new (or happened outside the steps, where a step cannot be compared)."""
    if site["step"] is None:
        return None
    for entry in ended(run_dir):
        same = all(entry.get(key) == site[key] for key in ("error", "step", "where"))
        if same and entry.get("rank") == rank and entry.get("attempt") != attempt:
            return entry
    return None


def refuse_requeue(run_dir: str, line: str) -> None:
    """Leave the reason launch/slurm.sbatch reads before requeueing an exit 1."""
    try:
        with open(os.path.join(run_dir, NOT_REQUEUED), "w", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass


def interruptions(run_dir: str) -> list[str]:
    """The run's earlier attempts' ends, one phrase each (rank 0's line, else the first rank's that recorded one),
    for the end summary."""
    by_attempt: dict[str, dict[str, Any]] = {}
    for entry in ended(run_dir):
        kept = by_attempt.get(entry["attempt"])
        if kept is None or (entry.get("rank") == 0 and kept.get("rank") != 0):
            by_attempt[entry["attempt"]] = entry
    return [f"exit {entry['exit_code']}: {entry['line']}" for entry in by_attempt.values()]


def resume_with_micro_batch(run_dir: str, micro_batch_size: int, reason: str) -> None:
    """Leave the micro-batch the next attempt at the run resumes with, and why."""
    write_json_atomic(
        os.path.join(run_dir, SMALLER_MICRO_BATCH), {"micro_batch_size": micro_batch_size, "reason": reason}
    )


def micro_batch_to_resume_with(run_dir: str) -> tuple[int, str] | None:
    """The micro-batch an earlier attempt that ran out of memory left for this one, and why (None: none did)."""
    try:
        with open(os.path.join(run_dir, SMALLER_MICRO_BATCH), encoding="utf-8") as f:
            left = json.load(f)
        return int(left["micro_batch_size"]), str(left["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def no_smaller_micro_batch(run_dir: str) -> None:
    """A run out of memory at its smallest micro-batch: what an earlier attempt left is spent (launch/slurm.sbatch
    requeues an exit 4 only while the file is there)."""
    try:
        os.remove(os.path.join(run_dir, SMALLER_MICRO_BATCH))
    except FileNotFoundError:
        pass


def leave_out_batch(run_dir: str, step: int) -> None:
    """Note that the batch step `step` takes is to be left out by every later attempt (its loss spiked)."""
    write_json_atomic(os.path.join(run_dir, LEFT_OUT_BATCHES), sorted(batches_left_out(run_dir) | {step}))


def batches_left_out(run_dir: str) -> set[int]:
    """The steps at which this run leaves out the batch it would take, before taking the next."""
    try:
        with open(os.path.join(run_dir, LEFT_OUT_BATCHES), encoding="utf-8") as f:
            return {int(step) for step in json.load(f)}
    except (OSError, ValueError, TypeError):
        return set()
