"""The real entry point: a short run learns and writes its outputs; bad input fails cleanly."""

from __future__ import annotations

import json
import math
import uuid

import pytest
from conftest import PARITY, assert_same_run

from llmtrain.faults import arm

pytestmark = pytest.mark.slow

LEARNS = [
    "data.tokenizer.kind=bpe",
    "train.steps=60",
    "train.eval_every=30",
    "train.micro_batch_size=8",
    "optim.warmup_steps=5",
    "logging.wandb.mode=offline",
]


def test_a_short_run_on_the_embedded_corpus_learns_and_logs_offline_without_secrets(train):
    secret = "k" + uuid.uuid4().hex + uuid.uuid4().hex[:7]  # 40 characters no corpus or config contains
    # present in the run's environment, must not reach any file
    run = train(*LEARNS, "logging.wandb.project=parity", "profile.steps=[59,60]", env={"WANDB_API_KEY": secret})
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = run.metrics
    assert [m["step"] for m in metrics] == list(range(1, 61))
    for m in metrics:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= m.keys()
        assert math.isfinite(m["loss"]) and m["tokens_per_s"] > 0
    assert [m["step"] for m in metrics if "val_loss" in m] == [30, 60]
    # A uniform guess over the 4096-token BPE costs ln(4096) = 8.32 nats. Measured on this data: ~6.2 after
    # 60 steps. The threshold asks for 1.5 nats below the start, on the training and the held-out loss.
    first = metrics[0]["loss"]
    assert first == pytest.approx(math.log(4096), abs=0.1)
    last_ten = sum(m["loss"] for m in metrics[-10:]) / 10
    assert last_ten < first - 1.5
    assert metrics[-1]["val_loss"] < first - 1.5
    summary = run.summary
    assert summary["steps"] == 60 and summary["final_val_loss"] == metrics[-1]["val_loss"]
    assert (run.run_dir / "loss.png").stat().st_size > 10_000
    assert "parameters" in run.stderr + run.stdout and "tokens/step" in run.stderr + run.stdout
    # the last two steps profiled: a Chrome trace, the busiest operators in the summaries
    trace = json.loads((run.run_dir / "profile" / "trace-rank0.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    profile = summary["profile"]
    assert profile["steps"] == [59, 60] and profile["trace"] == "profile/trace-rank0.json"
    assert len(profile["top_operators"]) == 5 and 0 < sum(op["share"] for op in profile["top_operators"]) <= 1
    assert "profile   steps 59-60" in run.stderr + run.stdout
    # the planner's prediction for this layout beside what happened
    predicted = summary["predicted"]
    assert predicted["step_s"] > 0 and predicted["peak_gib_per_rank"] > 0 and predicted["hardware"] == "cpu"
    assert "planner   predicted" in run.stderr + run.stdout
    offline_runs = list((run.run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1
    assert list(offline_runs[0].glob("*.wandb"))
    for path in run.run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_a_fresh_interpreter_repeats_the_run_and_another_seed_does_not(train, reference):
    """The suite starts its runs from forks of a warm interpreter (tests/zygote.py): the same run in a fresh one is
    the same to the bit. The seed reaches the run at all: another gives other losses."""
    assert_same_run(train(*PARITY, name="fresh", fresh=True), reference)
    other = train(*PARITY, "seed=7", name="other").metrics
    assert [m["loss"] for m in reference.metrics] != [m["loss"] for m in other]


def _assert_clean_failure(run, key: str, exit_code: int = 2) -> None:
    """The error names `key` on its first line, the exit code is the config error's (2), and the run directory is
    gone (it held nothing but Hydra's files)."""
    assert run.returncode == exit_code, (run.returncode, run.stderr[-3000:])
    lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
    assert key in lines[0], run.stderr
    assert not run.run_dir.exists()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data=local", "data.path={tmp}/corpus.txt", "data.val_path={tmp}/missing/*.txt"], "data.val_path"),
        (["data=prepared", "data.path={tmp}"], "data.path"),  # a directory, but no store in it
    ],
)
def test_missing_validation_files_or_store_give_one_line(train, tmp_path, overrides, key):
    (tmp_path / "corpus.txt").write_text("some text " * 100)
    run = train(*(o.format(tmp=tmp_path) for o in overrides))
    _assert_clean_failure(run, key)
    assert run.stderr.strip().count("\n") == 0


def test_empty_data_file(train, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    run = train("data=local", f"data.path={tmp_path / 'empty.txt'}")
    _assert_clean_failure(run, "data.path")


def test_jsonl_without_the_text_field(train, tmp_path):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    run = train("data=local", f"data.path={tmp_path / 'docs.jsonl'}")
    _assert_clean_failure(run, "data.text_field")


@pytest.mark.parametrize(
    "layout, nproc, reads",
    [
        (("parallel=single",), 0, 1),
        (("parallel=pp",), 2, 1),
        # experts as grouped GEMMs, their boundaries on the device: no read of their own
        pytest.param(("model=moe-tiny",), 0, 1, marks=pytest.mark.slow),
        # the ring reads nothing; expert parallelism reads its exchanges' split sizes, once per mixture block (2)
        # and micro-batch (4: the cp ranks share each sequence)
        pytest.param(
            ("model=moe-tiny", "parallel=fsdp", "parallel.cp=2", "parallel.ep=2"), 2, 1 + 2 * 4, marks=pytest.mark.slow
        ),
    ],
)
def test_a_training_step_reads_the_device_once(layout, nproc, reads, train, tmp_path):
    """Loss, gradient norm and the stop flag reach the host together, once per step (on a GPU every read of a
    device value stalls the CPU until the device catches up). torch's pipeline schedules infer their stages'
    shapes during the first step, which reads a little more."""
    host_reads = tmp_path / "host_reads.txt"
    run = train(*layout, "train.steps=4", nproc=nproc, env=arm(host_reads=str(host_reads)))
    assert run.returncode == 0, run.stderr[-3000:]
    per_step = [int(line) for line in host_reads.read_text().split()]
    assert len(per_step) == 4 * max(nproc, 1)
    steady = per_step if nproc == 0 else sorted(per_step)[: 3 * nproc]  # every rank's steps after its first
    assert set(steady) == {reads}, per_step
