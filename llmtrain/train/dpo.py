"""Direct Preference Optimization (Rafailov et al., 2023) on data=preference's pairs (data/preference.py).

For a prompt x with a chosen answer w and a rejected one l, the policy π (the model with its adapters) and the
reference π_ref (the same model with its adapters switched off: the frozen base, no second copy):
    z = β [(log π(w|x) - log π_ref(w|x)) - (log π(l|x) - log π_ref(l|x))],   loss = -log σ(z),
averaged over the global batch's pairs, where log π(y|x) sums the answer's token log-probabilities (its prompt is
context). β(log π - log π_ref) is an answer's reward; the step logs the chosen and rejected rewards, their margin
and how often the chosen is rewarded above the rejected (TRL's rewards/chosen, rewards/rejected, rewards/margins,
rewards/accuracies), averaged over the pairs.

Every layout trains it as it trains the cross-entropy. The loss is not a sum over tokens (σ couples a pair's two
whole answers), but its gradient is: -∇log σ(z) = -σ(-z) ∇z, with ∇z = β (∇log π(w|x) - ∇log π(l|x)) a sum over the
answers' tokens. So a step first computes each row's log π and log π_ref without gradients (ParallelModel.row_sums:
whole rows, however the layout splits them), then trains on the token cross-entropy weighted by +β σ(-z) / P on
the chosen answer's tokens and -β σ(-z) / P on the rejected one's (P: the global batch's pairs), a weighted sum over
tokens (scoring.WEIGHTED_TARGETS) that every layout splits as it splits the plain loss and whose gradient is DPO's.
Any loss of the reward margin z trains the same way, its weights -β ℓ'(z) / P: a pairwise objective of another
loss (IPO's, say: docs/extending.md) overrides `pair_losses` alone.
It costs a third forward pass a step (reference, policy, policy with gradients) where one process could do with
two. With dropout the policy's two passes draw different masks: the gradient is then DPO's in expectation only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmtrain.config import RootConfig
from llmtrain.data import Data, RankSlice, SourceBatch
from llmtrain.errors import ConfigError
from llmtrain.model.lora import adapters_disabled
from llmtrain.model.scoring import SUMMED_LOSSES, weighted_targets
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel.tensors import MicroBatches
from llmtrain.train.objectives import Objective, PreparedStep, token_rows

# What a step records beside its loss, in the order `statistics` stacks them.
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


class DirectPreference(Objective):
    """DPO over the model's pairs of rows (chosen, rejected), β = data.beta."""

    def __init__(
        self, model: ParallelModel, data: Data, train_slice: RankSlice, val_slice: RankSlice, config: RootConfig
    ):
        rows, _ = model.plan.micro_batching()
        if rows % 2:
            raise ConfigError(
                f"parallel.microbatches={model.plan.parallel.microbatches} cuts a rank's pairs into micro-batches of "
                f"{rows} rows, parting a chosen answer from its rejected one: set parallel.microbatches so that "
                f"each holds an even number of rows"
            )
        self.model, self.beta = model, config.data.beta
        self._train_slice, self._held_out, self._val_slice = train_slice, data.validation, val_slice

    def pair_losses(self, margins: torch.Tensor) -> torch.Tensor:
        """Each pair's loss of its reward margin z = r(chosen) - r(rejected): DPO's -log σ(z)."""
        return -F.logsigmoid(margins)

    @torch.no_grad()
    def rewards(self, micro_batches: MicroBatches) -> torch.Tensor:
        """(this rank's pairs, 2): the chosen and rejected answers' rewards β (log π - log π_ref), in fp64."""
        device = self.model.runtime.device
        with adapters_disabled(self.model.module):  # each row's summed loss: -log π_ref(answer | prompt)
            reference_nll = self.model.row_sums(micro_batches, SUMMED_LOSSES)[:, 0].to(device)
        policy_nll = self.model.row_sums(micro_batches, SUMMED_LOSSES)[:, 0].to(device)
        return (self.beta * (reference_nll - policy_nll)).view(-1, 2)

    def statistics(self, rewards: torch.Tensor) -> torch.Tensor:
        """Collective: the loss, then REWARDS, each a mean over the global batch's pairs."""
        margins = rewards[:, 0] - rewards[:, 1]
        mine = torch.stack(
            [
                self.pair_losses(margins).mean(),
                rewards[:, 0].mean(),
                rewards[:, 1].mean(),
                margins.mean(),
                (margins > 0).double().mean(),
            ]
        )
        return self.model.reduce_mean(mine)  # every data-parallel rank holds as many pairs

    def prepared(self, batch: SourceBatch) -> PreparedStep:
        """Collective: this rank's pairs' micro-batches with each row's targets weighted so that the training loss's
        gradient is the pair loss's (the module docstring); the loss and REWARDS recorded."""
        micro_batches = self._train_slice.micro_batches(token_rows(batch), self.model.runtime.device)
        rewards = self.rewards(micro_batches)
        margins = (rewards[:, 0] - rewards[:, 1]).requires_grad_()
        with torch.enable_grad():
            (slope,) = torch.autograd.grad(self.pair_losses(margins).sum(), margins)
        pairs = len(rewards) * self.model.plan.dp_size
        pull = -self.beta * slope / pairs
        row_weights = torch.stack([pull, -pull], dim=1).flatten().split([len(t) for _, t in micro_batches])
        weighted = [
            (inputs, weighted_targets(targets, weights.to(targets.device)))
            for (inputs, targets), weights in zip(micro_batches, row_weights)
        ]
        statistics = self.statistics(rewards)
        return PreparedStep(weighted, statistics[0], dict(zip(REWARDS, statistics[1:])))

    def console(self, record: dict[str, Any]) -> list[str]:
        return [f"margin {record['rewards/margins']:.3f} acc {record['rewards/accuracies']:.2f}"]

    def validation(self) -> dict[str, float]:
        """Collective: the held-out pairs' loss and rewards (`val_loss`, `val_rewards/...`)."""
        (held_out,) = self._held_out
        micro_batches = self._val_slice.micro_batches(token_rows(held_out.rows), self.model.runtime.device)
        values = self.statistics(self.rewards(micro_batches)).tolist()
        return {"val_loss": values[0], **{f"val_{name}": value for name, value in zip(REWARDS, values[1:])}}
