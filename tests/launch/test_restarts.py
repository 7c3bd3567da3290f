"""Restarts and requeues only for what the machine did: a crash that repeats an earlier attempt's, at the same step
and place, ends the run for good (llmtrain/process/attempts.py), and a run that was restarted says so in its end
summary."""

from __future__ import annotations

import json

import pytest
from harness.runs import PARITY, assert_parity

from llmtrain.errors import note_step
from llmtrain.faults import arm
from llmtrain.process import attempts


def _crash(step: int | None) -> KeyError:
    try:
        raise KeyError("missing")
    except KeyError as error:
        if step is not None:
            note_step(error, step)
        return error


def test_a_crash_repeats_only_from_another_attempt_at_the_same_step_and_place(tmp_path):
    """The same rank, error, step and frame from an earlier attempt is a repeat; from this attempt, at another
    step, on another rank or outside the steps it is not. The summary gets one phrase per earlier attempt."""
    site = attempts.crash_site(_crash(7))
    assert site["error"] == "KeyError" and site["step"] == 7 and site["where"].endswith("in _crash")
    attempts.record(str(tmp_path), "a1c3.1", 1, 1, "rank 1 crashed", site)
    assert attempts.repeated_crash(str(tmp_path), "a1c3.1", 1, site) is None  # this attempt's own record
    assert attempts.repeated_crash(str(tmp_path), "a1c3.2", 1, site)["line"] == "rank 1 crashed"
    assert attempts.repeated_crash(str(tmp_path), "a1c3.2", 0, site) is None
    assert attempts.repeated_crash(str(tmp_path), "a1c3.2", 1, attempts.crash_site(_crash(8))) is None
    assert attempts.repeated_crash(str(tmp_path), "a1c3.2", 1, attempts.crash_site(_crash(None))) is None
    attempts.record(str(tmp_path), "a1c3.2", 0, 77, "rank 1 ended mid-run")
    (tmp_path / attempts.ATTEMPTS).open("a").write('{"attempt": "cut sh')  # a line a crash cut short
    assert attempts.interruptions(str(tmp_path)) == ["exit 1: rank 1 crashed", "exit 77: rank 1 ended mid-run"]


@pytest.mark.slow
def test_a_bug_that_repeats_after_a_restart_ends_the_run_with_its_traceback(train):
    """Step 5 raises KeyError in every attempt (checkpoint 4 saved): train.py's launcher restarts the worker, it
    resumes from checkpoint 4 and fails the same way, which ends the run: one line naming the error, the step and
    the place, the traceback, exit 1, and the reason left for launch/slurm.sbatch, which then does not requeue (a
    further restart leaves at once: test_bad_input_is_checked_once_however_many_restarts_the_launcher_has)."""
    run = train(
        *PARITY,
        "checkpoint.every=2",
        "parallel.nproc=1",
        "parallel.max_restarts=1",
        env=arm(raise_at_step="5"),
        ranks=1,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    refusals = [line for line in run.stderr.splitlines() if line.startswith("error: rank 0 crashed with KeyError")]
    assert len(refusals) == 1 and " in step 5 at llmtrain/faults.py:" in refusals[0], run.stderr[-3000:]
    assert "as in the attempt before" in refusals[0] and "Traceback" in run.stderr.split(refusals[0])[1]
    crashes = [json.loads(line) for line in (run.run_dir / attempts.ATTEMPTS).read_text().splitlines()]
    assert [(c["exit_code"], c["step"]) for c in crashes] == [(1, 5), (1, 5)]
    assert run.stderr.count("resumed   from") <= 1 and run.stdout.count("resumed   from") <= 1
    assert (run.run_dir / attempts.NOT_REQUEUED).read_text().startswith("rank 0 crashed with KeyError in step 5")


@pytest.mark.slow
def test_out_of_memory_in_a_step_restarts_with_a_smaller_micro_batch_and_the_same_run(train, reference, tmp_path):
    """Step 5 runs out of memory once (checkpoint 4 saved, micro-batch 2): the error says the restart takes
    micro-batch 1, train.py's launcher restarts the worker, which resumes from checkpoint 4 with it (twice the
    accumulation, the same global batch) and ends as the uninterrupted run does, within the parity tolerance (the
    per-sequence gradients summed in another grouping); its end summary names the out-of-memory attempt."""
    run = train(
        *PARITY,
        "checkpoint.every=2",
        "parallel.nproc=1",
        "parallel.max_restarts=1",
        env=arm(oom_at_step="5", oom_marker=str(tmp_path / "out-of-memory-once")),
        ranks=1,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "rank 0 ran out of cpu memory in step 5" in output
    assert "A restart or requeue resumes with train.micro_batch_size=1 (the same global batch)" in output
    assert "train.micro_batch_size=1, not 2: rank 0 ran out of memory in step 5" in output
    assert "micro 1 x accumulation 16" in output and "step-00000004" in output.split("resumed   from")[1]
    assert_parity(run, reference)
    ends = run.summary["interruptions"]
    assert len(ends) == 1 and ends[0].startswith("exit 4: rank 0 ran out of cpu memory in step 5"), ends


@pytest.mark.slow
def test_bad_input_is_checked_once_however_many_restarts_the_launcher_has(train):
    """torchrun --max-restarts=2 over a batch no micro-batch divides: the first attempt refuses it in one line (exit
    2) and tells the agent, whose restarts leave at once saying so, without checking the config again."""
    run = train("train.batch_size=15", "train.micro_batch_size=4", nproc=1, restarts=2)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: train.batch_size=15 is not divisible by train.micro_batch_size=4: set train.batch_size to a "
        "multiple of 4"
    ], run.stderr[-3000:]
    left = [line for line in run.stderr.splitlines() if line.startswith("llmtrain: not restarted")]
    assert len(left) == 2 and all(line.endswith(errors[0]) for line in left), run.stderr[-3000:]
