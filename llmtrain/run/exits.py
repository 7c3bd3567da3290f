"""How a job's process ends, with the exit codes README lists. Before the process has a runtime, a ConfigError is
one `error:` line, exit 2 and no run directory left behind. After, a RunError (bad input, divergence, out of
memory, a checkpoint that could not be written, a stop signal, a hang) is its one line and exit code, recorded so
that a launcher's restarts leave with it too; a peer's death is PeerLost; anything else keeps its traceback. How
each attempt ended goes to the run directory (attempts.py), where a crash that repeats an earlier attempt's ends
the run for good."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig

from llmtrain.errors import ConfigError, Preempted, RunError, exit_for
from llmtrain.parallel_plan import with_layouts_that_run
from llmtrain.process import attempts
from llmtrain.process.launch_env import launch_rank
from llmtrain.process.run_dir import exit_with_config_error, remove_if_empty_run
from llmtrain.process.runtime import Runtime, ended_on_purpose, record_end_on_purpose
from llmtrain.train.peer_loss import is_peer_loss, peer_lost
from llmtrain.train.preemption import PreemptionWatch


@contextmanager
def exits_on_config_error(run_dir: str) -> Iterator[None]:
    """Before this process has a runtime: a ConfigError ends it with one line and exit 2, its run directory
    removed when it holds nothing of the run."""
    try:
        yield
    except ConfigError as error:
        exit_with_config_error(error, run_dir, is_main=True)


def leave_if_ended_on_purpose() -> None:
    """A worker restarted after the run had ended on purpose (a stop signal, bad input, divergence) leaves with
    that run's exit code: only a crash, a hang or a lost peer is trained on from the last checkpoint."""
    ended = ended_on_purpose()
    if ended is None:
        return
    code, line = ended
    if launch_rank() == 0:
        print(f"llmtrain: not restarted, as the run had ended on purpose (exit {code}): {line}", file=sys.stderr)
    sys.exit(code)


def run_to_exit(train: Callable[[], None], runtime: Runtime, run_dir: str, preemption: PreemptionWatch) -> None:
    """`train()`, then the process group left with the other ranks; a failure ends the process instead, with its
    exit code (a stop signal's handed over to the handler it replaced, e.g. submitit's, which requeues the job)."""
    try:
        train()
    except RunError as error:
        _end_on_purpose(error, runtime, run_dir, preemption)
    except BaseException as error:
        _end_after(error, runtime, run_dir)
    runtime.shutdown(synchronize=True)


def _end_on_purpose(error: RunError, runtime: Runtime, run_dir: str, preemption: PreemptionWatch) -> NoReturn:
    """A run that cannot go on, for a reason every restart would meet again: its one line and exit code, recorded
    for a launcher's restarts too."""
    if isinstance(error, ConfigError):
        error = with_layouts_that_run(error, list(HydraConfig.get().overrides.task), runtime.world_size)
    if isinstance(error, ConfigError) and runtime.is_main:
        remove_if_empty_run(run_dir)
    if runtime.is_main or not error.main_rank_speaks:
        if not error.restartable:
            record_end_on_purpose(runtime, error.exit_code, str(error))
        if not isinstance(error, ConfigError):  # bad input is no attempt at the run; its directory may be gone
            attempts.record(run_dir, runtime.attempt, runtime.rank, error.exit_code, str(error))
    preempted = isinstance(error, Preempted)

    def shut_down(synchronize: bool) -> None:
        runtime.shutdown(synchronize=synchronize)
        if preempted:
            preemption.hand_over()  # e.g. submitit's handler, which requeues the job

    exit_for(error, runtime.is_main, shut_down)


def _end_after(error: BaseException, runtime: Runtime, run_dir: str) -> NoReturn:
    """A failure that is no RunError: a peer's death becomes PeerLost (one line, its exit code); anything else
    keeps its traceback, and ends the run for good when it repeats an earlier attempt's crash."""
    if isinstance(error, Exception) and runtime.distributed and is_peer_loss(error):
        lost, speaks = peer_lost(error, runtime)
        if speaks:
            attempts.record(run_dir, runtime.attempt, runtime.rank, lost.exit_code, str(lost))
        exit_for(lost, speaks, lambda _: runtime.abort())  # a group with a dead member: torn down, not left
    if isinstance(error, Exception):
        _refuse_a_repeated_crash(error, runtime, run_dir)
    runtime.shutdown()  # no barrier: a failed rank's peers may never reach it
    raise error


def _refuse_a_repeated_crash(error: Exception, runtime: Runtime, run_dir: str) -> None:
    """Record where this rank crashed; when an earlier attempt crashed there too, say so in one line and keep the
    launchers from starting the run again: a bug, not the machine, which every restart would meet."""
    site = attempts.crash_site(error)
    step = f" in step {site['step']}" if site["step"] is not None else ""
    line = f"rank {runtime.rank} crashed with {site['error']}{step} at {site['where']}"
    earlier = attempts.repeated_crash(run_dir, runtime.attempt, runtime.rank, site)
    attempts.record(run_dir, runtime.attempt, runtime.rank, 1, line, site)
    if earlier is None:
        return
    refusal = (
        f"{line}, as in the attempt before: a bug that every restart would meet again, so the run ends here "
        f"(exit 1, not restarted or requeued; the traceback follows)"
    )
    print(f"error: {refusal}", file=sys.stderr)
    attempts.refuse_requeue(run_dir, refusal)
    record_end_on_purpose(runtime, 1, refusal)
