"""SLURM for real: launch/slurm.sbatch running a 2-node x 2-rank fsdp job preempted mid-run (signal, checkpoint,
requeue, resume) that still matches one node's uninterrupted run bit for bit, and a `-m` sweep submitted through
hydra-submitit-launcher. Runs where the slurm-sandbox (../shared/slurm-sandbox) is up and its environment loaded,
as .ci/run does; skipped elsewhere. The jobs are submitted at once to keep the wait short."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness.paths import REPO
from harness.runs import FAST, PARITY, Run

from llmtrain.checkpoint import load_final_model
from llmtrain.checkpoint.manager import read_meta
from llmtrain.faults import arm

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
SANDBOX_HINT = 'eval "$(../shared/slurm-sandbox/slurm-sandbox env)" after `slurm-sandbox up` (as .ci/run does)'


def _sandbox_missing() -> str | None:
    if not os.environ.get("SLURM_SANDBOX_DIR") or shutil.which("sbatch") is None:
        return f"no slurm-sandbox in this environment: {SANDBOX_HINT}"
    if subprocess.run(["sinfo"], capture_output=True, timeout=60).returncode != 0:
        return f"the slurm-sandbox does not answer (sinfo failed): {SANDBOX_HINT}"
    return None


SKIP_REASON = _sandbox_missing()
# .ci/run sets LLMTRAIN_REQUIRE_SLURM=1 where it brings the sandbox up: there a missing sandbox fails these tests
# rather than skipping them, so CI cannot go green without the only tests of sbatch, requeue and submitit.
REQUIRED = os.environ.get("LLMTRAIN_REQUIRE_SLURM") == "1"
pytestmark = [pytest.mark.slow]
if not REQUIRED:
    pytestmark.append(pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""))


@pytest.fixture(scope="module", autouse=True)
def _sandbox_required() -> None:  # module scope: before the jobs fixture submits anything
    if REQUIRED and SKIP_REASON is not None:
        pytest.fail(f"LLMTRAIN_REQUIRE_SLURM=1 but {SKIP_REASON}")


def _job_field(job: str, field: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=60).stdout
    match = re.search(rf"\b{field}=(\S+)", shown)
    return match.group(1) if match else ""


class Job:
    """One `sbatch launch/slurm.sbatch` submission from its own directory (where outputs/ appears)."""

    def __init__(self, workdir: Path, cache_dir: Path, *overrides: str, env: dict[str, str] | None = None):
        self.workdir = workdir
        workdir.mkdir()
        full_env = {
            **os.environ,
            "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1",
            "WANDB_SILENT": "true",
            **(env or {}),
        }
        full_env.pop("WANDB_API_KEY", None)
        # CPU nodes: no GPUs, one CPU per node's launcher; 2 workers per node
        args = [
            "sbatch",
            "--parsable",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            str(REPO / "launch" / "slurm.sbatch"),
            "parallel=fsdp",
            "parallel.nproc=2",
            f"data.cache_dir={cache_dir}",
            *FAST,
            *PARITY,
            *overrides,
        ]
        submitted = subprocess.run(args, cwd=workdir, env=full_env, capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        self.id = submitted.stdout.strip().split(";")[0]

    @property
    def state(self) -> str:
        return _job_field(self.id, "JobState")

    @property
    def output(self) -> str:
        path = self.workdir / f"llmtrain-{self.id}.out"
        return path.read_text(errors="replace") if path.is_file() else ""

    @property
    def run(self) -> Run:
        return Run(0, self.output, "", self.workdir / "outputs" / f"slurm-{self.id}")

    def steps_logged(self) -> int:
        metrics = self.run.run_dir / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


HAS_SUBMITIT = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
SWEEP_JOB_NAME = "llmtrain-test-sweep"
HANG_TIMEOUT = 10


def _submitit_sweep(workdir: Path, cache_dir: Path) -> subprocess.Popen:
    """`python train.py -m hydra/launcher=slurm ...` over two learning rates: two 2-node jobs, one rank per node
    (parallel.nproc=1: each srun task is a rank; with nproc > 1 each starts workers as under slurm.sbatch)."""
    workdir.mkdir()
    args = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.gpus_per_node=0",
        f"hydra.launcher.name={SWEEP_JOB_NAME}",
        "hydra.launcher.cpus_per_task=1",
        f"hydra.sweep.dir={workdir / 'sweep'}",
        f"data.cache_dir={cache_dir}",
        *FAST,
        "train.steps=2",
        "parallel=fsdp",
        "optim.lr=0.001,0.0003",
        "logging.wandb.mode=offline",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    with open(workdir / "submit.log", "w") as log:
        return subprocess.Popen(args, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def slurm_jobs(tmp_path_factory, cache_dir):
    """A `launch/slurm.sbatch` job preempted mid-run (SIGUSR1 to its batch shell after step 3), one whose rank 1
    hangs once in step 5 (the watchdog ends it) and, where the plugin is installed, a submitit sweep, submitted
    together; Slurm polled every second (`sbatch --wait` re-polls with a growing sleep)."""
    workdir = tmp_path_factory.mktemp("slurm")
    job = Job(workdir / "sbatch", cache_dir, "logging.wandb.mode=offline", env=arm(step_seconds="0.5"))
    faults = arm(
        kill_at_step="3",
        kill_on_rank="2",
        kill_marker=str(workdir / "killed-once"),
        hang_at_step="5",
        hang_on_rank="1",
        hang_marker=str(workdir / "hung-once"),
    )
    hung = Job(
        workdir / "hung",
        cache_dir,
        "checkpoint.every=2",
        f"train.hang_timeout={HANG_TIMEOUT}",
        "parallel.max_restarts=1",
        env=faults,
    )
    sweep = _submitit_sweep(workdir / "submitit", cache_dir) if HAS_SUBMITIT else None
    signalled = False
    deadline = time.monotonic() + 600
    try:
        while job.state not in FINISHED or hung.state not in FINISHED or (sweep and sweep.poll() is None):
            assert time.monotonic() < deadline, f"still running:\n{job.output[-3000:]}\n{hung.output[-3000:]}"
            if not signalled and job.steps_logged() >= 3:
                subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True, timeout=60)
                signalled = True
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job.id, hung.id], capture_output=True, timeout=60)
        if sweep and sweep.poll() is None:
            sweep.kill()
            subprocess.run(["scancel", f"--name={SWEEP_JOB_NAME}"], capture_output=True, timeout=60)
    assert signalled, job.output[-3000:]
    return job, workdir / "submitit", hung


def test_a_two_node_job_trains_bit_identically_to_one_node(slurm_jobs, layout_run):
    """2 nodes x 2 ranks of fsdp under slurm.sbatch (interrupted and resumed once, see below) against the same
    layout uninterrupted under torchrun on one node: the same losses, gradient norms and weights, to the bit."""
    job = slurm_jobs[0]
    assert job.state == "COMPLETED", job.output[-3000:]
    assert "dp_shard 4" in job.output and "2 nodes" in job.output
    assert sorted(os.listdir(job.workdir / "outputs")) == [f"slurm-{job.id}"]  # every node, every run: one directory
    assert len(list((job.workdir / "outputs").rglob("metrics.jsonl"))) == 1
    one_node = layout_run("parallel=fsdp", nproc=4)
    for key in ("loss", "grad_norm", "val_loss"):
        assert [m.get(key) for m in job.run.metrics] == [m.get(key) for m in one_node.metrics], key
    final, expected = load_final_model(job.run.run_dir / "model.pt"), load_final_model(one_node.run_dir / "model.pt")
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def test_a_preempted_job_checkpoints_requeues_and_resumes(slurm_jobs):
    job = slurm_jobs[0]
    log = job.output
    stopped = int(re.search(r"stopped by SIGUSR1 after step (\d+); checkpoint saved", log).group(1))
    assert 3 <= stopped < 10
    assert "requeueing job" in log and "(restart 1)" in log
    assert f"resumed   from {job.run.run_dir}/checkpoints/step-{stopped:08d}" in log
    # requeued once on 75; the second run's clean finish is not requeued
    assert _job_field(job.id, "Restarts") == "1" and job.state == "COMPLETED", log[-3000:]
    assert log.rstrip().endswith("llmtrain: finished")

    # the requeued run logged to the same W&B run: its id is kept with the checkpoints
    checkpoints = job.run.run_dir / "checkpoints"
    run_id = read_meta(str(checkpoints / f"step-{stopped:08d}"))["wandb_run_id"]
    assert read_meta(str(checkpoints / "step-00000010"))["wandb_run_id"] == run_id
    offline_runs = sorted((job.run.run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(p.name.endswith(f"-{run_id}") for p in offline_runs)


@pytest.mark.skipif(
    not HAS_SUBMITIT and not REQUIRED, reason='hydra-submitit-launcher is not installed: pip install -e ".[slurm]"'
)
def test_a_submitit_sweep_runs_one_multi_node_job_per_point(slurm_jobs):
    workdir = slurm_jobs[1]
    log = (workdir / "submit.log").read_text(errors="replace")
    points = sorted(p for p in (workdir / "sweep").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in points] == ["0", "1"], log[-3000:]
    for point in points:
        run = Run(0, "", "", point)
        assert len(run.metrics) == 2, log[-3000:]
        assert run.summary["world_size"] == 2  # a rank on each of 2 nodes
        offline = list((point / "wandb").glob("offline-run-*/*.wandb"))
        assert len(offline) == 1 and b"sweep" in offline[0].read_bytes()  # one W&B group for the sweep
    first_lrs = sorted(Run(0, "", "", p).metrics[0]["lr"] for p in points)  # each point got its own optim.lr
    assert first_lrs[1] / first_lrs[0] == pytest.approx(0.001 / 0.0003)


def test_a_worker_killed_on_the_second_node_is_restarted_in_place_then_a_hang_requeued(slurm_jobs, layout_run):
    """2 nodes x 2 ranks with parallel.max_restarts=1. Rank 2, on the second node, is killed (SIGKILL) as step 3
    starts: the ranks left name it, and the nodes' launchers restart every worker in place, within the allocation
    (no requeue), resuming from step 2. Then rank 1 stops before step 5: every rank writes its stack, the job exits
    76 with no restart left, and slurm.sbatch requeues it. The requeued run resumes from step 4 and ends
    bit-identical to one node's uninterrupted run, its end summary naming both earlier attempts' ends."""
    hung = slurm_jobs[2]
    log = hung.output
    assert re.search(r"ranks? [\d, ]*\b2\b[\d, ]* ended mid-run", log), log[-3000:]
    assert f"resumed   from {hung.run.run_dir}/checkpoints/step-00000002" in log
    assert "hang: no progress" in log and "behind: rank 1 in step 5 (starting the step)" in log, log[-3000:]
    assert "a rank hung" in log and "(interruption 1 of at most 3)" in log, log[-3000:]
    assert "(interruption 2" not in log, log[-3000:]  # the kill cost a restart in place, not a requeue
    assert f"resumed   from {hung.run.run_dir}/checkpoints/step-00000004" in log
    assert _job_field(hung.id, "Restarts") == "1" and hung.state == "COMPLETED", log[-3000:]
    assert sorted(p.name for p in (hung.run.run_dir / "hang").iterdir()) == [f"rank-{r}.txt" for r in range(4)]
    # one line for each earlier attempt, whose name both nodes' ranks agreed on (their agents' restart counts
    # differ): the kill's (77, or 76 where rank 0 was left waiting in a collective until its watchdog fired), then
    # the hang's
    ends = hung.run.summary["interruptions"]
    assert len(ends) == 2 and ends[0][:7] in ("exit 77", "exit 76") and ends[1].startswith("exit 76: hang: "), ends
    assert "in step 5 (starting the step)" in ends[1], ends
    one_node = layout_run("parallel=fsdp", nproc=4)
    for key in ("loss", "grad_norm", "val_loss"):
        assert [m.get(key) for m in hung.run.metrics] == [m.get(key) for m in one_node.metrics], key
