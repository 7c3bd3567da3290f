"""The models a chat answers with, loaded: whole in this process, or laid out over the ranks that launched it."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, cast

import torch

from llmtrain.chat.engine import Answerer, measured_cache_bytes
from llmtrain.config import RootConfig
from llmtrain.errors import ConfigError
from llmtrain.model.base import LayeredModel
from llmtrain.process.runtime import Runtime


def model_name(path: str) -> str:
    """A model's name from its path: the run's and the checkpoint's directories, or an exported directory's."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "checkpoints":
        return f"{parts[-3]}/{parts[-1]}"
    return parts[-1]


def chat_config(overrides: list[str]) -> RootConfig:
    """Training's config of `overrides` (what a chat reads of it: train.device, train.precision, the layout keys);
    a bad key or value is one line."""
    from omegaconf import OmegaConf

    from llmtrain.config import check_domains
    from llmtrain.config.composition import compose_or_refuse

    composed = compose_or_refuse("train", overrides, RootConfig)
    check_domains(composed, RootConfig)
    return cast(RootConfig, OmegaConf.to_object(composed))


def whole_answerer(path: str, config: RootConfig, raw: bool, device: torch.device) -> Answerer:
    """One process: the whole model at `path` on `device`, in train.precision."""
    from llmtrain.checkpoint.offline import find_checkpoint, load_model_and_tokenizer

    exported = os.path.isfile(os.path.join(path, "config.json"))
    model, tokenizer = load_model_and_tokenizer(path)
    return whole_model_answerer(
        model_name(path if exported else find_checkpoint(path)), model, tokenizer, config, raw, device
    )


def whole_model_answerer(
    name: str, model: LayeredModel, tokenizer: Any, config: RootConfig, raw: bool, device: torch.device
) -> Answerer:
    """`model` (whole, on the CPU) answering under `name` on `device`, in train.precision, with `tokenizer`."""
    from llmtrain.data.chat_prompt import PromptFormat
    from llmtrain.parallel.precision import precision_policy, uses_bf16

    context, _ = precision_policy(device, uses_bf16(config.train.precision, device), fsdp_mixed_precision=False)
    model = model.to(device)
    cache_bytes = measured_cache_bytes(model, device, context)
    return Answerer(name, model, PromptFormat.of(tokenizer, raw), device, context, cache_bytes=cache_bytes)


def laid_out_answerer(path: str, config: RootConfig, raw: bool, runtime: Runtime) -> Answerer:
    """Under torchrun: this rank's part of the checkpoint's model, laid out by `config`."""
    from llmtrain.checkpoint.offline import find_checkpoint
    from llmtrain.data.chat_prompt import PromptFormat
    from llmtrain.parallel.parallel_model import unwrap
    from llmtrain.parallel_plan import check_samples
    from llmtrain.run.laid_out import laid_out_checkpoint

    if os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{path} is an exported directory: lay out a checkpoint, or chat with it in one process")
    checkpoint = find_checkpoint(path)
    model, tokenizer = laid_out_checkpoint(checkpoint, config, runtime)
    check_samples(model.plan)
    name, module = model_name(checkpoint), unwrap(model.module)
    cache_bytes = measured_cache_bytes(module, runtime.device, model.precision)
    return Answerer(
        name, module, PromptFormat.of(tokenizer, raw), runtime.device, model.precision, cache_bytes=cache_bytes
    )


def answerers(path: str, compare: str | None, raw: bool, config: RootConfig, runtime: Runtime) -> list[Answerer]:
    """The models to answer with: `path`'s, and with `compare` "" its base (adapters off), with a path that one's."""

    def load(where: str) -> Answerer:
        if runtime.distributed:
            return laid_out_answerer(where, config, raw, runtime)
        return whole_answerer(where, config, raw, runtime.device)

    first = load(path)
    if compare is None:
        return [first]
    if compare == "":
        if not first.has_adapters:
            raise ConfigError(
                f"--compare without a path compares adapters on and off, but {path} has no low-rank adapters: "
                f"give the model to compare with (--compare OTHER)"
            )
        return [first, replace(first, name=f"{first.name}:base", adapters=False)]
    other = load(compare)
    return [first, replace(other, name=f"{other.name}:2") if other.name == first.name else other]
