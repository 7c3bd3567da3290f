"""torch's flight recorder, read: the collectives this process posted, oldest first (TORCH_FR_BUFFER_SIZE of them,
every process group together; init_runtime keeps the last 2000 unless the user set another number).

Each entry names the collective, its group and its number in that group, when the host posted it, and how far it
got. On NCCL "started" and "completed" come from CUDA events (a collective can be posted long before the device
reaches it), and with TORCH_NCCL_ENABLE_TIMING each completed one carries how long its kernel ran (`duration_ms`),
waiting for late peers included. gloo's entries stay "scheduled"; a finished one is marked retired."""

from __future__ import annotations

import json

import torch


def flight_entries() -> tuple[list[dict], str]:
    """The flight recorder's collectives of this process, oldest first, or why there are none."""
    dumps = torch._C._distributed_c10d
    dump = getattr(dumps, "_dump_nccl_trace_json", None) if torch.cuda.is_available() else None
    dump = dump or getattr(dumps, "_dump_fr_trace_json", None)
    if dump is None:
        return [], "(this torch build has no flight recorder)"
    try:
        entries = json.loads(dump(includeCollectives=True, onlyActive=False)).get("entries", [])
    except Exception as error:  # the recorder is a diagnostic: its failure must not stop the caller
        return [], f"(the flight recorder could not be read: {error})"
    if not entries:
        return [], "(none recorded: set TORCH_FR_BUFFER_SIZE > 0 before the start)"
    return entries, ""


def finished(entry: dict) -> bool:
    return entry.get("state") == "completed" or bool(entry.get("retired"))


def group_of(entry: dict) -> str:
    return str(entry.get("process_group", ["?"])[0])


def describe(entry: dict) -> str:
    """The collective, its number in its group, the group and how far it got: `nccl:all_reduce #12 group 0 started`
    (posted: on NCCL its device has not reached it; gloo tells no more)."""
    state = entry.get("state", "?")
    state = "completed" if finished(entry) else {"scheduled": "posted"}.get(state, state)
    return f"{entry.get('profiling_name', '?')} #{entry.get('collective_seq_id', '?')} group {group_of(entry)} {state}"


def oldest_unfinished(entries: list[dict]) -> dict | None:
    """Where this process waits: the oldest collective it posted that has not finished (NCCL: whose kernel has
    not completed), or None."""
    return next((entry for entry in entries if not finished(entry)), None)


def seconds_in_collectives(entries: list[dict], since_ns: int, until_ns: int) -> float | None:
    """How long the collectives posted in [since_ns, until_ns) ran (NCCL's timed kernels, waiting for late peers
    included), or None where one of them has no time yet (not completed, or timing off) or the ring buffer no
    longer reaches back to since_ns."""
    if not entries or entries[0].get("time_created_ns", 0) >= since_ns:
        return None
    total_ms = 0.0
    for entry in entries:
        if since_ns <= entry.get("time_created_ns", 0) < until_ns:
            if entry.get("duration_ms") is None:
                return None
            total_ms += entry["duration_ms"]
    return total_ms / 1000


def flight_record(entries: list[dict], reason: str) -> str:
    """The newest entries, one per line. A rank waiting in a collective its peers never posted shows a higher
    number than theirs."""
    if not entries:
        return reason
    return "\n".join(f"  {describe(entry)}" for entry in entries[-20:])
