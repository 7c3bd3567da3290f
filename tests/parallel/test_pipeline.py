"""Pipeline parallelism: the stage split, schedule checks, every schedule's parity with the unsplit model (one
torchrun per pipeline depth, tests/workers/pipeline_worker.py), and pp end to end (pp_fsdp, pp_tp and 3d with the other
layouts: test_parallel.py, test_llama.py)."""

from __future__ import annotations

import json

import pytest
import torch
from harness.layouts import layout_plan
from harness.paths import WORKERS
from harness.processes import torchrun
from harness.runs import LOSS_RTOL, PARAM_ATOL, PIPELINE, assert_parity
from pipeline_worker import STEPS

from llmtrain.catalog import SCHEDULES
from llmtrain.differences import max_relative_difference, within
from llmtrain.errors import ConfigError
from llmtrain.model import build_model, initial_weights, materialize, meta_model
from llmtrain.parallel.family import gpt_pipeline_part, gpt_stage_view
from llmtrain.parallel.pipeline.split import rank_stages, stage_rank
from llmtrain.parallel_plan import stage_layers, validate_schedule
from llmtrain.tools import compose_config

WORKER = WORKERS / "pipeline_worker.py"


# -- the stage split -----------------------------------------------------------------------------------------------
def test_blocks_are_shared_out_evenly_or_with_lighter_edges():
    assert stage_layers(8, 4, 0) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # The embedding and the head count as one block each: the first and last stage get one block fewer.
    assert stage_layers(6, 4, 1) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]


@pytest.mark.parametrize(
    "n_layer, n_stages, edge_blocks, message",
    [
        (6, 4, 0, "model.n_layer=6 (+ 2 x parallel.pp_edge_blocks=0) does not split evenly into 4 pipeline stages"),
        (4, 4, 2, "parallel.pp_edge_blocks=2 leaves the first or last of 4 stages without a block"),
    ],
)
def test_a_split_that_does_not_fit_is_refused(n_layer, n_stages, edge_blocks, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        stage_layers(n_layer, n_stages, edge_blocks)


def test_stages_are_dealt_in_loops_or_in_a_v():
    assert rank_stages(1, 4, 2, "loop") == [1, 5]
    assert rank_stages(1, 4, 2, "v") == [1, 6]
    assert rank_stages(0, 4, 2, "v") == [0, 7]  # a V puts the embedding and the head on rank 0
    for style, per_rank in (("loop", 3), ("v", 2)):
        for pp_rank in range(4):
            assert all(stage_rank(s, 4, style) == pp_rank for s in rank_stages(pp_rank, 4, per_rank, style))


def test_rank_parts_keep_the_whole_models_names_weights_and_function():
    cfg = compose_config(["model=tiny", "model.n_layer=4"])
    whole = build_model(cfg.model, 257, seed=3)
    init = initial_weights(cfg.model, whole, seed=3)
    layers = stage_layers(4, 4, 0)
    expected = whole.state_dict()
    # Two ranks with two stages each in a V: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2; each part is cut
    # on the meta device and allocates only its own blocks.
    parts = []
    for rank in range(2):
        stages = rank_stages(rank, 2, 2, "v")
        part = gpt_pipeline_part(
            meta_model(cfg.model, 257), [i for s in stages for i in layers[s]], 0 in stages, 3 in stages
        )
        materialize(part, torch.device("cpu"), init)
        parts.append(part)
    assert sorted(parts[0].blocks) == ["0", "3"] and sorted(parts[1].blocks) == ["1", "2"]
    merged = {name: tensor for part in parts for name, tensor in part.state_dict().items()}
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[name], expected[name]) for name in expected)
    # Rank 0 holds the embedding and the head, as two stages' copies of one matrix, not one shared tensor.
    assert parts[0].lm_head.weight is not parts[0].tok_emb.weight
    # The stage views run the parts' own modules; chained, they compute the whole model.
    views = {
        stage: gpt_stage_view(parts[stage_rank(stage, 2, "v")], layers[stage], stage == 0, stage == 3)
        for stage in range(4)
    }
    assert views[3].lm_head is parts[0].lm_head and views[2].blocks["2"] is parts[1].blocks["2"]
    tokens = torch.randint(0, 257, (2, 16))
    x = tokens
    for stage in range(4):
        x = views[stage](x)
    assert torch.equal(x, whole(tokens))


# -- schedule checks -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "schedule, pp, per_rank, m, message",
    [
        ("1f1b", 4, 1, 2, "parallel.microbatches=2 is below 4, which parallel.pp_schedule=1f1b needs"),
        ("dualpipev", 2, 2, 2, "parallel.microbatches=2 is below 4"),
        ("gpipe", 2, 2, 4, "runs one stage per rank but parallel.pp_stages_per_rank=2"),
        ("interleaved_1f1b", 2, 1, 4, "interleaves virtual stages but parallel.pp_stages_per_rank=1"),
        ("zbv", 2, 3, 8, "exactly two stages per rank in a V but parallel.pp_stages_per_rank=3"),
        ("zero_bubble", 4, 2, 6, "parallel.microbatches=6 is not a multiple of parallel.pp=4"),
        ("pipedream", 2, 1, 4, "parallel.pp_schedule='pipedream' is not a pipeline schedule: use one of gpipe, 1f1b"),
    ],
)
def test_schedules_refuse_what_they_cannot_run(schedule, pp, per_rank, m, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_schedule(schedule, pp, per_rank, m)


def test_compiled_or_recomputed_blocks_only_with_schedules_that_run_backward_whole():
    """Compiled and selectively recomputed blocks fail at the first step of a schedule that splits backward in two
    (the dry run found the second); fully recomputed ones hold more than without recomputation there (the grid)."""
    validate_schedule("1f1b", 2, 1, 4, compiled=True, recompute="selective")
    validate_schedule("interleaved_1f1b", 2, 2, 4, recompute="full")
    with pytest.raises(ConfigError, match="train.compile=true does not work with parallel.pp_schedule=zbv"):
        validate_schedule("zbv", 2, 2, 4, compiled=True)
    for schedule in ("zero_bubble", "zbv", "dualpipev"):
        for recompute in ("selective", "full"):
            with pytest.raises(ConfigError, match=f"={recompute} does not pay with parallel.pp_schedule={schedule}"):
                validate_schedule(schedule, 2, 2, 4, recompute=recompute)
        validate_schedule(schedule, 2, 2, 4, recompute="none")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.batch_size=16", "parallel.microbatches=6"],
            "train.batch_size=16 is not divisible by data-parallel size x parallel.microbatches = 1 x 6",
        ),
        (["model.n_layer=3"], "model.n_layer=3 (+ 2 x parallel.pp_edge_blocks=0) does not split evenly into 2"),
    ],
)
def test_pipeline_layout_checks(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        layout_plan("parallel=pp", *overrides, world_size=2)


# -- every schedule against the unsplit model ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("pp, microbatches", [(2, 4), (4, 8)])
def test_every_schedule_matches_the_unsplit_model(pp, microbatches, tmp_path):
    torchrun(pp, str(WORKER), str(tmp_path), str(microbatches), timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == set(SCHEDULES)
    for schedule, r in results.items():
        for ours, reference in (
            (r["losses"], r["reference_losses"]),
            (r["norms"], r["reference_norms"]),
            ([r["validation"]], [r["reference_validation"]]),
        ):
            assert within(max_relative_difference(ours, reference), LOSS_RTOL), (schedule, r)
        assert r["same_names"] and within(r["weight_difference"], PARAM_ATOL), (schedule, r)
        assert (tmp_path / schedule / "pipeline.png").stat().st_size > 10_000
    # Activations alive at once: GPipe holds every micro-batch, 1F1B at most pp - rank on rank `rank`.
    assert results["gpipe"]["peak_in_flight"] == [microbatches] * pp
    for schedule in ("1f1b", "1f1b_reference"):
        assert results[schedule]["peak_in_flight"] == [pp - rank for rank in range(pp)]
    # The hand-written 1F1B does what torch's does, bit for bit.
    ours, theirs = results["1f1b_reference"], results["1f1b"]
    assert ours["losses"] == theirs["losses"] and ours["norms"] == theirs["norms"]
    assert ours["weights_equal_1f1b"]
    _assert_groups_meet_their_match(ours["posted_groups"], pp, microbatches)


def _assert_groups_meet_their_match(groups: list[list[list]], pp: int, microbatches: int) -> None:
    """NCCL-safety of the hand-written 1F1B, checked on its real traffic: between two neighbouring ranks, the k-th
    group one posts towards the other meets the k-th group the other posts back, op for op (each send a receive
    there), so every group can complete as one; and the steady phase posts a send and a receive together."""
    for rank in range(pp - 1):
        down = [[kind for kind, peer in group if peer == rank + 1] for group in groups[rank]]
        up = [[kind for kind, peer in group if peer == rank] for group in groups[rank + 1]]
        down, up = [g for g in down if g], [g for g in up if g]
        flipped = [sorted("recv" if kind == "send" else "send" for kind in group) for group in up]
        assert [sorted(group) for group in down] == flipped, (rank, down, up)
        # per step: m activations down and m gradients up; fused groups carry one of each
        assert sum(len(group) for group in down) == 2 * microbatches * STEPS + STEPS  # + one header per step
        assert any(sorted(group) == ["recv", "send"] for group in down), (rank, down)


# -- the layouts, end to end ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_pipeline_run_matches_single_and_draws_its_schedule(reference, layout_run):
    # 4 micro-batches of 4 sequences, not the 8 of 2 that train.micro_batch_size=2 would give.
    run = layout_run(*PIPELINE, nproc=2)
    assert_parity(run, reference)
    assert "(micro 4 x accumulation 4 x data-parallel 1)" in run.stderr + run.stdout
    pipeline = run.summary["pipeline"]
    assert pipeline["schedule"] == "gpipe" and pipeline["peak_in_flight"] == [4, 4]
    assert pipeline["bubble_theory"] == pytest.approx(1 / 4) and pipeline["bubble_measured"] > 0
    assert (run.run_dir / "pipeline.png").stat().st_size > 10_000
    events = json.loads((run.run_dir / "pipeline.json").read_text())["events"]
    assert [sorted((e["kind"], e["micro_batch"]) for e in rank) for rank in events] == [
        sorted((kind, i) for kind in "FB" for i in range(4))
    ] * 2
    assert "pipeline  bubble" in run.stderr + run.stdout


@pytest.mark.slow
def test_too_few_micro_batches_fail_with_one_line(train):
    run = train("parallel=pp", "parallel.microbatches=1", nproc=2)
    assert run.returncode != 0  # each worker exits with 2; torchrun reports 1
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "parallel.microbatches=1 is below 2" in errors[0], run.stderr[-3000:]
    assert not (run.run_dir / "metrics.jsonl").exists()
