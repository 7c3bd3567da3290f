"""A hung or slow rank on real processes: the step watchdog (llmtrain/train/watchdog.py), one rank stuck before a
collective, the other waiting inside it, both write where they are, the job ends with the hang code and a rerun
resumes exactly; the straggler report (llmtrain/train/stragglers.py) names a rank slowed on purpose. In this
process, with a floor of tenths of a second and an exit that records instead of ending the process: the watchdog a
GPU run arms by itself when train.hang_timeout is unset (after 5 steps, 20x their median, at least 300 s, 10x in the
slow phases)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from harness.runs import PARITY, Run, assert_resumed_exactly, run_train, start_run, wait_for_steps

from llmtrain.errors import HUNG_EXIT
from llmtrain.faults import arm
from llmtrain.process.runtime import Runtime
from llmtrain.train.watchdog import STARTUP_ALLOWANCE, StepWatchdog

TIMEOUT = 5
# How long a test waits for a firing that is due in tenths of a second: generous against a loaded machine, and
# only spent when the watchdog is broken.
FIRING_WAIT = 5.0


@pytest.mark.slow
def test_a_rank_stuck_before_a_collective_ends_the_job_with_every_ranks_stack(tmp_path, cache_dir, layout_run):
    """Rank 1 stops as step 4's forward/backward begins (a fault point); rank 0 runs its forward and waits for rank
    1 in backward's gradient all-reduce: the same step and phase, as every rank of a GPU job ends up (at the step's
    one read). Within the timeout and a few seconds both have written their stacks (rank 1's in the fault, rank
    0's in the collective); one line names rank 1 as behind from the flight recorders (rank 0 waits in an
    all-reduce rank 1 never posted), the launcher exits HUNG_EXIT, and the rerun resumes from step 2's checkpoint
    to the uninterrupted run's records and weights."""
    run = (*PARITY, "parallel=ddp", "parallel.nproc=2", "checkpoint.every=2", f"train.hang_timeout={TIMEOUT}")
    hang = arm(hang_at_step="4", hang_on_rank="1", hang_in_phase="forward/backward")
    process, run_dir = start_run(tmp_path, cache_dir, *run, nproc=0, env=hang, name="hung")
    wait_for_steps(run_dir, 3, process)
    step_3_logged = time.monotonic()
    assert process.wait(timeout=120) == HUNG_EXIT
    ended_after = time.monotonic() - step_3_logged
    output = (tmp_path / "hung.stdout").read_text() + (tmp_path / "hung.stderr").read_text()
    stuck, waiting = ((run_dir / "hang" / f"rank-{rank}.txt").read_text() for rank in (1, 0))
    assert "in step 4, forward/backward, at _hang (llmtrain/faults.py" in stuck and "in _hang" in stuck
    assert "in step 4, forward/backward" in waiting and "waiting in gloo:all_reduce" in waiting and "posted" in waiting
    line = next(line for line in output.splitlines() if "hang: no progress" in line)
    behind = re.search(
        r"behind: rank 1 in step 4 \(forward/backward\) at _hang .*?in no collective \(newest: gloo:\w+ #(\d+)", line
    )
    ahead = re.search(
        r"waiting for them: rank 0 in step 4 \(forward/backward\) .*?waiting in gloo:all_reduce #(\d+)", line
    )
    assert behind and ahead, line
    assert int(ahead.group(1)) == int(behind.group(1)) + 1, line  # the all-reduce rank 1 never posted
    assert ended_after < TIMEOUT + 20, ended_after
    resumed = start_run(tmp_path, cache_dir, *run, nproc=0, env={}, name="hung")[0]  # the same run directory
    assert resumed.wait(timeout=300) == 0, (tmp_path / "hung.stderr").read_text()[-3000:]
    rerun = Run(0, (tmp_path / "hung.stdout").read_text(), (tmp_path / "hung.stderr").read_text(), run_dir)
    assert_resumed_exactly(rerun, layout_run("parallel=ddp", nproc=2))


@pytest.mark.slow
def test_the_first_watchdog_to_fire_makes_every_rank_dump_at_once(tmp_path, cache_dir):
    """Rank 1 stops while logging step 3 (a W&B call that never returns: a slow phase, 10x the timeout) and rank 0
    waits for it in step 4 (1x). Rank 0's watchdog fires first and tells the others through the job's store:
    rank 1 writes its dump within a poll, long before its own deadline (and the launcher's kill), and the line
    names it as behind rather than silent."""
    run = (*PARITY, "parallel=ddp", "parallel.nproc=2", f"train.hang_timeout={TIMEOUT}")
    hang = arm(hang_at_step="3", hang_on_rank="1", hang_in_phase="logging")
    process, run_dir = start_run(tmp_path, cache_dir, *run, nproc=0, env=hang, name="told")
    wait_for_steps(run_dir, 3, process)
    step_3_logged = time.monotonic()
    assert process.wait(timeout=120) == HUNG_EXIT
    assert time.monotonic() - step_3_logged < 2 * TIMEOUT  # rank 1's own deadline: 10 x TIMEOUT
    stuck = (run_dir / "hang" / "rank-1.txt").read_text()
    assert "in step 3, logging, at _hang" in stuck and "(another rank's watchdog fired)" in stuck
    output = (tmp_path / "told.stdout").read_text() + (tmp_path / "told.stderr").read_text()
    line = next(line for line in output.splitlines() if "hang: no progress" in line)
    assert "silent" not in line and "behind: rank 1 in step 3 (logging)" in line, line
    assert "waiting for them: rank 0 in step 4 (forward/backward)" in line, line


@pytest.mark.slow
def test_the_straggler_report_names_the_rank_that_computes_longer(tmp_path, cache_dir, layout_run):
    """Rank 1 computes 0.5 s more in every step (a fault point, busy, not asleep): every logging step (every 2nd)
    records it as the slowest rank, far behind its peer, one warning says so after three such steps, and the
    gathering changes nothing that is learned (the losses are the uninterrupted ddp run's, to the bit)."""
    run = run_train(
        tmp_path,
        cache_dir,
        *PARITY,
        "parallel=ddp",
        "logging.log_every=2",
        nproc=2,
        env=arm(slow_rank="1", slow_seconds="0.5"),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    checked = [record for record in run.metrics if "slowest_rank" in record]
    assert [record["step"] for record in checked] == [2, 4, 6, 8, 10]
    # The lag is the share of the step rank 0 waited for rank 1: about 0.8 for a 0.1 s step alone, less when the
    # machine's other work slows both ranks' steps; what the report must say is who lags past the threshold (0.2).
    assert all(record["slowest_rank"] == 1 and record["straggler_lag"] > 0.3 for record in checked), checked
    warnings = [line for line in (run.stdout + run.stderr).splitlines() if "rank 1's peers waited" in line]
    assert len(warnings) == 1 and "step 6: rank 1" in warnings[0], warnings
    assert [m["loss"] for m in run.metrics] == [m["loss"] for m in layout_run("parallel=ddp", nproc=2).metrics]


# -- the default arming (train.hang_timeout unset), in this process -----------------------------------------------


class RecordedExit:
    """Stands in for os._exit: the code the watchdog ended with and when, so the test process lives on."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.at: float | None = None
        self.fired = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.at = time.monotonic()
        self.fired.set()


def runtime_on(device: str) -> Runtime:
    return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device(device), launcher="none")


@pytest.fixture
def default_watchdog(tmp_path: Path) -> Iterator[Callable[[float], tuple[StepWatchdog, RecordedExit]]]:
    """Makes unarmed watchdogs (train.hang_timeout unset) with the given floor on a CPU runtime; closes them after."""
    made: list[StepWatchdog] = []

    def make(auto_floor: float) -> tuple[StepWatchdog, RecordedExit]:
        exit_ = RecordedExit()
        watchdog = StepWatchdog(None, runtime_on("cpu"), str(tmp_path), auto_floor=auto_floor, end_process=exit_)
        made.append(watchdog)
        return watchdog, exit_

    yield make
    for watchdog in made:
        watchdog.close()


def run_steps(watchdog: StepWatchdog, step_seconds: list[float], first_step: int = 1) -> int:
    """What the loop tells the watchdog for these steps (their phases, then each step's time, as reported: no real
    waiting); returns the next step."""
    step = first_step
    for seconds in step_seconds:
        for phase in ("starting the step", "forward/backward", "optimizer"):
            watchdog.phase_begins(step, phase)
        watchdog.step_ends(step, seconds)
        step += 1
    return step


def stall_until_fired(watchdog: StepWatchdog, exit_: RecordedExit, step: int, phase: str) -> float:
    """Enter `phase` and make no more progress: the seconds until the watchdog fired (measured from before the mark,
    so never less than the allowance it gave the phase)."""
    entered = time.monotonic()
    watchdog.phase_begins(step, phase)
    assert exit_.fired.wait(FIRING_WAIT), f"no firing within {FIRING_WAIT} s of {phase} (timeout {watchdog.timeout})"
    assert exit_.at is not None
    return exit_.at - entered


def test_an_unset_hang_timeout_gives_gpu_runs_a_watchdog_to_arm_and_cpu_runs_none(tmp_path):
    """The default is on where it matters (a GPU), unarmed until the steps decide; off on a CPU, and 0 is off."""
    watchdog = StepWatchdog.for_run(None, runtime_on("cuda"), str(tmp_path))  # a device name: no GPU needed
    assert watchdog is not None
    try:
        assert watchdog.timeout is None
    finally:
        watchdog.close()
    assert StepWatchdog.for_run(None, runtime_on("cpu"), str(tmp_path)) is None
    assert StepWatchdog.for_run(0, runtime_on("cuda"), str(tmp_path)) is None


def test_the_default_watchdog_is_not_armed_before_the_fifth_step(default_watchdog, tmp_path):
    """Four steps in, a phase that stalls for 6x what an armed watchdog would allow (the floor: 20x these steps is
    less) is not a hang; the fifth step arms it, and the next stall fires."""
    watchdog, exit_ = default_watchdog(auto_floor=0.05)
    step = run_steps(watchdog, [0.001] * 4)
    assert watchdog.timeout is None
    watchdog.phase_begins(step, "forward/backward")
    assert not exit_.fired.wait(0.3), "the watchdog fired before the warm-up steps were over"
    step = run_steps(watchdog, [0.001], first_step=step)
    assert watchdog.timeout == pytest.approx(0.05)
    stall_until_fired(watchdog, exit_, step, "forward/backward")
    assert exit_.codes == [HUNG_EXIT]
    assert f"in step {step}, forward/backward" in (tmp_path / "hang" / "rank-0.txt").read_text()


def test_the_default_timeout_is_20_times_the_median_step_after_the_first(default_watchdog, tmp_path, caplog):
    """The first step (compiling, warming up) is left out of the median: with it, 0.4 s instead of 0.3 s. Steps
    after the fifth change nothing. A phase that overruns the 0.3 s fires the hang path: the dump names the step
    and phase, one line names the rank, and the process would end with HUNG_EXIT."""
    watchdog, exit_ = default_watchdog(auto_floor=0.01)
    step = run_steps(watchdog, [5.0, 0.01, 0.01, 0.02, 0.02])
    assert watchdog.timeout == pytest.approx(20 * 0.015)
    step = run_steps(watchdog, [9.0], first_step=step)
    assert watchdog.timeout == pytest.approx(20 * 0.015)
    with caplog.at_level(logging.ERROR, logger="llmtrain"):
        stalled = stall_until_fired(watchdog, exit_, step, "forward/backward")
    assert stalled >= 0.3
    assert exit_.codes == [HUNG_EXIT]
    assert f"in step {step}, forward/backward" in (tmp_path / "hang" / "rank-0.txt").read_text()
    assert "hang: no progress" in caplog.text and f"rank 0 in step {step} (forward/backward)" in caplog.text


def test_the_default_timeout_is_at_least_the_floor_300_s_in_production(default_watchdog, tmp_path):
    """Steps of a millisecond would give 20 ms: the floor (here 0.3 s) holds instead; a watchdog made as the run
    makes it takes 300 s."""
    watchdog, exit_ = default_watchdog(auto_floor=0.3)
    step = run_steps(watchdog, [0.001] * 5)
    assert watchdog.timeout == pytest.approx(0.3)
    assert stall_until_fired(watchdog, exit_, step, "forward/backward") >= 0.3
    production = StepWatchdog(None, runtime_on("cpu"), str(tmp_path))
    try:
        run_steps(production, [0.001] * 5)  # armed, but nothing marked after: it cannot fire here
        assert production.timeout == 300.0
    finally:
        production.close()


@pytest.mark.parametrize("phase", ["validation", "downstream tasks", "logging", "checkpoint"])
def test_the_slow_phases_get_10_times_the_default_timeout(default_watchdog, tmp_path, phase):
    """Validation, eval.tasks, logging and checkpoints may take longer than a step: a stall in one fires only after
    10x the derived timeout (0.03 s here, so not before 0.3 s)."""
    watchdog, exit_ = default_watchdog(auto_floor=0.03)
    step = run_steps(watchdog, [0.001] * 5)
    assert watchdog.timeout == pytest.approx(0.03)
    assert stall_until_fired(watchdog, exit_, step, phase) >= 10 * 0.03
    assert exit_.codes == [HUNG_EXIT]
    assert f"in step {step}, {phase}" in (tmp_path / "hang" / "rank-0.txt").read_text()


def test_an_attempt_is_watched_from_its_start_with_its_first_step_under_the_startup_allowance(tmp_path):
    """train.hang_timeout set (0.05 s here): the watch starts as the run joins its group, in "starting up", with
    20x the timeout to the end of the attempt's first step (a restart's checkpoint read, compilation); from the
    second step on a phase gets 1x. A start that never reaches a step fires; a stalled first step fires only after
    the start-up allowance; a stalled second step fires within a poll of the timeout."""
    timeout, startup = 0.05, STARTUP_ALLOWANCE * 0.05
    for case in ("before any step", "in the first step", "in the second step"):
        exit_ = RecordedExit()
        made = time.monotonic()
        watchdog = StepWatchdog(timeout, runtime_on("cpu"), str(tmp_path / case), end_process=exit_)
        try:
            if case == "before any step":
                assert exit_.fired.wait(FIRING_WAIT) and exit_.at is not None
                where = "in step 0, starting up"
            elif case == "in the first step":
                stall_until_fired(watchdog, exit_, 1, "forward/backward")
                where = "in step 1, forward/backward"
            else:
                step = run_steps(watchdog, [0.001])
                assert stall_until_fired(watchdog, exit_, step, "forward/backward") < startup / 2
                where = "in step 2, forward/backward"
            assert exit_.codes == [HUNG_EXIT]
            if case != "in the second step":
                assert exit_.at is not None and exit_.at - made >= startup, case
            assert where in (tmp_path / case / "hang" / "rank-0.txt").read_text(), case
        finally:
            watchdog.close()
