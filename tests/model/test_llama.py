"""The Llama family (RMSNorm, rotary positions, SwiGLU, grouped-query attention) under every layout family: each
reproduces the unsplit llama-tiny, step for step, in 2- and 4-rank process groups (tests/workers/layout_worker.py), and
3-D (pipeline x FSDP x tensor parallel) in an 8-rank one, for GPT-2's family too. Its forward against transformers'
LlamaForCausalLM and its parameter counts are in test_model.py. Qwen3's and Gemma 3's additions run in other groups:
tests/parallel/test_parallel.py (bf16 FSDP with tensor parallelism, an interleaved pipeline over FSDP) and
tests/data/test_sft.py (with adapters: tensor and sequence parallelism, bf16 FSDP, 3-D)."""

from __future__ import annotations

import pytest
from harness.layouts import (
    BF16,
    FOUR_BLOCKS,
    GROUP_RUN,
    assert_matches_single,
    layout_group,
    layout_groups,
)

pytestmark = pytest.mark.slow

COMMON = f"model=llama-tiny {GROUP_RUN}"
# On 2 ranks what needs one degree of 2, on 4 what needs two (conftest.layout_groups).
LAYOUTS = {
    2: [
        "parallel=ddp train.compile=true",
        "parallel=fsdp train.activation_checkpointing=full",
        # 2 key/value heads per rank with their 4 query heads; every rank runs the whole batch, in 2 micro-batches
        "parallel=tp parallel.sequence_parallel=true train.micro_batch_size=4",
        "parallel=tp parallel.sequence_parallel=false parallel.loss_parallel=false train.micro_batch_size=4",
        "parallel=pp parallel.pp_schedule=1f1b",
    ],
    4: [
        "parallel=hsdp parallel.dp_shard=2 train.activation_checkpointing=selective",
        "parallel=fsdp_tp",
        f"{FOUR_BLOCKS} parallel=pp_fsdp parallel.pp_schedule=interleaved_1f1b parallel.pp_stages_per_rank=2",
        f"{FOUR_BLOCKS} parallel=pp_tp parallel.pp_schedule=zbv parallel.pp_stages_per_rank=2",
    ],
}


# pp 2 x dp_shard 2 x tp 2, two stages per pipeline rank, every block recomputed; GPT-2's family (tiny); and bf16.
LAYOUTS_3D = [
    f"{FOUR_BLOCKS} parallel=3d parallel.pp_schedule=interleaved_1f1b parallel.pp_stages_per_rank=2"
    " train.activation_checkpointing=full",
    "model=tiny parallel=3d",
    f"{BF16} parallel=3d",  # the bf16 tier's 3-D layout (tests/parallel/test_parallel.py has the others)
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return layout_groups(tmp_path_factory, COMMON, LAYOUTS)


@pytest.mark.parametrize("layout", [*LAYOUTS[2], *LAYOUTS[4]])
def test_llama_layout_matches_single(layout, results):
    assert_matches_single(results, layout)


def test_3d_layouts_match_single(tmp_path_factory):
    results = layout_group(tmp_path_factory, 8, COMMON, LAYOUTS_3D)
    for layout in LAYOUTS_3D:
        assert_matches_single(results, layout)
