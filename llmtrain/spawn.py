"""`parallel.nproc=N` without torchrun: train.py starts its own N workers through torch's elastic launch API.

The parent composes the config as usual (so a `-m` sweep gives each job its own workers and run directory), then
re-runs train.py in N workers with the same overrides, pinned to the parent's run directory and W&B identity.
Workers see torchrun's environment (RANK, WORLD_SIZE, ...), so they train instead of spawning again.
"""

from __future__ import annotations

import os
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def launched_externally() -> bool:
    """True inside torchrun (or our own workers) and inside an srun step of several tasks."""
    return "RANK" in os.environ or int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def spawn_workers(nproc: int, overrides: list[str], run_dir: str, wandb_name: str, wandb_group: str | None) -> int:
    """Run train.py in `nproc` local workers; returns the exit code to leave with (the first failure's)."""
    pinned = [f"hydra.run.dir={_quoted(run_dir)}", f"logging.wandb.name={_quoted(wandb_name)}"]
    if wandb_group is not None:
        pinned.append(f"logging.wandb.group={_quoted(wandb_group)}")
    # As torchrun does: workers that each take every core would fight over them.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    script = os.path.abspath(sys.argv[0])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    try:
        elastic_launch(config, sys.executable)(script, *_without_pinned(overrides), *pinned)
    except ChildFailedError as failure:
        _, first = failure.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 1
    return 0


def _quoted(value: str) -> str:
    """A Hydra override value taken literally, whatever characters (=, spaces, quotes) the path holds."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _without_pinned(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith(("logging.wandb.name=", "logging.wandb.group="))]
