"""The test session's warm interpreter: imports what every run imports once, then forks one process per run.

    python tests/workers/zygote.py SOCKET        # started by conftest.warm_interpreter(); stops when its stdin closes

tests/workers/warm_python.py connects to SOCKET with a run (arguments, environment, working directory, its standard
streams). The zygote forks; the fork becomes that run as a fresh `python ARGS` would be (its streams, directory,
environment, thread count, `-u`, the fault handler, `sys.argv`, `sys.path[0]`, `__main__`) and runs the script or
module to the end, through the interpreter's own exit (atexit, thread joins). Each run is a real process of its own:
it only skips the imports its parent made. The zygote sends the client the run's pid, and its wait status when it
ends; a run whose client dies is killed with everything it started (a SIGKILL to the client, as the tests and
torchrun send, reaches the run). SOCKET's folder keeps `children/<client pid>` = the run's pid, for tests that
signal a run's process tree.

A fork copies only the thread that called it: a lock another thread held (an allocator's, a thread pool's queue,
the import lock) stays held in the child forever, and the pool the child expects is gone. So the zygote forks only
while it runs one thread, as the kernel counts them (torch's intra-op pool, OpenBLAS's, jemalloc's or a tokenizer's
are threads Python never sees); otherwise it refuses the run, and the client fails with the reason on one line.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
from pathlib import Path

from warm_python import STATUS, receive_exactly, startup_environment

# What a train.py run (alone or as a torchrun rank), torchrun and the test tools import before their first step.
# Not the modules runs execute as __main__ (runpy warns when one was imported already).
PRELOAD = (
    "llmtrain.run.job",
    "llmtrain.config.composition",
    "llmtrain.tools",
    "hydra.main",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    # imported by a run's first call into a function torch keeps from being compiled (a parameter's initialisation
    # on the meta device, an optimizer's step, FSDP's hooks): ~1.5 CPU s a run, near every run
    "torch._dynamo",
)
PEER_CREDENTIALS = struct.Struct("3i")
# The one thread the imports start: pyarrow's bundled jemalloc (pyarrow comes with datasets) starts its background
# purging thread, `jemalloc_bg_thd`, as pyarrow loads (measured with pyarrow 26, whose default pool is mimalloc all
# the same). The zygote's jemalloc runs without it; a forked run lacks it either way (a fork copies one thread).
NO_JEMALLOC_THREAD = ("JE_ARROW_MALLOC_CONF", "background_thread:false")


def preload() -> tuple[int, dict[str, str]]:
    """The imports every run shares; the number of threads a fresh interpreter's torch would use and the variables
    the imports add to the environment (torch names its compiler's cache folder)."""
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    import matplotlib

    matplotlib.use("Agg")  # as llmtrain's plots choose
    importlib.import_module("matplotlib.pyplot")
    import torch

    # The imports' objects stay put in every run: a run's collections skip them (and leave their pages shared).
    gc.collect()
    gc.freeze()
    return torch.get_num_threads(), {key: value for key, value in os.environ.items() if key not in before}


def os_threads() -> int | None:
    """This process's threads as the kernel counts them (Linux's /proc/self/status), or None where it does not say."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:")), None)


def thread_names() -> list[str]:
    """The names of this process's threads: the kernel's (a native pool's threads name themselves, as jemalloc's
    `jemalloc_bg_thd`), or Python's where the kernel does not say."""
    names = []
    for task in sorted(Path("/proc/self/task").glob("*")):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            pass  # it ended meanwhile
    return names or [thread.name for thread in threading.enumerate()]


def fork_refusal() -> str | None:
    """Why this process must not fork now, on one line; None while it runs one thread (Python's count, and the
    kernel's, which also sees the threads native libraries start)."""
    threads = max(threading.active_count(), os_threads() or 0)
    if threads == 1:
        return None
    return (
        f"the zygote runs {threads} threads ({', '.join(thread_names())}), not 1: a fork would copy only one of "
        "them and leave a lock another holds held in the run; refusing to fork (LLMTRAIN_TEST_COLD=1: fresh runs)"
    )


def process_tree(pid: int) -> list[int]:
    """`pid`'s descendants, deepest first."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found = process_tree(child) + [child] + found
    return found


def die_with_client(connection: socket.socket) -> None:
    """In a run: wait for its client's end of the connection to close (the client exits only after the run, unless
    killed) and take the run and what it started down with it."""
    while connection.recv(1):
        pass
    for pid in process_tree(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def become_run(request: dict, streams: list[int], connection: socket.socket, zygote: Zygote) -> None:
    """In the fork: turn into `python <flags> <args>` started with the request's streams, directory and environment,
    and run it; the interpreter's exit then ends the process as it would end a fresh one."""
    import faulthandler

    import torch

    for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    for target, stream in enumerate(streams):
        os.dup2(stream, target)
        os.close(stream)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**zygote.imports_set, **request["env"]})
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else zygote.default_threads)
    if "-u" in request["flags"] or os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)
    threading.Thread(target=die_with_client, args=(connection,), daemon=True).start()
    args = request["args"]
    if args[0] == "-m":
        sys.argv = ["-m", *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    header, streams, _, _ = socket.recv_fds(connection, STATUS.size, 3)
    payload = receive_exactly(connection, STATUS.unpack(header)[0])
    if payload is None:
        raise ConnectionError("the client left mid-request")
    return json.loads(payload), list(streams)


class Zygote:
    def __init__(self, address: str, default_threads: int, imports_set: dict[str, str]) -> None:
        self.default_threads = default_threads
        self.imports_set = imports_set
        self.children_dir = Path(address).parent / "children"
        self.children_dir.mkdir()
        self.runs: dict[int, tuple[socket.socket, int]] = {}  # run pid -> (its connection, its client's pid)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address)
        self.listener.listen(128)
        self.wakeup_read, wakeup_write = os.pipe()
        os.set_blocking(wakeup_write, False)
        signal.set_wakeup_fd(wakeup_write)
        signal.signal(signal.SIGCHLD, lambda number, frame: None)  # wakes select() through the wakeup fd
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self.start_run)
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, self.reap)
        self.selector.register(sys.stdin, selectors.EVENT_READ, self.stop_if_abandoned)
        self.serving = True

    def serve(self) -> None:
        while self.serving:
            for key, _ in self.selector.select():
                key.data()

    def start_run(self) -> None:
        connection, _ = self.listener.accept()
        try:
            request, streams = receive_request(connection)
        except (OSError, ValueError):
            connection.close()
            return
        client = PEER_CREDENTIALS.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
        )[0]
        refusal = fork_refusal()
        if refusal is not None:  # a negative "pid": the reason's length, the reason follows
            print(refusal, flush=True)
            reason = refusal.encode()
            for stream in streams:
                os.close(stream)
            try:
                connection.sendall(STATUS.pack(-len(reason)) + reason)
            except OSError:
                pass  # its client is gone
            connection.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.selector.close()
            self.listener.close()
            os.close(self.wakeup_read)
            for other, _ in self.runs.values():
                other.close()
            become_run(request, streams, connection, self)
            raise SystemExit(0)  # the script returned: unwind to the interpreter's exit, as a fresh one would
        for stream in streams:
            os.close(stream)
        (self.children_dir / str(client)).write_text(str(pid))
        self.runs[pid] = (connection, client)
        connection.sendall(STATUS.pack(pid))

    def reap(self) -> None:
        os.read(self.wakeup_read, 4096)
        while self.runs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            connection, client = self.runs.pop(pid)
            (self.children_dir / str(client)).unlink(missing_ok=True)
            try:
                connection.sendall(STATUS.pack(status))
            except OSError:
                pass  # its client was killed
            connection.close()

    def stop_if_abandoned(self) -> None:
        if not sys.stdin.buffer.read1(4096):
            self.serving = False


def main(address: str) -> None:
    started_with = startup_environment(dict(os.environ))
    variable, setting = NO_JEMALLOC_THREAD  # before pyarrow loads; jemalloc's later settings win
    os.environ[variable] = ",".join(filter(None, [os.environ.get(variable), setting]))
    default_threads, imports_set = preload()
    environment = {"started_with": started_with, "set_by_imports": imports_set}
    (Path(address).parent / "environment.json").write_text(json.dumps(environment))
    Zygote(address, default_threads, imports_set).serve()


if __name__ == "__main__":
    main(sys.argv[1])
