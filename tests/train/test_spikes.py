"""Loss spikes (train.spike_factor, train.spike_window, train.on_spike): a finite loss far over the recent median is
reported with its step and batch, and under on_spike=skip its update never reaches the weights. In-process runs of
the tiny model, a spike made by the spike_at_steps fault point; and a rollback through train.py's launcher."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import cast

import pytest
import torch
from harness.corpora import DOCUMENT_CORPUS
from harness.runs import PARITY
from omegaconf import OmegaConf

from llmtrain import catalog, faults
from llmtrain.config import DataConfig, PrepareConfig, RootConfig
from llmtrain.data.prepare import prepare
from llmtrain.errors import TrainingDiverged
from llmtrain.process.runtime import Runtime
from llmtrain.run.build import build_training
from llmtrain.tools import compose_config
from llmtrain.train.fault_points import FaultPoints
from llmtrain.train.loop import Trainer
from llmtrain.train.state import LoopState
from llmtrain.train.update_guard import RecentLosses

ALONE = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
# The tiny model on the tests' short documents in byte tokens, judged against the median of 3 steps so that a spike
# at step 5 is the first step judged; nothing saved, nothing logged to W&B.
RUN = [
    "model=tiny",
    "data=local",
    f"data.path={DOCUMENT_CORPUS}",
    "data.tokenizer.kind=byte",
    "train.seq_len=32",
    "train.batch_size=4",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "train.save_model=false",
    "train.device=cpu",
    "train.spike_window=3",
    "optim.warmup_steps=0",
    "checkpoint.resume=none",
    "logging.wandb.mode=disabled",
]
SPIKE = 5


@pytest.fixture
def arm(monkeypatch):
    """Arms fault points in this process (faults.armed is read once per process), disarmed after the test."""

    def armed(**points: str) -> None:
        monkeypatch.setenv(faults.ENVIRONMENT, faults.arm(**points)[faults.ENVIRONMENT])
        faults.armed.cache_clear()

    yield armed
    monkeypatch.delenv(faults.ENVIRONMENT, raising=False)
    faults.armed.cache_clear()


def _train(
    run_dir: Path, steps: int, *overrides: str, keep_weights: bool = True
) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    """The records of `steps` steps of a run of `overrides`, and its weights before the first and after each (where
    kept)."""
    config = compose_config([*RUN, f"train.steps={steps + 1}", *overrides])  # no final checkpoint
    parts = build_training(cast(RootConfig, OmegaConf.to_object(config)), ALONE, str(run_dir))
    records: list[dict] = []
    weights = [_weights(parts.model.module)]
    try:
        trainer = Trainer(parts, records.append, observers=[FaultPoints(0, parts.model.module)])
        parts.model.module.train()
        for _ in range(steps):
            trainer.advance()
            if keep_weights:
                weights.append(_weights(parts.model.module))
    finally:
        parts.data.close()
    return records, weights


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[name], right[name]) for name in left)


def _spikes(records: list[dict]) -> list[int]:
    return [record["step"] for record in records if record.get("spike")]


def test_a_spike_is_logged_with_its_step_and_batch_and_trained_on_and_a_normal_run_has_none(arm, tmp_path, caplog):
    arm()
    normal, _ = _train(tmp_path / "normal", 7)
    assert _spikes(normal) == []  # a tiny run's falling loss judged against 3 steps: no false alarm
    arm(spike_at_steps=str(SPIKE))
    with caplog.at_level(logging.WARNING, logger="llmtrain"):
        spiked, weights = _train(tmp_path / "spiked", 7)
    assert _spikes(spiked) == [SPIKE] and not any(record.get("skipped") for record in spiked)
    assert [r["loss"] for r in spiked[: SPIKE - 1]] == [r["loss"] for r in normal[: SPIKE - 1]]
    assert spiked[SPIKE - 1]["loss"] == pytest.approx(faults.SPIKE_SCALE * normal[SPIKE - 1]["loss"], rel=1e-4)
    (line,) = [record.getMessage() for record in caplog.records if "spike" in record.getMessage()]
    assert line.startswith(f"step {SPIKE}: loss ") and "x the median of the last 3 steps (" in line, line
    assert line.endswith(f"a spike (batch {SPIKE - 1} of the data stream, counting from 0)"), line
    assert not _same(weights[SPIKE - 1], weights[SPIKE])  # trained on, as asked
    assert len(spiked) == 7


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """The tests' short documents as a prepared store: its batches name their sequences."""
    data = OmegaConf.structured(DataConfig(source="local", path=str(DOCUMENT_CORPUS)))
    data.tokenizer.kind = "byte"
    out = tmp_path_factory.mktemp("stores") / "documents"
    prepare(cast(DataConfig, OmegaConf.to_object(data)), PrepareConfig(out=str(out), num_proc=1))
    return out


def test_a_skipped_spike_leaves_the_weights_as_a_non_finite_step_does(arm, store, tmp_path, caplog):
    """The spike's update is dropped exactly as an overflowing step's is: the weights across it are unchanged, and
    the steps after it train as those after a non-finite step at the same place."""
    prepared = ["data=prepared", f"data.path={store}", "train.on_spike=skip"]
    arm(spike_at_steps=str(SPIKE))
    with caplog.at_level(logging.WARNING, logger="llmtrain"):
        spiked, weights = _train(tmp_path / "spiked", SPIKE + 2, *prepared)
    arm(inf_at_steps=str(SPIKE))
    overflowed, _ = _train(tmp_path / "overflowed", SPIKE + 2, *prepared)
    assert _spikes(spiked) == [SPIKE] and spiked[SPIKE - 1]["skipped"]
    assert _same(weights[SPIKE - 1], weights[SPIKE]) and not _same(weights[SPIKE], weights[SPIKE + 1])
    assert [r["loss"] for r in spiked[SPIKE:]] == [r["loss"] for r in overflowed[SPIKE:]]
    (line,) = [record.getMessage() for record in caplog.records if "spike" in record.getMessage()]
    first = (SPIKE - 1) * 4  # train.batch_size sequences a batch
    assert f"a spike (batch {SPIKE - 1} of the data stream, counting from 0: its sequences {first}-{first + 3})" in line
    assert line.endswith(": the weights were left unchanged (1 skipped step(s) in a row)"), line


def test_skipped_spikes_in_a_row_stop_the_run_as_non_finite_steps_do(arm, tmp_path):
    arm(spike_at_steps=f"{SPIKE},{SPIKE + 1}")
    with pytest.raises(TrainingDiverged, match=f"^step {SPIKE + 1}: 2 steps in a row skipped"):
        _train(tmp_path / "run", SPIKE + 2, "train.on_spike=skip", "train.max_bad_steps=2")


def test_a_spike_is_judged_against_the_median_of_a_full_window():
    recent = RecentLosses(factor=5, window=3, losses=[9.0, 2.0, 1.0, 3.0])
    assert list(recent.losses) == [2.0, 1.0, 3.0]
    assert recent.spike_median(10.0) is None and recent.spike_median(10.5) == 2.0
    recent.add(9.0)
    assert recent.spike_median(10.5) is None  # the median is now 3.0
    assert RecentLosses(factor=5, window=3, losses=[1.0, 1.0]).spike_median(1e9) is None  # the window not full
    assert RecentLosses(factor=0, window=3, losses=[1.0, 1.0, 1.0]).spike_median(1e9) is None  # off


# Its one step is skipped, so torch sees the schedule step without an optimizer step before it and says so.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_resumed_run_judges_its_first_steps_by_the_losses_it_continues(arm, tmp_path):
    """The window refills from the records restored with the checkpoint, the skipped steps' left out, so a spike
    right after a resume is caught as the uninterrupted run would catch it."""
    resumed_after = SPIKE
    arm(spike_at_steps=str(resumed_after + 1))
    records = [{"step": step, "loss": 5.0} for step in range(1, resumed_after - 1)]
    records += [{"step": step, "loss": 900.0, "skipped": True} for step in (resumed_after - 1, resumed_after)]
    config = compose_config([*RUN, f"train.steps={resumed_after + 2}", "train.on_spike=skip"])
    parts = build_training(cast(RootConfig, OmegaConf.to_object(config)), ALONE, str(tmp_path / "run"))
    parts.state = LoopState(step=resumed_after, records=records)  # as a checkpoint after two skipped spikes holds
    try:
        trainer = Trainer(parts, lambda record: None, observers=[FaultPoints(0, parts.model.module)])
        trainer.advance()
    finally:
        parts.data.close()
    resumed = trainer.state.records[-1]
    assert resumed["step"] == resumed_after + 1 and resumed.get("spike") and resumed["skipped"]


@pytest.mark.slow
def test_a_rollback_resumes_from_the_last_checkpoint_with_the_spikes_batch_left_out(train, reference, tmp_path):
    """train.on_spike=rollback, a spike at step 6 (checkpoint 4 saved): the run ends with exit 78 naming the step
    and its batch, train.py's launcher restarts it, and the restart resumes from checkpoint 4, repeats steps 5,
    leaves out the batch step 6 took and trains on the next, with no spike; steps 1-5 are the uninterrupted run's,
    step 6 another batch's, and the end summary names the rollback."""
    run = train(
        *PARITY,
        "checkpoint.every=2",
        "train.spike_window=3",
        "train.on_spike=rollback",
        "parallel.nproc=1",
        "parallel.max_restarts=1",
        env=faults.arm(spike_at_steps="6", spike_marker=str(tmp_path / "spiked-once")),
        ranks=1,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert re.search(r"step 6: loss \S+ is \S+x the median of the last 3 steps .*: a spike \(batch 5 of", output)
    assert "rolled back: a restart or requeue resumes from the last complete checkpoint" in output
    assert "step 6: the batch whose loss spiked before the run rolled back is left out" in output
    assert "step-00000004" in output.split("resumed   from")[1].splitlines()[0]
    ours, theirs = [m["loss"] for m in run.metrics], [m["loss"] for m in reference.metrics]
    assert len(ours) == 10 and ours[:5] == theirs[:5] and ours[5] != theirs[5]
    assert not any(m.get("spike") for m in run.metrics)
    ends = run.summary["interruptions"]
    assert len(ends) == 1 and ends[0].startswith("exit 78: step 6: loss"), ends


# Each objective whose loss measures progress, on its toy run: next-token on the short documents, DPO on the test
# pairs (preference_run). GRPO's loss is judged by no spike rule (tests/train/test_grpo_objective.py).
TOY_STEPS = 150
TOY_WINDOW = 10  # 140 of the 150 steps judged (the default window of 100 judges 50)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["next_token", "dpo"])
def test_a_toy_run_of_each_objective_finds_no_false_spike_whatever_the_guard_does(objective, tmp_path):
    """150 steps under train.on_spike=log, skip and rollback, each step judged against the median of the 10 before
    (the default factor, 5): no step is a spike or skipped, and the three runs take the same steps (the guard costs
    a run without spikes nothing). DPO's loss falls towards 0, where a ratio to the median is most easily crossed."""
    from harness.corpora import write_preference_data
    from harness.preference import preference_run

    overrides = [f"train.spike_window={TOY_WINDOW}"]
    if objective == "dpo":
        overrides += [*preference_run(*write_preference_data(tmp_path)), "train.eval_every=0", "optim.warmup_steps=0"]
    runs = {}
    for action in catalog.SPIKE_ACTIONS:
        records, _ = _train(tmp_path / action, TOY_STEPS, *overrides, f"train.on_spike={action}", keep_weights=False)
        assert len(records) == TOY_STEPS and not [r["step"] for r in records if r.get("spike") or r.get("skipped")]
        runs[action] = [record["loss"] for record in records]
    assert runs["log"] == runs["skip"] == runs["rollback"]
    assert runs["log"][-1] < 0.75 * runs["log"][0], runs["log"][::10]  # it learned: the judged losses fell
