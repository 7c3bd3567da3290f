"""`python ARGS`, started from the test session's warm interpreter (tests/workers/zygote.py) where it can be.

The suite starts a few hundred Python processes (train.py runs, torchrun and its ranks), and each fresh one spends
~7 CPU seconds importing torch, datasets and llmtrain before its first step: two thirds of the suite's time on two
cores. This client asks the zygote, a process that has made those imports once, to fork a process that runs ARGS
(a script or `-m module`, with `-u`) with this process's arguments, environment, working directory and standard
streams, and then stands in for it: it forwards the signals it gets, and exits as that process did. If this
client dies, so does that process (tests/workers/zygote.py). A zygote that refuses to fork (it runs more than one
thread)
fails the run with its reason: a run never silently becomes a fresh interpreter there. Anything else (another flag,
no zygote, an environment that changes how an interpreter starts) runs a fresh interpreter instead, as before.

Standard library only, and started with `python -S`: the client itself costs a few milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

ADDRESS = "LLMTRAIN_TEST_ZYGOTE"  # the zygote's socket; unset: every run is a fresh interpreter
COLD_STARTS = "LLMTRAIN_TEST_COLD_STARTS"  # a file: one line per run started cold for its environment
# Read once, as an interpreter starts (or by modules as they are imported): a run that sets them otherwise than the
# zygote was started with needs an interpreter of its own. The zygote's child sets up the runtime ones itself;
# torchrun's and NCCL's are read when a process group forms.
STARTUP_VARIABLES = ("PYTHON", "LD_", "CUDA_", "HF_", "TRANSFORMERS_", "TORCH", "MPL", "OMP_", "KMP_", "MKL_")
RUNTIME_VARIABLES = (
    # Set in the test process by its own imports (lm_eval, torchao), to the defaults a run would take anyway, and
    # read when used: were they startup variables, every run after a test that imports those would start cold.
    "TORCHINDUCTOR_CACHE_DIR",
    "KMP_DUPLICATE_LIB_OK",  # scikit-learn's, through lm_eval: read by Intel's OpenMP, which torch does not load
    "TORCHDYNAMO_DISABLE",  # read by torch.compile at each call
    "HF_XET_",
    "PYTHONFAULTHANDLER",
    "PYTHONUNBUFFERED",
    "PYTHON_EXEC",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_",
    "TORCH_NCCL_",
)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGABRT)
STATUS = struct.Struct("!i")


def startup_environment(env: dict[str, str]) -> dict[str, str]:
    return {
        key: value
        for key, value in env.items()
        if key.startswith(STARTUP_VARIABLES) and not key.startswith(RUNTIME_VARIABLES)
    }


def warm_request(args: list[str]) -> dict | None:
    """What the zygote needs to run `python ARGS`, or None where a fresh interpreter must."""
    address = os.environ.get(ADDRESS)
    flags = []
    while args and args[0] == "-u":
        flags.append(args.pop(0))
    runnable = bool(args) and (args[0] == "-m" and len(args) > 1 or not args[0].startswith("-"))
    if not address or not runnable:
        return None
    with open(os.path.join(os.path.dirname(address), "environment.json")) as f:
        zygote = json.load(f)
    ours = {
        key: value
        for key, value in startup_environment(dict(os.environ)).items()
        if zygote["set_by_imports"].get(key) != value  # a run started by a warm run inherits these
    }
    if ours != zygote["started_with"]:
        record_cold_start(ours, zygote["started_with"])
        return None
    return {"flags": flags, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}


def record_cold_start(ours: dict[str, str], zygote: dict[str, str]) -> None:
    """Note a run that starts a fresh interpreter because its startup variables differ from the zygote's, for the
    test session's summary (tests/conftest.py): a variable some import sets quietly makes every later run cold."""
    record = os.environ.get(COLD_STARTS)
    if record:
        changed = sorted(key for key in {*ours, *zygote} if ours.get(key) != zygote.get(key))
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(record, "a") as f:  # one short line per write: concurrent runs' lines do not interleave
            f.write(json.dumps({"changed": changed, "test": test}) + "\n")


def receive_exactly(connection: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def connect() -> socket.socket | None:
    """A connection to the zygote; None if it is gone (a run then starts a fresh interpreter)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(os.environ[ADDRESS])
    except OSError:
        connection.close()
        return None
    return connection


def stand_in(connection: socket.socket, request: dict) -> None:
    """Hand `request` to the zygote, forward signals to the process it starts, and exit as that process did."""
    child: list[int] = []
    pending: list[int] = []  # signals that arrived before the run's process existed

    def forward(received: int, frame: object) -> None:
        if child:
            os.kill(child[0], received)
        else:
            pending.append(received)

    for number in FORWARDED:
        signal.signal(number, forward)
    payload = json.dumps(request).encode()
    socket.send_fds(connection, [STATUS.pack(len(payload))], [0, 1, 2])
    connection.sendall(payload)
    started = receive_exactly(connection, STATUS.size)
    if started is None:
        sys.exit("warm_python: the zygote closed the connection before starting the run")
    pid = STATUS.unpack(started)[0]
    if pid < 0:  # refused (tests/workers/zygote.py's fork_refusal): the reason, -pid bytes, follows
        reason = receive_exactly(connection, -pid)
        sys.exit(f"warm_python: {reason.decode() if reason else 'the zygote refused the run'}")
    child.append(pid)
    for number in pending:
        os.kill(child[0], number)
    status = receive_exactly(connection, STATUS.size)
    if status is None:
        sys.exit("warm_python: the zygote closed the connection before the run ended")
    code = STATUS.unpack(status)[0]
    if os.WIFSIGNALED(code):  # end as the run did: killed by the same signal
        if os.WTERMSIG(code) not in (signal.SIGKILL, signal.SIGSTOP):  # those two take no handler, nor need one
            signal.signal(os.WTERMSIG(code), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(code))
    sys.exit(os.waitstatus_to_exitcode(code))


def main() -> None:
    args = sys.argv[1:]
    request = warm_request(list(args))
    connection = connect() if request is not None else None
    if request is None or connection is None:
        os.execv(sys.executable, [sys.executable, *args])
    stand_in(connection, request)


if __name__ == "__main__":
    main()
