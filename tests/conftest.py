"""The suite's fixtures and hooks. What the tests share beyond fixtures is in tests/harness/ (paths, processes, runs
of the entry point, layout groups, corpora); the scripts they start are in tests/workers/ (the warm interpreter's
zygote and the multi-rank workers), on the path by pyproject's `pythonpath`."""

from __future__ import annotations

import os

# The suite tests the CPU / gloo path, also on a machine with GPUs: they are hidden from this process and every
# run it starts (a GPU machine is checked separately, by hand).
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Two xdist workers share CI's two cores: one thread for each worker and every process a test starts (with two, a
# process's OpenMP threads spin waiting for a descheduled peer; measured on test_train + test_moe: 490 -> 314 CPU s).
os.environ["OMP_NUM_THREADS"] = "1"

import hashlib  # noqa: E402
import json
import multiprocessing.process
import resource
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from filelock import FileLock
from harness.runs import PARITY, Run, run_train
from warm_python import COLD_STARTS

# Where tests/workers/warm_python.py notes each run that started a fresh interpreter because its environment differs
# from
# the zygote's; set once, by the process that starts the xdist workers, so that they share it, and summarised at the
# end (pytest_terminal_summary): a variable an import sets quietly made every later run of a worker cold, unseen.
os.environ.setdefault(COLD_STARTS, os.path.join(tempfile.gettempdir(), f"llmtrain-cold-starts-{os.getpid()}.jsonl"))


@pytest.fixture(autouse=True)
def _processes_start_in_the_slow_tier_only(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier (`-m "not slow"`) is what a developer runs before each commit, in-process: a test that starts a
    process (the entry point, torchrun, a torch.multiprocessing worker) is marked `slow`, and one that is not fails
    here, naming the mark, rather than quietly making the fast tier slow. Module and session fixtures (a layout
    group) are set up before this and serve marked tests only."""
    if request.node.get_closest_marker("slow"):
        return
    test = request.node.nodeid
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def refuse(*args, **kwargs):
        pytest.fail(f"{test} starts a process: mark it @pytest.mark.slow (the fast tier runs in-process)")

    def refuse_but_library_lookups(popen, program, *args, **kwargs):
        # ctypes.util.find_library asks ldconfig, once per library, as a module imports (trio's, under
        # huggingface_hub's HTTP client): a lookup, not a run
        if not isinstance(program, (str, bytes)) and os.path.basename(str(program[0])) == "ldconfig":
            return execute_child(popen, program, *args, **kwargs)
        refuse()

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse_but_library_lookups)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone (its store in memory), left again after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenizer cache for the whole session, so a BPE is trained once."""
    return tmp_path_factory.mktemp("llmtrain-cache")


@pytest.fixture
def train(tmp_path, cache_dir):
    """train(*overrides, fast=True, name="run", nproc=0) runs `python train.py` (or, with nproc > 0,
    `torchrun --standalone --nproc_per_node=nproc train.py`) with its run directory tmp_path/name."""
    return lambda *overrides, **options: run_train(tmp_path, cache_dir, *overrides, **options)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory, cache_dir, worker_id: str):
    """shared_runs(*overrides, nproc=N): the PARITY run of these overrides, made once per session, whichever of the
    pytest-xdist workers asks first (the others wait for it under a file lock and read what it left), and shared by
    every test that needs it (parity, resume, reshard)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if worker_id != "master" else base  # xdist gives each worker a folder under one session's
    runs = shared / "shared-runs"
    runs.mkdir(exist_ok=True)

    def get(*overrides: str, nproc: int = 0) -> Run:
        name = hashlib.sha256(json.dumps([overrides, nproc]).encode()).hexdigest()[:16]
        with FileLock(runs / f"{name}.lock"):
            made = runs / f"{name}.json"
            if made.exists():
                fields = json.loads(made.read_text())
                return Run(**{**fields, "run_dir": Path(fields["run_dir"])})
            run = run_train(runs, cache_dir, *PARITY, *overrides, nproc=nproc, name=name)
            made.write_text(json.dumps({**run.__dict__, "run_dir": str(run.run_dir)}))
            return run

    return get


@pytest.fixture(scope="session")
def reference(shared_runs) -> Run:
    """The single-process run every layout must reproduce."""
    run = shared_runs()
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def layout_run(shared_runs):
    """layout_run(*overrides, nproc=N): the PARITY run of a layout, made once per session and shared."""
    return shared_runs


# The files the two xdist workers start first, longest first, so that the suite ends on short files rather than on a
# worker left alone with a long one: the Slurm jobs (in CI mostly queued and polled, 240 s beside the rest), then
# each file taking 40 s or more alone on this 2-core machine (seconds measured alone in a comment), the others after
# them in collection order. (pyproject's --no-loadscope-reorder: xdist would otherwise hand out the files with
# the most tests first.)
FIRST = (
    "test_slurm.py",
    "test_parallel.py",  # 258
    "test_checkpoint.py",  # 151
    "test_moe.py",  # 93
    "test_context_parallel.py",  # 85
    "test_llama.py",  # 84
    "test_low_precision.py",  # 76
    "test_train.py",  # 75
    "test_sft.py",  # 68
    "test_gpu_tools.py",  # 61
    "test_extending.py",  # 55
    "test_tensor_parallel.py",  # 51
    "test_crash.py",  # 51
    "test_watchdog.py",  # 47
    "test_prepare.py",  # 47
    "test_launch.py",  # 44
    "test_pipeline.py",  # 44
    "test_layout_accounting.py",  # 43
    "test_downstream.py",  # 42
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


# LLMTRAIN_TEST_CPU=<file>: each test's CPU seconds (setup, module fixtures included, call and teardown), in this
# process and in the processes it started and waited for, appended to <file> as one JSON line: what the suite's
# budget is spent on, free of the noise two workers sharing two cores put on wall times. Run it with
# LLMTRAIN_TEST_COLD=1: a warm run's processes are children of the zygote, not of the test.
CPU_REPORT = os.environ.get("LLMTRAIN_TEST_CPU")


def _cpu_seconds() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not CPU_REPORT:
        yield
        return
    (own, children), start = _cpu_seconds(), time.monotonic()
    yield
    own_after, children_after = _cpu_seconds()
    record = {"test": item.nodeid, "own_s": own_after - own, "children_s": children_after - children}
    with open(CPU_REPORT, "a") as f:  # one short line per write: the two workers' lines do not interleave
        f.write(json.dumps({**record, "wall_s": time.monotonic() - start}) + "\n")


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the process that started it reports
        return
    noted = Path(os.environ[COLD_STARTS])
    if not noted.exists():
        return
    by_change: dict[str, list[str]] = {}
    for line in noted.read_text().splitlines():
        record = json.loads(line)
        by_change.setdefault(", ".join(record["changed"]), []).append(record["test"])
    noted.unlink()
    terminalreporter.section("runs started cold (a fresh interpreter, not the zygote's fork)")
    for changed, tests in sorted(by_change.items(), key=lambda item: -len(item[1])):
        named = ", ".join(dict.fromkeys(tests))
        terminalreporter.write_line(f"{len(tests)} for their environment's {changed}: {named[:300]}")
