"""What the planner predicts against what real layouts hold and send: llmtrain.bench.layout_memory runs every
layout for two steps in a 2-rank or a 4-rank gloo process group and reports each rank's parameter, gradient and
optimizer bytes and the bytes of every collective of the second step (counted by the profiler), beside the
planner's numbers for that rank's pipeline stage (llmtrain/planner/)."""

from __future__ import annotations

import pytest
from harness.processes import json_lines, torchrun

pytestmark = pytest.mark.slow

# name -> (ranks, parallel=...): each on the fewest ranks that show what it splits (a 4-rank group's steps cost
# 3-4 times a 2-rank group's on CI's two cores); the pipeline on 4, for a middle stage.
LAYOUTS = {
    "ddp": (2, "ddp"),
    "zero1": (2, "zero1"),
    "zero2": (2, "zero2"),
    "fsdp": (2, "fsdp"),
    "tp": (2, "tp train.micro_batch_size=8"),
    "tp+sp": (2, "tp parallel.sequence_parallel=true train.micro_batch_size=8"),
    "hsdp": (4, "hsdp parallel.dp_shard=2"),
    "pp": (4, "pp"),
    "pp_fsdp": (4, "pp_fsdp"),
    # the schedule written here: FSDP gathers each stage once a step and reduces once, not per micro-batch
    "pp_fsdp reference 1f1b": (4, "pp_fsdp parallel.pp_schedule=1f1b_reference"),
    "pp_tp": (4, "pp_tp train.micro_batch_size=4"),
    "fsdp cp2": (4, "fsdp parallel.cp=2"),  # dp_shard 2 x cp 2: the ring's sends and receives
    "pp cp2": (4, "pp parallel.cp=2"),
    "fsdp ep2": (4, "fsdp parallel.ep=2 model=moe-tiny"),  # experts' FSDP over 2 ranks, tokens by all-to-all
    # 2 experts over 4 shards: split along their width, each rank holds a quarter (by expert: two hold padding)
    "fsdp 2 experts": (4, "fsdp model=moe-tiny model.moe.num_experts=2"),
}
MEMORY_TOLERANCE, COMM_TOLERANCE = 0.02, 0.05


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    # two micro-batches per data-parallel rank (gradient accumulation), 8 per pipeline (4 with pp_fsdp and pp_tp),
    # and two for the tensor-parallel ranks (which share one replica's batch: every collective per micro-batch)
    small = ("train.seq_len=32", "train.batch_size=16", "train.micro_batch_size=2")
    by_layout: dict[str, list[dict]] = {}
    for nproc in (2, 4):
        layouts = f"--layouts={';'.join(spec for ranks, spec in LAYOUTS.values() if ranks == nproc)}"
        for row in json_lines(torchrun(nproc, "-m", "llmtrain.bench.layout_memory", layouts, *small).stdout):
            by_layout.setdefault(row["parallel"], []).append(row)
    return {name: by_layout[spec] for name, (_, spec) in LAYOUTS.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_state_per_rank_is_the_plan(layout, rows):
    assert len(rows[layout]) == LAYOUTS[layout][0]
    for row in rows[layout]:
        for key in ("params", "grads", "optimizer"):
            assert row[key] == pytest.approx(row["predicted"][key], rel=MEMORY_TOLERANCE), (key, row)
    during_step, planned = rows[layout][0]["params_during_step"], rows[layout][0]["predicted"]
    if layout == "zero2":  # gathered parameters kept from forward to backward
        assert during_step == pytest.approx(planned["gathered"], rel=MEMORY_TOLERANCE)
    if layout == "fsdp":  # blocks resharded after their forward: a fraction of the whole stays
        assert during_step < 0.5 * planned["params"] * 4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bytes_communicated_per_step_are_the_plan(layout, rows):
    for row in rows[layout]:
        measured, planned = row["comm"], row["predicted"]["comm"]
        assert set(planned) <= set(measured), (measured, planned)
        for op, nbytes in planned.items():
            if op == "all_to_all":  # a rank's share depends on where its tokens were routed; the total does not
                continue
            assert measured[op] == pytest.approx(nbytes, rel=COMM_TOLERANCE), (op, row["rank"], measured, planned)
        # what the plan leaves out are scalars (losses, gradient norms, DDP's bucket check)
        assert all(measured[op] < 2**10 for op in set(measured) - set(planned)), (measured, planned)


def test_pipeline_stages_differ_and_the_plan_follows(rows):
    first, middle = rows["pp"][0], rows["pp"][1]
    assert first["params"] > middle["params"]  # the embedding lives on the first stage
    assert middle["comm"]["send"] == pytest.approx(2 * first["comm"]["send"])  # sends both ways


def test_the_expert_exchange_totals_the_plan(rows):
    """Every routed slot goes out and comes back once, whatever the routing: the ranks' all-to-all bytes add up
    to the plan's (which gives each rank the mean share)."""
    ranks = rows["fsdp ep2"]
    measured = sum(row["comm"]["all_to_all"] for row in ranks)
    assert measured == sum(row["predicted"]["comm"]["all_to_all"] for row in ranks)
