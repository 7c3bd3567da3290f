"""Models larger than one device: a rank's build (meta device -> layout -> its own shards) peaks at its share of
the weights plus one whole tensor, not at the whole model. Real torchrun processes on CPU; the peak is the
process's resident-set high-water mark (llmtrain/train/memory.py)."""

from __future__ import annotations

import pytest
from harness.layouts import MEMORY_MARGIN
from harness.processes import json_lines, torchrun

pytestmark = pytest.mark.slow

# 8 blocks of d_model 512: ~101 MB of fp32 weights, large enough that a whole copy per rank would show.
MODEL = [
    "model=tiny",
    "model.n_layer=8",
    "model.d_model=512",
    "model.n_head=8",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.batch_size=8",
]


def _rows(nproc: int, *overrides: str) -> list[dict]:
    rows = json_lines(torchrun(nproc, "-m", "llmtrain.bench.layout_memory", "--build-only", *MODEL, *overrides).stdout)
    assert len(rows) == nproc
    return rows


@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (4, ["parallel=fsdp"]),
        (2, ["parallel=pp", "parallel.pp_schedule=gpipe"]),
    ],
)
def test_a_rank_builds_only_its_share(nproc, overrides):
    rows = _rows(nproc, *overrides)
    whole = rows[0]["whole_model"]
    for row in rows:
        share = row["reported"]["params"]
        assert share < 0.6 * whole, row  # a quarter (fsdp x4), about half (pp x2: a stage plus its embedding/head)
        assert row["build_peak"] <= share + row["largest_tensor"] + MEMORY_MARGIN, row
        assert row["build_peak"] < share + 0.5 * whole, row
    # Every rank's parameters together are the model once (pp: the head's copy of the embedding twice).
    total = sum(row["reported"]["params"] for row in rows)
    assert whole <= total <= whole * 1.05
