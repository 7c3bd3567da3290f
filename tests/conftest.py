"""Shared helpers: run the real entry point in processes of its own and read what it wrote. The processes start
from a warm interpreter (tests/zygote.py) that made the imports once; LLMTRAIN_TEST_COLD=1 starts fresh ones."""

from __future__ import annotations

import os

# The suite tests the CPU / gloo path, also on a machine with GPUs: they are hidden from this process and every
# run it starts (a GPU machine is checked separately, by hand).
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Two xdist workers share CI's two cores: one thread for each worker and every process a test starts (with two, a
# process's OpenMP threads spin waiting for a descheduled peer; measured on test_train + test_moe: 490 -> 314 CPU s).
os.environ["OMP_NUM_THREADS"] = "1"

import atexit  # noqa: E402
import contextlib
import functools
import hashlib
import json
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from filelock import FileLock
from omegaconf import OmegaConf
from warm_python import ADDRESS, COLD_STARTS

from llmtrain.checkpoint import load_final_model
from llmtrain.checkpoint.manager import complete_checkpoints
from llmtrain.differences import within
from llmtrain.faults import arm
from llmtrain.plan import ParallelPlan
from llmtrain.tools import compose_config
from llmtrain.tools.compare_runs import METRICS, compare

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# Short documents (the first lines of the standard library's docstrings, 47 characters on average), so that most
# windows of the layout tests hold several packed documents, and the overrides that train on them within each one
# (train.attention=document; tests/test_documents.py).
DOCUMENT_CORPUS = TESTS / "data" / "short_documents.jsonl"
DOCUMENTS = f"data=local data.path={DOCUMENT_CORPUS} data.tokenizer.kind=byte train.attention=document"
# ... with the predictions at end-of-text unscored and every second block attending to a sliding window of 8 keys
UNSCORED_WINDOWED = "train.score_after_eos=false model.sliding_window=[8,0]"

# A ChatML template, as SmolLM2's: each turn between <|im_start|>role and <|im_end|>; the assistant's prompt opens
# one more. As in SmolLM2-Instruct, the tokenizer's end-of-text is <|im_end|>, which ends every turn: packed
# conversations are separated by another special token, <|endoftext|> (data/sft.py, packing_separator).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_chat_data(directory: Path, conversations: int = 240) -> tuple[Path, Path]:
    """A transformers tokenizer with CHAT_TEMPLATE (a small BPE of the document corpus) and a .jsonl of
    conversations made of the corpus's lines: one to three user/assistant turns, some with a system turn, some
    written as prompt/response pairs. (tokenizer directory, conversations file)."""
    from transformers import PreTrainedTokenizerFast

    from llmtrain.data.tokenizers import train_bpe

    lines = [json.loads(line)["text"] for line in DOCUMENT_CORPUS.read_text().splitlines()]
    backend = train_bpe(lines, 512)
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory / "tokenizer")
    records = []
    for i in range(conversations):
        turns = 1 + i % 3
        said = [lines[(7 * i + j) % len(lines)] for j in range(2 * turns)]
        messages = [{"role": "system", "content": "Answer in one line."}] if i % 4 == 0 else []
        for question, answer in zip(said[::2], said[1::2]):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"prompt": said[0], "response": said[1]} if i % 5 == 0 else {"messages": messages})
    path = directory / "conversations.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return directory / "tokenizer", path


# Small enough for a 2-core CI machine; every test run of train.py starts from these.
FAST = [
    "train.device=cpu",
    "model=tiny",
    "train.seq_len=64",
    "train.batch_size=16",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "logging.wandb.mode=disabled",
    "data.tokenizer.kind=byte",
]


def free_port(low: int = 0, high: int = 0) -> int:
    """A port nobody listens on: any (low=high=0) or one in [low, high)."""
    for candidate in [0] if high == 0 else random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port")


@functools.cache
def warm_interpreter() -> dict[str, str]:
    """The environment that starts this pytest process's Python runs, torchrun and its ranks (PYTHON_EXEC) from a
    warm interpreter (tests/zygote.py, started on first use: a run then skips ~7 CPU s of imports); {} under
    LLMTRAIN_TEST_COLD=1, where each is a fresh interpreter. `python()` is the interpreter to name."""
    if os.environ.get("LLMTRAIN_TEST_COLD") == "1":
        return {}
    folder = Path(tempfile.mkdtemp(prefix="llmtrain-zygote-"))  # a socket's path has at most 107 bytes
    address = folder / "socket"
    client = folder / "python"
    client.write_text(f"#!/bin/sh\nexec '{sys.executable}' -S '{TESTS / 'warm_python.py'}' \"$@\"\n")
    client.chmod(0o755)
    with open(folder / "zygote.log", "w") as log:
        zygote = subprocess.Popen(
            [sys.executable, str(TESTS / "zygote.py"), str(address)],
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


# Where tests/warm_python.py notes each run that started a fresh interpreter because its environment differs from
# the zygote's; set once, by the process that starts the xdist workers, so that they share it, and summarised at the
# end (pytest_terminal_summary): a variable an import sets quietly made every later run of a worker cold, unseen.
os.environ.setdefault(COLD_STARTS, os.path.join(tempfile.gettempdir(), f"llmtrain-cold-starts-{os.getpid()}.jsonl"))


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


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone (its store in memory), left again after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


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


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def metrics(self) -> list[dict]:
        with open(self.run_dir / "metrics.jsonl") as f:
            return [json.loads(line) for line in f]

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenizer cache for the whole session, so a BPE is trained once."""
    return tmp_path_factory.mktemp("llmtrain-cache")


@pytest.fixture
def train(tmp_path, cache_dir):
    """train(*overrides, fast=True, name="run", nproc=0) runs `python train.py` (or, with nproc > 0,
    `torchrun --standalone --nproc_per_node=nproc train.py`) with its run directory tmp_path/name."""
    return lambda *overrides, **options: run_train(tmp_path, cache_dir, *overrides, **options)


def train_command(
    workdir: Path,
    cache_dir: Path,
    *overrides: str,
    fast: bool = True,
    name: str = "run",
    nproc: int = 0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
    restarts: int = 0,
) -> tuple[list[str], dict[str, str], Path]:
    """The command line, environment and run directory of `python train.py` (or torchrun with nproc ranks, restarting
    them up to `restarts` times), from the warm interpreter unless `fresh`."""
    run_dir = workdir / name
    interpreter, warm = (sys.executable, {}) if fresh else (python(), warm_interpreter())
    torchrun_args = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}"]
        if nproc
        else []
    )
    launcher = [interpreter, *torchrun_args]
    args = launcher + [str(REPO / "train.py"), f"hydra.run.dir={run_dir}", f"data.cache_dir={cache_dir}"]
    args += (FAST if fast else []) + list(overrides)
    full_env = {**os.environ, **warm, "WANDB_SILENT": "true"}
    full_env.pop("WANDB_API_KEY", None)  # a developer's own key never reaches a test run
    full_env.update(env or {})
    return args, full_env, run_dir


def run_train(
    workdir: Path, cache_dir: Path, *overrides: str, timeout: float = 480, ranks: int | None = None, **options
) -> Run:
    """The run, or (past `timeout`, before pytest's own limit) a failure showing where each process waited: a
    hang is aborted with SIGABRT, on which Python's fault handler prints every thread's stack. `ranks`: the
    processes it runs, where train.py starts them (parallel.nproc), not torchrun."""
    args, env, run_dir = train_command(workdir, cache_dir, *overrides, **options)
    with rank_slots(options.get("nproc", 0) if ranks is None else ranks):
        process = subprocess.Popen(
            args,
            cwd=workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "PYTHONFAULTHANDLER": "1"},
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in [*descendants(process.pid), process.pid]:  # torchrun's workers run in sessions of their own
                os.kill(pid, signal.SIGABRT)
            stdout, stderr = process.communicate()
            pytest.fail(f"no result after {timeout:.0f}s from {' '.join(args)}\n{stderr[-30_000:]}")
    return Run(process.returncode, stdout, stderr, run_dir)


# 10 steps of the tiny model on a global batch of 16 sequences, validated at steps 5 and 10.
PARITY = [
    "train.steps=10",
    "train.eval_every=5",
    "train.seq_len=32",
    "train.batch_size=16",
    "train.micro_batch_size=2",
    "data.window_shuffle_buffer=64",
]
# fp32 on CPU: the layouts sum the same per-sequence gradients in a different order (per-rank partial sums, then
# a collective), which moves results by a few ulps (~1e-7 relative); AdamW's normalisation keeps that from
# growing over 10 steps. Measured differences are ~1e-7 on losses and ~1e-7 on weights; the bounds leave 10-100x
# room without letting a real bug through. A missed reduction (one rank's gradient for the average) moves losses by
# >1e-3. A doubled one scales every gradient uniformly, to which AdamW and clipping are blind (the losses and weights
# stay put): only grad_norm shows it (2x), which is why grad_norm is among the compared metrics (compare_runs.METRICS).
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
# The pipeline layout whose PARITY run test_pipeline and test_checkpoint share: pp 2, GPipe, 4 micro-batches.
PIPELINE = ("parallel=pp", "parallel.pp_schedule=gpipe", "parallel.microbatches=4")


LAYOUT_WORKER = Path(__file__).with_name("layout_worker.py")
# The release tier's layout groups (tests/test_releases.py, test_release_features.py): two steps of the tiny model.
RELEASE_COMMON = "model=tiny train.seq_len=32 train.batch_size=16 train.micro_batch_size=2 optim.warmup_steps=1"
# What the main suite covers on its own torch, run by .ci/run's release tier only (tests/test_releases.py).
release_tier_only = pytest.mark.skipif(
    not os.environ.get("LLMTRAIN_RELEASE_TIER"),
    reason="the main suite covers this on its torch; the release tier runs it on the others",
)
# What a build or a checkpoint touches besides tensors (DTensor / FSDP / DCP bookkeeping, library code paged in on
# first use, the allocator's slack), measured at 6-12 MiB on this machine; the memory tests' bounds leave this room
# without admitting a whole model.
MEMORY_MARGIN = 24 * 2**20


def layout_group(
    tmp_path_factory, nproc: int, common: str, layouts: list[str], env: dict[str, str] | None = None
) -> dict:
    """tests/layout_worker.py's results for `layouts` on `nproc` ranks of one process group."""
    out = tmp_path_factory.mktemp("layouts")
    torchrun(nproc, str(LAYOUT_WORKER), str(out), common, *layouts, timeout=900, env=env)
    return json.loads((out / "results.json").read_text())


def layout_groups(tmp_path_factory, common: str, groups: dict[int, list[str]]) -> dict:
    """layout_group's results for each `{nproc: layouts}`, together. Each layout runs on the fewest ranks that
    give every one of its degrees a 2: on CI's two cores, a layout's steps over 4 ranks cost 3-4 times those over
    2 (twice the processes per core, each collective waiting for all of them to be scheduled)."""
    return {
        name: row
        for nproc, layouts in groups.items()
        for name, row in layout_group(tmp_path_factory, nproc, common, layouts).items()
    }


# The bf16 tier (layouts with train.precision=bf16, against one process in bf16): CUDA's policy on gloo, FSDP's mixed
# precision where FSDP applies (bf16 weights gathered, every op of a block in bf16, gradients reduced in fp32) and
# autocast elsewhere (bf16 matmuls, fp32 norms and weights), so an FSDP layout and its single-process reference round
# at different places. Bound: bf16's unit roundoff, 2^-8, on losses and gradient norms: a layout may differ from the
# reference by one rounding of the quantity itself, not more. Measured over the groups' two steps (tiny GPT, Llama,
# MoE and Mixtral over every layout): losses within 3.5e-4, gradient norms within 1.6e-3; bf16 single against fp32
# single differs by 1.4e-4 and 3.6e-4. A missed or doubled reduction moves gradient norms by tens of percent or 2x.
# Weights are not compared: after two AdamW steps, near lr x sign(gradient), a weight whose tiny gradient changes sign
# under another rounding moves by 2 lr a step, a bound every run meets.
BF16_RTOL = 2**-8
BF16 = "train.precision=bf16"

# The layout groups' runs warm up for one step, then take the full learning rate: Adam's first updates are near
# lr x sign(gradient), so a weight whose gradient is tiny can move by a different ~1e-5 under another summation order
# (measured: up to 1.2e-5, GPT-2's tiny under tensor parallelism in 2 micro-batches). Losses and gradient norms stay
# within LOSS_RTOL, where a missed or doubled reduction shows far beyond it.
GROUP_WEIGHT_ATOL = 5e-5


def assert_matches_single(results: dict, layout: str) -> None:
    """A layout of a layout_group followed its unsplit model: losses, gradient norms and the validation loss within
    LOSS_RTOL (BF16_RTOL in bf16), the same parameter names, weights within GROUP_WEIGHT_ATOL after the last step
    (fp32); and both ran the optimizer and the precision the layout names (a setting both ignored would let them
    agree)."""
    from layout_worker import reference_name

    reference, run = results[reference_name(layout)], results[layout]
    bf16 = BF16 in layout.split()
    rtol = BF16_RTOL if bf16 else LOSS_RTOL
    for key in ("losses", "norms", "val_losses"):
        assert run[key] == pytest.approx(reference[key], rel=rtol), (layout, key, run[key], reference[key])
    assert run["same_names"], (layout, run)
    # packed documents: a document after another one in a window gets the losses it gets alone (layout_worker.py)
    assert run["boundary_gap"] is None or within(run["boundary_gap"], rtol), (layout, run["boundary_gap"])
    assert bf16 or within(run["weight_difference"], GROUP_WEIGHT_ATOL), (layout, run)
    for ran in (run, reference):  # both computed in the precision the layout names (fp32 on CPU by default)
        assert ran["precision"].startswith("bf16" if bf16 else "fp32"), (layout, ran["precision"])
        assert ("torch.bfloat16" in ran["holdings"]["computed_in"]) == bf16, (layout, ran["holdings"])
    muon = "optim=muon" in layout.split()
    for held in (run["holdings"], reference["holdings"]):
        assert all(name.endswith("Muon") == muon for name in held["optimizer"]), (layout, held["optimizer"])


def layout_plan(*overrides: str, world_size: int) -> ParallelPlan:
    """The plan a `world_size`-rank job with these overrides makes (llmtrain/plan.py: no process group needed)."""
    config = OmegaConf.to_object(compose_config(list(overrides)))
    return ParallelPlan.of(config.parallel, config.train, config.model, world_size)


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


def assert_same_run(run: Run, other: Run) -> None:
    """`run` logged what `other` did, to the bit, and ended with its weights."""
    assert run.returncode == 0, run.stderr[-3000:]
    for key in ("loss", "grad_norm", "val_loss"):
        assert [m.get(key) for m in run.metrics] == [m.get(key) for m in other.metrics], key
    final = load_final_model(run.run_dir / "model.pt")
    expected = load_final_model(other.run_dir / "model.pt")
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def assert_resumed_exactly(resumed: Run, uninterrupted: Run) -> None:
    """A run resumed from a checkpoint repeated the uninterrupted run (assert_same_run)."""
    assert "resumed   from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    assert_same_run(resumed, uninterrupted)


def assert_parity(run: Run, reference: Run) -> None:
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.metrics) == 10 and sum("val_loss" in m for m in run.metrics) == 2
    differences = compare(str(run.run_dir), str(reference.run_dir))
    for key in METRICS:
        assert differences[key] <= LOSS_RTOL, differences
    assert differences["weights"] <= PARAM_ATOL, differences


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def wait_for_steps(run_dir: Path, steps: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while steps_logged(run_dir) < steps:
        assert process.poll() is None, f"the run ended early:\n{run_stderr(run_dir)[-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def run_stderr(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.stderr").read_text()


def assert_console_quiet(run: Run) -> None:
    """A run's console holds no warning (torch's deprecations, an extra's load failures, llmtrain's own): only
    torchrun's notice that it set OMP_NUM_THREADS, which is the launcher's."""
    noisy = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if re.search(r"warn|deprecat|failed to load", line, re.IGNORECASE) and "torch/distributed/run.py" not in line
    ]
    assert noisy == [], noisy[:5]


def start_run(
    tmp_path: Path, cache_dir: Path, *overrides: str, nproc: int, env: dict, name: str, ranks: int | None = None
):
    """The run in the background, its output in files beside its run directory (a pipe could fill and block);
    `ranks` as for run_train."""
    args, full_env, run_dir = train_command(tmp_path, cache_dir, *overrides, nproc=nproc, env=env, name=name)
    claim = claim_ranks(nproc if ranks is None else ranks)
    with open(tmp_path / f"{name}.stdout", "w") as out, open(tmp_path / f"{name}.stderr", "w") as err:
        process = subprocess.Popen(args, cwd=tmp_path, env=full_env, stdout=out, stderr=err)
    if claim is not None:  # held until the run ends
        claim.rename(claim.with_name(f"{process.pid}.claim"))
    return process, run_dir


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and those that tests/zygote.py forked for it (or for them)."""
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


def killed_mid_run(tmp_path, cache_dir, layout: tuple[str, ...], nproc: int, *extra: str) -> Path:
    """A run checkpointing every 5 steps, killed (SIGKILL to every process) while step 9 runs; its checkpoints."""
    process, run_dir = start_run(
        tmp_path,
        cache_dir,
        *PARITY,
        *layout,
        "checkpoint.every=5",
        *extra,
        nproc=nproc,
        env=arm(hang_at_step="9"),
        name="killed",
    )
    checkpoints = run_dir / "checkpoints"
    wait_for_steps(run_dir, 8, process)
    kill_hard(process)
    assert [Path(p).name for p in complete_checkpoints(str(checkpoints))] == ["step-00000005"]
    return checkpoints


# Started first, so that the two workers finish together: the files whose tests take minutes (the Slurm jobs, mostly
# queued and polled; the kill-and-resume runs).
FIRST = ("test_slurm.py", "test_checkpoint.py")


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
