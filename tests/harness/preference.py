"""Preference tuning's tests' shared pieces: a short run on the test pairs, and a referee that computes a step's
log-likelihood ratios from the definition."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from llmtrain.model.scoring import UNSCORED
from llmtrain.train.loop import Components
from llmtrain.train.objectives import PreparedStep


def preference_run(tokenizer: Path, pairs_file: Path) -> list[str]:
    """Overrides of a short LoRA run on `pairs_file`'s pairs (harness.corpora.write_preference_data)."""
    return [
        "data=preference", f"data.path={pairs_file}", "data.tokenizer.kind=hf", f"data.tokenizer.name={tokenizer}",
        "data.val_fraction=0.1", "model=llama-tiny", "model.n_layer=2", "model.lora.rank=4", "train.seq_len=64",
        "train.batch_size=8", "train.micro_batch_size=2", "train.device=cpu", "logging.wandb.mode=disabled",
    ]  # fmt: skip


def answer_log_probabilities(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its scored targets, from the logits' log-softmax: the referee's own sums."""
    log_probs = torch.log_softmax(model(inputs).float(), dim=-1)
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != UNSCORED)).sum(dim=1)


@dataclass(frozen=True)
class RefereedStep:
    """One training step of a preference objective beside its referee: what the objective prepared (its gradients
    taken on the model), and from copies of the model taken before it, each row's log-likelihood ratio log π - log
    π_ref as (pairs, chosen and rejected), differentiable through the referee's adapters."""

    prepared: PreparedStep
    log_ratios: torch.Tensor
    referee: torch.nn.Module


def refereed_step(parts: Components) -> RefereedStep:
    """The adapters moved off zero (so the policy differs from its reference), then one step of `parts`'s objective
    on the next batch, and the referee's log-likelihood ratios of the same rows (the policy a copy of the model,
    the reference another with its adapters zeroed)."""
    module = parts.model.module
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    rows = parts.data.train.next()
    micro_batches = parts.train_slice.micro_batches(rows)
    referee, reference = copy.deepcopy(module), copy.deepcopy(module)
    prepared = parts.objective.prepared(rows)
    parts.model.forward_backward(prepared.micro_batches)
    inputs, targets = (torch.cat(part) for part in zip(*micro_batches))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("lora_b"):
                param.zero_()
        reference_lp = answer_log_probabilities(reference, inputs, targets)
    log_ratios = (answer_log_probabilities(referee, inputs, targets) - reference_lp).view(-1, 2)
    return RefereedStep(prepared, log_ratios, referee)


def assert_adapter_gradients_match(model: torch.nn.Module, referee: torch.nn.Module) -> None:
    """Every adapter's gradient on `model` is the referee's (its loss's backward taken), and only adapters have one:
    fp32 sums in other orders, within 1e-4 of each tensor's largest element."""
    ours = dict(model.named_parameters())
    compared = [name for name, param in referee.named_parameters() if param.grad is not None]
    assert compared == [name for name, _ in referee.named_parameters() if name.rpartition(".")[2].startswith("lora")]
    for name, param in referee.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(ours[name].grad, param.grad, rtol=0, atol=1e-4 * param.grad.abs().max().item())
