"""The collective benchmark (llmtrain/bench/comm_bench.py): its config errors, nccl-tests' bus factors, and a real
4-rank gloo run whose CSVs, plot and table agree with each other and with the definitions."""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from harness.paths import REPO
from harness.processes import torchrun

from llmtrain.bench.comm_bench import OPS, PAIRS_HEADER, parse_config
from llmtrain.errors import ConfigError
from llmtrain.planner.links import CSV_HEADER, bus_factor
from llmtrain.planner.probe import OK, UNSUPPORTED, WRONG, first_call, make_op, round_size
from llmtrain.process.runtime import Runtime

CPU = torch.device("cpu")
SIZES, PAIR_BYTES, RANKS = (4096, 65536), 1 << 20, 4


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_reduce", 8) == 1.75
    assert [bus_factor(op, 4) for op in ("reduce_scatter", "all_gather", "all_to_all")] == [0.75] * 3
    assert bus_factor("broadcast", 4) == bus_factor("send_recv", 4) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0  # one rank moves nothing


def test_sizes_are_rounded_to_whole_elements_per_rank():
    assert round_size(4096, 4, 4) == 4096
    assert round_size(1000, 3, 4) == 996 and round_size(1000, 3, 2) == 996
    assert round_size(5, 4, 4) == 16  # at least one element per rank


def test_config_defaults_and_overrides():
    cfg = parse_config([], CPU)
    assert cfg.ops == list(OPS) and cfg.dtype == "float32" and (cfg.warmup, cfg.iters) == (5, 20)
    assert cfg.sizes == [1024 * 4**k for k in range(8)] and cfg.sizes[-1] == 16 << 20
    assert cfg.pair_bytes == 4 << 20 and not cfg.pairs
    cfg = parse_config(["bench.ops=[broadcast,all_reduce]", "bench.sizes=[4096]", "bench.dtype=bfloat16"], CPU)
    assert cfg.ops == ["broadcast", "all_reduce"] and cfg.sizes == [4096] and cfg.dtype == "bfloat16"


@pytest.mark.parametrize(
    "arg, named",
    [
        ("bench.iter=3", "bench.iter"),
        ("iters=3", "iters is not a key"),
        ("bench.warmup=lots", "bench.warmup"),
        ("bench.dtype=float8", "bench.dtype"),
        ("bench.ops=[all_reduce,allgather]", "allgather"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(arg, named):
    with pytest.raises(ConfigError) as error:
        parse_config([arg], CPU)
    assert named in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow  # a process of its own: the fast tier checks the same parser in-process above
def test_a_misspelt_key_exits_2_with_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "llmtrain.bench.comm_bench", "bench.iter=3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: bench.iter is not a key: did you mean bench.iters? (the keys of bench: dtype, iters, ops, out, "
        "pair_bytes, pairs, sizes, warmup)"
    ]


@pytest.fixture
def group_of_one():
    """A one-rank gloo group in this process (its store in memory), left before the next test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield Runtime(rank=0, world_size=1, local_rank=0, device=CPU, launcher="none")
    dist.destroy_process_group()


def test_an_op_the_backend_lacks_is_reported_and_a_wrong_result_caught(group_of_one):
    def lacking() -> None:
        raise RuntimeError("ProcessGroupGloo does not support this\n(a C++ stack)")

    assert first_call(lacking, lambda: True, CPU) == (UNSUPPORTED, "ProcessGroupGloo does not support this")
    assert first_call(lambda: None, lambda: False, CPU) == (WRONG, "wrong result after the first call")
    for op in OPS[:-1]:  # send_recv needs a second rank
        run, check = make_op(op, 4096, torch.bfloat16, group_of_one)
        assert first_call(run, check, CPU) == (OK, ""), op


def _csv(path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


@pytest.mark.slow
def test_four_gloo_ranks_measure_every_supported_op_and_pair(tmp_path):
    done = torchrun(
        RANKS,
        *("-m", "llmtrain.bench.comm_bench", f"bench.sizes=[{','.join(map(str, SIZES))}]"),
        *("bench.iters=3", "bench.warmup=1", f"bench.out={tmp_path}", "bench.pairs=true"),
        f"bench.pair_bytes={PAIR_BYTES}",
        timeout=120,
    )
    print(done.stdout)  # the table, for -s
    assert done.stdout.startswith("comm_bench: backend gloo, 4 ranks, device cpu")
    unsupported = set(re.findall(r"^(\w+) .* unsupported on gloo: ", done.stdout, re.MULTILINE))
    assert "WRONG RESULT" not in done.stdout

    header, rows = _csv(tmp_path / "comm_bench.csv")
    assert tuple(header) == CSV_HEADER
    measured = [op for op in OPS if op not in unsupported]
    assert {"all_reduce", "broadcast", "all_gather", "send_recv"} <= set(measured)  # gloo has these
    assert [(r["op"], int(r["bytes"])) for r in rows] == [(op, size) for op in measured for size in SIZES]
    table = {
        (op, int(kib) * 1024): float(time_us)
        for op, kib, time_us in re.findall(r"^(\w+) +(\d+) KiB +([\d.]+) +[\d.]+ +[\d.]+$", done.stdout, re.M)
    }
    assert list(table) == [(r["op"], int(r["bytes"])) for r in rows]  # the table shows the same measurements
    for r in rows:
        seconds, algbw = float(r["time_us"]) * 1e-6, float(r["algbw_GBps"])
        assert int(r["ranks"]) == RANKS and seconds > 0
        assert math.isclose(algbw, int(r["bytes"]) / seconds / 1e9, rel_tol=1e-3), r
        assert math.isclose(float(r["busbw_GBps"]), algbw * bus_factor(r["op"], RANKS), rel_tol=1e-4), r
        assert abs(table[r["op"], int(r["bytes"])] - float(r["time_us"])) <= 0.051, r

    header, pairs = _csv(tmp_path / "comm_pairs.csv")
    assert tuple(header) == PAIRS_HEADER
    ordered = [(s, d) for s in range(RANKS) for d in range(RANKS) if s != d]
    assert [(int(p["src"]), int(p["dst"])) for p in pairs] == ordered
    for p in pairs:
        assert int(p["bytes"]) == PAIR_BYTES and float(p["time_us"]) > 0 and float(p["GBps"]) > 0
        assert math.isclose(float(p["GBps"]), PAIR_BYTES / (float(p["time_us"]) * 1e-6) / 1e9, rel_tol=1e-3)
    assert re.search(r"^src\\dst +0 +1 +2 +3$", done.stdout, re.MULTILINE)

    assert (tmp_path / "comm_bench.png").stat().st_size > 5_000
