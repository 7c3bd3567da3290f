"""Runs of the real entry point (`python train.py`, or torchrun over it) and what they are held to: the PARITY
run's overrides, its tolerances, exact resume, and runs started in the background or killed mid-step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness.paths import REPO
from harness.processes import claim_ranks, descendants, kill_hard, python, rank_slots, warm_interpreter
from llmtrain.checkpoint import load_final_model
from llmtrain.checkpoint.manager import complete_checkpoints
from llmtrain.faults import arm
from llmtrain.tools.compare_runs import METRICS, compare

# Small enough for a 2-core CI machine; every test run of train.py starts from these.
FAST = [
    "train.device=cpu",
    "model=tiny",
    "train.seq_len=64",
    "train.batch_size=16",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "logging.wandb.mode=disabled",
    "data.tokenizer.kind=byte",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def metrics(self) -> list[dict]:
        with open(self.run_dir / "metrics.jsonl") as f:
            return [json.loads(line) for line in f]

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


def train_command(
    workdir: Path,
    cache_dir: Path,
    *overrides: str,
    fast: bool = True,
    name: str = "run",
    nproc: int = 0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
    restarts: int = 0,
) -> tuple[list[str], dict[str, str], Path]:
    """The command line, environment and run directory of `python train.py` (or torchrun with nproc ranks, restarting
    them up to `restarts` times), from the warm interpreter unless `fresh`."""
    run_dir = workdir / name
    interpreter, warm = (sys.executable, {}) if fresh else (python(), warm_interpreter())
    torchrun_args = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}"]
        if nproc
        else []
    )
    launcher = [interpreter, *torchrun_args]
    args = launcher + [str(REPO / "train.py"), f"hydra.run.dir={run_dir}", f"data.cache_dir={cache_dir}"]
    args += (FAST if fast else []) + list(overrides)
    full_env = {**os.environ, **warm, "WANDB_SILENT": "true"}
    full_env.pop("WANDB_API_KEY", None)  # a developer's own key never reaches a test run
    full_env.update(env or {})
    return args, full_env, run_dir


def run_train(
    workdir: Path, cache_dir: Path, *overrides: str, timeout: float = 480, ranks: int | None = None, **options
) -> Run:
    """The run, or (past `timeout`, before pytest's own limit) a failure showing where each process waited: a
    hang is aborted with SIGABRT, on which Python's fault handler prints every thread's stack. `ranks`: the
    processes it runs, where train.py starts them (parallel.nproc), not torchrun."""
    args, env, run_dir = train_command(workdir, cache_dir, *overrides, **options)
    with rank_slots(options.get("nproc", 0) if ranks is None else ranks):
        process = subprocess.Popen(
            args,
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "PYTHONFAULTHANDLER": "1"},
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [*descendants(process.pid), process.pid]:  # torchrun's workers run in sessions of their own
                os.kill(pid, signal.SIGABRT)
            stdout, stderr = process.communicate()
            pytest.fail(f"no result after {timeout:.0f}s from {' '.join(args)}\n{stderr[-30_000:]}")
    return Run(process.returncode, stdout, stderr, run_dir)


# 10 steps of the tiny model on a global batch of 16 sequences, validated at steps 5 and 10.
PARITY = [
    "train.steps=10",
    "train.eval_every=5",
    "train.seq_len=32",
    "train.batch_size=16",
    "train.micro_batch_size=2",
    "data.window_shuffle_buffer=64",
]


# fp32 on CPU: the layouts sum the same per-sequence gradients in a different order (per-rank partial sums, then
# a collective), which moves results by a few ulps (~1e-7 relative); AdamW's normalisation keeps that from
# growing over 10 steps. Measured differences are ~1e-7 on losses and ~1e-7 on weights; the bounds leave 10-100x
# room without letting a real bug through. A missed reduction (one rank's gradient for the average) moves losses by
# >1e-3. A doubled one scales every gradient uniformly, to which AdamW and clipping are blind (the losses and weights
# stay put): only grad_norm shows it (2x), which is why grad_norm is among the compared metrics (compare_runs.METRICS).
LOSS_RTOL = 1e-5


PARAM_ATOL = 1e-5


# The pipeline layout whose PARITY run test_pipeline and test_checkpoint share: pp 2, GPipe, 4 micro-batches.
PIPELINE = ("parallel=pp", "parallel.pp_schedule=gpipe", "parallel.microbatches=4")


def assert_same_run(run: Run, other: Run) -> None:
    """`run` logged what `other` did, to the bit, and ended with its weights."""
    assert run.returncode == 0, run.stderr[-3000:]
    for key in ("loss", "grad_norm", "val_loss"):
        assert [m.get(key) for m in run.metrics] == [m.get(key) for m in other.metrics], key
    final = load_final_model(run.run_dir / "model.pt")
    expected = load_final_model(other.run_dir / "model.pt")
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def assert_resumed_exactly(resumed: Run, uninterrupted: Run) -> None:
    """A run resumed from a checkpoint repeated the uninterrupted run (assert_same_run)."""
    assert "resumed   from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    assert_same_run(resumed, uninterrupted)


def assert_parity(run: Run, reference: Run) -> None:
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.metrics) == 10 and sum("val_loss" in m for m in run.metrics) == 2
    differences = compare(str(run.run_dir), str(reference.run_dir))
    for key in METRICS:
        assert differences[key] <= LOSS_RTOL, differences
    assert differences["weights"] <= PARAM_ATOL, differences


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def wait_for_steps(run_dir: Path, steps: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while steps_logged(run_dir) < steps:
        assert process.poll() is None, f"the run ended early:\n{run_stderr(run_dir)[-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def run_stderr(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.stderr").read_text()


def assert_console_quiet(run: Run) -> None:
    """A run's console holds no warning (torch's deprecations, an extra's load failures, llmtrain's own): only
    torchrun's notice that it set OMP_NUM_THREADS, which is the launcher's."""
    noisy = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if re.search(r"warn|deprecat|failed to load", line, re.IGNORECASE) and "torch/distributed/run.py" not in line
    ]
    assert noisy == [], noisy[:5]


def start_run(
    tmp_path: Path, cache_dir: Path, *overrides: str, nproc: int, env: dict, name: str, ranks: int | None = None
):
    """The run in the background, its output in files beside its run directory (a pipe could fill and block);
    `ranks` as for run_train."""
    args, full_env, run_dir = train_command(tmp_path, cache_dir, *overrides, nproc=nproc, env=env, name=name)
    claim = claim_ranks(nproc if ranks is None else ranks)
    with open(tmp_path / f"{name}.stdout", "w") as out, open(tmp_path / f"{name}.stderr", "w") as err:
        process = subprocess.Popen(args, cwd=tmp_path, env=full_env, stdout=out, stderr=err)
    if claim is not None:  # held until the run ends
        claim.rename(claim.with_name(f"{process.pid}.claim"))
    return process, run_dir


def killed_mid_run(tmp_path, cache_dir, layout: tuple[str, ...], nproc: int, *extra: str) -> Path:
    """A run checkpointing every 5 steps, killed (SIGKILL to every process) while step 9 runs; its checkpoints."""
    process, run_dir = start_run(
        tmp_path,
        cache_dir,
        *PARITY,
        *layout,
        "checkpoint.every=5",
        *extra,
        nproc=nproc,
        env=arm(hang_at_step="9"),
        name="killed",
    )
    checkpoints = run_dir / "checkpoints"
    wait_for_steps(run_dir, 8, process)
    kill_hard(process)
    assert [Path(p).name for p in complete_checkpoints(str(checkpoints))] == ["step-00000005"]
    return checkpoints
