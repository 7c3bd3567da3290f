"""Group Relative Policy Optimization's loss (Shao et al. 2024, DeepSeekMath), as TRL's GRPOTrainer defines it and
its variants (Dr. GRPO, Liu et al. 2025; DAPO, Yu et al. 2025), over completions of known per-token log-
probabilities. Each prompt's `group` completions are scored; a completion's advantage is its reward less its group's
mean, over the group's standard deviation plus 1e-4 (`scale_rewards`; Dr. GRPO: not scaled). At each completion
token, with the ratio ρ = π(token) / π_old(token) of the policy to the one that sampled it:

    loss_t = -min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A) + β (π_ref/π - log(π_ref/π) - 1)    (k3, Schulman 2020)

reduced over the global batch as `loss` says: `grpo` each completion's mean over its tokens, then the mean over the
completions; `dr_grpo` the sum over every token divided by (completions x max_new_tokens); `dapo` the sum over every
token divided by the tokens. Its gradient is a weighted sum of the tokens' log-probability gradients, the weights
known from the log-probabilities alone: so a step trains it as the weighted cross-entropy over the completion tokens
(model/scoring.py's weighted targets) that every layout trains, each token's weight -∂loss/∂log π(token)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# rl.loss's reductions (llmtrain/catalog/objectives.py describes each)
LOSSES = ("grpo", "dr_grpo", "dapo")
SCALE_EPSILON = 1e-4  # added to a group's standard deviation (TRL's)


@dataclass(frozen=True)
class GRPOSettings:
    loss: str = "dapo"
    beta: float = 0.0  # the KL term's weight; 0: no reference
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    max_new_tokens: int = 256  # dr_grpo's normaliser


@dataclass(frozen=True)
class GlobalBatch:
    """What the loss is normalised by over every rank's completions: their number and their tokens."""

    completions: int
    tokens: int


def group_spread(rewards: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over each prompt's `group` consecutive completions, those a reward scored (NaN: none did, left out as TRL
    leaves them): (groups, group) whether each was scored, and (groups, 1) the mean and the unbiased standard
    deviation of the scored ones (0 where fewer than two were)."""
    grouped = rewards.view(-1, group)
    scored = ~grouped.isnan()
    count = scored.sum(dim=1, keepdim=True)
    mean = grouped.nan_to_num(0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    squares = torch.where(scored, grouped - mean, 0.0).square().sum(dim=1, keepdim=True)
    return scored, mean, (squares / (count - 1).clamp(min=1)).sqrt()


def advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """(rows,): each completion's reward less its group's mean (the `group` consecutive rows of one prompt), over
    the group's standard deviation (unbiased, as TRL's) plus SCALE_EPSILON where `scale`; 0 for a completion no
    reward scored (NaN), which is left out of its group's mean and deviation."""
    scored, mean, deviation = group_spread(rewards, group)
    centred = torch.where(scored, rewards.view(-1, group) - mean, 0.0)
    if scale:
        centred = centred / (deviation + SCALE_EPSILON)
    return centred.flatten()


@dataclass(frozen=True)
class TokenTerms:
    """Each completion token's terms (rows, positions): the ratio ρ = π / π_old, where the clip holds ρ (below 1 - ε
    where A < 0, above 1 + ε_high where A > 0: there min() takes the clipped term, constant in π), and the k3 KL to
    the reference, π_ref/π - log(π_ref/π) - 1 (None without one). The loss, its weights and the step's metrics
    (clip ratios, kl) all read these."""

    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    kl: torch.Tensor | None

    @classmethod
    def of(
        cls,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        reference_log_probs: torch.Tensor | None,
        advantage: torch.Tensor,
        settings: GRPOSettings,
    ) -> TokenTerms:
        """Differentiable in `log_probs` (ratio and kl)."""
        ratio = torch.exp(log_probs - old_log_probs)
        a = advantage[:, None]
        kl = None
        if settings.beta and reference_log_probs is not None:
            gap = reference_log_probs - log_probs
            kl = torch.exp(gap) - gap - 1
        return cls(ratio, (a < 0) & (ratio < 1 - settings.epsilon), (a > 0) & (ratio > 1 + settings.epsilon_high), kl)


def token_losses(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    reference_log_probs: torch.Tensor | None,
    advantage: torch.Tensor,
    settings: GRPOSettings,
) -> torch.Tensor:
    """(rows, positions): each completion token's loss_t (the module docstring); differentiable in `log_probs`."""
    terms = TokenTerms.of(log_probs, old_log_probs, reference_log_probs, advantage, settings)
    return _losses(terms, advantage, settings)


def _losses(terms: TokenTerms, advantage: torch.Tensor, settings: GRPOSettings) -> torch.Tensor:
    clipped = terms.ratio.clamp(1 - settings.epsilon, 1 + settings.epsilon_high)
    losses = -torch.minimum(terms.ratio * advantage[:, None], clipped * advantage[:, None])
    return losses if terms.kl is None else losses + settings.beta * terms.kl


def token_shares(mask: torch.Tensor, settings: GRPOSettings, batch: GlobalBatch) -> torch.Tensor:
    """(rows, positions): what each of this rank's completion tokens (`mask`) counts for in the global batch's loss,
    by `settings.loss`'s reduction (in the mask's dtype; a boolean one's as float32)."""
    mask = mask if mask.is_floating_point() else mask.float()
    if settings.loss == "grpo":
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / batch.completions
    if settings.loss == "dr_grpo":
        return mask / (batch.completions * settings.max_new_tokens)
    if settings.loss == "dapo":
        return mask / max(batch.tokens, 1)
    raise ValueError(f"rl.loss={settings.loss!r}: one of {', '.join(LOSSES)}")


def loss_and_weights(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    reference_log_probs: torch.Tensor | None,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    settings: GRPOSettings,
    batch: GlobalBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the loss, and each token's weight in the cross-entropy whose gradient is the loss's:
    -∂loss/∂log π(token) = share x (A ρ where the clip does not hold ρ, 0 where it does, - β (1 - π_ref/π)), from
    the log-probabilities alone (no graph is kept). The clip holds ρ above 1 + ε_high where A > 0 and below 1 - ε
    where A < 0: there min() takes the clipped term, constant in π."""
    shares = token_shares(mask, settings, batch)
    terms = TokenTerms.of(log_probs.detach(), old_log_probs, reference_log_probs, advantage, settings)
    held = terms.clipped_low | terms.clipped_high
    slope = torch.where(held, torch.zeros_like(terms.ratio), advantage[:, None] * terms.ratio)
    if terms.kl is not None and reference_log_probs is not None:
        slope = slope - settings.beta * (1 - torch.exp(reference_log_probs - log_probs.detach()))
    return (_losses(terms, advantage, settings) * shares).sum(), shares * slope
