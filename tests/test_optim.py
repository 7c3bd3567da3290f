"""Optimizer groups, the warmup + cosine schedule, and the precision policy."""

import contextlib

import pytest
import torch
from omegaconf import OmegaConf

from llmtrain.model import GPT, GPTConfig
from llmtrain.optim import build_adamw, build_schedule, lr_factor
from llmtrain.parallel.precision import precision_policy

OPTIM = OmegaConf.create(
    dict(lr=1e-3, min_lr_ratio=0.1, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, warmup_steps=10)
)


def test_warmup_then_cosine_to_the_floor():
    factors = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert factors[-1] == pytest.approx(0.1)
    assert factors[10 + 89 // 2] == pytest.approx(0.55, abs=0.02)  # halfway through the decay


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(2, 2)
    optimizer = build_adamw(model, OPTIM)
    schedule = build_schedule(optimizer, 100, OPTIM)
    seen = []
    for _ in range(100):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen[0] == pytest.approx(1e-4) and max(seen) == pytest.approx(1e-3) and seen[-1] == pytest.approx(1e-4)


def test_decay_only_on_matrices():
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=2, d_model=8, max_seq_len=8))
    decay, no_decay = build_adamw(model, OPTIM).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_one_precision_policy_fsdp_casts_where_it_applies_autocast_elsewhere():
    """bf16 under FSDP: its mixed precision alone (no autocast on top); bf16 elsewhere: autocast; fp32: neither."""
    cuda = torch.device("cuda", 0)
    context, described = precision_policy(cuda, bf16=True, fsdp_mixed_precision=True)
    assert context is contextlib.nullcontext and described.startswith("bf16 (FSDP mixed precision")
    context, described = precision_policy(torch.device("cpu"), bf16=True, fsdp_mixed_precision=False)
    assert isinstance(context(), torch.autocast) and described.startswith("bf16 autocast")
    assert precision_policy(torch.device("cpu"), bf16=False, fsdp_mixed_precision=True) == (
        contextlib.nullcontext,
        "fp32",
    )
