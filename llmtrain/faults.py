"""Named fault points: the places where a test makes a run fail the way the world does (a hang, a device out of
memory, a full disk, a non-finite step) or counts what a step does. A run arms them with one environment variable,
read once per process:

    LLMTRAIN_FAULTS="hang_at_step=9"                LLMTRAIN_FAULTS="inf_at_steps=4,5,6 step_seconds=0.5"

  hang_at_step=k            step k never finishes (a test then kills the run: a crash mid-run)
  hang_on_rank=r            with hang_at_step: only rank r hangs, the others then wait for it in the step's first
                            collective (what the hang watchdog is for)
  hang_marker=PATH          with hang_at_step: hang only while PATH does not exist, and create it when hanging (a
                            job requeued after the hang then runs through)
  hang_in_phase=NAME        with hang_at_step: hang when the step enters this phase of the loop (the watchdog's
                            PHASES: "forward/backward", "logging", ...), not when it starts
  kill_at_step=k            the process kills itself (SIGKILL, as the OOM killer or a lost node ends it) as step k
                            starts
  kill_on_rank=r            with kill_at_step: only rank r
  kill_marker=PATH          with kill_at_step: only while PATH does not exist, created on the kill (a job restarted
                            or requeued after it then runs through)
  step_seconds=s            every step takes at least s seconds (time to send a signal mid-run)
  slow_rank=r               with slow_seconds=s: rank r computes s seconds more in every step (a throttled device)
  inf_at_steps=3,4          those steps' loss and gradients become non-finite (an overflow)
  inf_grad_at_steps=3       those steps' gradients become non-finite, their loss stays finite
  spike_at_steps=3,4        those steps' loss and gradients become SPIKE_SCALE times what they were: finite, a loss
                            spike (what a batch of bad data does)
  spike_marker=PATH         with spike_at_steps: only while PATH does not exist, created at the first spike (a run
                            rolled back past it then takes another batch there, which does not spike)
  oom_at_step=k             step k raises torch.OutOfMemoryError, as the CUDA allocator does
  oom_marker=PATH           with oom_at_step: only while PATH does not exist, created on the error (the restart,
                            with a smaller micro-batch, then runs through)
  raise_at_step=k           step k raises KeyError in every attempt at the run: a bug, which no restart fixes
  hang_in_save_at_step=k    checkpoint k's shards are written, then its write never finishes (no .metadata, no
                            rename), in the background thread under checkpoint.async_save
  disk_full_at_step=k       checkpoint k's write fails with ENOSPC, as a full disk makes it
  damage_checkpoint_at_step=k  once checkpoint k is complete, 4 KiB in the middle of its first shard are inverted,
                            its size unchanged (a failing disk, a bad copy: what only its checksums can tell)
  data_errors=n             n reads of a document from the streamed training data fail in a row with a network error
                            (ConnectionError, as a hub stream or a stalled shared file system raises), each retried
  data_stall_seconds=s      one read of a document from the streamed training data blocks s seconds first (a stalled
                            stream: the watchdog names the phase "waiting for data")
  data_fault_at_read=k      with data_errors or data_stall_seconds: from the process's k-th read of a document on,
                            failed reads counted (1, the default: the first)
  host_reads=FILE           each step appends to FILE how many times the training thread read a tensor's value on
                            the host (item, tolist, float, int, bool): each one a device sync on a GPU. Reads
                            inside optimizer.step are left out (AdamW keeps its step counters on the host)
  device_syncs=FILE         on a GPU each step appends to FILE how many synchronizing CUDA operations it ran, the
                            optimizer's included (torch.cuda.set_sync_debug_mode("warn"): any wait of the host for
                            the device, not only reads); 0 on a CPU
  gpu_turn=FILE             from its second step to its end, rank 0 holds an exclusive lock on FILE: runs started
                            side by side (llmtrain.tools.gpu_check's speed rows) start up and compile together, then
                            take their measured steps one at a time

Unarmed, a point costs a dictionary lookup. The code calls the points by these names; nothing is patched. A run
checks the variable at its start (`check_armed`): an unknown point or a value of the wrong kind is one line and
exit 2, and what is armed is said once, so a run that was meant to be real cannot fail on purpose unnoticed."""

from __future__ import annotations

import errno
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import cache
from typing import Any, NoReturn

from llmtrain.errors import ConfigError

ENVIRONMENT = "LLMTRAIN_FAULTS"
# spike_at_steps's factor: far over train.spike_factor's default, and finite in fp32 and bf16 alike.
SPIKE_SCALE = 100.0


def _step_list(value: str) -> list[int]:
    return [int(step) for step in value.split(",") if step]


# Each point and the check of its value (a ValueError for a value of another kind).
POINTS: dict[str, Callable[[str], object]] = {
    "hang_at_step": _step_list,
    "hang_on_rank": int,
    "hang_marker": str,
    "hang_in_phase": str,
    "kill_at_step": _step_list,
    "kill_on_rank": int,
    "kill_marker": str,
    "step_seconds": float,
    "slow_rank": int,
    "slow_seconds": float,
    "inf_at_steps": _step_list,
    "inf_grad_at_steps": _step_list,
    "spike_at_steps": _step_list,
    "spike_marker": str,
    "oom_at_step": _step_list,
    "oom_marker": str,
    "raise_at_step": _step_list,
    "hang_in_save_at_step": _step_list,
    "disk_full_at_step": _step_list,
    "damage_checkpoint_at_step": _step_list,
    "data_errors": int,
    "data_stall_seconds": float,
    "data_fault_at_read": int,
    "host_reads": str,
    "device_syncs": str,
    "gpu_turn": str,
}


class BadFaultPoint(ValueError):
    """An entry of LLMTRAIN_FAULTS that arms nothing as written; the message says which and why."""


def _checked(points: dict[str, str]) -> dict[str, str]:
    for name, value in points.items():
        if name not in POINTS:
            raise BadFaultPoint(f"{name} is not a fault point: the points are {', '.join(POINTS)}")
        try:
            POINTS[name](value)
        except ValueError:
            raise BadFaultPoint(f"{name}={value} is not a value it takes (llmtrain/faults.py lists each)") from None
    return points


@cache
def armed() -> dict[str, str]:
    """The points this process was started with (name -> value). Raises BadFaultPoint."""
    entries = os.environ.get(ENVIRONMENT, "").split()
    malformed = [entry for entry in entries if "=" not in entry]
    if malformed:
        raise BadFaultPoint(f"{malformed[0]} is not point=value")
    return _checked(dict(entry.split("=", 1) for entry in entries))


def check_armed() -> str | None:
    """At a run's start: what is armed, as one line to say once (None when nothing is). Raises ConfigError,
    one line, for an entry that arms nothing as written."""
    try:
        points = armed()
    except BadFaultPoint as error:
        raise ConfigError(f"{ENVIRONMENT}: {error}: fix or unset it") from None
    if not points:
        return None
    listed = " ".join(f"{name}={value}" for name, value in points.items())
    return f"fault points armed ({ENVIRONMENT}={listed}): a test's run, made to fail or slow where they say"


def arm(**points: object) -> dict[str, str]:
    """The environment entry that arms `points` in a run started with it (for tests)."""
    entries = _checked({name: str(value) for name, value in points.items()})
    return {ENVIRONMENT: " ".join(f"{name}={value}" for name, value in entries.items())}


def _steps(name: str) -> set[int]:
    return set(_step_list(armed().get(name, "")))


def _hangs_here(rank: int) -> bool:
    return int(armed().get("hang_on_rank", rank)) == rank and _once("hang_marker")


def _once(marker_point: str) -> bool:
    """Whether a fault with this marker point fires: always without a marker, else while the marker does not
    exist (it is created now)."""
    marker = armed().get(marker_point)
    if marker is None:
        return True
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def _hang() -> NoReturn:
    while True:
        time.sleep(1)


def phase_begins(step: int, phase: str, rank: int) -> None:
    """When training step `step` on `rank` enters `phase` of the loop: hang_at_step (hang_on_rank, hang_marker,
    hang_in_phase; by default the step's first phase)."""
    if phase == armed().get("hang_in_phase", "starting the step") and step in _steps("hang_at_step"):
        if _hangs_here(rank):
            _hang()


_steps_begun: list[int] = []  # the steps this process began, for gpu_turn
_turn: list[Any] = []  # gpu_turn's open lock file, kept from being closed


def step_begins(step: int, rank: int) -> None:
    """At the start of training step `step` on `rank`: kill_at_step (kill_on_rank), slow_rank, oom_at_step,
    raise_at_step, gpu_turn."""
    _steps_begun.append(step)
    if len(_steps_begun) == 2 and rank == 0 and "gpu_turn" in armed():
        _take_turn(armed()["gpu_turn"])
    if step in _steps("kill_at_step") and int(armed().get("kill_on_rank", rank)) == rank and _once("kill_marker"):
        os.kill(os.getpid(), signal.SIGKILL)
    if int(armed().get("slow_rank", -1)) == rank:
        busy_until = time.thread_time() + float(armed()["slow_seconds"])
        while time.thread_time() < busy_until:  # compute, not a sleep: the thread's CPU time grows
            pass
    if step in _steps("oom_at_step") and _once("oom_marker"):
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated: oom_at_step)")
    if step in _steps("raise_at_step"):
        raise KeyError(f"simulated: raise_at_step={step}")


def _take_turn(path: str) -> None:
    """Wait for, then hold until this process ends (when the system lets it go), an exclusive lock on `path`."""
    import fcntl

    held = open(path, "a")  # open for the rest of the process: the lock lasts as long
    fcntl.flock(held, fcntl.LOCK_EX)
    _turn.append(held)


def gradients_computed(step: int, loss: Any, parameters: Iterator[Any]) -> Any:
    """After step `step`'s backward, with its loss: inf_at_steps, inf_grad_at_steps, spike_at_steps. Returns the
    loss."""
    if step in _steps("inf_at_steps") | _steps("inf_grad_at_steps"):
        _scale_gradients(parameters, float("inf"))
        return loss * float("inf") if step in _steps("inf_at_steps") else loss
    if step in _steps("spike_at_steps") and _once("spike_marker"):
        _scale_gradients(parameters, SPIKE_SCALE)
        return loss * SPIKE_SCALE
    return loss


def _scale_gradients(parameters: Iterator[Any], scale: float) -> None:
    for param in parameters:
        if param.grad is not None:
            param.grad.mul_(scale)


def step_ends(started: float) -> None:
    """At the end of a training step that began at perf_counter() `started`: step_seconds."""
    seconds = float(armed().get("step_seconds", 0))
    if seconds > 0:
        time.sleep(max(0.0, seconds - (time.perf_counter() - started)))


def checkpoint_write(step: int, write: Callable[[], Any]) -> Any:
    """Around the write of checkpoint `step`'s shards (`write()`; its result, when it has a `wait`, is waited on
    before hanging): disk_full_at_step, hang_in_save_at_step."""
    if step in _steps("disk_full_at_step"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"checkpoint {step} (simulated: disk_full_at_step)")
    written = write()
    if step in _steps("hang_in_save_at_step"):
        written.wait()  # the shards are on disk
        _hang()
    return written


def checkpoint_complete(path: str) -> None:
    """Once the checkpoint at `path` (step-<n>) is complete: damage_checkpoint_at_step."""
    step = int(os.path.basename(path).split("-")[1])
    if step not in _steps("damage_checkpoint_at_step"):
        return
    shard = os.path.join(path, sorted(name for name in os.listdir(path) if name.endswith(".distcp"))[0])
    with open(shard, "r+b") as f:
        f.seek(max(0, os.path.getsize(shard) // 2 - 2048))
        data = f.read(4096)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(byte ^ 0xFF for byte in data))


_document_reads = itertools.count(1)  # numbers this process's reads of a document while a data point is armed


def document_read(source: str) -> None:
    """Before a read of a document from the streamed training data of `source` (a try: a retry is another read):
    data_stall_seconds, data_errors (data_fault_at_read)."""
    points = armed()
    if "data_errors" not in points and "data_stall_seconds" not in points:
        return
    read, first = next(_document_reads), int(points.get("data_fault_at_read", 1))
    if read == first:
        time.sleep(float(points.get("data_stall_seconds", 0)))
    if first <= read < first + int(points.get("data_errors", 0)):
        raise ConnectionError(errno.ECONNRESET, f"{source}: connection reset by peer (simulated: data_errors)")


_HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


def counting_host_reads(optimizer: Any):
    """A context around one training step: host_reads. Counts the training thread's reads of tensor values on the
    host while the step runs (outside `optimizer.step`) and appends the count to the armed file."""
    path = armed().get("host_reads")
    return _counting(path, optimizer) if path else nullcontext()


@contextmanager
def _counting(path: str, optimizer: Any) -> Iterator[None]:
    import torch

    thread, count, in_optimizer = threading.get_ident(), [0], [False]
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counted(original: Callable) -> Callable:
        def read(tensor, *args, **kwargs):
            if threading.get_ident() == thread and not in_optimizer[0]:
                count[0] += 1
            return original(tensor, *args, **kwargs)

        return read

    optimizer_step = optimizer.step

    def step_uncounted(*args, **kwargs):
        in_optimizer[0] = True
        try:
            return optimizer_step(*args, **kwargs)
        finally:
            in_optimizer[0] = False

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    optimizer.step = step_uncounted
    try:
        yield
    finally:
        del optimizer.step
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        with open(path, "a") as f:
            f.write(f"{count[0]}\n")


def counting_device_syncs():
    """A context around one training step: device_syncs. Counts the synchronizing CUDA operations the step runs
    (CUDA's sync debug mode warns at each) and appends the count to the armed file."""
    path = armed().get("device_syncs")
    return _counting_syncs(path) if path else nullcontext()


@contextmanager
def _counting_syncs(path: str) -> Iterator[None]:
    import warnings

    import torch

    on_gpu = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode("default")
    with open(path, "a") as f:
        f.write(f"{sum('synchroniz' in str(warning.message) for warning in caught)}\n")
