"""Low-rank adapters (LoRA; Hu et al., 2021): fine-tuning that trains a small update beside each frozen weight.

A target linear layer computes y = W x + b + (alpha / rank) · B A dropout(x), A of shape (rank, in) and B of shape
(out, rank). W and b are frozen; only A and B are trained, so gradients and optimizer state exist for
rank · (in + out) values per layer instead of in · out. B starts at zero (the adapted model starts as its base) and
A as nn.Linear's own initialisation, PEFT's choices. The adapted layer keeps nn.Linear's parameter names (`weight`,
`bias`) beside `lora_a` and `lora_b`, so the base model's checkpoints and Hugging Face files load into it unchanged
and the adapters are found by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmtrain.model.dropout import Dropout
from llmtrain.model.quantize import dequantized

# The adapters' parameter names in an adapted layer: A, then B.
ADAPTERS = ("lora_a", "lora_b")


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 0  # 0: no adapters, every parameter trains
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # the projections adapted, by attribute name (q_proj, fc_in, ...)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, projection: str) -> bool:
        return self.enabled and projection in self.targets


def adapter_kind(attribute: str) -> str | None:
    """Which factor a parameter's attribute name holds: `lora_a` (A), `lora_b` (B) or neither (None). A linear layer
    names its factors so; a mixture's experts prefix them with the projections they adapt (`in_lora_a`, moe.py)."""
    return next((kind for kind in ADAPTERS if attribute.endswith(kind)), None)


def is_adapter(name: str) -> bool:
    """Whether parameter `name` (a dotted model path) is a low-rank adapter."""
    return adapter_kind(name.rpartition(".")[2]) is not None


class LoRALinear(nn.Linear):
    """nn.Linear with a frozen weight and bias and a trainable low-rank update beside them (the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, lora: LoRAConfig):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_a = nn.Parameter(torch.empty(lora.rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, lora.rank))
        self.scale = lora.scale
        self.lora_dropout = Dropout(lora.dropout)
        self.adapting = True  # False: the base layer alone (adapters_disabled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapting:
            return super().forward(x)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)
        return super().forward(x) + update * self.scale

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / rank) · B A: the plain linear layer this one computes (without dropout; W dequantised where
        NF4 holds it)."""
        return dequantized(self.weight) + self.scale * (self.lora_b @ self.lora_a)


def linear(in_features: int, out_features: int, bias: bool, lora: LoRAConfig, projection: str) -> nn.Linear:
    """The model's linear layer `projection` (its attribute name): adapted when `lora` targets it."""
    if lora.adapts(projection):
        return LoRALinear(in_features, out_features, bias, lora)
    return nn.Linear(in_features, out_features, bias=bias)


def has_adapters(model: nn.Module) -> bool:
    """Whether any layer of `model` adapts its frozen base (a LoRALinear, a mixture's adapted experts)."""
    return any(getattr(module, "adapting", None) is True for module in model.modules())


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """`model` computes as its frozen base inside: every adapted layer (a LoRALinear, a mixture's adapted experts)
    without its update (preference tuning's reference model, with no second copy of the weights)."""
    layers = [module for module in model.modules() if getattr(module, "adapting", None) is True]
    for layer in layers:
        setattr(layer, "adapting", False)  # noqa: B010 (a flag of several module classes)
    try:
        yield
    finally:
        for layer in layers:
            setattr(layer, "adapting", True)  # noqa: B010


def freeze_base(model: nn.Module) -> None:
    """Train the adapters alone: every other parameter of `model` is frozen (no gradient, no optimizer state)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


@torch.no_grad()
def init_adapter(kind: str, full: torch.Tensor, generator: torch.Generator) -> None:
    """An adapter's initial value: A as nn.Linear initialises a weight (uniform within 1/sqrt(in)), B zero."""
    if kind == "lora_b":
        full.zero_()
    else:
        bound = 1 / math.sqrt(full.shape[1])
        full.uniform_(-bound, bound, generator=generator)
