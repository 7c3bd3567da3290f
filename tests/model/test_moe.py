"""Mixture of experts (llmtrain/model/moe.py) in one process: the dropless block against a token-by-token
reference, the auxiliary losses' gradient, the load metric, the active-parameter FLOPs, the planner's count, the
config's errors; and every data-parallel, tensor-parallel, expert-parallel and pipeline layout against the unsplit
model (tests/workers/layout_worker.py). The all-to-all exchange itself: tests/parallel/test_expert_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from harness.layouts import (
    FOUR_BLOCKS,
    GROUP_RUN,
    GROUP_WEIGHT_ATOL,
    assert_matches_single,
    layout_group,
)
from harness.runs import LOSS_RTOL, PARITY, run_train

from llmtrain.config import validate
from llmtrain.errors import ConfigError
from llmtrain.model import auxiliary_loss_scale, build_model, flops_per_token, meta_model, num_parameters
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.moe import Experts, MoE
from llmtrain.planner.shapes import whole_model_parameters
from llmtrain.tools import compose_config
from llmtrain.tools.compare_runs import METRICS, compare

PRESETS = ["moe-tiny", "mixtral-tiny"]


def _mixture(preset: str) -> tuple[MoE, GPTConfig]:
    model = build_model(compose_config([f"model={preset}"]).model, 257, seed=0)
    block = next(block for block in model.blocks.values() if isinstance(block.mlp, MoE))
    return block.mlp, model.cfg


def _one_expert(experts: Experts, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's MLP written out from its weights."""
    if experts.w_gate is not None:
        hidden = F.silu(x @ experts.w_gate[e]) * (x @ experts.w_in[e])
    else:
        hidden = F.gelu(x @ experts.w_in[e], approximate="tanh")
    return hidden @ experts.w_out[e]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_grouped_gemm_gives_the_experts_one_by_one_and_their_gradients(preset):
    """The grouped GEMM over tokens sorted by expert (some experts given none) against each expert's MLP over its
    own tokens, forward and the gradients of the tokens and of every weight."""
    moe, cfg = _mixture(preset)
    counts = torch.tensor([5, 0, 3, 9, 0, 1, 6, 4])
    x = torch.randn(int(counts.sum()), cfg.d_model, requires_grad=True)
    weights = list(moe.experts.parameters())
    out_grad = torch.randn(len(x), cfg.d_model)
    grouped = torch.autograd.grad(moe.experts(x, counts), [x, *weights], out_grad)
    loop = torch.cat([_one_expert(moe.experts, e, rows) for e, rows in enumerate(x.split(counts.tolist()))])
    torch.testing.assert_close(moe.experts(x, counts), loop)
    for got, expected in zip(grouped, torch.autograd.grad(loop, [x, *weights], out_grad)):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_mixture_sends_every_token_through_its_top_k_experts(preset):
    """Dropless token choice: each token's output is the renormalised top-k router weights times its experts'
    outputs, computed here one token at a time."""
    moe, cfg = _mixture(preset)
    x = torch.randn(3, 10, cfg.d_model)
    with torch.no_grad():
        out = moe.eval()(x)
        tokens = x.reshape(-1, cfg.d_model)
        probs = moe.router(tokens).float().softmax(-1)
        expected = []
        for token, p in zip(tokens, probs):
            weights, chosen = p.topk(cfg.moe.top_k)
            weights = weights / weights.sum()
            expected.append(sum(w * _one_expert(moe.experts, int(e), token[None])[0] for w, e in zip(weights, chosen)))
    torch.testing.assert_close(out.reshape(-1, cfg.d_model), torch.stack(expected), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("parameters", ["fp32 under bf16 autocast", "bf16"])
def test_a_mixture_trains_a_step_in_bf16_as_in_fp32(preset, parameters):
    """The user's GPU run on this CPU (numerics only, not CUDA's kernels): autocast's fp32 residual stream meets
    bf16 expert outputs, FSDP's bf16 parameters bf16 everywhere. Forward and backward run and land within bf16's
    precision of fp32's loss; every gradient is finite."""
    model = build_model(compose_config([f"model={preset}"]).model, 257, seed=0)
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = F.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).item()
    if parameters == "bf16":
        model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=parameters != "bf16"):
        logits = model(ids)
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    assert loss.item() == pytest.approx(reference, rel=1e-3)  # measured 2e-5 (autocast) and 6e-5 (bf16 weights)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)


def test_auxiliary_losses_reach_the_router_as_if_added_to_the_loss():
    """The balance and z-losses ride on backward (the block's output is untouched), scaled like the micro-batch's
    loss: the gradients equal those of (loss + auxiliary) x scale computed explicitly."""
    moe, cfg = _mixture("moe-tiny")
    moe.moe = dataclasses.replace(moe.moe, z_loss_coef=1e-3)
    x, weights, scale = torch.randn(2, 12, cfg.d_model), torch.randn(2, 12, cfg.d_model), 0.25

    moe.train()
    with auxiliary_loss_scale(scale):
        out = moe(x)
    (scale * (out * weights).sum()).backward()
    injected = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()

    moe.eval()  # no injection: the auxiliary loss written out instead
    out_plain = moe(x)
    tokens = x.reshape(-1, cfg.d_model)
    logits = moe.router(tokens).float()
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(cfg.moe.top_k).indices.flatten(), minlength=cfg.moe.num_experts)
    auxiliary = moe.balance_loss(logits, probs, counts, len(tokens))
    torch.testing.assert_close(out, out_plain)
    (scale * ((out_plain * weights).sum() + auxiliary)).backward()
    for got, expected in zip(injected, [p.grad for p in moe.parameters()]):
        torch.testing.assert_close(got, expected, atol=1e-7, rtol=1e-5)
    assert moe.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_expert_load_counts_every_routed_slot_once(preset):
    """Once per training forward: not again when activation checkpointing reruns the blocks in backward, and not
    for validation (eval mode) or forwards without gradients."""
    model = build_model(compose_config([f"model={preset}"]).model, 257, seed=0, recompute="full")
    tokens, cpu = torch.randint(0, 257, (4, 16)), torch.device("cpu")
    model(tokens).sum().backward()
    with torch.no_grad():
        model(tokens)
    model.eval()(tokens)
    load = model.take_expert_load(cpu)
    mixtures = sum(model.cfg.moe.is_moe_block(i) for i in range(model.cfg.n_layer))
    assert load is not None and int(load.sum()) == tokens.numel() * model.cfg.moe.top_k * mixtures
    assert int(model.take_expert_load(cpu).sum()) == 0  # read once


@pytest.mark.parametrize("preset", PRESETS)
def test_flops_count_the_active_parameters_and_the_planner_counts_all(preset):
    model = meta_model(compose_config([f"model={preset}"]).model, 257)
    cfg, n = model.cfg, num_parameters(model)
    assert whole_model_parameters(cfg) == n
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = n - experts * (cfg.moe.num_experts - cfg.moe.top_k) // cfg.moe.num_experts
    lookups = cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0
    assert flops_per_token(cfg, n, 64) == 6 * (active - lookups) + 12 * cfg.n_layer * cfg.d_model * 64


def test_a_checkpoint_keeps_the_mixture_settings():
    cfg = meta_model(compose_config(["model=mixtral-tiny", "model.moe.shared_experts=1"]).model, 257).cfg
    assert GPTConfig.from_dict(dataclasses.asdict(cfg)) == cfg


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.moe.top_k=9"], "model.moe.top_k=9"),
        (["model.moe.every=5"], "model.moe.every=5"),
        (["model.moe.aux_loss_coef=-1"], "model.moe.aux_loss_coef"),
    ],
)
def test_mixture_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(["model=moe-tiny", *overrides]))
    assert key in str(error.value) and "\n" not in str(error.value)


# Balance and z losses 50x and (from 0) on: a wrong auxiliary gradient under some split (missed, doubled, or seeing
# only a rank's part of the tokens) moves the gradient norms far beyond the tolerance.
COMMON = f"model=moe-tiny {GROUP_RUN} model.moe.aux_loss_coef=0.5 model.moe.z_loss_coef=0.05"
LAYOUTS = [
    "parallel=ddp",
    "parallel=fsdp train.activation_checkpointing=selective",
    "parallel=fsdp train.activation_checkpointing=full parallel.ep=2",  # experts over ep 2 x expert_shard 2
    "parallel=fsdp parallel.ep=4",
    "parallel=hsdp parallel.dp_shard=2 parallel.ep=2",
    "parallel=fsdp_tp parallel.tp=2",  # experts split by hidden units, sequence parallel around them
    "parallel=fsdp_tp parallel.tp=2 parallel.ep=2 parallel.sequence_parallel=false",
    "parallel=fsdp parallel.cp=2 parallel.ep=2",  # balance counts summed over the ranks sharing each sequence
    f"{FOUR_BLOCKS} parallel=pp parallel.pp_schedule=1f1b",  # pp 4
    f"{FOUR_BLOCKS} parallel=pp_fsdp parallel.pp_schedule=interleaved_1f1b parallel.pp_stages_per_rank=2 parallel.ep=2",
    # Mixtral's experts are SwiGLU (a third, gated matrix): where they are split or exchanged
    "model=mixtral-tiny parallel=fsdp parallel.ep=4",
    "model=mixtral-tiny parallel=fsdp_tp parallel.tp=2",
    f"model=mixtral-tiny {FOUR_BLOCKS} parallel=pp_fsdp parallel.pp_schedule=interleaved_1f1b"
    " parallel.pp_stages_per_rank=2 parallel.ep=2",
    # Qwen3-MoE's experts with adapters of their own, over ep 2 x expert_shard 2 (FSDP splits experts and adapters)
    "model=qwen3-moe-tiny model.lora.rank=4 model.lora.targets=[q_proj,experts_in,experts_out] parallel=fsdp"
    " parallel.ep=2",
]
EXPERT_PARALLEL = LAYOUTS[1:4]  # fsdp over 4 ranks with ep 1, 2, 4


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return layout_group(tmp_path_factory, 4, COMMON, LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixture_layout_matches_single(layout, results):
    """Dropless routing and a balance loss per micro-batch: the same micro-batches give the same losses, the
    same gradients (router included) and the same weights under any data, tensor, expert or pipeline split."""
    assert_matches_single(results, layout)


@pytest.mark.slow
def test_dropless_routing_gives_the_same_losses_for_every_ep(results):
    """ep 1, 2 and 4 (fsdp over 4 ranks) route every token to its experts wherever they live: nothing is dropped,
    so the losses agree to float rounding (a capacity limit would drop different tokens at each ep)."""
    losses = [results[layout]["losses"] for layout in EXPERT_PARALLEL]
    for other in losses[1:]:
        assert other == pytest.approx(losses[0], rel=1e-6, abs=0)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_continues_in_one_process(tmp_path, cache_dir):
    """fsdp with the experts over ep 2 follows the single-process run through train.py (validation, metrics,
    final weights) and records every step's expert load; its step-5 checkpoint (expert shards as DTensors on the
    expert mesh) continued by one process follows it too: weights, AdamW moments and data position all carried
    over."""
    moe = (*PARITY, "model=moe-tiny")
    reference = run_train(tmp_path, cache_dir, *moe, name="single")
    saved = run_train(tmp_path, cache_dir, *moe, "parallel=fsdp", "parallel.ep=2", "checkpoint.every=5", nproc=2)
    step_5 = saved.run_dir / "checkpoints" / "step-00000005"
    resumed = run_train(tmp_path, cache_dir, *moe, f"checkpoint.resume={step_5}", name="resumed")
    for run in (saved, resumed):
        assert run.returncode == 0, run.stderr[-3000:]
        differences = compare(str(run.run_dir), str(reference.run_dir))
        assert all(differences[key] <= LOSS_RTOL for key in METRICS), differences
        assert differences["weights"] <= GROUP_WEIGHT_ATOL, differences
    # summed over both ranks and moe-tiny's 2 mixture blocks: the global batch's tokens x top_k (2) x 2
    tokens = 16 * 32  # PARITY: batch 16 x seq 32
    assert len(saved.metrics) == 10
    for record in saved.metrics:
        assert len(record["expert_load"]) == 8 and sum(record["expert_load"]) == tokens * 2 * 2
        assert record["expert_imbalance"] >= 1.0


@pytest.mark.parametrize("preset", PRESETS)
def test_the_benchmarks_dense_twin_meets_as_many_parameters_per_token(preset):
    """llmtrain.bench.moe_bench compares a mixture with a dense model whose tokens meet as many parameters: the
    twin has no experts, and its active parameters are within 1% of the mixture's (which holds several times more)."""
    from llmtrain.bench.moe_bench import active_parameters, dense_twin

    mixture = compose_config([f"model={preset}"]).model
    twin = dense_twin([f"model={preset}"])
    assert "model.moe.num_experts=0" in twin
    assert active_parameters(compose_config(twin).model) == pytest.approx(active_parameters(mixture), rel=0.01)
    assert num_parameters(meta_model(mixture, 4096)) > 1.5 * active_parameters(mixture)
