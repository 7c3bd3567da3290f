"""Context parallelism: the ring against full causal attention (forward and gradients, real gloo processes), the
zigzag split's balance, its one-line errors, and every layout with parallel.cp > 1 against the unsplit model for
both families (tests/layout_worker.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_matches_single, json_lines, layout_group, python, torchrun

from llmtrain.errors import ConfigError
from llmtrain.parallel.context import zigzag_positions
from llmtrain.plan import check_context_parallel


@pytest.mark.slow  # four processes' imports: ~20 s on two cores
def test_ring_attention_equals_full_causal_attention(tmp_path):
    """Outputs and the gradients of q, k and v, each rank's zigzag shard against the same rows of one process's
    fused attention (fp64 inputs; the ring computes in fp32), at cp 4 and 2, multi-head and grouped-query."""
    torchrun(4, str(Path(__file__).with_name("ring_worker.py")), str(tmp_path))
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert all(len(cases) == 4 for cases in found)
    assert max(error for cases in found for error in cases.values()) < 1e-5, found


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_shards_cover_the_sequence_and_balance_causal_work(cp):
    """Every position once; each rank's queries see the same number of keys (position p sees p + 1), where
    contiguous pieces would give the last rank 2·cp - 1 times the first's."""
    t = 16 * cp
    shards = [zigzag_positions(t, cp, rank) for rank in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(t))
    assert all(torch.equal(shard, shard.sort().values) for shard in shards)  # in order: causal within a rank
    work = {int((shard + 1).sum()) for shard in shards}
    assert len(work) == 1
    contiguous = [int((torch.arange(r * t // cp, (r + 1) * t // cp) + 1).sum()) for r in range(cp)]
    assert contiguous[-1] > contiguous[0]


@pytest.mark.parametrize(
    "args, key",
    [
        ((2, 30, 0.0, 1, False), "train.seq_len=30"),
        ((2, 32, 0.1, 1, False), "model.attention_dropout=0.1"),
        ((2, 36, 0.0, 4, True), "parallel.tp=4"),
    ],
)
def test_context_parallel_errors_name_the_key(args, key):
    with pytest.raises(ConfigError) as error:
        check_context_parallel(*args)
    assert key in str(error.value) and "\n" not in str(error.value)


COMMON = "model=tiny train.seq_len=32 train.batch_size=8 train.micro_batch_size=2 optim.warmup_steps=1"
# Where every rank shares each sequence (no data parallelism), micro-batches of 4: 2 per step, not 4.
LAYOUTS = [
    "parallel=fsdp parallel.cp=4 train.micro_batch_size=4",
    "parallel=fsdp parallel.cp=2",  # dp_shard 2 x cp 2
    "parallel=hsdp parallel.dp_replicate=2 parallel.dp_shard=1 parallel.cp=2",
    "parallel=fsdp_tp parallel.cp=2 train.micro_batch_size=4",  # cp 2 x tp 2 with sequence parallelism
    "parallel=pp parallel.cp=2 parallel.pp_schedule=interleaved_1f1b parallel.pp_stages_per_rank=2",
    "parallel=fsdp parallel.cp=2 train.activation_checkpointing=selective train.compile=true",
    # the Llama family's rotary positions and grouped-query heads on sequence shards
    "model=llama-tiny parallel=fsdp parallel.cp=4 train.micro_batch_size=4",
    "model=llama-tiny parallel=fsdp_tp parallel.cp=2 train.micro_batch_size=4",
    "model=llama-tiny parallel=pp parallel.cp=2 parallel.pp_schedule=interleaved_1f1b parallel.pp_stages_per_rank=2",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return layout_group(tmp_path_factory, 4, COMMON, LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_layout_matches_single(layout, results):
    assert_matches_single(results, layout)


@pytest.mark.slow
def test_a_long_sequence_over_four_ranks_keeps_a_quarter_of_the_activations():
    """seq_len 2048, one sequence: MemTracker's peak activations of one forward + backward on a cp rank against
    one process's (llmtrain.bench.activation_memory). A quarter of the tokens per rank; the ring stores no score
    matrix, as the fused kernel does not, so about a quarter of the activations (measured: 0.20)."""
    long = ["train.seq_len=2048", "model.max_seq_len=2048", "train.micro_batch_size=1"]
    tool = ["-m", "llmtrain.bench.activation_memory"]
    single = subprocess.run([python(), *tool, *long], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    ring = torchrun(4, *tool, "parallel=fsdp", "parallel.cp=4", *long, timeout=300)
    whole, quarter = json_lines(single.stdout)[0], json_lines(ring.stdout)[0]
    assert "cp 4" in quarter["layout"]
    assert 0.15 < quarter["act"] / whole["act"] < 0.3, (quarter, whole)
