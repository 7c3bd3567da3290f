"""The distributed runtime joins a real gloo process group from torchrun's or srun's environment."""

from __future__ import annotations

import datetime
import os
import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness.paths import REPO
from harness.processes import free_port, rank_slots

from llmtrain.bench.startup_store import CountedStore
from llmtrain.errors import ConfigError
from llmtrain.process.runtime import (
    agree_on_attempt,
    cuda_device_index,
    first_slurm_host,
    gather_posts,
    init_runtime,
    peer_to_peer_verdict,
    process_group_backend,
    use_tf32_for_fp32_matmuls,
)


def _worker(rank: int, env: dict[str, str], results) -> None:
    os.environ.update({k: v.format(rank=rank) for k, v in env.items()})
    runtime = init_runtime("cpu")
    value = torch.tensor([float(runtime.rank + 1)])
    dist.all_reduce(value)
    backend = dist.get_backend()
    results.put((runtime.rank, runtime.world_size, runtime.launcher, backend, value.item(), os.environ["MASTER_ADDR"]))
    runtime.shutdown(synchronize=True)


def _spawn(env: dict[str, str], nprocs: int = 2) -> list[tuple]:
    context = mp.get_context("spawn")
    results = context.Queue()
    with rank_slots(nprocs):
        mp.start_processes(_worker, args=(env, results), nprocs=nprocs, start_method="spawn")
    return sorted(results.get(timeout=60) for _ in range(nprocs))


@pytest.mark.slow  # real processes: the slow tier
def test_torchrun_environment():
    env = {
        "RANK": "{rank}",
        "LOCAL_RANK": "{rank}",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    assert _spawn(env) == [(0, 2, "torchrun", "gloo", 3.0, "127.0.0.1"), (1, 2, "torchrun", "gloo", 3.0, "127.0.0.1")]


@pytest.mark.slow  # real processes: the slow tier
def test_srun_environment_without_torchrun(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    job_id = 20000 * 7 + free_port() - 20000  # the runtime derives port 20000 + job_id % 20000
    env = {
        "SLURM_PROCID": "{rank}",
        "SLURM_LOCALID": "{rank}",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_JOB_ID": str(job_id),
    }
    results = _spawn(env)
    assert [r[:5] for r in results] == [(0, 2, "slurm", "gloo", 3.0), (1, 2, "slurm", "gloo", 3.0)]
    assert results[0][5] == "localhost"


def test_plain_process_has_no_group(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    runtime = init_runtime("cpu")
    assert (runtime.rank, runtime.world_size, runtime.launcher, runtime.distributed) == (0, 1, "none", False)


@pytest.mark.parametrize(
    "nodelist, first",
    [("gpu[03-05,09],login1", "gpu03"), ("node7,node8", "node7"), ("solo", "solo"), ("rack1-n[10-11]", "rack1-n10")],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def _stamp_worker(rank: int, results) -> None:
    from llmtrain.process.launch_env import hydra_output_subdir, run_stamp

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    time.sleep(1.2 * rank)  # the ranks' clocks are a second apart when they compose the config
    results.put((rank, run_stamp(), hydra_output_subdir()))


@pytest.mark.slow  # real processes: the slow tier
def test_ranks_started_seconds_apart_agree_on_the_run_directory(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    context = mp.get_context("spawn")
    results = context.Queue()
    with rank_slots(2):
        mp.start_processes(_stamp_worker, args=(results,), nprocs=2, start_method="spawn")
    (_, stamp0, subdir0), (_, stamp1, subdir1) = sorted(results.get(timeout=60) for _ in range(2))
    assert stamp0 == stamp1 and "/" in stamp0
    assert (subdir0, subdir1) == (".hydra", None)


def test_slurm_job_names_the_run_directory(monkeypatch):
    from llmtrain.process.launch_env import run_stamp

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run_stamp() == "slurm-4242"


def _clear_launch_environment(monkeypatch) -> None:
    for key in (
        "RANK",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_STEP_NUM_NODES",
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_ID",
        "SLURM_RESTART_COUNT",
    ):
        monkeypatch.delenv(key, raising=False)


def test_a_launcher_per_node_meets_the_others_on_the_steps_first_host(monkeypatch):
    from llmtrain.run.spawn import job_nodes

    _clear_launch_environment(monkeypatch)
    assert job_nodes(4).count == 1 and job_nodes(4).rendezvous == "localhost:0"  # no Slurm step: this machine
    monkeypatch.setenv("SLURM_JOB_ID", "20007")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    nodes = job_nodes(4)  # what every node computes: the same rendezvous, a new id after a requeue
    assert (nodes.count, nodes.rendezvous, nodes.run_id) == (2, "gpu07:20007", "slurm-20007-1")


def test_workers_per_task_on_top_of_a_rank_per_task_is_refused(monkeypatch):
    from llmtrain.errors import ConfigError
    from llmtrain.run.spawn import job_nodes

    _clear_launch_environment(monkeypatch)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    with pytest.raises(ConfigError) as error:
        job_nodes(4)
    assert "parallel.nproc=4" in str(error.value) and "--ntasks-per-node=1" in str(error.value)


def test_a_stop_signal_is_recorded_and_handed_back_to_whoever_watched_before(monkeypatch):
    """A real SIGUSR2 to this process: the watch records it instead of dying of it; `hand_over` then runs the
    handler installed before the watch (submitit's requeue, in a submitit job)."""
    import signal

    from llmtrain.train.preemption import PreemptionWatch

    earlier = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: earlier.append(signum))
    try:
        with PreemptionWatch() as watch:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert watch.signal_name == "SIGUSR2" and earlier == []
            watch.hand_over()
            assert earlier == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR2)  # closed: the earlier handler is back
        assert earlier == [signal.SIGUSR2, signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.parametrize("local_rank, lines", [(0, 1), (1, 0)])
def test_a_stop_signal_is_announced_once_per_node_by_the_rank_the_runtime_names(monkeypatch, capsys, local_rank, lines):
    """A signal before the runtime exists is announced once the watch learns its rank (from the Runtime, whatever
    the environment says), by local rank 0 only; further signals add no line."""
    import signal

    from llmtrain.process.runtime import Runtime
    from llmtrain.train.preemption import PreemptionWatch

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    runtime = Runtime(rank=5, world_size=8, local_rank=local_rank, device=torch.device("cpu"), launcher="slurm")
    with PreemptionWatch() as watch:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.signal_name == "SIGUSR1" and capsys.readouterr().err == ""  # no rank known yet
        assert watch.stop_requested(runtime)
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.stop_requested(runtime)
    announced = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmtrain: ")]
    assert len(announced) == lines
    assert all(line.startswith("llmtrain: SIGUSR1 received on rank 5: ") for line in announced)


def test_only_the_runtime_and_what_runs_before_it_read_rank_variables():
    """The process's place in the job comes from the Runtime; only runtime.py, launch_env.py (the run directory,
    before any Runtime) and spawn.py (the launcher) read the launchers' rank variables."""
    import re

    package = REPO / "llmtrain"
    allowed = {"process/runtime.py", "process/launch_env.py", "run/spawn.py"}
    variables = re.compile(
        r"\b(LOCAL_RANK|RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|SLURM_PROCID|SLURM_LOCALID|SLURM_NTASKS|"
        r"SLURM_STEP_NUM_TASKS)\b"
    )
    readers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if str(path.relative_to(package)) not in allowed and variables.search(path.read_text())
    )
    assert readers == []


def test_more_processes_on_a_node_than_gpus_is_one_line():
    assert cuda_device_index(1, 2, "torchrun") == 1
    with pytest.raises(ConfigError, match=r"^local rank 2 but only 2 CUDA device\(s\) are visible") as error:
        cuda_device_index(2, 2, "torchrun")
    assert "--nproc_per_node=2" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError):
        cuda_device_index(1, 1, "torchrun")  # two processes, one GPU


def test_peer_to_peer_is_off_on_geforce_cards_and_where_devices_report_none():
    """Decided from the devices in every launch path (not only launch/single_node.sh): GeForce drivers can report
    peer access over PCIe they cannot do, on which NCCL hangs or crawls."""
    geforce = peer_to_peer_verdict(["NVIDIA GeForce RTX 4080"] * 4, peers_reachable=True)
    assert geforce is not None and "NVIDIA GeForce RTX 4080" in geforce
    assert peer_to_peer_verdict(["NVIDIA H100 80GB HBM3"] * 8, peers_reachable=True) is None
    assert (
        peer_to_peer_verdict(["NVIDIA A10"] * 2, peers_reachable=False)
        == "the devices report no peer access to each other"
    )


def test_srun_with_one_gpu_bound_per_task_uses_it_whatever_the_local_rank():
    """srun --gpus-per-task=1: the task of local rank 3 sees its own GPU as device 0."""
    assert cuda_device_index(3, 1, "slurm") == 0
    assert cuda_device_index(3, 4, "slurm") == 3  # all four visible: each takes its own


def test_gpu_jobs_get_a_gloo_backend_beside_nccl_for_host_tensors():
    """CPU-offloaded FSDP reduces gradients that live in host memory: a NCCL-only group has no backend for them."""
    assert process_group_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_fp32_matmuls_use_tf32_tensor_cores_on_gpus_only():
    """...readable through both of torch's APIs afterwards (the legacy getter, which inductor calls, raised after
    the new API alone set it)."""
    before = torch.get_float32_matmul_precision()
    try:
        use_tf32_for_fp32_matmuls(torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == before
        use_tf32_for_fp32_matmuls(torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.releases
def test_the_ranks_of_an_attempt_agree_on_its_number_whatever_an_earlier_attempt_left_in_the_store():
    """Four ranks on a real TCP store that outlives them, as an agent's does. The first attempt agrees; the second
    dies before rank 0 starts, leaving its ranks' posts; in the third the ranks start in a random order, seconds
    apart (as nodes restarted by different agents do, rank 0 last): each gets one number, new, not the second
    attempt's stale posts or the first's number."""
    world = 4
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=timeout, wait_for_workers=False)

    def connect() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", server.port, world + 1, is_master=False, timeout=timeout)

    def attempt(ranks: list[int], delays: dict[int, float]) -> dict[int, int]:
        numbers: dict[int, int] = {}

        def rank_joins(rank: int) -> None:
            time.sleep(delays.get(rank, 0.0))
            numbers[rank] = agree_on_attempt(connect(), rank, world, timeout)

        threads = [threading.Thread(target=rank_joins, args=(rank,)) for rank in ranks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        return numbers

    first = attempt(list(range(world)), {})
    assert len(set(first.values())) == 1 and len(first) == world, first
    for rank in (1, 2, 3):  # the second attempt's ranks post their names; its rank 0 never starts
        connect().set(f"llmtrain/join/hello/{rank}", os.urandom(16).hex())
    order = random.Random(0).sample([1, 2, 3], 3)
    third = attempt(list(range(world)), {0: 0.6, order[0]: 0.0, order[1]: 0.2, order[2]: 1.0})
    assert len(third) == world and len(set(third.values())) == 1, third
    assert set(third.values()) != set(first.values())


def test_a_start_costs_each_rank_the_same_few_store_calls_at_any_world_size():
    """The attempt agreement and a roll call on a real TCP store, 6 and then 20 ranks (threads, a connection each):
    every rank gets the one name and every post in at most 12 calls, at 20 ranks as at 6 (rank 0 polled
    every rank's keys before: its calls grew with the world, about 3 a rank a poll). A roll call missing a rank
    returns the others' posts once its seconds have passed."""
    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    # few connections, made once: without a resolver, every 25th or so waits 5 s for its own host name
    connections = [dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout) for _ in range(20)]

    def start(world: int) -> dict[int, int]:
        calls: dict[int, int] = {}
        names: set[str] = set()

        def rank_starts(rank: int) -> None:
            store = CountedStore(connections[rank])
            names.add(agree_on_attempt(store, rank, world, timeout))  # type: ignore[arg-type]
            posts = gather_posts(store, rank, world, f"roll/{world}", f"rank {rank}", 30)  # type: ignore[arg-type]
            assert posts == {peer: f"rank {peer}".encode() for peer in range(world)}
            calls[rank] = sum(store.calls.values())

        threads = [threading.Thread(target=rank_starts, args=(rank,)) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(calls) == world and len(names) == 1, (calls, names)
        return calls

    small, large = start(6), start(20)
    assert max(small.values()) <= 12 and max(large.values()) <= 12, (small, large)  # the last poster sets one key more
    started = time.monotonic()
    posts = gather_posts(server, 0, 3, "roll/missing", "here", 0.5)
    assert posts == {0: b"here"} and time.monotonic() - started < 5
