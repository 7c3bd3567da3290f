"""Data-parallel layouts reproduce `single`: real multi-process gloo runs of the entry point on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.corpora import DOCUMENTS, UNSCORED_WINDOWED
from harness.layouts import (
    BF16,
    FOUR_BLOCKS,
    GROUP_CORPUS,
    TWO_BLOCKS,
    assert_matches_single,
    layout_groups,
    layout_plan,
)
from harness.runs import PARITY, assert_console_quiet, assert_parity, run_train

from llmtrain.errors import ConfigError

pytestmark = pytest.mark.slow


# The entry point end to end (validation, metrics, summary, final weights) for the data-parallel families: ddp on 2
# ranks, fsdp on 4 (these runs are also the uninterrupted runs test_checkpoint.py resumes against).
@pytest.mark.parametrize("layout, nproc", [("ddp", 2), ("fsdp", 4)])
def test_layout_matches_single(layout, nproc, reference, layout_run):
    run = layout_run(f"parallel={layout}", nproc=nproc)
    assert_console_quiet(run)
    assert_parity(run, reference)
    assert f"layout    {layout}" in run.stderr + run.stdout


# The other data-parallel, the tensor-parallel and the combined pipeline layouts of GPT-2's family, driving the same
# trainer in two process groups: 2 ranks for one degree of 2, 4 for two (the Llama family's in test_llama.py). Where
# tensor parallelism leaves the batch whole on every rank, micro-batches of 4 or 8: 4 or 2 per step, not 8.
# The bf16 tier: every layout, and each family (GPT-2's, Llama, MoE, Mixtral), with train.precision=bf16 against one
# process in bf16 (conftest.BF16_RTOL): the GPU user's precision policy, run here on gloo (which has every collective
# these layouts issue in bf16: all-gathers, all-reduces, sends, all-to-all; FSDP reduces gradients in fp32 by policy).
# Muon under every layout, against Muon in one process (its Newton-Schulz in fp32, as the runs compute): whole
# matrices where they are (ddp, pp, experts split by expert), from ZeRO-1's flat slices, spread over the ranks that
# split them (zero2, fsdp, hsdp, cp) or gathered (fsdp with `gather`, tp, fsdp_tp's 2-D split, 3d).
LAYOUTS = {
    2: [
        "parallel=zero1",
        "parallel=zero2",
        "parallel=tp train.micro_batch_size=8",
        "parallel=tp parallel.sequence_parallel=true train.activation_checkpointing=selective train.micro_batch_size=4",
        "optim=muon parallel=ddp",
        "optim=muon parallel=zero1",
        "optim=muon parallel=zero2",
        "optim=muon parallel=fsdp optim.whole_matrices=gather",
        "optim=muon parallel=tp train.micro_batch_size=8",
        "optim=muon parallel=pp parallel.pp_schedule=gpipe parallel.microbatches=4",
        f"{BF16} parallel=ddp",
        f"{BF16} parallel=zero1",
        f"{BF16} parallel=zero2",
        f"{BF16} parallel=fsdp",
        # 4 micro-batches per rank accumulated unsharded (fp32), reduce-scattered once
        "parallel=fsdp parallel.reduce_once_per_step=true",
        f"{BF16} parallel=fsdp parallel.reduce_once_per_step=true",
        f"{BF16} parallel=tp parallel.sequence_parallel=true train.micro_batch_size=8",
        f"{BF16} parallel=pp parallel.pp_schedule=gpipe parallel.microbatches=4",
        # packed documents that never see each other (test_documents.py): masks and per-document positions through
        # compiled recomputed blocks, sequence-parallel position lookups, every pipeline stage, bf16; with the
        # predictions at end-of-text unscored, one mean over the batch's scored targets however it is cut (tp's
        # micro-batches of 8 against one process's of 2; pipeline micro-batches), over sliding windows in every
        # second block
        f"{DOCUMENTS} parallel=fsdp train.activation_checkpointing=selective train.compile=true",
        f"{DOCUMENTS} {UNSCORED_WINDOWED} parallel=tp parallel.sequence_parallel=true train.micro_batch_size=8",
        f"{DOCUMENTS} {UNSCORED_WINDOWED} parallel=pp parallel.pp_schedule=1f1b parallel.microbatches=4",
        f"{DOCUMENTS} {BF16} parallel=ddp",
    ],
    4: [
        "parallel=hsdp parallel.dp_shard=2",
        "parallel=pp_fsdp parallel.pp_schedule=1f1b_reference",  # torch's schedules with FSDP: test_llama.py
        "parallel=pp_tp train.micro_batch_size=4",
        "parallel=fsdp_tp train.activation_checkpointing=full train.micro_batch_size=4",
        "optim=muon parallel=fsdp",
        "optim=muon parallel=hsdp parallel.dp_shard=2",
        "optim=muon parallel=fsdp_tp train.micro_batch_size=4",
        "optim=muon parallel=pp_fsdp parallel.pp_schedule=1f1b_reference",
        "optim=muon parallel=3d",
        "optim=muon parallel=fsdp parallel.cp=2",
        "model=moe-tiny optim=muon parallel=fsdp parallel.ep=2",
        f"{BF16} parallel=hsdp parallel.dp_shard=2",
        f"{BF16} parallel=ddp_tp train.micro_batch_size=4",
        f"{BF16} parallel=pp_fsdp parallel.pp_schedule=1f1b_reference",
        f"{BF16} parallel=pp_tp train.micro_batch_size=4",
        f"{BF16} parallel=fsdp parallel.cp=2",
        # Gemma 3's text model (a sliding-window block and a global one with their own rotary bases, sandwich and
        # (1 + w) norms, GeGLU, the scaled embedding) and Qwen3's (head norms, heads wider than d_model / n_head)
        f"model=gemma3-tiny model.sliding_window=[16,0] {BF16} parallel=fsdp_tp train.micro_batch_size=4",
        f"model=qwen3-tiny {FOUR_BLOCKS} {BF16} parallel=pp_fsdp parallel.pp_schedule=interleaved_1f1b"
        " parallel.pp_stages_per_rank=2",
        f"model=moe-tiny {BF16} parallel=fsdp parallel.ep=2",
        f"model=mixtral-tiny {BF16} parallel=fsdp_tp parallel.tp=2",
        f"model=mixtral-tiny {FOUR_BLOCKS} {BF16} parallel=pp parallel.pp_schedule=1f1b",  # pp 4
        f"{DOCUMENTS} parallel=3d",
        f"model=llama-tiny {DOCUMENTS} parallel=pp_fsdp parallel.pp_schedule=1f1b_reference",
    ],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    common = (
        f"model=tiny {TWO_BLOCKS} {GROUP_CORPUS} train.seq_len=32 train.batch_size=16 train.micro_batch_size=2"
        " optim.warmup_steps=1"
    )
    return layout_groups(tmp_path_factory, common, LAYOUTS)


@pytest.mark.parametrize("layout", [*LAYOUTS[2], *LAYOUTS[4]])
def test_layouts_in_a_process_group_match_single(layout, results):
    assert_matches_single(results, layout)


def test_fsdp_reduces_once_per_step_when_asked(results):
    """parallel.reduce_once_per_step: the same steps (above) with a quarter of the gradient reductions (4
    micro-batches per rank), counted in the flight recorder of the last step."""
    every = results[f"{BF16} parallel=fsdp"]["holdings"]["gradient_reductions"]
    once = results[f"{BF16} parallel=fsdp parallel.reduce_once_per_step=true"]["holdings"]["gradient_reductions"]
    assert once > 0 and every == 4 * once, (every, once)


def test_auto_picks_a_layout_says_why_and_trains(reference, layout_run):
    run = layout_run("parallel=auto", nproc=2)
    assert_parity(run, reference)
    output = run.stdout + run.stderr
    decision = next(line for line in output.splitlines() if "parallel=auto chose" in line)
    chosen = decision.split("parallel=auto chose ")[1].split()[0]
    assert "GiB per rank" in decision and "s/step predicted" in decision and "runner-up" in decision
    assert f"layout    auto -> {'fsdp' if chosen in ('zero2', 'hsdp') else chosen}" in output
    assert run.summary["world_size"] == 2 and run.summary["layout"].startswith(chosen.split("_")[0])
    # measure first: the machine's collectives timed at start (or read from the cache) and planned with
    measured = next(line for line in output.splitlines() if "collectives measured on this machine" in line)
    table = Path(measured.split(": ")[-1])
    ops = {row.split(",")[0] for row in table.read_text().splitlines()[1:]}
    assert {"all_reduce", "reduce_scatter", "all_gather", "send_recv"} <= ops


def test_only_rank_zero_writes_and_speaks(layout_run):
    """...and no rank prints a warning llmtrain causes (the straggler check's gather on logging steps once warned
    on every rank)."""
    run = layout_run("parallel=ddp", nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (run.stdout + run.stderr).count("model     tiny") == 1
    assert len(run.metrics) == 10
    assert_console_quiet(run)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["parallel=ddp", "parallel.dp_replicate=3"], 2, "parallel.dp_replicate=3"),
        (["parallel=fsdp", "parallel.dp_replicate=-1"], 2, "-1"),
        (["parallel=hsdp", "parallel.dp_shard=2"], 3, "world size 3"),
    ],
)
def test_bad_layouts_are_refused_before_any_process_group(overrides, world_size, message):
    with pytest.raises(ConfigError) as error:
        layout_plan(*overrides, world_size=world_size)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "overrides, nproc, message",
    [
        (["parallel=ddp", "train.batch_size=6", "train.micro_batch_size=2"], 2, "train.batch_size=6"),
        (["parallel=ddp_tp"], 0, "parallel.tp=2"),  # a degree above 1 needs more than one process
        # rank 0 decides and every rank stops with its error (none left waiting for a decision)
        (["parallel=auto", "hardware.device_memory_gib=0.001", "plan.reserved_gib=0"], 2, "parallel=auto: no layout"),
    ],
)
def test_bad_layouts_fail_with_one_line(overrides, nproc, message, train):
    run = train(*overrides, nproc=nproc)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], run.stderr[-3000:]
    assert not (run.run_dir / "metrics.jsonl").exists()
    if message.startswith("parallel."):  # the planner, on this run's command line, lists the layouts that run
        plan = errors[0].split("python -m llmtrain.tools.plan ")[1].split()
        assert set(overrides) <= set(plan) and "plan.world_size=1" in plan


@pytest.mark.parametrize("layout, nproc", [("parallel=fsdp", 1), ("parallel=pp", 0)])
def test_a_multi_process_layout_on_one_process_trains_as_single(layout, nproc, reference, tmp_path, cache_dir):
    """`torchrun train.py parallel=fsdp` (torchrun starts one process unless told otherwise) and `python train.py
    parallel=pp`: every degree is 1, so the layout runs on a process group of one and learns what single does."""
    run = run_train(tmp_path, cache_dir, *PARITY, layout, nproc=nproc)
    assert_parity(run, reference)
    assert "(one process: nothing is split)" in run.stdout + run.stderr


def test_unknown_layout_lists_the_options(train):
    run = train("parallel=zero9")
    assert run.returncode == 2 and run.stderr.startswith("error: parallel=zero9 is not an option of parallel: choose")
    assert "fsdp" in run.stderr and run.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_frees_an_untied_embedding_after_its_forward_and_keeps_the_head(tied, one_rank_group):
    """The embedding is a unit of its own (resharded once the first block has its input) and [final norm, head]
    another kept for the start of backward, as is the last block; a head tied to the embedding leaves both in the
    root."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from llmtrain.model import build_model
    from llmtrain.parallel.fsdp import apply_fsdp
    from llmtrain.tools import compose_config

    model = build_model(compose_config(["model=llama-tiny", f"model.tie_embeddings={tied}"]).model, 97, seed=0)
    apply_fsdp(model, init_device_mesh("cpu", (1,)), reshard_after_forward=True, param_dtype=None, cpu_offload=False)
    model(torch.randint(0, 97, (2, 8)))  # forward only: where backward would start

    def resharded(module) -> bool:
        return all(isinstance(p, DTensor) for p in module.parameters())

    assert resharded(model.tok_emb) is not tied
    assert not resharded(model.lm_head) and not resharded(model.norm)
    *earlier, last = model.blocks.values()
    assert all(resharded(block) for block in earlier) and not resharded(last)  # where backward starts
