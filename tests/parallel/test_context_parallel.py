"""Context parallelism: the ring against full causal attention (forward and gradients, real gloo processes), the
zigzag split's balance, its one-line errors, and every layout with parallel.cp > 1 against the unsplit model for
both families (tests/workers/layout_worker.py)."""

from __future__ import annotations

import json
import subprocess
from functools import partial

import pytest
import torch
from harness.corpora import DOCUMENTS, UNSCORED_WINDOWED
from harness.layouts import FOUR_BLOCKS, GROUP_RUN, assert_matches_single, layout_group
from harness.paths import REPO, WORKERS
from harness.processes import json_lines, python, torchrun
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from llmtrain.differences import largest, within
from llmtrain.errors import ConfigError
from llmtrain.model.recompute import _save_expensive
from llmtrain.parallel import ring_attention as ring
from llmtrain.parallel.kernel_emulation import EMULATED_OPS, emulating_cuda_kernels
from llmtrain.parallel.ring_attention import zigzag_positions
from llmtrain.parallel_plan import check_context_parallel
from llmtrain.tools.ring_kernel_check import MASKS, TOLERANCE, blocks_against_sdpa, passes


@pytest.mark.slow  # four processes' imports: ~20 s on two cores
def test_ring_attention_equals_full_causal_attention(tmp_path):
    """Outputs and the gradients of q, k and v, each rank's zigzag shard against the same rows of one process's
    fused attention in fp64, at cp 4 and 2, multi-head and grouped-query, causal, within packed documents and
    within them over sliding windows (one process's SDPA under the same mask): the ring in fp64 within 1e-10, in bf16
    within 0.05 (one process's fused attention in bf16 is 0.016 off the fp64 reference here; the ring, merging in fp32,
    up to 0.02), on the CPU's kernels and, with packed documents, on CUDA's emulated; a NaN fails."""
    torchrun(4, str(WORKERS / "ring_worker.py"), str(tmp_path))
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert all(len(cases) == 28 for cases in found)
    for dtype, tolerance in (("float64", 1e-10), ("bfloat16", 0.05)):
        errors = [error for cases in found for case, error in cases.items() if case.endswith(dtype)]
        assert within(largest(errors), tolerance), found


@pytest.mark.releases
def test_selective_recomputation_keeps_the_ring_whole_and_never_replays_it(one_rank_group):
    """Under the selective policy the ring is one saved operator: nothing inside it (no score block) is recorded,
    backward does not run its forward (and its transfers) again, and the gradients are those without
    recomputation. (A ring of one rank: the policy and the operator are what is tested, not the transfers.)"""
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    expected = torch.autograd.grad(ring.ring_attention(q, k, v, one_rank_group).sin().sum(), (q, k, v))
    decisions = []

    def recording(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        decision = _save_expensive(ctx, op, *args, **kwargs)
        if not ctx.is_recompute:
            decisions.append((op.overloadpacket._qualified_op_name, decision))
        return decision

    ring.RING_TIMES.clear()
    ring.RING_TIMES.enabled = True
    try:
        out = checkpoint(
            lambda *qkv: ring.ring_attention(*qkv, one_rank_group).sin(),
            q,
            k,
            v,
            use_reentrant=False,
            context_fn=partial(create_selective_checkpoint_contexts, recording),
        )
        found = torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        ring.RING_TIMES.enabled = False
    assert decisions == [
        ("llmtrain::ring_attention", CheckpointPolicy.MUST_SAVE),
        ("aten::sin", CheckpointPolicy.PREFER_RECOMPUTE),
    ]
    assert len(ring.RING_TIMES.seconds("compute")) == 2  # one block forward, one backward: no replay
    for grad, reference in zip(found, expected):
        torch.testing.assert_close(grad, reference)


@pytest.mark.slow  # ~3 s: the checks import and run torch's tracing machinery
def test_the_ring_operator_passes_torchs_operator_checks(one_rank_group):
    """Its fake (shape-only) version matches the real outputs' shapes and strides for the non-contiguous q, k, v
    a model hands it, its autograd registration is sound, and torch.compile can trace it: what a compiled block
    around the ring relies on. Causal, within packed documents (where each query's document starts), and with a
    sliding window of 8 keys."""
    q, k, v = (torch.randn(2, 32, 4, 16).transpose(1, 2).requires_grad_() for _ in range(3))
    starts = torch.tensor([0] * 10 + [10] * 22).expand(2, 32)
    for documents, window in ((None, 0), (starts, 0), (starts, 8)):
        arguments = (q, k, v, documents, window, one_rank_group.group_name)
        torch.library.opcheck(torch.ops.llmtrain.ring_attention, arguments)


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


COMMON = f"model=tiny {GROUP_RUN}"
# Where every rank shares each sequence (no data parallelism), micro-batches of 4: 2 per step, not 4.
LAYOUTS = [
    "parallel=fsdp parallel.cp=4 train.micro_batch_size=4",
    "parallel=fsdp parallel.cp=2",  # dp_shard 2 x cp 2
    "parallel=hsdp parallel.dp_replicate=2 parallel.dp_shard=1 parallel.cp=2",
    "parallel=fsdp_tp parallel.cp=2 train.micro_batch_size=4",  # cp 2 x tp 2 with sequence parallelism
    f"{FOUR_BLOCKS} parallel=pp parallel.cp=2 parallel.pp_schedule=interleaved_1f1b parallel.pp_stages_per_rank=2",
    "parallel=fsdp parallel.cp=2 train.activation_checkpointing=selective train.compile=true",
    # the Llama family's rotary positions and grouped-query heads on sequence shards
    "model=llama-tiny parallel=fsdp parallel.cp=4 train.micro_batch_size=4",
    "model=llama-tiny parallel=fsdp_tp parallel.cp=2 train.micro_batch_size=4",
    f"model=llama-tiny {FOUR_BLOCKS} parallel=pp parallel.cp=2 parallel.pp_schedule=interleaved_1f1b"
    " parallel.pp_stages_per_rank=2",
    # packed documents that never see each other: the ring masks each block by the documents of its queries; with
    # the predictions at end-of-text unscored, ranks holding different counts of scored targets, and sliding windows
    f"{DOCUMENTS} {UNSCORED_WINDOWED} parallel=fsdp parallel.cp=4 train.micro_batch_size=4",
    f"model=llama-tiny {DOCUMENTS} parallel=fsdp_tp parallel.cp=2 train.micro_batch_size=4",
    f"{DOCUMENTS} {FOUR_BLOCKS} parallel=pp parallel.cp=2 parallel.pp_schedule=interleaved_1f1b"
    " parallel.pp_stages_per_rank=2",
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


@pytest.mark.releases
@pytest.mark.parametrize("mask_by", MASKS)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_the_ring_blocks_on_cudas_kernels_are_finite_and_match_sdpa(dtype, mask_by):
    """The ring's blocks merged and differentiated as the ring does (ring_kernel_check), on the kernels CUDA picks
    (flash for unmasked bf16, memory-efficient for fp32 and for every masked block), emulated: causal, packed
    documents (queries whose document has no key in a block), and two documents meeting where the blocks meet (a
    block no query sees); every output and gradient finite and within the kernels' tolerance of SDPA."""
    with emulating_cuda_kernels():
        differences = blocks_against_sdpa(torch.device("cpu"), dtype, mask_by, seq=128)
    assert passes(differences, TOLERANCE[dtype]), differences


@pytest.mark.releases
def test_the_efficient_kernels_bf16_backward_reads_the_output_in_its_own_layout():
    """The NaN the first H200 showed (bf16, masked blocks: dq and dk NaN, dv fine), reproduced by the emulation:
    handed an output laid out (batch, heads, rows, dim), the kernel's Delta reads other rows and past the tensor's
    end; laid out as its forward writes it ((batch, rows, heads, dim) in memory), what attention_blocks hands it,
    the gradients are finite."""
    q, k, v, out_grad = (torch.randn(1, 4, 64, 16, dtype=torch.bfloat16) for _ in range(4))
    out, lse, *_ = EMULATED_OPS.efficient(q, k, v, None, True, 0.0, True)
    unused = torch.empty(())
    for layout, finite in ((out.contiguous(), False), (out, True)):
        dq, dk, dv, _ = EMULATED_OPS.efficient_backward(
            out_grad, q, k, v, None, layout, lse, unused, unused, 0.0, [True] * 3 + [False], True
        )
        assert bool(dv.isfinite().all())
        assert bool(dq.isfinite().all()) == finite and bool(dk.isfinite().all()) == finite
