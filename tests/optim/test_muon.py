"""Muon's checkpoints: saved under fsdp over 4 ranks, resumed bit-identically, resharded to tp 2 x dp 2 and then
to one process, every step following the unsplit run; a checkpoint of one optimizer refuses the other with one
line. Muon's parity under every layout: tests/parallel/test_parallel.py's layout groups.

The chain trains on a three-source data mixture (`data=mix`), so it is also the mixture's resume test: its position
saved by 4 data-parallel ranks continues on 2 (tp 2 x dp 2), then on 1, with the uninterrupted run's batches."""

from __future__ import annotations

import json

import pytest
from harness.paths import WORKERS
from harness.processes import torchrun
from harness.runs import LOSS_RTOL
from test_mixture import WEIGHTS, mixture_override, mixture_stores

from llmtrain.checkpoint.training import check_optimizer_matches
from llmtrain.config import OptimConfig
from llmtrain.errors import ConfigError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("muon-chain")
    mixture = mixture_override(mixture_stores(tmp_path_factory.mktemp("mixture")), WEIGHTS)
    common = (
        f"model=tiny optim=muon train.seq_len=32 train.batch_size=16 train.micro_batch_size=2 optim.warmup_steps=1 "
        f"data=mix {mixture}"
    )
    torchrun(4, str(WORKERS / "resume_worker.py"), str(out), common, timeout=600)
    return json.loads((out / "results.json").read_text())


def test_muon_state_resumes_exactly_and_reshards_from_fsdp_to_tp_dp_to_one_process(chain):
    """A lost or misplaced momentum buffer (or a repeated batch) moves step 3's loss far beyond the tolerance."""
    single = chain["single"]
    assert chain["fsdp"] == pytest.approx(single, rel=LOSS_RTOL)
    assert chain["fsdp resumed"] == {step: chain["fsdp"][step] for step in ("3", "4")}  # bit-identical
    assert chain["ddp_tp"] == pytest.approx({step: single[step] for step in ("3", "4")}, rel=LOSS_RTOL)
    assert chain["single resumed"] == pytest.approx({"4": single["4"]}, rel=LOSS_RTOL)


def test_a_checkpoint_of_one_optimizer_refuses_the_other_with_one_line(chain):
    check_optimizer_matches(chain["checkpoint"], OptimConfig(name="muon"))
    with pytest.raises(ConfigError) as refused:
        check_optimizer_matches(chain["checkpoint"], OptimConfig(name="adamw"))
    message = str(refused.value)
    assert "\n" not in message and "optim=muon" in message and "optim=adamw" in message
