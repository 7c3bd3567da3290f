"""Bandwidth of each collective training uses, per message size, measured and reported as nccl-tests does.

    torchrun --standalone --nproc_per_node=N -m llmtrain.bench.comm_bench [bench.KEY=VALUE ...]

Keys: `--help` lists them (each declared once, in BenchConfig below, with its default, domain and doc); a misspelt
key or a value outside its domain is a one-line error, exit code 2.

Sizes follow nccl-tests: `bytes` is the whole buffer. all_reduce and broadcast: the tensor; all_gather: the
gathered output (each rank contributes bytes/n); reduce_scatter: the input (each rank keeps bytes/n); all_to_all:
the whole send buffer; send_recv: the message each rank sends to (rank+1)%n while it receives from (rank-1)%n.

The time of one iteration is the slowest rank's mean over `iters` (a collective is done when its last rank is),
after a barrier. algbw = bytes / time and busbw = algbw x the op's factor (all_reduce 2(n-1)/n; reduce_scatter,
all_gather and all_to_all (n-1)/n; broadcast and send_recv 1), in GB/s of 1e9 bytes: busbw is comparable with the
link's bandwidth whatever n is. An op or dtype the backend does not implement (gloo lacks some) is reported as
unsupported and left out of the CSV.

Rank 0 prints the table and writes comm_bench.csv (op,bytes,ranks,time_us,algbw_GBps,busbw_GBps) and
comm_bench.png (busbw against bytes, per op). With bench.pairs=true, every ordered pair (i, j) sends pair_bytes
from i to j while the other ranks wait, into comm_pairs.csv (src,dst,bytes,time_us,GBps) and an n x n matrix of
GB/s: a slow link (GPUs across a PCIe switch or a socket) shows up as uneven entries.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, cast

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from llmtrain.config import check_domains, keys_help, schema_keys, unknown_key_line
from llmtrain.domains import Flag, ListOf, OneOf, WritableDirectory, at_least, key
from llmtrain.errors import ConfigError, closed_pipe_is_quiet, first_line
from llmtrain.planner.links import CSV_HEADER, bus_factor
from llmtrain.runtime import Runtime, init_runtime, join_single_process_group

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send_recv")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAIRS_HEADER = ("src", "dst", "bytes", "time_us", "GBps")

# An op whose first call raised one of these is reported as unsupported: c10 errors (gloo's "not supported",
# an unsupported dtype) reach Python as RuntimeError, NotImplementedError or ValueError.
UNSUPPORTED_ERRORS = (RuntimeError, NotImplementedError, ValueError)
OK, UNSUPPORTED, WRONG = 0, 1, 2

# torch 2.13 renamed the single-tensor collectives; the old names remain as deprecated wrappers (a FutureWarning
# from every rank), and are all older releases have. As llmtrain/parallel/zero.py does.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class BenchConfig:
    ops: Optional[list[str]] = key(None, ListOf(OneOf(OPS)), "the ops to time, in this order (null: all of them)")
    sizes: Optional[list[int]] = key(
        None,
        ListOf(at_least(1)),
        "message sizes in bytes, each rounded down to a multiple of ranks x element size (null: 1 KiB to 1 GiB by "
        "factors of 4 on CUDA / NCCL, to 16 MiB on CPU / gloo)",
    )
    dtype: str = key("float32", OneOf(tuple(DTYPES)), "the element type")
    warmup: int = key(5, at_least(0), "untimed iterations before each measurement (the first also checks the result)")
    iters: int = key(20, at_least(1), "timed iterations per measurement")
    out: str = key(".", WritableDirectory(), "where the CSVs and the plot are written")
    pairs: bool = key(False, Flag(), "also time every ordered pair of ranks on its own, one send at a time")
    pair_bytes: Optional[int] = key(None, at_least(1), "the message of each pair (null: 64 MiB on CUDA, 4 MiB on CPU)")


@dataclass
class BenchRootConfig:
    bench: BenchConfig = field(default_factory=BenchConfig)


def default_sizes(device: torch.device) -> list[int]:
    """1 KiB .. 1 GiB by factors of 4 on a GPU; up to 16 MiB on CPU, where gloo moves a 1 GiB buffer in seconds."""
    largest = GiB if device.type == "cuda" else 16 * MiB
    return [KiB * 4**k for k in range(int(math.log(largest // KiB, 4)) + 1)]


def parse_config(argv: list[str], device: torch.device) -> BenchConfig:
    """The config of `bench.KEY=VALUE` arguments, checked against the keys' domains and with the defaults that
    depend on `device` filled in; ConfigError (one line naming the key) on an unknown key or a value outside."""
    keys = [name for name, _ in schema_keys(BenchRootConfig)]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(BenchRootConfig), OmegaConf.from_dotlist(argv))
    except ConfigKeyError as error:
        raise ConfigError(unknown_key_line(error.full_key or "?", keys)) from None
    except OmegaConfBaseException as error:
        raise ConfigError(f"{getattr(error, 'full_key', '') or argv}: {first_line(str(error))}") from None
    check_domains(merged, BenchRootConfig)
    cfg = cast(BenchRootConfig, OmegaConf.to_object(merged)).bench
    cfg.ops = list(dict.fromkeys(cfg.ops or OPS))  # each op once, in the order given
    cfg.sizes = cfg.sizes or default_sizes(device)
    cfg.pair_bytes = cfg.pair_bytes or (64 * MiB if device.type == "cuda" else 4 * MiB)
    return cfg


def round_size(nbytes: int, ranks: int, element_size: int) -> int:
    """`nbytes` rounded down to a multiple of ranks x element size (every rank's share whole elements), at least
    one element per rank."""
    unit = ranks * element_size
    return max(unit, nbytes // unit * unit)


def human_bytes(nbytes: float) -> str:
    """4096 -> '4 KiB', 1.5 * 2**20 -> '1.5 MiB', 1000 -> '1000 B'."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.3g} {unit}" if nbytes < 1000 else f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} GiB" if nbytes < 1000 else f"{nbytes:.0f} GiB"


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
        return (lambda: reduce_scatter(kept, source)), lambda: holds(kept, total)
    if op == "all_gather":
        mine, gathered = filled(share, rank + 1), filled(numel, 0)
        return (lambda: all_gather(gathered, mine)), lambda: holds(gathered, from_each_rank())
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


def measure(op: str, nbytes: int, cfg: BenchConfig, runtime: Runtime) -> Result:
    """One (op, size): the first call (checked), the rest of the warm-up, the timed calls; every rank returns the
    slowest rank's time."""
    run, check = make_op(op, nbytes, DTYPES[cfg.dtype], runtime)
    status, reason = first_call(run, check, runtime.device)
    if status != OK:
        return Result(op, nbytes, runtime.world_size, math.nan, status, reason)
    for _ in range(cfg.warmup - 1):
        run()
    seconds = slowest(timed(run, cfg.iters, runtime.device))
    return Result(op, nbytes, runtime.world_size, seconds)


def measure_pair(src: int, dst: int, nbytes: int, cfg: BenchConfig, runtime: Runtime) -> float:
    """Seconds of one `nbytes` message from src to dst while every other rank waits: the slower of the two ends
    (the receiver's, in practice: its last byte arrived). Every rank calls this for every pair, in the same order,
    so that each send meets its receive and the barriers and the reduction match."""
    rank, device, dtype = runtime.rank, runtime.device, DTYPES[cfg.dtype]
    tensor = torch.zeros(nbytes // dtype.itemsize, dtype=dtype, device=device)

    def step() -> None:
        if rank == src:
            dist.send(tensor, dst)
        elif rank == dst:
            dist.recv(tensor, src)

    for _ in range(max(cfg.warmup, 1)):  # at least one: NCCL connects a pair on its first message
        step()
    return slowest(timed(step, cfg.iters, device))  # a waiting rank times nothing: about 0


def _row(result: Result, backend: str) -> str:
    if result.status == UNSUPPORTED:
        return f"{result.op:<15}{human_bytes(result.nbytes):>10}   unsupported on {backend}: {result.reason}"
    if result.status == WRONG:
        return f"{result.op:<15}{human_bytes(result.nbytes):>10}   WRONG RESULT: {result.reason}"
    return (
        f"{result.op:<15}{human_bytes(result.nbytes):>10}{result.seconds * 1e6:>13.1f}"
        f"{result.algbw:>12.3f}{result.busbw:>12.3f}"
    )


def write_csv(results: list[Result], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        for r in results:
            if r.status == OK:
                writer.writerow([r.op, r.nbytes, r.ranks, f"{r.seconds * 1e6:.3f}", f"{r.algbw:.6g}", f"{r.busbw:.6g}"])


def plot(results: list[Result], path: str, title: str) -> None:
    """busbw against bytes, one line per op (log x)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    measured = [r for r in results if r.status == OK]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for op in dict.fromkeys(r.op for r in measured):
        points = [(r.nbytes, r.busbw) for r in measured if r.op == op]
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=op)
    sizes = sorted({r.nbytes for r in measured})
    ax.set_xscale("log", base=2)
    if sizes:
        ax.set_xticks(sizes, [human_bytes(s) for s in sizes], rotation=45, ha="right")
    ax.set_xlabel("bytes (nccl-tests convention)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if measured:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pair_matrix(times: dict[tuple[int, int], float], nbytes: int, ranks: int) -> str:
    """GB/s of every ordered pair as an n x n table, rows the sender."""
    lines = ["src\\dst" + "".join(f"{dst:>9}" for dst in range(ranks))]
    for src in range(ranks):
        cells = [f"{'-':>9}" if src == dst else f"{nbytes / times[src, dst] / 1e9:>9.2f}" for dst in range(ranks)]
        lines.append(f"{src:>7}" + "".join(cells))
    return "\n".join(lines)


def run_pairs(cfg: BenchConfig, runtime: Runtime) -> None:
    n = runtime.world_size
    if n < 2:
        if runtime.is_main:
            print("\npairs: one rank, no pair to time")
        return
    element_size = DTYPES[cfg.dtype].itemsize
    nbytes = max(element_size, cast(int, cfg.pair_bytes) // element_size * element_size)
    times = {}
    for src in range(n):
        for dst in range(n):
            if src != dst:
                times[src, dst] = measure_pair(src, dst, nbytes, cfg, runtime)
    if runtime.is_main:
        with open(os.path.join(cfg.out, "comm_pairs.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(PAIRS_HEADER)
            for (src, dst), seconds in times.items():
                writer.writerow([src, dst, nbytes, f"{seconds * 1e6:.3f}", f"{nbytes / seconds / 1e9:.6g}"])
        print(f"\npairs: GB/s of {human_bytes(nbytes)} from src to dst, one pair at a time")
        print(pair_matrix(times, nbytes, n), flush=True)


def run(cfg: BenchConfig, runtime: Runtime) -> list[Result]:
    n, device = runtime.world_size, runtime.device
    backend = "nccl" if device.type == "cuda" else "gloo"
    element_size = DTYPES[cfg.dtype].itemsize
    sizes = list(dict.fromkeys(round_size(s, n, element_size) for s in cast(list[int], cfg.sizes)))
    if runtime.is_main:
        where = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
        print(
            f"comm_bench: backend {backend}, {n} ranks, device {device}{where}, dtype {cfg.dtype}, "
            f"sizes {', '.join(human_bytes(s) for s in sizes)}, {cfg.warmup} warm-up + {cfg.iters} timed iterations",
            flush=True,
        )
        os.makedirs(cfg.out, exist_ok=True)
        print(f"\n{'op':<15}{'bytes':>10}{'time_us':>13}{'algbw GB/s':>12}{'busbw GB/s':>12}", flush=True)
    results = []
    for op in cast(list[str], cfg.ops):
        if op == "send_recv" and n < 2:
            if runtime.is_main:
                print(f"{op:<15}{'':>10}   skipped: needs at least 2 ranks", flush=True)
            continue
        for nbytes in sizes:
            result = measure(op, nbytes, cfg, runtime)
            results.append(result)
            if runtime.is_main:
                print(_row(result, backend), flush=True)
            if result.status != OK:
                break  # the other sizes would fail the same way
    if runtime.is_main:
        write_csv(results, os.path.join(cfg.out, "comm_bench.csv"))
        plot(results, os.path.join(cfg.out, "comm_bench.png"), f"{backend}, {n} ranks, {cfg.dtype}")
    if cfg.pairs:
        run_pairs(cfg, runtime)
    if runtime.is_main:
        written = ["comm_bench.csv", "comm_bench.png"] + (["comm_pairs.csv"] if cfg.pairs and n > 1 else [])
        print(f"\nwrote {', '.join(os.path.join(cfg.out, name) for name in written)}", flush=True)
    return results


def main(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:
        usage = "\n\n".join(__doc__.split("\n\n")[:2])
        print(f"{usage}\n\nKeys:\n{keys_help(OmegaConf.structured(BenchRootConfig), BenchRootConfig)}")
        return
    runtime = init_runtime("auto")
    try:
        cfg = parse_config(argv, runtime.device)
    except ConfigError as error:
        if runtime.is_main:
            print(f"error: {error}", file=sys.stderr)
        runtime.shutdown()
        sys.exit(2)
    join_single_process_group(runtime)  # `python -m llmtrain.bench.comm_bench` runs as a group of one
    results = run(cfg, runtime)
    runtime.shutdown(synchronize=True)
    if any(r.status == WRONG for r in results):
        sys.exit(1)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
