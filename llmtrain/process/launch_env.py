"""Hydra resolvers that read the launch environment, so every rank of a job composes the same config.

Each rank of a torchrun or srun job runs Hydra on its own. A run directory stamped with each rank's own clock
can differ by a second and split the run in two; these resolvers derive the stamp from what the ranks share.
"""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

STAMP_FORMAT = "%Y-%m-%d/%H-%M-%S"


def _process_start_time(pid: int) -> float | None:
    """Wall-clock start of a process, from /proc (Linux); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, StopIteration):
        return None
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def run_stamp() -> str:
    """The run directory's stamp, the same on every rank:
    - a Slurm job: `slurm-<job id>` (a requeued job keeps its directory);
    - torchrun on one node: the start time of the torchrun agent, the parent of every worker;
    - torchrun across nodes: `torchrun-<rendezvous id>`;
    - a plain process: now."""
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    if int(env.get("WORLD_SIZE", "1")) > 1:
        if env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE"):
            started = _process_start_time(os.getppid())
            if started is not None:
                return time.strftime(STAMP_FORMAT, time.localtime(started))
        return f"torchrun-{env.get('TORCHELASTIC_RUN_ID', 'run')}"
    return time.strftime(STAMP_FORMAT)


# Set by torchrun's agent (and the one parallel.nproc runs) in its workers: how many times it has started them again.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def under_a_restarting_agent() -> bool:
    """Whether an elastic agent started this process, one that may start it again after it fails."""
    return RESTART_COUNT in os.environ


def restart_count() -> int:
    """How many times the agent that started this process has started its workers again (0: first, or none)."""
    return int(os.environ.get(RESTART_COUNT, "0"))


def launch_rank() -> int:
    """This process's global rank as its launcher (torchrun, srun) set it; 0 for a plain process."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def launch_coordinates() -> tuple[int, int, int, str]:
    """(rank, world size, local rank, launcher) as the launcher set them: torchrun's variables, a Slurm step that
    started one task per rank (SLURM_STEP_* exist only inside a job step, not in the batch shell), or one plain
    process ("none")."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun"
    if int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return (int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env.get("SLURM_LOCALID", 0)), "slurm")
    return 0, 1, 0, "none"


def hydra_output_subdir() -> str | None:
    """Only rank 0 writes the composed config (.hydra/) into the shared run directory."""
    return ".hydra" if launch_rank() == 0 else None


def ranks_per_node() -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, srun's tasks per node, else the whole world (one node)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "WORLD_SIZE"):
        value = os.environ.get(key)
        if value:
            return int(value.split("(")[0].split(",")[0])  # Slurm writes "4(x2)" for two nodes of four tasks
    return 1


def register_resolvers() -> None:
    for name, resolver in (
        ("llmtrain_stamp", run_stamp),
        ("llmtrain_output_subdir", hydra_output_subdir),
        ("llmtrain_ranks_per_node", ranks_per_node),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver, use_cache=True)
