"""Qwen3-MoE (Qwen3-30B-A3B's family): the presets' parameter counts and the tiny model's logits against
transformers' Qwen3MoeForCausalLM, its weights in both directions (model.init_from of a saved Qwen3-MoE, whose files
hold each expert's tensors, or of transformers 5's fused ones; the export map into one), routing with and without
the top-k renormalisation, and the refusals."""

from __future__ import annotations

import subprocess
import warnings

import pytest
import torch
from harness.layouts import needs_torchao
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # at collection: its first import runs ldconfig

from llmtrain.errors import ConfigError
from llmtrain.model import build_model, meta_model, num_parameters
from llmtrain.model.hf import hf_format_of
from llmtrain.model.hf_mixtral import to_mixtral_state_dict
from llmtrain.tools import compose_config

LOGIT_ATOL = 1e-5  # fp32
VOCAB = 257
# qwen3-moe-tiny's shape in transformers' terms: heads of 32 over a width of 128, 8 experts of 128, 2 a token
TINY = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=32, max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            norm_topk_prob=True, router_aux_loss_coef=0.001)  # fmt: skip


def _spread(model: torch.nn.Module) -> torch.nn.Module:
    """Head norms away from one and routers away from zero (transformers starts both so), so that a norm or a router
    loaded into the wrong place shows."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5, generator=generator)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.normal_(0, 0.5, generator=generator)
    return model


@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "qwen3-30b-a3b"])
def test_qwen3_moe_parameter_counts_equal_transformers(preset):
    """qwen3-30b-a3b holds 30,532,122,624 parameters, as Qwen3MoeForCausalLM of the release's config counts them."""
    ours = meta_model(compose_config([f"model={preset}"]).model, 151936)
    with torch.device("meta"):
        reference = Qwen3MoeForCausalLM(hf_format_of(ours.cfg).hf_config(ours.cfg, 0))
    assert num_parameters(ours) - ours.cfg.padding_parameters == reference.num_parameters()
    if preset == "qwen3-30b-a3b":
        assert reference.num_parameters() == 30_532_122_624


@pytest.mark.parametrize("renormalize", [True, False])
def test_our_qwen3_moe_exports_into_transformers_with_our_logits(renormalize):
    """The export's map and config: Qwen3MoeForCausalLM takes every tensor of our model (strictly) and computes our
    logits, the top-k probabilities renormalised (norm_topk_prob) or not."""
    cfg = compose_config(["model=qwen3-moe-tiny", f"model.moe.renormalize={str(renormalize).lower()}"]).model
    ours = _spread(build_model(cfg, VOCAB, seed=3)).eval()
    family = hf_format_of(ours.cfg)
    assert family.transformers_class == "Qwen3MoeForCausalLM"
    theirs = Qwen3MoeForCausalLM(family.hf_config(ours.cfg, 0)).eval()
    theirs.load_state_dict(to_mixtral_state_dict(ours), strict=True)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow  # writes and reads model directories
@pytest.mark.parametrize("layout", ["per expert", "fused"])
def test_a_hugging_face_qwen3_moe_initialises_our_model_with_its_logits(tmp_path, layout):
    """A saved Qwen3MoeForCausalLM (its files hold each expert's gate_proj, up_proj and down_proj, as the release
    does), or one whose files hold transformers 5's fused experts: our qwen3-moe-tiny started from it computes its
    logits."""
    torch.manual_seed(0)
    theirs = _spread(Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY))).eval()
    theirs.save_pretrained(tmp_path)
    if layout == "fused":
        (tmp_path / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ("model.layers.0.mlp.experts.0.gate_proj.weight" in names) == (layout == "per expert")
    ours = build_model(compose_config(["model=qwen3-moe-tiny", f"model.init_from={tmp_path}"]).model, VOCAB, seed=1)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(ids)[..., :VOCAB] - theirs(ids).logits).abs().max().item() <= LOGIT_ATOL


def test_a_qwen3_moe_it_cannot_hold_is_refused_in_one_line():
    cfg = meta_model(compose_config(["model=qwen3-moe-tiny", "model.moe.shared_experts=1"]).model, VOCAB).cfg
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM only as .*\(model.moe.shared_experts=1") as refused:
        hf_format_of(cfg)
    assert "\n" not in str(refused.value)


# -- NF4 experts (model.quantize_base=nf4) ----------------------------------------------------------------------------
QLORA_EXPERTS = ["model=qwen3-moe-tiny", "model.lora.rank=4", "model.quantize_base=nf4"]


@needs_torchao
@pytest.mark.parametrize("grouped", [True, False])
def test_nf4_holds_each_blocks_experts_and_a_block_dequantises_them_only_while_it_computes(grouped, monkeypatch):
    """Under QLoRA the routed experts are NF4 too: each stack (E, in, out) is torchao's NF4 of its experts' rows one
    after another, which every expert holds whole groups of; a training step's autograd keeps no dequantised stack
    for backward (the matmul dequantises again there), with the grouped kernel or without it (the experts one by
    one, as on an RTX 4080), and the adapters get gradients."""
    import llmtrain.model.moe as moe
    from llmtrain.model.quantize import BLOCK, SCALER_BLOCK, _nf4, dequantized, is_nf4

    if not grouped:
        monkeypatch.setattr(moe, "_grouped_kernel_takes", lambda x, weights: False)

    quantized = build_model(compose_config(QLORA_EXPERTS).model, VOCAB, seed=1)
    plain = build_model(compose_config(QLORA_EXPERTS[:2]).model, VOCAB, seed=1)
    experts, reference = quantized.blocks["0"].mlp.experts, plain.blocks["0"].mlp.experts
    for name in ("w_in", "w_gate", "w_out"):
        stack, whole = getattr(experts, name), getattr(reference, name).detach()
        assert is_nf4(stack) and stack.shape == (whole.shape[0] * whole.shape[1], whole.shape[2])
        expected = _nf4().to_nf4(whole.flatten(0, 1).to(torch.bfloat16), BLOCK, SCALER_BLOCK).get_original_weight()
        assert torch.equal(dequantized(stack), expected)
    stack_elements = {reference.w_in.numel(), reference.w_out.numel()}
    saved: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.shape)
        return tensor

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = quantized(ids)[..., :VOCAB].float().logsumexp(-1).mean()
    loss.backward()
    assert not [shape for shape in saved if shape.numel() in stack_elements]
    adapters = [p for name, p in quantized.named_parameters() if "lora" in name]
    assert adapters and all(p.grad is not None for p in adapters)


# Qwen3-MoE under the layouts that take experts, against one process (2 ranks): FSDP sharding experts by expert,
# expert parallelism over 2 (all-to-all), tensor parallelism splitting the experts by hidden units, QLoRA's NF4
# experts (wider, so that every NF4 tensor splits into 2 shards of whole groups) under FSDP and expert parallelism,
# and adapters on every expert (over bf16 and over NF4 experts), sharded and exchanged with them.
NF4_WIDTH = "model.d_model=256 model.lora.rank=4 model.quantize_base=nf4"
EXPERT_ADAPTERS = "model.lora.rank=4 model.lora.targets=[q_proj,experts_in,experts_out]"
QWEN3_MOE_LAYOUTS = [
    "parallel=fsdp",
    "parallel=fsdp parallel.ep=2",
    "parallel=tp",
    f"{NF4_WIDTH} parallel=fsdp",
    f"{NF4_WIDTH} parallel=fsdp parallel.ep=2",
    f"{EXPERT_ADAPTERS} parallel=fsdp",
    f"{EXPERT_ADAPTERS} parallel=fsdp parallel.ep=2",
    f"{EXPERT_ADAPTERS} model.d_model=256 model.quantize_base=nf4 parallel=fsdp parallel.ep=2",
]


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory) -> dict:
    from harness.layouts import GROUP_RUN, layout_group

    common = f"model=qwen3-moe-tiny {GROUP_RUN}"
    # The group takes under a minute. Rarely a rank of it aborts on a corrupted heap or, seen once, hangs: the cause
    # is not found (issue 84). Past the deadline each rank prints every thread's stack and exits; a group that did
    # not finish is reported as a warning with what its ranks printed, and runs once more (a wrong number is the
    # tests' to find, and fails). A group that fails twice fails.
    deadline = {"LLMTRAIN_GROUP_DEADLINE_S": "250"}
    try:
        return layout_group(tmp_path_factory, 2, common, QWEN3_MOE_LAYOUTS, env=deadline, timeout=280)
    except (AssertionError, subprocess.TimeoutExpired) as unfinished:
        warnings.warn(f"the Qwen3-MoE layout group did not finish (issue 84), runs again: {unfinished}", stacklevel=1)
        return layout_group(tmp_path_factory, 2, common, QWEN3_MOE_LAYOUTS, env=deadline, timeout=280)


@pytest.mark.slow
@pytest.mark.parametrize("layout", QWEN3_MOE_LAYOUTS)
def test_qwen3_moe_under_a_layout_matches_one_process(layout, layout_results):
    from harness.layouts import assert_matches_single

    assert_matches_single(layout_results, layout)


def test_the_planner_fits_qwen3_30b_a3b_qlora_on_four_16_gb_cards():
    """Qwen3-30B-A3B with its blocks' weights in NF4 (experts included) and rank-16 adapters, sequences of 2,048:
    the layouts that keep every weight on each rank cannot hold the 15.6 GiB of NF4 and bf16 weights; FSDP over the
    four cards does, and parallel=auto picks a layout within the usable 15 GiB a rank (the dry run of that pick
    agrees within 4%: docs/finetuning.md), among layouts that split NF4 experts one way only."""
    from llmtrain.planner.auto import auto_decision, auto_plans, configured_cost

    overrides = ["model=qwen3-30b-a3b", "model.lora.rank=16", "model.quantize_base=nf4", "train.seq_len=2048",
                 "train.batch_size=8", "train.micro_batch_size=1", "train.activation_checkpointing=full",
                 "hardware=rtx4080x4", "data.tokenizer.kind=byte"]  # fmt: skip
    cfg = compose_config([*overrides, "parallel=ddp"])
    assert not configured_cost(cfg, 4, 4, 151936, True).fits
    fsdp = configured_cost(compose_config([*overrides, "parallel=fsdp"]), 4, 4, 151936, True)
    assert fsdp.fits and fsdp.heaviest.total < 15 * 2**30
    assert fsdp.heaviest.parameters < 4.5 * 2**30  # a quarter of the NF4 experts, attention and embeddings
    picked = auto_decision(compose_config([*overrides, "parallel=auto"]), 4, 4, 151936, True, "1f1b").chosen
    assert picked is not None and picked.fits and picked.heaviest.total < 15 * 2**30
    # NF4 experts are split by expert parallelism or by FSDP, never by both (parallel/fsdp.py refuses it)
    weighed = {p.candidate.degrees for p in auto_plans(cfg, 4, 4, 151936, True, "1f1b")[0]}
    assert {d.ep for d in weighed} == {1, 4} and all(d.ep in (1, d.dp_shard_cp) for d in weighed)


# -- adapters on the experts (model.lora.targets experts_in, experts_out) ---------------------------------------------
@pytest.mark.parametrize("quantized", [False, pytest.param(True, marks=needs_torchao)])
def test_expert_adapters_compute_what_their_merged_experts_compute(quantized):
    """Per expert, an A and B beside the input projections (the gate's columns, then the up-projection's, as
    transformers' fused gate_up_proj) and beside the output projection, named by ours or by transformers' names:
    the adapted model's logits are those of the model whose experts hold W + (alpha / rank) A B (its NF4 stacks
    dequantised), the base's with the adapters off; they train, and the planner counts them."""
    from llmtrain.model import trainable_parameters
    from llmtrain.model.hf_peft import merged
    from llmtrain.model.lora import adapters_disabled
    from llmtrain.planner.shapes import holding

    overrides = [
        "model=qwen3-moe-tiny",
        "model.lora.rank=4",
        "model.lora.targets=[q_proj,experts.gate_up_proj,experts_out]",
    ]
    cfg = compose_config([*overrides, *(["model.quantize_base=nf4"] if quantized else [])]).model
    ours = build_model(cfg, VOCAB, seed=1).eval()
    with torch.no_grad():  # B away from zero: the adapters then change every expert
        for name, param in ours.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    experts = ours.blocks["0"].mlp.experts
    assert experts.in_lora_b.shape == (8, 4, 2 * 128) and experts.out_lora_a.shape == (8, 128, 4)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = ours(ids)[..., :VOCAB]
    with torch.no_grad():
        assert (merged(ours)(ids)[..., :VOCAB] - logits).abs().max().item() <= LOGIT_ATOL
        with adapters_disabled(ours):
            base = ours(ids)[..., :VOCAB]
    assert (base - logits).abs().max().item() > 1e-3
    logits.float().logsumexp(-1).mean().backward()
    assert all(
        getattr(experts, name).grad is not None for name in ("in_lora_a", "in_lora_b", "out_lora_a", "out_lora_b")
    )
    assert holding(ours.cfg).trainable == trainable_parameters(ours)


@pytest.mark.parametrize("targets", ["[q_proj,experts_in,experts_out]", "[experts.down_proj]"])
def test_peft_puts_the_exported_expert_adapters_onto_transformers_qwen3_moe(tmp_path, targets):
    """The adapters saved in PEFT's format (target_parameters on transformers' fused expert stacks, beside
    target_modules): PeftModel.from_pretrained onto Qwen3MoeForCausalLM holding our base computes our adapted
    logits, whichever of the experts' projections are adapted."""
    from dataclasses import replace

    from llmtrain.model.hf_peft import save_peft_adapter
    from llmtrain.model.lora import LoRAConfig, is_adapter

    peft = pytest.importorskip("peft")
    cfg = compose_config(["model=qwen3-moe-tiny", "model.lora.rank=4", f"model.lora.targets={targets}"]).model
    ours = _spread(build_model(cfg, VOCAB, seed=1)).eval()
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    base = type(ours)(replace(ours.cfg, lora=LoRAConfig()))
    base.load_state_dict({k: v for k, v in ours.state_dict().items() if not is_adapter(k)})
    theirs = Qwen3MoeForCausalLM(hf_format_of(base.cfg).hf_config(base.cfg, 0)).eval()
    theirs.load_state_dict(to_mixtral_state_dict(base), strict=True)
    save_peft_adapter(ours, None, str(tmp_path / "adapter"))
    adapted = peft.PeftModel.from_pretrained(theirs, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (adapted(ids).logits - ours(ids)[..., :VOCAB]).abs().max().item() <= LOGIT_ATOL


def test_the_planner_counts_experts_run_one_by_one_where_the_card_has_no_fused_grouped_gemm():
    """On an RTX 4080 (Ada, sm_89) torch has no fused grouped GEMM: each of a rank's 128 experts' 3 matmuls is
    launched on its own, in each forward pass (2 with full recomputation) and the input's backward (the experts are
    frozen), in each of the 8 micro-batches of all 48 mixtures: 8 x 48 x 3 x 128 x 3 launches of
    hardware.kernel_launch_us beyond the FLOPs. An H200 (Hopper) runs them as one grouped GEMM: nothing more."""
    from llmtrain.planner.auto import configured_cost

    run = ["model=qwen3-30b-a3b", "model.lora.rank=16", "model.quantize_base=nf4", "train.seq_len=2048",
           "train.batch_size=32", "train.micro_batch_size=1", "train.activation_checkpointing=full",
           "data.tokenizer.kind=byte", "parallel=fsdp"]  # fmt: skip

    def compute_s(hardware: str, launch_us: float) -> float:
        cfg = compose_config([*run, f"hardware={hardware}", f"hardware.kernel_launch_us={launch_us}"])
        return configured_cost(cfg, 4, 4, 151936, True).compute_s

    launches = 8 * 48 * 3 * 128 * 3
    assert compute_s("rtx4080x4", 5.0) - compute_s("rtx4080x4", 1e-9) == pytest.approx(launches * 5e-6, rel=1e-6)
    assert compute_s("h200", 5.0) == compute_s("h200", 1e-9)
