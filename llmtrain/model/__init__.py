"""The model and its construction from the `model` config group: the class of its family (model.family, a row of
llmtrain/catalog/models.py's MODEL_FAMILIES; the GPT for every preset), built on the meta device, laid out, then
materialised with the initial weights of the seed or of a Hugging Face model (model.init_from)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from llmtrain.catalog import EXPERT_LORA_TARGETS, LORA_TARGETS, imported, model_family
from llmtrain.model.base import LayeredModel
from llmtrain.model.flops import flops_per_token
from llmtrain.model.gpt import GPT, num_parameters, seeded_init, trainable_parameters
from llmtrain.model.gpt_config import GPTConfig
from llmtrain.model.lora import LoRAConfig, is_adapter
from llmtrain.model.losses import chunked_cross_entropy, cross_entropy_loss, summed_cross_entropy
from llmtrain.model.materialize import Materializer, ParameterInit, materialize
from llmtrain.model.moe import MoEConfig, auxiliary_loss_scale
from llmtrain.model.rope import RopeScaling


def gpt_config(model_cfg, vocab_size: int) -> GPTConfig:
    """The model config group as the network's shape: each field of GPTConfig is the group's key of that name,
    with the vocabulary resolved (the group's own, or the tokenizer's) and the nested groups converted."""
    resolved: dict[str, Any] = {
        "vocab_size": model_cfg.vocab_size or vocab_size,
        "rope_scaling": rope_scaling(model_cfg.rope_scaling),
        "moe": MoEConfig(**{f.name: getattr(model_cfg.moe, f.name) for f in dataclasses.fields(MoEConfig)}),
        "sliding_window": tuple(model_cfg.sliding_window or ()),
        "rope_layers": tuple(model_cfg.rope_layers or ()),
        "lora": LoRAConfig(
            model_cfg.lora.rank, model_cfg.lora.alpha, model_cfg.lora.dropout, lora_targets(model_cfg.lora.targets)
        ),
    }
    return GPTConfig(
        **{f.name: resolved.get(f.name, getattr(model_cfg, f.name)) for f in dataclasses.fields(GPTConfig)}
    )


def lora_targets(names: list[str]) -> tuple[str, ...]:
    """model.lora.targets as our projections' names, each given by ours or by Hugging Face's (catalog.LORA_TARGETS)."""
    ours = {hf: mine for mine, hf in (*LORA_TARGETS.items(), *EXPERT_LORA_TARGETS.items())}
    return tuple(dict.fromkeys(ours.get(name, name) for name in names))


def model_group_of(gpt_cfg: GPTConfig, model_cfg):
    """The inverse of gpt_config: the model config group `model_cfg` with the shape of `gpt_cfg`, for a model whose
    shape and weights come from a checkpoint (so no init_from)."""
    scaling = gpt_cfg.rope_scaling
    shape = {f.name: getattr(gpt_cfg, f.name) for f in dataclasses.fields(GPTConfig)}
    shape["moe"] = dataclasses.replace(model_cfg.moe, **dataclasses.asdict(gpt_cfg.moe))
    shape["sliding_window"] = list(gpt_cfg.sliding_window) or None
    shape["rope_layers"] = list(gpt_cfg.rope_layers) or None
    lora = gpt_cfg.lora
    shape["lora"] = dataclasses.replace(
        model_cfg.lora, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=list(lora.targets)
    )
    shape["rope_scaling"] = (
        dataclasses.replace(model_cfg.rope_scaling, type="none")
        if scaling is None
        else dataclasses.replace(
            model_cfg.rope_scaling,
            type=scaling.kind,
            **{name: value for name, value in dataclasses.asdict(scaling).items() if name != "kind"},
        )
    )
    return dataclasses.replace(model_cfg, name="checkpoint", init_from=None, **shape)


def rope_scaling(scaling_cfg) -> RopeScaling | None:
    if scaling_cfg.type == "none":
        return None
    return RopeScaling(
        factor=float(scaling_cfg.factor),
        low_freq_factor=float(scaling_cfg.low_freq_factor),
        high_freq_factor=float(scaling_cfg.high_freq_factor),
        original_max_seq_len=int(scaling_cfg.original_max_seq_len),
        kind=scaling_cfg.type,
    )


def family_class(family: str) -> type[GPT]:
    """The model class of `model.family=family`: its row's in llmtrain/catalog/models.py, imported now. It takes GPT's
    constructor arguments and gives GPT's interface (`cfg`, `recompute`, the LayeredModel methods)."""
    return imported(model_family(family).model)


def meta_model(model_cfg, vocab_size: int, recompute: str = "none") -> GPT:
    """The whole model of `model.family` on the meta device: shapes only, no memory, for a layout to cut and shard;
    its blocks recompute their activations in backward as `recompute` (train.activation_checkpointing) says."""
    cfg = gpt_config(model_cfg, vocab_size)
    with torch.device("meta"):
        return family_class(cfg.family)(cfg, recompute=recompute)


def initial_weights(model_cfg, model: GPT, seed: int) -> ParameterInit:
    """Where the initial weights come from: the model at model.init_from (read tensor by tensor; its low-rank
    adapters from `seed`), else `seed`."""
    return pretrained_or_seeded(model_cfg.init_from, model, seed)


def base_of(model_cfg, seed: int) -> dict[str, Any]:
    """The base a model with low-rank adapters adapts, as its checkpoints name it: model.init_from with a
    fingerprint of its weights, or the run's seed, from which an untrained base is drawn."""
    if not model_cfg.init_from:
        return {"init_from": None, "seed": seed}
    from llmtrain.model.hf_files import local_hf_directory, weights_fingerprint

    return {
        "init_from": model_cfg.init_from,
        "fingerprint": weights_fingerprint(local_hf_directory(model_cfg.init_from)),
    }


def pretrained_or_seeded(init_from: str | None, model: GPT, seed: int) -> ParameterInit:
    """The weights of the Hugging Face model `init_from` (with low-rank adapters drawn from `seed`), or all from
    `seed`."""
    if not init_from:
        return seeded_init(model, seed)
    from llmtrain.model.hf import hf_weights

    pretrained, seeded = hf_weights(init_from, model.cfg), seeded_init(model, seed)

    def init(name: str, full: torch.Tensor) -> None:  # adapters are new: drawn from the seed
        (seeded if is_adapter(name) else pretrained)(name, full)

    return init


def build_model(model_cfg, vocab_size: int, seed: int, recompute: str = "none") -> GPT:
    """The whole model materialised in this process on the CPU, with the weights every layout starts from (for
    tools and tests; training lays the model out on the meta device first, llmtrain/run/build.py)."""
    model = meta_model(model_cfg, vocab_size, recompute)
    materialize(model, torch.device("cpu"), initial_weights(model_cfg, model, seed))
    return model


__all__ = [
    "LayeredModel",
    "GPT",
    "GPTConfig",
    "Materializer",
    "ParameterInit",
    "auxiliary_loss_scale",
    "build_model",
    "chunked_cross_entropy",
    "cross_entropy_loss",
    "family_class",
    "summed_cross_entropy",
    "flops_per_token",
    "gpt_config",
    "initial_weights",
    "materialize",
    "meta_model",
    "model_group_of",
    "num_parameters",
    "pretrained_or_seeded",
    "base_of",
    "trainable_parameters",
]
