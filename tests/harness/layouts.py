"""Layout groups: several layouts trained in one process group by workers/layout_worker.py, each held to its
unsplit reference (assert_matches_single); the release tier's common overrides."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from omegaconf import OmegaConf

from harness.corpora import DOCUMENT_CORPUS
from harness.paths import WORKERS
from harness.processes import torchrun
from harness.runs import LOSS_RTOL
from llmtrain.differences import within
from llmtrain.parallel_plan import ParallelPlan
from llmtrain.tools import compose_config

LAYOUT_WORKER = WORKERS / "layout_worker.py"
# A test of a feature torchao computes (float8, 8-bit moments, NF4) skips where the `fp8` extra is not installed.
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="the fp8 extra (torchao): pip install -e '.[fp8]'"
)


# The main suite's layout groups train two blocks of each model on the short documents (harness/corpora.py, in byte
# tokens), read in a fraction of the time the embedded corpus's stream takes to start. Two blocks show every split:
# tensor and sequence parallelism and the ring within each block, FSDP's units, two pipeline stages and the
# activation passed between them, a dense and a mixture block in moe-tiny; what a layout costs on CI's two cores
# grows with each block's operators and collectives (test_parallel.py's 4-rank group: 261 CPU s with four blocks on
# the embedded corpus, 153 with two on the documents and one validation batch, workers/layout_worker.py). A layout
# of four pipeline stages (pp 4, or two stages per rank) keeps four blocks: FOUR_BLOCKS among its own overrides,
# before its `parallel` ones, so that its reference has four too.
GROUP_CORPUS = f"data=local data.path={DOCUMENT_CORPUS} data.tokenizer.kind=byte"
TWO_BLOCKS = "model.n_layer=2"
FOUR_BLOCKS = "model.n_layer=4"
# What most groups train besides their model: two blocks on the short documents, 8 sequences of 32 a step
GROUP_RUN = (
    f"{TWO_BLOCKS} {GROUP_CORPUS} train.seq_len=32 train.batch_size=8 train.micro_batch_size=2 optim.warmup_steps=1"
)


# Low-rank adapters on every projection, and QLoRA (an NF4 base) at widths whose projections split into whole NF4
# groups over two FSDP shards: the fine-tuning layouts' overrides.
LORA = "model.lora.rank=4"
QLORA = f"model.d_model=256 model.n_head=4 model.n_kv_head=2 model.d_ff=512 {LORA} model.quantize_base=nf4"


# The release tier's layout groups (tests/releases/test_releases.py, test_release_features.py): two steps of the tiny
# model.
# float8 rounding is a step function: e4m3 keeps 3 mantissa bits, so where two layouts' sums differ in the last
# fp32 bit (1e-7), a value on a rounding boundary moves by up to 1/16 of itself. Measured over the group's two
# steps: losses within 8e-5 of the unsplit float8 model (tensor parallel with sequence parallelism, the furthest),
# validation losses within 3e-4, weights within 4e-3; 8-bit AdamW alone within 1e-7 and 5e-5.
FLOAT8_RTOL = 1e-3
RELEASE_COMMON = "model=tiny train.seq_len=32 train.batch_size=16 train.micro_batch_size=2 optim.warmup_steps=1"


# What the main suite covers on its own torch, run by .ci/run's release tier only (tests/releases/test_releases.py).
release_tier_only = pytest.mark.skipif(
    not os.environ.get("LLMTRAIN_RELEASE_TIER"),
    reason="the main suite covers this on its torch; the release tier runs it on the others",
)


# What a build or a checkpoint touches besides tensors (DTensor / FSDP / DCP bookkeeping, library code paged in on
# first use, the allocator's slack), measured at 6-12 MiB on this machine; the memory tests' bounds leave this room
# without admitting a whole model.
MEMORY_MARGIN = 24 * 2**20


def layout_group(
    tmp_path_factory,
    nproc: int,
    common: str,
    layouts: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 900,
) -> dict:
    """tests/workers/layout_worker.py's results for `layouts` on `nproc` ranks of one process group."""
    out = tmp_path_factory.mktemp("layouts")
    torchrun(nproc, str(LAYOUT_WORKER), str(out), common, *layouts, timeout=timeout, env=env)
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
ROUTED_MODELS = ("model=moe-tiny", "model=mixtral-tiny")


# The layout groups' runs warm up for one step, then take the full learning rate: Adam's first updates are near
# lr x sign(gradient), so a weight whose gradient is tiny can move by a different ~1e-5 under another summation order
# (measured: up to 6.1e-5, llama-tiny compiled under ddp). A weight that missed a step's update is ~lr = 1e-3 away,
# 10x beyond. Losses and gradient norms stay within LOSS_RTOL, where a missed or doubled reduction shows far beyond it.
GROUP_WEIGHT_ATOL = 1e-4


# Routing is a discrete choice: under another summation order, a token whose top experts score within rounding of
# each other goes to another one, and its loss and its experts' gradients change by far more than rounding. Muon
# makes that likely by step 2: it orthogonalises each expert's gradient, of few tokens and so low rank, which
# magnifies that gradient's rounding about 1,000x (a 1e-7 relative change moves the result 1e-4). Measured on an AMD
# EPYC, moe-tiny under Muon against one process: zero1 and fsdp (their reduce-scatters sum in another order) 2.3e-5
# on the second loss, 9.0e-5 on its gradient norm, weights 4.1e-4 apart (the magnified rounding alone moves them
# ~1e-7: only a token routed elsewhere explains it); ddp, which sums in the one process's order, exactly equal.
# Bound for routed experts under Muon: ROUTED_MUON_RTOL on losses and gradient norms, weights not compared. A missed
# or doubled reduction still moves the first gradient norm 2x, and one step moves these losses 3%.
ROUTED_MUON_RTOL = 2e-4


def assert_matches_single(results: dict, layout: str) -> None:
    """A layout of a layout_group followed its unsplit model: losses, gradient norms and the validation loss within
    LOSS_RTOL (BF16_RTOL in bf16, ROUTED_MUON_RTOL for experts under Muon), the same parameter names, weights within
    GROUP_WEIGHT_ATOL after the last step (fp32, experts under Muon aside); and both ran the optimizer and the
    precision the layout names (a setting both ignored would let them agree)."""
    from layout_worker import reference_name

    reference, run = results[reference_name(layout)], results[layout]
    bf16 = BF16 in layout.split()
    muon = "optim=muon" in layout.split()
    routed_muon = muon and any(word in layout.split() for word in ROUTED_MODELS)
    rtol = BF16_RTOL if bf16 else ROUTED_MUON_RTOL if routed_muon else LOSS_RTOL
    for key in ("losses", "norms", "val_losses"):
        assert run[key] == pytest.approx(reference[key], rel=rtol), (layout, key, run[key], reference[key])
    assert run["same_names"], (layout, run)
    # packed documents: a document after another one in a window gets the losses it gets alone (layout_worker.py)
    assert run["boundary_gap"] is None or within(run["boundary_gap"], rtol), (layout, run["boundary_gap"])
    assert bf16 or routed_muon or within(run["weight_difference"], GROUP_WEIGHT_ATOL), (layout, run)
    for ran in (run, reference):  # both computed in the precision the layout names (fp32 on CPU by default)
        assert ran["precision"].startswith("bf16" if bf16 else "fp32"), (layout, ran["precision"])
        assert ("torch.bfloat16" in ran["holdings"]["computed_in"]) == bf16, (layout, ran["holdings"])
    for held in (run["holdings"], reference["holdings"]):
        assert all(name.endswith("Muon") == muon for name in held["optimizer"]), (layout, held["optimizer"])


def layout_plan(*overrides: str, world_size: int) -> ParallelPlan:
    """The plan a `world_size`-rank job with these overrides makes (llmtrain/parallel_plan.py: no process group
    needed)."""
    config = OmegaConf.to_object(compose_config(list(overrides)))
    return ParallelPlan.of(config.parallel, config.train, config.model, world_size)
