"""Launching without a scheduler: a local `-m` sweep whose jobs each start their own workers, and a two-"node"
torchrun job meeting at a c10d rendezvous on loopback (what a cluster without Slurm runs). Real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from harness.processes import free_port
from harness.runs import PARITY, Run, assert_parity, train_command

pytestmark = pytest.mark.slow


def test_a_local_sweep_gives_every_point_its_workers_run_directory_and_wandb_group(tmp_path, cache_dir, reference):
    """`-m` over two learning rates of fsdp, each point's 2 workers started by train.py itself, with accumulation
    (micro-batches of 4 on 2 ranks: 2 per step): the point at the default learning rate reproduces `single`."""
    sweep = tmp_path / "sweep"
    args, env, _ = train_command(
        tmp_path,
        cache_dir,
        *PARITY,
        "train.micro_batch_size=4",
        "optim.lr=0.001,0.0003",
        "parallel=fsdp",
        "parallel.nproc=2",
        f"hydra.sweep.dir={sweep}",
    )
    # `-m` before the overrides; a sweep writes under hydra.sweep.dir
    args = args[:2] + ["-m"] + [a for a in args[2:] if not a.startswith("hydra.run.dir=")]
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    points = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in points] == ["0", "1"]
    seen, names, schedules = set(), set(), {}
    for point in points:
        overrides = yaml.safe_load((point / ".hydra" / "overrides.yaml").read_text())
        lr = next(o for o in overrides if o.startswith("optim.lr="))
        seen.add(lr)
        run = Run(0, "", "", point)
        schedules[lr] = [m["lr"] for m in run.metrics]
        if lr == "optim.lr=0.001":  # the reference's learning rate
            assert_parity(run, reference)
        assert len(run.metrics) == 10
        assert run.summary["world_size"] == 2 and run.summary["layout"].startswith("fsdp")
        # the W&B identity the point's workers were given (rank 0's composed overrides): the sweep's group, a
        # name of its own (W&B recording the group is tested with a real offline run in test_slurm.py)
        pinned = {
            key: value.strip("'")
            for key, value in (o.split("=", 1) for o in overrides)
            if key.startswith("logging.wandb.")
        }
        assert pinned["logging.wandb.group"] == "sweep"
        names.add(pinned["logging.wandb.name"])
    assert seen == {"optim.lr=0.001", "optim.lr=0.0003"} and len(names) == 2
    assert sorted(os.listdir(tmp_path)) == ["sweep"]  # nothing written outside the sweep directory
    # each point trained at its own learning rate, every step
    high, low = schedules["optim.lr=0.001"], schedules["optim.lr=0.0003"]
    assert low == pytest.approx([0.3 * lr for lr in high], rel=1e-9)


def test_two_torchrun_nodes_on_loopback_reproduce_one_node(tmp_path, cache_dir, reference, layout_run):
    """`torchrun --nnodes=2` twice on one machine, rendezvous on 127.0.0.1: 2 x 2 ranks train as fsdp on 4 ranks
    of one node does, in one run directory that both "nodes" derive from the rendezvous id."""
    port = free_port()
    processes = []
    for node in range(2):
        args, env, _ = train_command(tmp_path, cache_dir, *PARITY, "parallel=fsdp")
        args = [a for a in args if not a.startswith("hydra.run.dir=")]
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=loopback",
        ]
        env["OMP_NUM_THREADS"] = "1"
        with open(tmp_path / f"node{node}.log", "w") as log:
            processes.append(
                subprocess.Popen(launcher + args[1:], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    codes = [p.wait(timeout=600) for p in processes]
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-2000:] for n in range(2))
    assert codes == [0, 0], logs
    assert sorted(os.listdir(tmp_path / "outputs")) == ["torchrun-loopback"]
    run = Run(0, "", "", tmp_path / "outputs" / "torchrun-loopback")
    assert_parity(run, reference)
    one_node = layout_run("parallel=fsdp", nproc=4)
    assert [m["loss"] for m in run.metrics] == pytest.approx([m["loss"] for m in one_node.metrics], rel=1e-6)
