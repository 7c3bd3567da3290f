"""Low-rank adapters (llmtrain/model/lora.py): what trains, what stays, and the layer they add up to. Their layouts
are in test_parallel.py's groups, their checkpoints and exports below."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmtrain.catalog import MLP_KINDS
from llmtrain.config import validate
from llmtrain.errors import ConfigError
from llmtrain.model import GPT, GPTConfig, cross_entropy_loss, trainable_parameters
from llmtrain.model.lora import LoRAConfig, LoRALinear, is_adapter
from llmtrain.optim import build_optimizer
from llmtrain.tools import compose_config

LLAMA = GPTConfig(
    vocab_size=97, n_layer=2, n_head=4, d_model=32, max_seq_len=16, bias=False, norm="rmsnorm", position="rope",
    mlp="swiglu", n_kv_head=2,
)  # fmt: skip
ADAPTED = dataclasses.replace(LLAMA, lora=LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "fc_out")))


def _model(cfg: GPTConfig) -> GPT:
    model = GPT(cfg)
    model.init_weights(0)
    return model


@pytest.mark.releases
def test_only_the_targeted_projections_get_adapters_and_only_they_train():
    model = _model(ADAPTED)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable == {
        f"blocks.{i}.{module}.{adapter}"
        for i in range(2)
        for module in ("attn.q_proj", "attn.v_proj", "mlp.fc_out")
        for adapter in ("lora_a", "lora_b")
    }
    assert all(is_adapter(name) for name in trainable)
    # rank x (in + out) per adapted projection: q 32+32, v 32+16 (two of four heads' keys), fc_out 128+32
    assert trainable_parameters(model) == 2 * 4 * (64 + 48 + 160)
    # the base keeps its names: the same parameters as the model without adapters, plus the adapters
    base = {name for name, _ in _model(LLAMA).named_parameters()}
    assert {name for name, _ in model.named_parameters()} == base | trainable


@pytest.mark.releases
def test_an_adapted_model_starts_as_its_base_and_steps_move_only_the_adapters():
    base, adapted = _model(LLAMA), _model(ADAPTED)
    tokens = torch.randint(0, 97, (2, 12))
    torch.testing.assert_close(adapted(tokens), base(tokens), rtol=0, atol=0)  # B starts at zero
    before = {name: param.detach().clone() for name, param in adapted.named_parameters()}
    optimizer = build_optimizer(adapted, compose_config(["model=tiny"]).optim)
    for _ in range(3):
        cross_entropy_loss(adapted(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in adapted.named_parameters():
        moved = not torch.equal(param, before[name])
        assert moved == is_adapter(name), name
        assert param.grad is None


@pytest.mark.releases
def test_an_adapted_layer_computes_its_merged_weight():
    layer = LoRALinear(8, 6, True, LoRAConfig(rank=2, alpha=4.0, targets=("q_proj",)))
    torch.nn.init.normal_(layer.lora_a)
    torch.nn.init.normal_(layer.lora_b)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.merged_weight(), layer.bias))


def test_float8_with_adapters_is_refused_in_one_line():
    pytest.importorskip("torchao")
    cfg = compose_config(["model=tiny", "model.lora.rank=4", "train.float8=tensorwise"])
    with pytest.raises(ConfigError, match="train.float8=tensorwise with model.lora.rank=4"):
        validate(cfg)


@pytest.mark.parametrize("quantize, mlp", [("none", "swiglu"), ("nf4", "swiglu"), ("nf4", "relu2")])
def test_the_planner_counts_a_frozen_base_as_the_built_model_holds_it(quantize, mlp):
    """What one process holds of a model with adapters (fp32 weights, or an NF4 base at 0.516 bytes a weight;
    gradients and AdamW's moments for the adapters alone), measured on the built model, is what the planner counts
    from the config; with squared-ReLU MLPs (model.mlp=relu2) both of each MLP's matrices are NF4, and the planner
    counts two."""
    from omegaconf import OmegaConf

    from llmtrain.model.quantize import is_nf4
    from llmtrain.parallel_plan import Degrees
    from llmtrain.planner.candidates import Candidate
    from llmtrain.planner.inputs import llmtrain_state_bytes
    from llmtrain.planner.memory import model_states
    from llmtrain.planner.shapes import block_projections, holding
    from llmtrain.process.runtime import Runtime
    from llmtrain.run.build import build_parallel_model
    from llmtrain.train.memory import held_bytes

    if quantize == "nf4":
        pytest.importorskip("torchao")  # the `fp8` extra: installed by CI
    # widths whose projections are whole NF4 groups (model/quantize.py)
    widths = ["model.d_model=256", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=512"]
    config = OmegaConf.to_object(
        compose_config(
            ["model=llama-tiny", *widths, "model.lora.rank=4", f"model.quantize_base={quantize}", f"model.mlp={mlp}"]
        )
    )
    one_process = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    model = build_parallel_model(config, one_process, 257)
    measured = held_bytes(model.module, model.optimizer, config.optim)
    held = holding(model.module.cfg)
    assert held.trainable == trainable_parameters(model.module) and held.trainable < held.total / 20
    quantized = [p for p in model.module.parameters() if is_nf4(p)]
    assert held.quantized == sum(p.numel() for p in quantized) and bool(quantized) == (quantize == "nf4")
    sizes = llmtrain_state_bytes(config, bf16=False)
    params, grads, optimizer, _ = model_states(Candidate("single", Degrees()), held, sizes)
    built = [block.mlp for block in model.module.blocks.values()]
    assert all((module.fc_gate is None) == (mlp == "relu2") for module in built)
    assert all(is_nf4(module.fc_in.weight) and is_nf4(module.fc_out.weight) for module in built) == (quantize == "nf4")
    planned = [name for name in block_projections(model.module.cfg) if name.startswith("fc_")]
    assert len(planned) == MLP_KINDS[mlp].matrices == (2 if mlp == "relu2" else 3)
    # each NF4 matrix also holds its 16 levels and its scales' mean (34 bytes), which the planner leaves out
    params += 34 * len(quantized)
    assert (params, grads, optimizer) == (measured.params, measured.grads, measured.optimizer)


@pytest.mark.releases
def test_selective_recomputation_reruns_the_adapters_up_projection_and_keeps_the_base_matmul():
    """Under train.activation_checkpointing=selective the matmuls' outputs are kept, but an adapter's B output is as
    wide as its layer's for r / width of its cost (Llama 3.1 8B under LoRA held 10 GiB more than its full
    fine-tune at 4,096 tokens): the policy reruns it, keeps the base's and the rank-r A's, and the gradients are
    those of no recomputation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from llmtrain.model.recompute import _save_expensive

    class Matmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.policies: list[tuple[tuple[int, ...], str]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                shape = tuple(func(*args, **(kwargs or {})).shape)
                self.policies.append((shape, _save_expensive(None, func, *args).name))
            return func(*args, **(kwargs or {}))

    layer = LoRALinear(64, 96, False, LoRAConfig(rank=4, alpha=8.0, targets=("q_proj",)))
    with Matmuls() as seen:
        layer(torch.randn(3, 64))
    assert sorted(seen.policies) == [((3, 4), "MUST_SAVE"), ((3, 96), "MUST_SAVE"), ((3, 96), "PREFER_RECOMPUTE")]

    adapted = dataclasses.replace(ADAPTED, d_model=64, lora=dataclasses.replace(ADAPTED.lora, rank=2))
    tokens = torch.randint(0, 97, (2, 12))
    grads = []
    for mode in ("none", "selective"):
        model = GPT(adapted, recompute=mode)
        model.init_weights(0)
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                torch.nn.init.normal_(param, generator=torch.Generator().manual_seed(len(name)))
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6)
