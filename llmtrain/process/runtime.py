"""The process's place in the job: rank and world from torchrun, from SLURM's srun, or from nothing.

`init_runtime` joins the process group when there is one (NCCL on CUDA, gloo on CPU) and picks the device;
`Runtime.shutdown` leaves it cleanly. Everything else asks the Runtime, never the environment, except what runs
before a Runtime can exist: launch_env.py (the run directory every rank agrees on) and spawn.py (the launcher).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar, cast

import torch
import torch.distributed as dist

from llmtrain.errors import ConfigError
from llmtrain.process.attempts import this_attempt
from llmtrain.process.launch_env import launch_coordinates, restart_count, under_a_restarting_agent

# The flat collectives under their torch >= 2.10 names: the older ones warn on every call (once a rank); torch
# 2.9, llmtrain's floor, has only those.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
T = TypeVar("T")


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    launcher: str  # torchrun | slurm | none
    notes: tuple[str, ...] = ()  # what was decided from the hardware at start, for the start summary
    # This attempt at the run (attempts.py): the name its ranks agreed on under an agent that restarts them
    attempt: str = field(default_factory=this_attempt)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def from_main(self, value: T) -> T:
        """Collective: rank 0's `value` on every rank (where each rank reading it for itself could see another)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def from_every_rank(self, value: T) -> list[T]:
        """Collective: every rank's `value`, in rank order."""
        if not self.distributed:
            return [value]
        values: list[T | None] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return cast(list[T], values)

    def decided_by_main(self, decide: Callable[[], T]) -> T:
        """Collective: `decide()` run on rank 0 alone (it may read or move files), its result on every rank; a
        ConfigError it raises is raised on every rank, so none waits for a decision that never comes."""
        try:
            outcome: tuple[T | None, str | None] = (decide(), None) if self.is_main else (None, None)
        except ConfigError as error:
            if not self.distributed:
                raise
            outcome = (None, str(error))
        value, refusal = self.from_main(outcome)
        if refusal is not None:
            raise ConfigError(refusal)
        return cast(T, value)

    def abort(self) -> None:
        """Abort every process group: NCCL's kernels stop spinning on the device and its communicators are freed,
        where a peer has gone or hangs and an orderly shutdown could wait for it. Failing, it says so and returns:
        its caller is ending the process."""
        if self.distributed:
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as error:
                logging.getLogger("llmtrain").warning(f"the process groups could not be aborted ({error})")

    def shutdown(self, synchronize: bool = False) -> None:
        """Leave the process group. `synchronize` (at the normal end of a job) first waits for every rank: a rank
        that tears gloo down while a peer still finishes the last collective can abort that peer at exit."""
        if self.distributed:
            if synchronize:
                dist.barrier()
            dist.destroy_process_group()


def first_slurm_host(nodelist: str) -> str:
    """The first hostname of a Slurm hostlist such as 'gpu[03-05,09],login1' -> 'gpu03'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot parse SLURM nodelist {nodelist!r}")
    prefix, ranges = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def slurm_job_port(job_id: str) -> int:
    """The port of a Slurm job's rendezvous: every node derives the same one from the job id, and jobs sharing a
    node get different ones (unless their ids differ by a multiple of 20000)."""
    return 20000 + int(job_id) % 20000


def _process_coordinates() -> tuple[int, int, int, str]:
    rank, world_size, local_rank, launcher = launch_coordinates()
    if launcher == "slurm":  # srun started one task per rank: the rendezvous torch expects, from the step itself
        os.environ.setdefault("MASTER_ADDR", first_slurm_host(os.environ["SLURM_STEP_NODELIST"]))
        os.environ.setdefault("MASTER_PORT", str(slurm_job_port(os.environ["SLURM_JOB_ID"])))
    return rank, world_size, local_rank, launcher


def cuda_device_index(local_rank: int, device_count: int, launcher: str) -> int:
    """The GPU of the process with this node-local rank. Under srun with per-task GPU binding (--gpus-per-task=1,
    --gpu-bind) each task sees only its own GPU, as device 0, whatever its local rank. Otherwise more processes
    than GPUs on a node is refused (two ranks sharing one device make NCCL fail with "Duplicate GPU", or silently
    halve the memory each can use)."""
    if local_rank < device_count:
        return local_rank
    if launcher == "slurm" and device_count == 1:
        return 0
    raise ConfigError(
        f"local rank {local_rank} but only {device_count} CUDA device(s) are visible on this node: start at most "
        f"{device_count} processes per node (torchrun --nproc_per_node={device_count}), or train.device=cpu"
    )


def _pick_device(preference: str, local_rank: int, launcher: str) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible: use train.device=auto or cpu")
    if preference != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index(local_rank, torch.cuda.device_count(), launcher))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors and gloo for CPU ones on a GPU job (CPU-offloaded FSDP reduces gradients that live in
    host memory; a NCCL-only group has no backend for them), gloo alone on a CPU job."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def use_tf32_for_fp32_matmuls(device: torch.device) -> None:
    """On a GPU, fp32 matmuls and convolutions run on the TF32 tensor cores (10-bit mantissa inputs, fp32
    accumulation): several times the fp32 rate, at the precision training needs; what an fp32 run's MFU is
    measured against (train/metrics.py). Nothing changes on CPU."""
    if device.type == "cuda":
        # The legacy call: it sets every backend's setting alike, so both APIs read "tf32" / "high" after it. Set
        # through the new `torch.backends.cuda.matmul.fp32_precision` alone, the legacy getter raises ("a mix of the
        # legacy and new APIs"), and inductor's autotuning and flex attention call it. Convolutions use TF32 already.
        torch.set_float32_matmul_precision("high")


def peer_to_peer_verdict(names: list[str], peers_reachable: bool) -> str | None:
    """Why NCCL must not use peer-to-peer transfers between this node's GPUs, or None when it may: GeForce cards
    (their drivers can report peer access over PCIe they cannot do, and NCCL then hangs or crawls: the RTX
    40-series), or devices that report no peer access."""
    geforce = sorted({name for name in names if "GeForce" in name})
    if geforce:
        return f"{', '.join(geforce)}: GeForce drivers can report peer access they cannot do"
    if not peers_reachable:
        return "the devices report no peer access to each other"
    return None


def _decide_peer_to_peer(world_size: int) -> tuple[str, ...]:
    """NCCL_P2P_DISABLE=1 where peer_to_peer_verdict says so, for every launcher (set before the process group
    exists, so NCCL reads it), unless the user set NCCL's P2P variables: the one line saying what was decided."""
    if world_size == 1 or "NCCL_P2P_DISABLE" in os.environ or "NCCL_P2P_LEVEL" in os.environ:
        return ()
    count = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(index) for index in range(count)]
    pairs = [(a, b) for a in range(count) for b in range(count) if a != b]
    verdict = peer_to_peer_verdict(names, all(torch.cuda.can_device_access_peer(a, b) for a, b in pairs))
    if verdict is None:
        return ()
    os.environ["NCCL_P2P_DISABLE"] = "1"
    return (f"NCCL peer-to-peer off ({verdict}): GPUs exchange through host memory; NCCL_P2P_DISABLE=0 overrides",)


def init_runtime(device_preference: str = "auto", timeout_minutes: float = 30) -> Runtime:
    rank, world_size, local_rank, launcher = _process_coordinates()
    device = _pick_device(device_preference, local_rank, launcher)
    use_tf32_for_fp32_matmuls(device)
    notes = _decide_peer_to_peer(world_size) if device.type == "cuda" else ()
    attempt = this_attempt()
    if world_size > 1 and not dist.is_initialized():
        # The flight recorders the hang watchdog dumps and the straggler check reads (train/), read when the group
        # is made: the last collectives of each group, kept in a ring buffer at the cost of a record per
        # collective. One name for every backend since torch 2.9, llmtrain's floor (NCCL's older
        # TORCH_NCCL_TRACE_BUFFER_SIZE now warns).
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        if device.type == "cuda":  # each NCCL kernel's time in its record: the straggler check's waits
            os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store = None
        if under_a_restarting_agent():
            store, attempt = _attempt_store(rank, world_size, timeout)
        dist.init_process_group(
            backend=process_group_backend(device),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            store=store,
        )
    return Runtime(rank, world_size, local_rank, device, launcher, notes, attempt)


def roll_call(runtime: Runtime, prefix: str, mine: str | bytes, seconds: float) -> dict[int, bytes]:
    """Post `mine` under `prefix` to the job's store and read what the other ranks post within `seconds`: for a
    rank whose collectives have failed or hang (the store is a separate connection). Rank -> its post, this rank's
    included; {} when the store's host is gone too."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return gather_posts(store, runtime.rank, runtime.world_size, prefix, mine, seconds)
    except (RuntimeError, dist.DistStoreError):
        return {}


def gather_posts(
    store: dist.Store, rank: int, world_size: int, prefix: str, mine: str | bytes, seconds: float
) -> dict[int, bytes]:
    """Every rank's post under `prefix` that arrives within `seconds`, by rank: each rank appends its own to one
    key and counts itself in, the one that completes the count says so, and each reads all posts in one call once
    it has or `seconds` have passed. Five calls a rank at any world size (a key a rank, each read by every rank,
    cost world_size² calls)."""
    store.set_timeout(datetime.timedelta(seconds=seconds))
    text = mine.decode() if isinstance(mine, bytes) else mine
    store.append(f"{prefix}/posts", json.dumps([rank, text]) + "\n")  # type: ignore[attr-defined]  # (stubs)
    if store.add(f"{prefix}/count", 1) == world_size:
        store.set(f"{prefix}/all", "")
    _appeared(store, [f"{prefix}/all"], seconds)
    posts = (json.loads(line) for line in store.get(f"{prefix}/posts").decode().splitlines())
    return {int(poster): post.encode() for poster, post in posts}


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> tuple[dist.Store, str]:
    """torchrun's store with this attempt's keys under a prefix of their own, and the attempt's name. The store
    outlives the workers that torchrun restarts: without the prefix a restarted rank can read the address its dead
    predecessor published and gloo connects to nobody ("connectFullMesh failed ... Connection refused"), while its
    peer waits for it."""
    store = _agent_store(rank, world_size, timeout)
    name = agree_on_attempt(store, rank, world_size, timeout)
    return dist.PrefixStore(f"llmtrain/attempt-{name}", store), name


# Keys in the agent's store by which the ranks of one attempt agree on its name.
_STORE_NAME, _ATTEMPTS_DRAWN, _HELLO, _ANSWER, _CONFIRMED = (
    f"llmtrain/join/{part}" for part in ("store", "drawn", "hello", "answer", "ok")
)
# How long rank 0 waits for the confirmations at a time before it reads the posts again (a rank that started after
# its last read is answered then)
_REREAD_SECONDS = 0.5


def agree_on_attempt(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> str:
    """A name every rank of this attempt gets and no rank of an earlier attempt had, from a store that outlives the
    attempts (the store's own random name, then a count). Each node's agent counts its own restarts
    (TORCHELASTIC_RESTART_COUNT), and torch's agent does not count a restart that another node's failure caused,
    so the counts differ across nodes. Rank 0 draws the count; every other rank posts a name of its own making and
    waits for rank 0's answer to that name, so it never takes a count drawn before it started. Rank 0 answers every
    post it reads (a dead predecessor's too, harmlessly) until each rank has confirmed the answer.

    Every call waits inside the store, none polls it: another rank makes three calls (post, answer, confirm),
    rank 0 a few at start and three each `_REREAD_SECONDS` while ranks are missing (the posts read in one call,
    the new ones answered in one, the confirmations awaited in one): a 1,024-rank start costs the store about
    3,000 calls in all (llmtrain/bench/startup_store.py), where polling every rank's keys cost that many a poll."""
    if rank != 0:
        hello = os.urandom(16).hex()
        store.set(f"{_HELLO}/{rank}", hello)
        try:
            name = store.get(f"{_ANSWER}/{hello}").decode()  # waits for it, as long as the store's timeout
        except dist.DistStoreError as error:
            raise RuntimeError(f"rank {rank}: rank 0 did not start within {timeout} ({error})") from None
        store.set(f"{_CONFIRMED}/{name}/{rank}", "")
        return name
    name = f"{store.compare_set(_STORE_NAME, '', os.urandom(4).hex()).decode()}.{store.add(_ATTEMPTS_DRAWN, 1)}"
    posts = [f"{_HELLO}/{peer}" for peer in range(1, world_size)]
    confirmations = [f"{_CONFIRMED}/{name}/{peer}" for peer in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    answered: Sequence[bytes | None] = [None] * len(posts)
    while posts:
        # every rank's post is there (its own, or a dead predecessor's): answer the ones not answered yet
        if not _appeared(store, posts, deadline - time.monotonic()):
            _did_not_start(store, posts, timeout)
        read = store.multi_get(posts)
        new = [post for post, before in zip(read, answered) if post != before]
        if new:
            answers = [f"{_ANSWER}/{post.decode()}" for post in new]
            store.multi_set(answers, [name] * len(new))  # type: ignore[attr-defined]  # (missing from torch's stubs)
        answered = read
        if _appeared(store, confirmations, _REREAD_SECONDS):
            break
        if time.monotonic() > deadline:
            _did_not_start(store, confirmations, timeout)
    return name


def _appeared(store: dist.Store, keys: list[str], seconds: float) -> bool:
    """Whether every key of `keys` is in the store now or appears within `seconds` (one call, waiting in it)."""
    try:
        store.wait(keys, datetime.timedelta(seconds=max(seconds, 0.001)))
        return True
    except dist.DistStoreError:
        return False


def _did_not_start(store: dist.Store, keys: list[str], timeout: datetime.timedelta) -> NoReturn:
    """Rank 0's error naming the ranks (1, 2, ... in `keys`' order) whose key is still missing."""
    missing = [rank for rank, key in enumerate(keys, 1) if not store.check([key])]
    raise RuntimeError(f"rank 0: ranks {', '.join(map(str, missing))} did not start within {timeout}")


def _agent_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """A connection to the store of the elastic agent (torchrun's, or the one parallel.nproc runs) that started
    this worker: it lives as long as the agent, across the workers it restarts."""
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return store


# In the agent's store: why the workers ended on purpose, for the workers it would start again.
_ENDED_ON_PURPOSE = "llmtrain/ended-on-purpose"


def record_end_on_purpose(runtime: Runtime | None, exit_code: int, line: str) -> None:
    """Under an agent that restarts its workers (torchrun --max-restarts, parallel.max_restarts): say that the run
    ended on purpose (stopped and saved, bad input, diverged), so that a restart leaves with the same code instead
    of training on past a stop signal or failing the same way again (`runtime` None: before this process has one,
    e.g. a config refused by the checks train.py runs first). The record ends with the agent: a requeued job starts
    without it."""
    if not under_a_restarting_agent():
        return
    rank, world_size = (runtime.rank, runtime.world_size) if runtime else launch_coordinates()[:2]
    try:
        store = _agent_store(rank, world_size, datetime.timedelta(seconds=10))
        store.set(_ENDED_ON_PURPOSE, f"{exit_code} {line}")
    except (RuntimeError, ValueError, dist.DistStoreError) as error:  # the agent is gone: no restart to tell
        logging.getLogger("llmtrain").warning("could not tell the launcher the run ended on purpose: %s", error)


def ended_on_purpose() -> tuple[int, str] | None:
    """In a worker an agent started again: the exit code and line of a run that had ended on purpose
    (record_end_on_purpose), which this attempt leaves with at once; None for a restart after a failure."""
    if restart_count() == 0:
        return None
    rank, world_size, _, _ = launch_coordinates()
    try:
        store = _agent_store(rank, world_size, datetime.timedelta(seconds=30))
        if not store.check([_ENDED_ON_PURPOSE]):
            return None
        code, _, line = store.get(_ENDED_ON_PURPOSE).decode().partition(" ")
    except (RuntimeError, ValueError, dist.DistStoreError):
        return None
    return int(code), line


def join_single_process_group(runtime: Runtime) -> None:
    """A process group of this one process, so that a layout written for many ranks (FSDP, TP, PP, DDP of degree
    1) runs unchanged on one: what `torchrun train.py parallel=fsdp` (one process by default) and a one-GPU debug
    run of a multi-GPU config need. Its store lives in this process: nothing listens on a port."""
    if runtime.world_size == 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=process_group_backend(runtime.device),
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=runtime.device if runtime.device.type == "cuda" else None,
        )
