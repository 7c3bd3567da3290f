"""Timing collectives on this process group, as nccl-tests does: the core of `llmtrain.bench.comm_bench`, and
`probe_links`, the short measurement `parallel=auto` makes at start so that it plans with the links this machine
has rather than the ones its hardware config claims (a PCIe card without peer-to-peer, a slow inter-node link).
"""

from __future__ import annotations

import csv
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmtrain.planner.links import CSV_HEADER, bus_factor
from llmtrain.process.runtime import Runtime, all_gather_single, reduce_scatter_single

# An op whose first call raised one of these is reported as unsupported: c10 errors (gloo's "not supported",
# an unsupported dtype) reach Python as RuntimeError, NotImplementedError or ValueError.
UNSUPPORTED_ERRORS = (RuntimeError, NotImplementedError, ValueError)
OK, UNSUPPORTED, WRONG = 0, 1, 2

# torch 2.13 renamed the single-tensor collectives; the old names remain as deprecated wrappers (a FutureWarning
# from every rank), and are all older releases have. As llmtrain/parallel/zero.py does.


def round_size(nbytes: int, ranks: int, element_size: int) -> int:
    """`nbytes` rounded down to a multiple of ranks x element size (every rank's share whole elements), at least
    one element per rank."""
    unit = ranks * element_size
    return max(unit, nbytes // unit * unit)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(value: float) -> float:
    """The maximum of `value` over ranks (through the CPU backend: gloo, on a GPU job too)."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def timed(run: Callable[[], None], iters: int, device: torch.device) -> float:
    """This rank's mean seconds per call of `run` over `iters` calls, the ranks started together by a barrier;
    on a GPU the clock stops when the device has finished, not when the last call was queued."""
    dist.barrier()
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(iters):
        run()
    _synchronize(device)
    return (time.perf_counter() - started) / iters


def make_op(
    op: str, nbytes: int, dtype: torch.dtype, runtime: Runtime
) -> tuple[Callable[[], None], Callable[[], bool]]:
    """(run, check): one call of `op` on a buffer of `nbytes` (nccl-tests' convention), and whether the buffers
    hold what one call must leave, given inputs filled with rank + 1 (so only right after the first call)."""
    n, rank, device = runtime.world_size, runtime.rank, runtime.device
    numel = nbytes // dtype.itemsize
    share = numel // n

    def filled(count: int, value: float) -> torch.Tensor:
        return torch.full((count,), value, dtype=dtype, device=device)

    def holds(tensor: torch.Tensor, expected: float | torch.Tensor) -> bool:
        # Within 1%: a sum over many ranks in 16 bits is rounded, a missing or doubled contribution is not.
        expected = torch.as_tensor(expected, dtype=torch.float32, device=device).expand(tensor.shape)
        return torch.allclose(tensor.float(), expected, rtol=1e-2, atol=0)

    def from_each_rank() -> torch.Tensor:
        """What a buffer whose k-th block came from rank k holds: k + 1 in each element of that block."""
        return torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(share)

    total = n * (n + 1) / 2  # the sum over ranks of rank + 1
    if op == "all_reduce":
        tensor = filled(numel, rank + 1)
        return (lambda: dist.all_reduce(tensor)), lambda: holds(tensor, total)
    if op == "reduce_scatter":
        source, kept = filled(numel, rank + 1), filled(share, 0)
        return (lambda: reduce_scatter_single(kept, source)), lambda: holds(kept, total)
    if op == "all_gather":
        mine, gathered = filled(share, rank + 1), filled(numel, 0)
        return (lambda: all_gather_single(gathered, mine)), lambda: holds(gathered, from_each_rank())
    if op == "broadcast":
        tensor = filled(numel, rank + 1)
        return (lambda: dist.broadcast(tensor, src=0)), lambda: holds(tensor, 1)
    if op == "all_to_all":
        sent, received = filled(numel, rank + 1), filled(numel, 0)
        return (lambda: dist.all_to_all_single(received, sent)), lambda: holds(received, from_each_rank())
    if op == "send_recv":
        sent, received = filled(numel, rank + 1), filled(numel, 0)
        previous = (rank - 1) % n

        def ring_step() -> None:
            # Both posted in one batch: with a blocking send first, every rank would send and none receive, which
            # deadlocks NCCL once the message outgrows its buffers.
            ops = [dist.P2POp(dist.isend, sent, (rank + 1) % n), dist.P2POp(dist.irecv, received, previous)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return ring_step, lambda: holds(received, previous + 1)
    raise ValueError(f"unknown op {op!r}")


def first_call(run: Callable[[], None], check: Callable[[], bool], device: torch.device) -> tuple[int, str]:
    """(status, reason) of the op's first call, agreed by every rank: UNSUPPORTED where any rank's call raised
    (the backend lacks the op or the dtype), WRONG where any rank's buffers do not hold the expected result."""
    status, reason = OK, ""
    try:
        run()
        _synchronize(device)
        if not check():
            status, reason = WRONG, "wrong result after the first call"
    except UNSUPPORTED_ERRORS as error:
        status, reason = UNSUPPORTED, (str(error).strip().splitlines() or [type(error).__name__])[0]
    agreed = int(slowest(float(status)))
    return agreed, reason if agreed == status else "on another rank"


@dataclass
class Result:
    op: str
    nbytes: int
    ranks: int
    seconds: float
    status: int = OK
    reason: str = ""

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.ranks)


def measure(op: str, nbytes: int, dtype: torch.dtype, warmup: int, iters: int, runtime: Runtime) -> Result:
    """One (op, size): the first call (checked), the rest of the warm-up, the timed calls; every rank returns the
    slowest rank's time."""
    run, check = make_op(op, nbytes, dtype, runtime)
    status, reason = first_call(run, check, runtime.device)
    if status != OK:
        return Result(op, nbytes, runtime.world_size, math.nan, status, reason)
    for _ in range(warmup - 1):
        run()
    seconds = slowest(timed(run, iters, runtime.device))
    return Result(op, nbytes, runtime.world_size, seconds)


def write_csv(results: list[Result], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        for r in results:
            if r.status == OK:
                writer.writerow([r.op, r.nbytes, r.ranks, f"{r.seconds * 1e6:.3f}", f"{r.algbw:.6g}", f"{r.busbw:.6g}"])


KiB, MiB = 1 << 10, 1 << 20
PROBE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "send_recv")  # what a plan counts


def probe_sizes(device: torch.device) -> list[int]:
    """A few sizes from latency-bound to bandwidth-bound: 64 KiB .. 64 MiB on a GPU, .. 4 MiB on CPU / gloo."""
    largest = 64 * MiB if device.type == "cuda" else 4 * MiB
    return [64 * KiB * 4**k for k in range(int(math.log(largest // (64 * KiB), 4)) + 1)]


def probe_links(runtime: Runtime, path: str) -> None:
    """Collective: time each op a plan counts at probe_sizes over all ranks (2 warm-up and 5 timed calls each, a
    few seconds) and write them as a comm_bench CSV at `path` (rank 0, complete or not at all)."""
    results = [
        measure(op, round_size(nbytes, runtime.world_size, 4), torch.float32, 2, 5, runtime)
        for op in PROBE_OPS
        for nbytes in probe_sizes(runtime.device)
    ]
    if runtime.is_main:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_csv(results, path + ".partial")
        os.replace(path + ".partial", path)
