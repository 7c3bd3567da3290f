"""QLoRA (model.quantize_base=nf4, llmtrain/model/quantize.py): torchao's NF4 held to a reference written from the
paper, what a rank keeps of it, the model that computes with it, the refusals and the planner's answer (its count
of what a rank holds is test_lora.py's). Its layouts (single, DDP, FSDP) are in tests/data/test_sft.py's group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("torchao")  # the `fp8` extra: installed by CI

from llmtrain.config import validate  # noqa: E402
from llmtrain.errors import ConfigError  # noqa: E402
from llmtrain.model import GPT, GPTConfig, trainable_parameters  # noqa: E402
from llmtrain.model.hf_peft import merged  # noqa: E402
from llmtrain.model.lora import LoRAConfig, is_adapter  # noqa: E402
from llmtrain.model.quantize import (  # noqa: E402
    BLOCK,
    GROUP,
    SCALER_BLOCK,
    dequantized,
    is_nf4,
    nf4_bytes_per_weight,
    quantized_piece,
)
from llmtrain.parallel_plan import ParallelPlan  # noqa: E402
from llmtrain.tools import compose_config  # noqa: E402

CPU = torch.device("cpu")


def reference_levels() -> torch.Tensor:
    """NF4's 16 levels as Dettmers et al. build them: 8 quantiles of a standard normal on the positive side and 7 on
    the negative, between the probabilities 0.5 and 0.9677 (so that the extreme quantiles are finite), plus an
    exact zero, scaled into [-1, 1]."""
    normal = torch.distributions.Normal(0.0, 1.0)
    edge = 0.9677083
    positive = normal.icdf(torch.linspace(edge, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -normal.icdf(torch.linspace(edge, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)]).sort().values
    return levels / levels.abs().max()


def reference_nf4(weight: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The dequantised NF4 of `weight`, written from the QLoRA paper: each block of 64 scaled by its absolute
    maximum, each value the nearest level; the block maxima less their mean, scaled by each group of 256's own
    maximum into int8 (double quantisation), dequantised back. In `weight`'s dtype, as torchao computes."""
    blocks = weight.reshape(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    codes = ((blocks / absmax[:, None]).unsqueeze(-1) - levels).abs().argmin(dim=-1)
    mean = absmax.mean()
    centred = (absmax - mean).reshape(-1, SCALER_BLOCK)
    factor = 128 / centred.abs().amax(dim=1, keepdim=True)
    int8 = (centred * factor).round().clamp(-128, 127)
    scales = (int8 / factor).flatten() + mean
    return (levels[codes] * scales[:, None]).reshape(weight.shape)


def test_torchaos_nf4_is_the_papers():
    """The levels are the normal quantiles (to bf16's rounding); the values torchao dequantises are the
    reference's, bit for bit; every value lies within half the widest gap between levels (plus the rounding of
    its block's scale) of the weight."""
    weight = torch.randn(512, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    nf4 = quantized_piece(weight, 512, 0, CPU)
    # held in bf16: one rounding of the quantiles (torchao writes them to four decimals first)
    torch.testing.assert_close(nf4.nf4.double(), reference_levels(), atol=0, rtol=2**-8)
    held = weight.to(torch.bfloat16)
    assert torch.equal(dequantized(nf4), reference_nf4(held, nf4.nf4))
    error = (dequantized(nf4).float() - held.float()).abs().reshape(-1, BLOCK).amax(dim=1)
    widest = (reference_levels().diff().max() / 2).item()
    assert (error <= (widest + 0.02) * held.float().abs().reshape(-1, BLOCK).amax(dim=1)).all()
    # 4 bits, an int8 scale per 64 weights and a bf16 factor per 16,384
    assert nf4_bytes_per_weight() == 0.5 + 1 / 64 + 2 / 16384
    codes_and_scales = (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor)
    assert sum(t.nbytes for t in codes_and_scales) == nf4_bytes_per_weight() * weight.numel()


@pytest.mark.parametrize("shards", [2, 4])
def test_a_rank_keeps_its_rows_of_the_whole_weights_quantisation(shards):
    """A shard is the whole tensor's quantisation cut by rows: gathered, the shards dequantise to what one process
    holds. Quantising each shard alone would not: the scales' mean differs from shard to shard."""
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 0.05
    whole = dequantized(quantized_piece(weight, 256, 0, CPU))
    rows = 256 // shards
    pieces = [quantized_piece(weight, rows, rank * rows, CPU) for rank in range(shards)]
    assert all(piece.shape == (rows, 512) for piece in pieces)
    assert torch.equal(torch.cat([dequantized(piece) for piece in pieces]), whole)
    alone = [dequantized(quantized_piece(rows_of, rows, 0, CPU)) for rows_of in weight.split(rows)]
    assert not torch.equal(torch.cat(alone), whole)


# Widths whose every projection is whole NF4 groups: q and out 256 x 256, k and v 128 x 256, the MLP 512 x 256
QLORA = GPTConfig(
    vocab_size=97, n_layer=2, n_head=4, d_model=256, max_seq_len=16, bias=False, norm="rmsnorm", position="rope",
    mlp="swiglu", n_kv_head=2, d_ff=512, lora=LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "fc_out")),
    quantize_base="nf4",
)  # fmt: skip


def _built(cfg: GPTConfig) -> GPT:
    from llmtrain.model import materialize, seeded_init

    with torch.device("meta"):
        model = GPT(cfg)
    materialize(model, CPU, seeded_init(model, 0))
    return model


def test_a_quantised_model_computes_with_its_dequantised_base_and_trains_its_adapters_alone():
    """Every block projection is NF4; the model computes what the same model with those weights dequantised does;
    a step's gradients reach the adapters and nothing else; merged for export, it computes the same again."""
    model = _built(QLORA)
    quantized = {name for name, param in model.named_parameters() if is_nf4(param)}
    projections = ("q_proj", "k_proj", "v_proj", "out_proj", "fc_gate", "fc_in", "fc_out")
    assert quantized == {f"blocks.{i}.{module}.{p}.weight" for i in range(2) for module, p in _places(projections)}
    plain = _built(dataclasses.replace(QLORA, quantize_base="none"))
    plain.load_state_dict({name: dequantized(tensor) for name, tensor in model.state_dict().items()})
    for layer in (*model.modules(), *plain.modules()):
        if hasattr(layer, "lora_b"):
            torch.nn.init.normal_(layer.lora_b, std=0.02, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    logits = model(tokens)
    torch.testing.assert_close(logits, plain(tokens), rtol=1e-5, atol=1e-5)
    logits.float().square().mean().backward()
    assert {name for name, param in model.named_parameters() if param.grad is not None} == {
        name for name, _ in model.named_parameters() if is_adapter(name)
    }
    assert trainable_parameters(model) == trainable_parameters(plain)
    with torch.no_grad():
        torch.testing.assert_close(merged(model)(tokens), logits.detach(), rtol=1e-5, atol=1e-5)


def _places(projections: tuple[str, ...]) -> list[tuple[str, str]]:
    return [("attn" if name in ("q_proj", "k_proj", "v_proj", "out_proj") else "mlp", name) for name in projections]


def test_bad_qlora_settings_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"model.quantize_base=nf4 freezes the base .* set model.lora.rank"):
        validate(compose_config(["model=llama-tiny", "model.quantize_base=nf4"]))
    cfg = compose_config(["model=llama-tiny", "model.quantize_base=nf4", "model.lora.rank=4", "parallel=tp"])
    with pytest.raises(ConfigError, match=r"model.quantize_base=nf4 with parallel.tp=2: .* use a layout without tp"):
        ParallelPlan.of(cfg.parallel, cfg.train, cfg.model, 2)
    from llmtrain.parallel.fsdp import check_nf4_shards

    with torch.device("meta"):
        model = GPT(QLORA)
    check_nf4_shards(model, 2)
    with pytest.raises(ConfigError, match=r"blocks.0.attn.k_proj.weight \(128 x 256\) does not split into 4 FSDP"):
        check_nf4_shards(model, 4)  # 2 groups of 16,384 weights cannot split four ways
    assert 128 * 256 == 2 * GROUP


def test_the_planner_fits_llama_8b_qlora_on_one_16_gb_card_where_bf16_lora_does_not():
    """Llama 3.1 8B with rank-16 adapters at sequence 2,048 (bf16, full recomputation), with llmtrain's own sizes:
    QLoRA fits one RTX 4080, and four under FSDP, where no tensor-parallel layout is offered; the bf16 base does
    not fit one card."""
    from llmtrain.parallel_plan import Degrees
    from llmtrain.planner.auto import auto_decision
    from llmtrain.planner.candidates import Candidate, enumerate_candidates
    from llmtrain.planner.cost import layout_cost
    from llmtrain.planner.inputs import llmtrain_state_bytes, machine_for, workload_for

    def config(world: int, quantize: str):
        return compose_config(
            [
                "model=llama3.1-8b", "hardware=rtx4080x4", f"hardware.gpus_per_node={world}", "model.lora.rank=16",
                f"model.quantize_base={quantize}", "train.precision=bf16", "train.seq_len=2048",
                "train.batch_size=16", "train.micro_batch_size=1", "train.activation_checkpointing=full",
            ]
        )  # fmt: skip

    one = auto_decision(config(1, "nf4"), 1, 1, 128256, True, "1f1b").chosen
    assert one is not None and one.name == "single" and one.heaviest.total < 15 * 2**30
    assert auto_decision(config(1, "none"), 1, 1, 128256, True, "1f1b").chosen is None
    cfg = config(4, "nf4")
    work, machine = workload_for(cfg, 128256, llmtrain_state_bytes(cfg, True)), machine_for(cfg, 4, 4, True)
    assert layout_cost(Candidate("fsdp", Degrees(dp_shard=4)), work, machine).fits
    offered = enumerate_candidates(4, 4, cfg.model, cfg.train, "all", "1f1b")
    assert offered and all(candidate.degrees.tp == 1 for candidate in offered)


@pytest.mark.slow
def test_qlora_under_fsdp_over_one_rank_steps_as_one_process():
    """Over one shard FSDP gathers nothing, so the NF4 weights stay whole, outside it (torch 2.13's one-shard path
    would copy only the first of NF4's three all-gather inputs): the step's loss and the adapters' gradients are
    one process's."""
    from omegaconf import OmegaConf

    from llmtrain.process.runtime import Runtime
    from llmtrain.run.build import build_parallel_model

    widths = ["model.d_model=256", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=512", "model.n_layer=2"]
    one_process = Runtime(rank=0, world_size=1, local_rank=0, device=CPU, launcher="none")
    tokens = torch.randint(0, 257, (4, 17), generator=torch.Generator().manual_seed(0))
    micro_batches = [(tokens[:, :-1], tokens[:, 1:])]
    steps = {}
    for layout in ("single", "fsdp"):
        config = compose_config(["model=llama-tiny", *widths, "model.lora.rank=4", "model.quantize_base=nf4",
                                 f"parallel={layout}", "train.micro_batch_size=4", "train.batch_size=4"])  # fmt: skip
        model = build_parallel_model(OmegaConf.to_object(config), one_process, 257)
        with torch.no_grad():  # adapters off zero, so that every one has a gradient (one shard: the whole tensor)
            for name, param in model.module.named_parameters():
                if name.endswith("lora_b"):
                    value = torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.02
                    getattr(param, "_local_tensor", param).copy_(value)
        loss = model.forward_backward(micro_batches)
        grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for name, p in model.module.named_parameters() if p.grad is not None}  # fmt: skip
        steps[layout] = (loss.item(), grads, sum(is_nf4(p) for p in model.module.parameters()))
    (loss, grads, nf4), (fsdp_loss, fsdp_grads, fsdp_nf4) = steps["single"], steps["fsdp"]
    assert nf4 == fsdp_nf4 == 14 and fsdp_loss == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == fsdp_grads.keys() and all(
        torch.allclose(fsdp_grads[name], grad, rtol=1e-5, atol=1e-7) for name, grad in grads.items()
    )
