"""Processes a test starts: torchrun jobs from the warm interpreter (workers/zygote.py), the ranks they may run
at once on a 2-core machine (rank_slots), ports, and hard kills."""

from __future__ import annotations

import atexit  # noqa: E402
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock
from warm_python import ADDRESS

from harness.paths import REPO, WORKERS


def free_port(low: int = 20000, high: int = 32768) -> int:
    """A port nobody listens on, in [low, high). The default range lies below Linux's ephemeral ports (32768 up):
    a port the kernel handed out as free may be taken as the local end of another process's connection before the
    launcher that was given it binds it (seconds later, after torchrun's start-up), and two "nodes" meeting there
    then both fail to host or reach the rendezvous store."""
    for candidate in random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return candidate
    raise RuntimeError("no free port")


@functools.cache
def warm_interpreter() -> dict[str, str]:
    """The environment that starts this pytest process's Python runs, torchrun and its ranks (PYTHON_EXEC) from a
    warm interpreter (tests/workers/zygote.py, started on first use: a run then skips ~7 CPU s of imports); {} under
    LLMTRAIN_TEST_COLD=1, where each is a fresh interpreter. `python()` is the interpreter to name."""
    if os.environ.get("LLMTRAIN_TEST_COLD") == "1":
        return {}
    folder = Path(tempfile.mkdtemp(prefix="llmtrain-zygote-"))  # a socket's path has at most 107 bytes
    address = folder / "socket"
    client = folder / "python"
    client.write_text(f"#!/bin/sh\nexec '{sys.executable}' -S '{WORKERS / 'warm_python.py'}' \"$@\"\n")
    client.chmod(0o755)
    with open(folder / "zygote.log", "w") as log:
        zygote = subprocess.Popen(
            [sys.executable, str(WORKERS / "zygote.py"), str(address)],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C to pytest reaches the runs through their clients, once
        )

    def stop() -> None:
        assert zygote.stdin is not None
        zygote.stdin.close()
        zygote.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    while not address.exists():
        assert zygote.poll() is None, (folder / "zygote.log").read_text()
        time.sleep(0.05)
    os.environ[ADDRESS] = str(address)  # inherited by every process a test starts: only python()'s client reads it
    return {ADDRESS: str(address), "PYTHON_EXEC": str(client)}


def python() -> str:
    """The interpreter for a test's Python subprocess: warm_interpreter's client, or this one."""
    return warm_interpreter().get("PYTHON_EXEC", sys.executable)


# How many ranks of multi-rank runs the pytest-xdist workers run at once. Gloo ranks wait for each other in every
# collective, so on CI's two cores ranks beyond four cost far more than their share: a 4-rank run took 12.6 s alone
# and 103 s beside another 4-rank run. A worker whose run would pass this waits until the other's ends.
RANK_CAPACITY = 4


# A scheduling aid, never a reason to fail: past this wait a run starts anyway (a test whose own background run
# holds the slots would otherwise wait for itself).
RANK_WAIT_LIMIT = 300


@contextlib.contextmanager
def rank_slots(ranks: int) -> Iterator[None]:
    """Hold `ranks` of RANK_CAPACITY while the block runs (see claim_ranks)."""
    claim = claim_ranks(ranks)
    try:
        yield
    finally:
        if claim is not None:
            claim.unlink()


def claim_ranks(ranks: int) -> Path | None:
    """Wait until `ranks` more fit in RANK_CAPACITY, then claim them for this process: a claim file named by its
    pid under a folder of this pytest run, counted under a file lock; the claim of a process that has ended
    (renamed to a run's pid: when that run ends) counts no more. None where nothing is claimed: a run of one
    process, or one worker alone."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if ranks < 2 or run_id is None:
        return None
    folder = Path(tempfile.gettempdir()) / f"llmtrain-ranks-{run_id}"
    folder.mkdir(exist_ok=True)
    claim = folder / f"{os.getpid()}.claim"
    deadline = time.monotonic() + RANK_WAIT_LIMIT
    while True:
        with FileLock(folder / "count.lock"):
            held = sum(_ranks_claimed(other) for other in folder.glob("*.claim") if _running(int(other.stem)))
            if held == 0 or held + ranks <= RANK_CAPACITY or time.monotonic() > deadline:
                claim.write_text(str(ranks))
                return claim
        time.sleep(0.2)


def _ranks_claimed(claim: Path) -> int:
    """The ranks a claim holds; 0 once it is gone (its holder releases it, or renames it to its run's pid, without
    the lock: between listing the folder and reading the claim)."""
    try:
        return int(claim.read_text())
    except FileNotFoundError:
        return 0


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (an ended child not yet waited for is a zombie: 'Z')."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def torchrun(
    nproc: int, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc <args>` from the repository, one thread per rank, with `env`
    added to the environment; asserts that it succeeded."""
    with rank_slots(nproc):
        done = subprocess.run(
            [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **warm_interpreter(), **(env or {})},
            cwd=REPO,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def json_lines(output: str) -> list[dict]:
    """The JSON objects a tool printed one per line."""
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def join_as_rank(rank: int, world_size: int, port: int) -> None:
    """In a `torch.multiprocessing` worker: the environment torchrun would give rank `rank`, so that
    init_runtime joins the process group."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and those that tests/workers/zygote.py forked for it (or for them)."""
    children = [
        int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    ]
    warm = Path(os.environ.get(ADDRESS, "/nonexistent")).parent / "children" / str(pid)  # no zygote: not there
    if warm.exists():
        children.append(int(warm.read_text()))
    return children + [d for child in children for d in descendants(child)]


def rank_processes(launcher: int) -> list[int]:
    """The processes that run the ranks of a torchrun job: the launcher's descendants that started none of their own
    (under the warm interpreter, not the clients that stand in for them)."""
    return [pid for pid in descendants(launcher) if not descendants(pid)]


def kill_hard(process: subprocess.Popen) -> None:
    """SIGKILL to the launcher and every worker at once: a crash, not a polite stop."""
    for pid in [process.pid, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):  # one that exited with its parent, killed a moment before
            os.kill(pid, signal.SIGKILL)
    process.wait()
