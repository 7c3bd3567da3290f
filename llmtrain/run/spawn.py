"""`parallel.nproc=N` without torchrun: train.py starts this node's N workers through torch's elastic agent (the
machinery behind torchrun).

The parent composes the config as usual (so a `-m` sweep gives each job its own workers and run directory), then
re-runs train.py in N workers with the same overrides, pinned to the parent's run directory and W&B identity.
Workers see torchrun's environment (RANK, WORLD_SIZE, ...), so they train instead of spawning again.

Inside a Slurm step of one task per node (`srun --ntasks-per-node=1 python train.py parallel.nproc=G`, as
launch/slurm.sbatch and the submitit launcher run it) the agents of all nodes meet at a c10d rendezvous on the
step's first host, its port and id derived from the job id: a multi-node job without torchrun. torchrun would do
the same, but it exits 1 whatever its workers exited with, and a requeue needs the trainer's own "preempted"
code (75) to reach the batch script: here the node's exit code is its first failed worker's.

Preemption signals (SIGTERM, SIGUSR1, SIGUSR2) sent to this parent are forwarded to the workers, which save a
checkpoint at their next step boundary and exit 75; the parent outlives the signal and waits for them. (torchrun
would kill its workers 30 s after a SIGTERM, and dies of a SIGUSR1.)

With `parallel.max_restarts=N` the agent starts all of this node's workers again after one fails (its rendezvous
brings the other nodes' along), as torchrun's `--max-restarts` does; they resume from the last complete
checkpoint. A run that ended on purpose (a stop signal, bad input, divergence) is not restarted into training:
the restarted workers find the end in the agent's store and leave with its code (runtime.ended_on_purpose).
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from llmtrain.errors import ConfigError
from llmtrain.process.runtime import first_slurm_host, slurm_job_port
from llmtrain.train.preemption import PREEMPTION_SIGNALS, PreemptionWatch

# What the elastic agent itself acts on (stopping its workers); the preemption signals are forwarded instead.
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


@dataclass(frozen=True)
class Nodes:
    count: int
    rendezvous: str  # host:port of the c10d rendezvous
    run_id: str


def launched_externally() -> bool:
    """True inside torchrun or our own workers: the process already has its rank."""
    return "RANK" in os.environ


def job_nodes(nproc: int) -> Nodes:
    """The nodes whose agents start workers together: every node of a Slurm step of one task per node, else
    this machine alone. A step of several tasks per node already has its ranks, so N more per task is an error."""
    env = os.environ
    tasks, nodes = int(env.get("SLURM_STEP_NUM_TASKS", "1")), int(env.get("SLURM_STEP_NUM_NODES", "1"))
    if tasks > nodes:
        raise ConfigError(
            f"parallel.nproc={nproc} starts {nproc} workers per srun task, but srun started {tasks} "
            f"tasks on {nodes} node(s): run srun --ntasks-per-node=1 with parallel.nproc, or drop "
            f"parallel.nproc and let every srun task be one rank"
        )
    if nodes > 1:
        job = env["SLURM_JOB_ID"]
        return Nodes(
            nodes,
            f"{first_slurm_host(env['SLURM_STEP_NODELIST'])}:{slurm_job_port(job)}",
            f"slurm-{job}-{env.get('SLURM_RESTART_COUNT', '0')}",
        )
    return Nodes(1, "localhost:0", uuid.uuid4().hex)


# A worker killed outright, by nobody on this side: most often Linux's out-of-memory killer.
KILLED_HINT = (
    "most often the host ran out of memory and the kernel's OOM killer chose it (dmesg | grep -i oom): lower "
    "train.micro_batch_size, set train.activation_checkpointing=selective or full, parallel.cpu_offload=false, or "
    "start fewer workers (parallel.nproc)"
)


def spawn_workers(
    entry_point: str,
    nproc: int,
    max_restarts: int,
    overrides: list[str],
    run_dir: str,
    wandb_name: str,
    wandb_group: str | None,
    preemption: PreemptionWatch,
) -> int:
    """Run `entry_point` (train.py) in `nproc` workers on this node (and as many on every other node of the step),
    starting them all again up to `max_restarts` times after a failure; returns the exit code to leave with: the
    last attempt's first failed worker's, 0 when all succeed. A preemption signal forwarded to the workers is
    recorded in `preemption`."""
    nodes = job_nodes(nproc)
    pinned = [f"hydra.run.dir={_quoted(run_dir)}", f"logging.wandb.name={_quoted(wandb_name)}"]
    if wandb_group is not None:
        pinned.append(f"logging.wandb.group={_quoted(wandb_group)}")
    # As torchrun does: workers that each take every core would fight over them.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    config = LaunchConfig(
        min_nodes=nodes.count,
        max_nodes=nodes.count,
        nproc_per_node=nproc,
        run_id=nodes.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=nodes.rendezvous,
        max_restarts=max_restarts,
        signals_to_handle=AGENT_SIGNALS,
    )
    try:
        with _forwarding_preemption_signals(preemption):
            # The workers' interpreter as torchrun picks it: PYTHON_EXEC where it is set, else this one.
            interpreter = os.environ.get("PYTHON_EXEC", sys.executable)
            elastic_launch(config, interpreter)(entry_point, *_without_pinned(overrides), *pinned)
    except ChildFailedError as failure:
        rank, first = failure.get_first_failure()
        if first.exitcode == -signal.SIGKILL and preemption.signal_name is None:
            print(f"error: rank {rank} was killed (SIGKILL): {KILLED_HINT}", file=sys.stderr)
        return first.exitcode if first.exitcode > 0 else 128 - first.exitcode  # killed by signal s: 128 + s
    return 0


@contextlib.contextmanager
def _forwarding_preemption_signals(preemption: PreemptionWatch) -> Iterator[None]:
    """While the workers run, a preemption signal to this process goes on to them (a scheduler that signals the
    whole process tree reaches them twice; they act on the first)."""

    def forward(signum: int, frame) -> None:
        preemption.record(signum)
        for child in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    previous = {sig: signal.signal(sig, forward) for sig in PREEMPTION_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _children() -> list[int]:
    """This process's child processes (Linux /proc; none found elsewhere)."""
    pids: list[int] = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError), open(path) as f:
            pids += [int(pid) for pid in f.read().split()]
    return pids


def _quoted(value: str) -> str:
    """A Hydra override value taken literally, whatever characters (=, spaces, quotes) the path holds."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _without_pinned(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith(("logging.wandb.name=", "logging.wandb.group="))]
