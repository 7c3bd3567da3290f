"""A rank that dies mid-run (SIGKILL, as the OOM killer or a lost node ends it), on real processes: the ranks left
say which rank ended in one line and exit 77, and torchrun's restart resumes the job from its last complete
checkpoint to the uninterrupted run's records and weights."""

from __future__ import annotations

import pytest
from conftest import PARITY, assert_resumed_exactly, run_train

from llmtrain.errors import PEER_LOST_EXIT
from llmtrain.faults import arm


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_and_torchrun_restarts_the_job_from_its_checkpoint(
    tmp_path, cache_dir, layout_run
):
    """Rank 1 kills itself as step 5 starts (once); rank 0 fails in the step's first collective and
    says, in one line, that rank 1 ended and that it exits 77. torchrun (--max-restarts=1) starts both again; they
    resume from step 4's checkpoint and end as the uninterrupted 2-rank ddp run does, to the bit."""
    run = run_train(
        tmp_path,
        cache_dir,
        *PARITY,
        "parallel=ddp",
        "checkpoint.every=2",
        nproc=2,
        restarts=1,
        env=arm(kill_at_step="5", kill_on_rank="1", kill_marker=str(tmp_path / "killed-once")),
    )
    output = run.stdout + run.stderr
    lines = [line for line in output.splitlines() if "ended mid-run" in line]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith("error: rank 1 ended mid-run") and f"exit {PEER_LOST_EXIT}" in lines[0], lines
    assert "Traceback" not in output.split("resumed   from")[0], output[-3000:]
    assert "resumed   from" in output and "step-00000004" in output.split("resumed   from")[1].splitlines()[0]
    assert_resumed_exactly(run, layout_run("parallel=ddp", nproc=2))
