"""The GPU check and the overhead benchmark, run on CPU: the harnesses are proven here, their numbers on a GPU."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from conftest import REPO, python


def _tool(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([python(), "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.slow  # a process of its own
def test_the_gpu_check_says_so_when_there_is_no_gpu():
    done = _tool("llmtrain.tools.gpu_check")
    assert done.returncode != 0 and "no CUDA GPU is visible; nothing was checked" in done.stderr


@pytest.mark.slow
def test_the_gpu_check_compares_each_run_with_its_reference_and_resumes_async_checkpoints(tmp_path):
    out = tmp_path / "check.json"
    done = _tool(
        "llmtrain.tools.gpu_check",
        *("--device", "cpu", "--model", "tiny", "--seq-len", "32", "--out", str(out)),
        *("--only", "bf16,async save,resume"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["bf16", "async save", "resume"]
    assert all(row["status"] == "ok" for row in rows.values())
    assert rows["resume"]["difference"] <= 1e-3
    assert rows["bf16"]["final_loss"] < rows["bf16"]["first_loss"]
    assert re.search(r"^resume +\| ok ", done.stdout, re.MULTILINE)


@pytest.mark.slow
def test_the_overhead_benchmark_times_both_loops_on_the_same_work():
    done = _tool(
        "llmtrain.bench.overhead",
        *("--steps", "2", "--rounds", "2"),
        *("model=tiny", "train.seq_len=32", "train.batch_size=8", "train.micro_batch_size=4"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(
        r"bare loop ([\d.]+) ms/step, trainer ([\d.]+) ms/step, overhead ([-+][\d.]+)%.*"
        r"rounds ranged ([-+][\d.]+)% to ([-+][\d.]+)%",
        done.stdout,
    )
    assert found, done.stdout
    bare, trainer, overhead, lowest, highest = (float(x) for x in found.groups())
    assert bare > 0 and trainer > 0 and lowest <= overhead <= highest
