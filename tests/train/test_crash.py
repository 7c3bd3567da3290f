"""A rank that dies mid-run (SIGKILL, as the OOM killer or a lost node ends it), on real processes: the ranks left
say which rank ended in one line and exit 77, and torchrun's restart resumes the job from its last complete
checkpoint to the uninterrupted run's records and weights; checkpoints on a clock bound what a crash loses."""

from __future__ import annotations

import pytest
from harness.processes import kill_hard
from harness.runs import PARITY, assert_resumed_exactly, run_train, start_run, wait_for_steps

from llmtrain.checkpoint.manager import complete_checkpoints, read_meta
from llmtrain.errors import PEER_LOST_EXIT
from llmtrain.faults import arm

# The two launchers that restart their workers: torchrun's --max-restarts and train.py's own (parallel.nproc).
RESTARTING = {
    "torchrun": {"nproc": 2, "restarts": 1},
    "train.py": {"overrides": ("parallel.nproc=2", "parallel.max_restarts=1"), "ranks": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(RESTARTING))
def test_a_rank_killed_mid_run_is_named_and_the_launcher_restarts_the_job_from_its_checkpoint(
    tmp_path, cache_dir, layout_run, launcher
):
    """Rank 1 kills itself as step 5 starts (once); rank 0 fails in the step's first collective and
    says, in one line, that rank 1 ended and that it exits 77. The launcher (torchrun --max-restarts=1, or train.py
    with parallel.max_restarts=1) starts both again; they resume from step 4's checkpoint and end as the
    uninterrupted 2-rank ddp run does, to the bit, and its end summary says it was restarted once, and why."""
    options = dict(RESTARTING[launcher])
    run = run_train(
        tmp_path,
        cache_dir,
        *PARITY,
        "parallel=ddp",
        "checkpoint.every=2",
        *options.pop("overrides", ()),
        env=arm(kill_at_step="5", kill_on_rank="1", kill_marker=str(tmp_path / "killed-once")),
        **options,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    lines = [line for line in output.splitlines() if "ended mid-run" in line and not line.startswith("restarted")]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith("error: rank 1 ended mid-run") and f"exit {PEER_LOST_EXIT}" in lines[0], lines
    assert "Traceback" not in output.split("resumed   from")[0], output[-3000:]
    assert "resumed   from" in output and "step-00000004" in output.split("resumed   from")[1].splitlines()[0]
    assert_resumed_exactly(run, layout_run("parallel=ddp", nproc=2))
    # the end summary says what the run went through
    interruptions = run.summary["interruptions"]
    assert len(interruptions) == 1 and interruptions[0].startswith("exit 77: rank 1 ended mid-run"), interruptions
    assert "restarted 1 time(s): exit 77: rank 1 ended mid-run" in output


@pytest.mark.slow
def test_checkpoints_on_a_clock_bound_what_a_crash_loses(tmp_path, cache_dir, reference):
    """checkpoint.every_minutes=0.005 (0.3 s) with steps of at least 0.2 s and no step rule: a checkpoint every
    second step or so. The run killed (SIGKILL to every process) as step 9 starts keeps one: the newest clock
    checkpoint, at step 5 or later (each older one was pruned once a newer one was complete), and a rerun resumes
    from it to the uninterrupted run's records and weights."""
    clock = (*PARITY, "checkpoint.every_minutes=0.005")
    process, run_dir = start_run(
        tmp_path, cache_dir, *clock, nproc=0, env=arm(hang_at_step="9", step_seconds="0.2"), name="clock"
    )
    wait_for_steps(run_dir, 8, process)
    kill_hard(process)
    kept = complete_checkpoints(str(run_dir / "checkpoints"), warn=False)
    assert len(kept) == 1 and read_meta(kept[0])["by_clock"], kept
    assert read_meta(kept[0])["step"] >= 5, kept
    rerun = run_train(tmp_path, cache_dir, *clock, name="clock")  # the same run directory: resumes from it
    assert_resumed_exactly(rerun, reference)
