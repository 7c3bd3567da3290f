"""The GPU check and the overhead benchmark, run on CPU: the harnesses are proven here, their numbers on a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from harness.paths import REPO
from harness.processes import python

from llmtrain.faults import arm


def _tool(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([python(), "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.slow  # a process of its own
def test_the_gpu_check_says_so_when_there_is_no_gpu():
    done = _tool("llmtrain.tools.gpu_check")
    assert done.returncode != 0 and "no CUDA GPU is visible; nothing was checked" in done.stderr


@pytest.mark.slow
def test_the_gpu_check_rehearses_each_kind_of_row_on_cpu(tmp_path):
    """One row of each kind, as on a GPU: a training run with its host reads and device syncs counted, ring
    attention's kernels against SDPA, a one-rank torchrun FSDP run with float8, and its resume compared with it,
    side by side; then two speed rows (Muon against bf16's speed), their steps after the first taken in turn: each
    ok, the resumed steps within 1e-3 of the first run's, the GPU column saying which rows shared it. (The other
    rows are these kinds with other overrides; the async checkpoint's resume has its own tests in
    test_checkpoint.py.)"""
    out = tmp_path / "check.json"
    rows_run = ["bf16", "host syncs", "ring kernels", "muon", "fsdp float8 save", "fsdp float8 resume"]
    done = _tool(
        "llmtrain.tools.gpu_check",
        *("--device", "cpu", "--model", "tiny", "--seq-len", "32", "--budget", "0", "--out", str(out)),
        *("--only", ",".join(rows_run)),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(rows_run)
    assert all(row["status"] == "ok" for row in rows.values()), rows
    assert rows["fsdp float8 resume"]["difference"] <= 1e-3
    assert rows["host syncs"]["final_loss"] < rows["host syncs"]["first_loss"]
    assert "host reads [1], device syncs [0]" in rows["host syncs"]["notes"][0]  # no CUDA here: nothing syncs
    notes = rows["ring kernels"]["notes"]
    assert "bfloat16: output" in notes[0] and "float32: output" in notes[4]
    assert "bfloat16 halves: output" in notes[2] and "float32 document kernel: output" in notes[7]
    assert re.search(r"^fsdp float8 resume +\| ok ", done.stdout, re.MULTILINE)
    assert rows["bf16"]["gpu"] == rows["muon"]["gpu"] == "alone"
    (bf16_start, bf16_end), (muon_start, muon_end) = rows["bf16"]["span"], rows["muon"]["span"]
    correctness = [rows[name] for name in ("host syncs", "ring kernels", "fsdp float8 save", "fsdp float8 resume")]
    assert all(row["gpu"].startswith("with ") for row in correctness)
    assert max(row["span"][1] for row in correctness) <= min(bf16_start, muon_start)  # the speed rows came after
    assert bf16_start < muon_end and muon_start < bf16_end  # and started side by side


@pytest.mark.slow
def test_the_overhead_benchmark_times_the_trainer_against_the_bare_loop_and_names_the_difference(tmp_path):
    out = tmp_path / "overhead.json"
    done = _tool(
        "llmtrain.bench.overhead",
        *("--steps", "2", "--rounds", "2", "--device", "cpu", "--out", str(out)),
        *("model=tiny", "train.seq_len=32", "train.batch_size=8", "train.micro_batch_size=4"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ladder = json.loads(out.read_text())
    assert list(ladder["s_per_step"]) == ["bare", "llmtrain"]  # eager: no compiled rung between them
    assert all(len(times) == 2 and min(times) > 0 for times in ladder["rounds"].values())
    assert ladder["ratio"]["bare"] == 1 and ladder["tokens_per_step"] == 8 * 32
    low, high = ladder["ratio_range"]["llmtrain"]
    assert low <= ladder["ratio"]["llmtrain"] <= high
    assert re.search(r"^llmtrain +[\d.]+ +[\d.]+x", done.stdout, re.MULTILINE), done.stdout
    assert "bare -> llmtrain: " in done.stdout and "the harness: the step's read" in done.stdout


_TAKING_TURNS = """
import time
from llmtrain import faults
spans = []
for step in (1, 2, 3):
    faults.step_begins(step, rank=0)
    began = time.monotonic()
    time.sleep(0.1)
    spans.append((began, time.monotonic()))
print(spans[1][0], spans[-1][1])
"""


@pytest.mark.slow
def test_runs_armed_with_a_gpu_turn_take_their_steps_after_the_first_one_at_a_time(tmp_path):
    """gpu_check's speed rows: three processes started together, each holding the turn from its second step to its
    end; their first steps overlap, their later steps never do."""
    env = {**os.environ, **arm(gpu_turn=tmp_path / "gpu.turn")}
    processes = [
        subprocess.Popen([sys.executable, "-c", _TAKING_TURNS], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        for _ in range(3)
    ]
    turns = sorted(tuple(map(float, process.communicate(timeout=60)[0].split())) for process in processes)
    assert all(process.returncode == 0 for process in processes)
    assert all(earlier[1] <= later[0] for earlier, later in zip(turns, turns[1:])), turns


def test_the_speed_section_holds_each_feature_to_its_reference_from_the_same_call():
    """Each SPEED_TARGETS row against its reference's tokens/s: met at or above its target, MISSED below, reported
    without a verdict where it has none, `not measured` where either row has no speed; the MFU target likewise."""
    from llmtrain.tools.gpu_check_report import MFU_TARGETS, SPEED_TARGETS, speed_section
    from llmtrain.tools.gpu_check_runs import Row

    targets = {name: (reference, target) for name, reference, target in SPEED_TARGETS}
    assert targets["compiled none"] == ("bare", 0.97) and targets["fsdp 1 rank"] == ("bf16", 0.9)
    rows = [
        Row("bare", tokens_per_s=1000.0),
        Row("compiled none", tokens_per_s=980.0),  # 0.98x: met
        Row("bf16", tokens_per_s=1000.0),
        Row("fsdp 1 rank", tokens_per_s=620.0),  # 0.62x, the H200's: missed
        Row("muon", tokens_per_s=900.0),  # no target: reported
        Row("moe eager", status="FAIL (exit 1)"),
        Row("fsdp moe 1 rank", tokens_per_s=500.0),
        Row("llama3.2-1b", tokens_per_s=100.0, mfu=0.389),
    ]
    lines = speed_section(rows).splitlines()
    assert "  compiled none / bare: 0.980x (980 / 1,000)  target 0.97x: met" in lines
    assert "  fsdp 1 rank / bf16: 0.620x (620 / 1,000)  target 0.90x: MISSED" in lines
    assert "  muon / bf16: 0.900x (900 / 1,000)" in lines
    assert "  fsdp moe 1 rank / moe eager: not measured (ok; FAIL (exit 1))" in lines
    assert f"  llama3.2-1b MFU 38.9%  target {MFU_TARGETS['llama3.2-1b']:.0%}: MISSED" in lines
    assert not any(line.startswith("  adamw 8-bit") for line in lines)  # neither row ran
