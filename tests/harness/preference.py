"""Preference tuning's tests' shared pieces: a short run on the test pairs, and the referee's log-probabilities."""

from __future__ import annotations

from pathlib import Path

import torch

from llmtrain.model.scoring import UNSCORED


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
