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
from dataclasses import dataclass, field
from typing import Optional, cast

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from llmtrain.config import check_domains, keys_help, schema_keys, unknown_key_line
from llmtrain.domains import Flag, ListOf, OneOf, WritableDirectory, at_least, key
from llmtrain.errors import ConfigError, closed_pipe_is_quiet, first_line
from llmtrain.planner.probe import OK, UNSUPPORTED, WRONG, Result, measure, round_size, slowest, timed, write_csv
from llmtrain.process.runtime import Runtime, init_runtime, join_single_process_group

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send_recv")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAIRS_HEADER = ("src", "dst", "bytes", "time_us", "GBps")


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


def human_bytes(nbytes: float) -> str:
    """4096 -> '4 KiB', 1.5 * 2**20 -> '1.5 MiB', 1000 -> '1000 B'."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.3g} {unit}" if nbytes < 1000 else f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} GiB" if nbytes < 1000 else f"{nbytes:.0f} GiB"


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
            result = measure(op, nbytes, DTYPES[cfg.dtype], cfg.warmup, cfg.iters, runtime)
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
