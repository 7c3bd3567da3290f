"""The release tier's second layout group (tests/releases/test_releases.py says what the tier is): context and expert
parallelism, and features whose torch APIs move between releases: float8 all-gathers with 8-bit moments under FSDP,
packed documents over the ring, experts over ranks, low-rank adapters over a frozen NF4 base (QLoRA) in bf16."""

from __future__ import annotations

import pytest
from harness.corpora import DOCUMENTS
from harness.layouts import FLOAT8_RTOL, RELEASE_COMMON, assert_matches_single, layout_group, release_tier_only

pytestmark = pytest.mark.releases

FEATURE_LAYOUTS = [
    "train.float8=tensorwise train.float8_layers=all optim.state_bits=8 parallel=fsdp",
    f"{DOCUMENTS} parallel=fsdp parallel.cp=2",
    "model=moe-tiny parallel=fsdp parallel.ep=2",
    # QLoRA in bf16: NF4's FSDP all-gather extension beside FSDP's mixed precision, with the frozen rest held in bf16
    "model=llama-tiny model.d_model=256 model.n_head=4 model.n_kv_head=2 model.d_ff=512 model.lora.rank=4 "
    "model.quantize_base=nf4 train.precision=bf16 parallel=fsdp",
]


@pytest.fixture(scope="module")
def feature_results(tmp_path_factory) -> dict:
    # eager, as test_low_precision's group: compiling torchao's 8-bit AdamW step alone takes most of a minute here
    return layout_group(tmp_path_factory, 2, RELEASE_COMMON, FEATURE_LAYOUTS, env={"TORCHDYNAMO_DISABLE": "1"})


@pytest.mark.slow
@release_tier_only
@pytest.mark.parametrize("layout", FEATURE_LAYOUTS)
def test_every_feature_on_this_torch_matches_one_process(layout, feature_results):
    if "train.float8=" not in layout:
        assert_matches_single(feature_results, layout)
        return
    reference = feature_results[" ".join(["single", *layout.split(" parallel=")[0].split()])]
    for key in ("losses", "norms", "val_losses"):  # float8's rounding steps: its own bound
        assert feature_results[layout][key] == pytest.approx(reference[key], rel=FLOAT8_RTOL), (layout, key)
