"""GRPO on the objective seam (train.objective=grpo, data=rl): each step samples `rl.group_size` completions of each
of its prompts on the laid-out policy (parallel/sampling.py), scores them with data.reward, and trains the loss of
train/grpo.py on them.

A step, on each rank over its own completion slots (data/rl.py's PromptBatch):
1. the rollout (the first of every rl.iterations steps): the completions, drawn by the KV-cached sampler with the
   run's seed and each prompt's draw number (so every layout draws what one process draws); their rewards, text
   decoded without the stop token, TRL's calling convention; each group's advantages; the completion tokens'
   log-probabilities under the policy that drew them (π_old) and, with rl.beta, under the reference (the base,
   adapters off) — forward passes without gradients over whole rows, prompt then completion;
2. the policy's log-probabilities now: π_old's own on the rollout's first step (nothing has moved), a forward pass
   without gradients on the others;
3. the training rows: the completion tokens as targets, each weighted by -∂loss/∂log π(token) (grpo.loss_and_weights)
   and its logits divided by rl.temperature (scoring.weighted_targets), so that every layout's weighted
   cross-entropy has GRPO's gradient.
The loss recorded is GRPO's; beside it TRL's metrics. Where every group's completions got the same reward the
advantages are 0, and so is the gradient (but for the KL term): the step says so once, and the loss reads ~0, which
is normal: GRPO's loss is not a measure of progress (the reward is).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from llmtrain.config import RootConfig
from llmtrain.data import Data, RankSlice, SourceBatch
from llmtrain.data.rewards import Rewards
from llmtrain.data.rl import PromptBatch
from llmtrain.errors import ConfigError
from llmtrain.model.lora import adapters_disabled
from llmtrain.model.sampling import Completions, SamplingSettings
from llmtrain.model.scoring import UNSCORED, token_log_probs, weighted_targets
from llmtrain.parallel.mesh import sum_over
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel.sampling import sample_completions
from llmtrain.parallel.tensors import MicroBatches
from llmtrain.parallel_plan import check_samples
from llmtrain.train.grpo import GlobalBatch, GRPOSettings, TokenTerms, advantages, group_spread, loss_and_weights
from llmtrain.train.objectives import Objective, PreparedStep

log = logging.getLogger("llmtrain")

ZERO_STD = 1e-6  # a group whose rewards' standard deviation is below this taught nothing (TRL's isclose to 0)


@dataclass(frozen=True)
class Rollout:
    """One batch of prompts' completions, as its steps train on them: the training rows (prompt then completion,
    the completion's tokens the scored targets), the scored positions, each completion's advantage, the log-
    probabilities of the policy that drew them (`old`) and of the reference (None without rl.beta), the draws it
    belongs to, and its metrics' numerators and denominators (summed over the data-parallel ranks)."""

    draws: tuple[int, ...]
    rows: torch.Tensor
    scored: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor
    entropies: torch.Tensor
    reference: torch.Tensor | None
    batch: GlobalBatch
    # the rollout's own metrics (rewards, lengths) by name: (numerator, denominator) summed over the ranks
    sampled: dict[str, torch.Tensor]


class GroupRelative(Objective):
    """GRPO over data=rl's prompts, as config.rl says."""

    def __init__(
        self, model: ParallelModel, data: Data, train_slice: RankSlice, val_slice: RankSlice, config: RootConfig
    ):
        check_samples(model.plan)
        _check_whole_groups(model, config)
        rl, t = config.rl, config.train
        self.model, self.data = model, data
        self._seed, self._seq_len = config.seed, t.seq_len
        self.group, self.scale, self.temperature = rl.group_size, rl.scale_rewards, rl.temperature
        self.settings = GRPOSettings(
            rl.loss, rl.beta, rl.epsilon, rl.epsilon if rl.epsilon_high is None else rl.epsilon_high, rl.max_new_tokens
        )
        # the stop tokens are the prompt set's (the tokenizer's end of text, a chat template's end of turn)
        self.sampling = SamplingSettings(rl.max_new_tokens, rl.temperature, rl.top_k, rl.top_p)
        self.rewards = Rewards.of(config.data)
        # rl.gather_weights=auto is decided by the planner before the job is built (planner/resolve.py)
        self.gather_once = rl.gather_weights == "once"
        self.current: Rollout | None = None  # the rollout the last step trained on
        self._rollout_seconds = 0.0  # the last step's sampling (0 where it reused a rollout)
        self._told_zero_std = False

    # -- the rollout ---------------------------------------------------------------------------------------------
    def rollout(self, slots: PromptBatch, group: int) -> Rollout:
        """Collective: the completions of this rank's slots (`group` consecutive ones a prompt), rewarded and
        scored (the module docstring's step 1)."""
        device = self.model.runtime.device
        drawn = self._sampled_completions(slots.every(group), group)
        rewards, each = self._rewarded(slots, drawn)
        rows, scored = self._rows(slots.tokens, drawn)
        old, entropies = self._log_probs(rows, scored)
        reference = None
        if self.settings.beta:
            with adapters_disabled(self.model.module):
                reference, _ = self._log_probs(rows, scored)
        counts = torch.stack([torch.tensor(float(len(rewards)), device=device), scored.sum().double()])
        totals = sum_over(counts, self.model.mesh.dp_mesh)
        batch = GlobalBatch(completions=int(totals[0].item()), tokens=int(totals[1].item()))
        return Rollout(
            tuple(slots.draws),
            rows,
            scored,
            advantages(rewards, group, self.scale),
            old,
            entropies,
            reference,
            batch,
            self._sampled(rewards, each, drawn, group),
        )

    def _sampled_completions(self, prompts: PromptBatch, group: int) -> Completions:
        """Collective: `group` completions of each of `prompts`, stopping at their prompt set's stop tokens."""
        settings = dataclasses.replace(self.sampling, stop_ids=prompts.prompts.stop_ids)
        return sample_completions(
            self.model, prompts.tokens, prompts.draws, group, settings, self._seed, self.gather_once
        )

    def _rewarded(self, slots: PromptBatch, drawn: Completions) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows,) each completion's reward, NaN where no function scored it; (functions, rows) each one's score."""
        stops = set(slots.prompts.stop_ids)
        texts = []
        for tokens in drawn.rows():
            ended = tokens[:-1] if tokens and tokens[-1] in stops else tokens
            texts.append(self.data.tokenizer.decode(ended))
        given = slots.given
        completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}] for p, t in zip(given, texts)]
        totals, each = self.rewards.scored(given, completions, slots.columns)
        device = self.model.runtime.device
        return (
            torch.tensor(totals, dtype=torch.float64, device=device),
            torch.tensor(each, dtype=torch.float64, device=device).reshape(len(each), len(totals)),
        )

    def _rows(self, prompts: list[list[int]], drawn: Completions) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, seq_len + 1) each prompt then its completion, zeros after; (rows, seq_len) whether a position's
        target is a completion token."""
        rows = torch.zeros(len(prompts), self._seq_len + 1, dtype=torch.long)
        scored = torch.zeros(len(prompts), self._seq_len, dtype=torch.bool)
        for row, (prompt, completion) in enumerate(zip(prompts, drawn.rows())):
            rows[row, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
            scored[row, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = True
        device = self.model.runtime.device
        return rows.to(device), scored.to(device)

    def _micro_batches(self, rows: torch.Tensor, targets: torch.Tensor) -> MicroBatches:
        size = self.model.plan.micro_batching()[0]
        return list(zip(rows[:, :-1].split(size), targets.split(size)))

    def _log_probs(self, rows: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Collective: (rows, seq_len) each completion token's log-probability under the model now (its logits
        divided by rl.temperature), and the entropy there; 0 elsewhere."""
        targets = torch.where(scored, rows[:, 1:], UNSCORED)
        statistic = token_log_probs(self._seq_len, self.temperature)
        values = self.model.row_sums(self._micro_batches(rows, targets), statistic).to(rows.device)
        return values[:, : self._seq_len], values[:, self._seq_len :]

    def _sampled(
        self, rewards: torch.Tensor, each: torch.Tensor, drawn: Completions, group: int
    ) -> dict[str, torch.Tensor]:
        """The rollout's metrics (reward ... completions/clipped_ratio), each as (numerator, denominator) summed
        over the data-parallel ranks."""
        _, _, deviation = group_spread(rewards, group)
        spread = deviation.flatten()
        rows = torch.tensor(float(len(rewards)), dtype=torch.float64, device=rewards.device)
        groups = torch.tensor(float(len(spread)), dtype=torch.float64, device=rewards.device)
        pairs = {
            "reward": (rewards.nan_to_num(0.0).sum(), (~rewards.isnan()).sum().double()),
            "reward_std": (spread.sum(), groups),
            **{
                f"rewards/{name}/mean": (scores.nan_to_num(0.0).sum(), (~scores.isnan()).sum().double())
                for name, scores in zip(self.rewards.names, each)
            },
            "frac_reward_zero_std": ((spread < ZERO_STD).sum().double(), groups),
            "completions/mean_length": (drawn.lengths.double().sum().to(rewards.device), rows),
            "completions/clipped_ratio": ((~drawn.stopped).sum().double().to(rewards.device), rows),
        }
        return _summed_pairs(pairs, self.model)

    # -- a step ----------------------------------------------------------------------------------------------------
    def prepared(self, batch: SourceBatch) -> PreparedStep:
        """Collective: the rollout of this rank's completion slots (sampled on the first of its steps), the
        training rows weighted with GRPO's gradient, its loss and metrics."""
        assert isinstance(batch, PromptBatch), "the config's check feeds grpo data=rl's prompts"
        slots = batch
        fresh = self.current is None or self.current.draws != tuple(slots.draws)
        self._rollout_seconds = 0.0
        if fresh:
            self.current = None  # its memory is free before the next one's
            started = time.perf_counter()
            self.current = self.rollout(slots, self.group)
            self._rollout_seconds = time.perf_counter() - started  # its host reads waited for the device
        rollout = self.current
        assert rollout is not None
        if fresh:  # the policy has not moved since it drew them
            log_probs, entropies = rollout.old, rollout.entropies
        else:
            log_probs, entropies = self._log_probs(rollout.rows, rollout.scored)
        loss, weights = loss_and_weights(
            log_probs, rollout.old, rollout.reference, rollout.advantages, rollout.scored, self.settings, rollout.batch
        )
        targets = torch.where(rollout.scored, rollout.rows[:, 1:], 0)
        weighted = weighted_targets(targets, weights, self.temperature)
        trained = self._micro_batches(rollout.rows, weighted)
        fractions = {**rollout.sampled, **_summed_pairs(self._stepped(log_probs, entropies, rollout), self.model)}
        metrics = {name: pair[0] / pair[1].clamp(min=1) for name, pair in fractions.items()}
        return PreparedStep(trained, sum_over(loss, self.model.mesh.dp_mesh), metrics)

    def _stepped(
        self, log_probs: torch.Tensor, entropies: torch.Tensor, rollout: Rollout
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This step's metrics (entropy, the clip ratios, kl) over this rank's completion tokens, as (numerator,
        denominator)."""
        mask = rollout.scored.double()
        tokens = mask.sum()
        terms = TokenTerms.of(log_probs, rollout.old, rollout.reference, rollout.advantages, self.settings)
        low, high = terms.clipped_low.double() * mask, terms.clipped_high.double() * mask
        pairs = {
            "entropy": ((entropies * mask).sum(), tokens),
            "clip_ratio/low_mean": (low.sum(), tokens),
            "clip_ratio/high_mean": (high.sum(), tokens),
            "clip_ratio/region_mean": ((low + high).sum(), tokens),
        }
        if terms.kl is not None:
            pairs["kl"] = ((terms.kl * mask).sum(), tokens)
        return pairs

    def recorded(self, metrics: dict[str, float]) -> dict[str, Any]:
        record = {**metrics, "rollout_seconds": self._rollout_seconds}
        if record["frac_reward_zero_std"] == 1 and not self._told_zero_std and self.model.runtime.is_main:
            self._told_zero_std = True
            log.warning(
                "every group's completions got the same reward this step, so every advantage is 0 and so is the "
                "gradient (but for rl.beta's KL term): the loss reads ~0, which is normal. If it persists, the task "
                "is too hard or too easy for the model: raise rl.group_size or rl.temperature, or change the data"
            )
        return record

    def console(self, record: dict[str, Any]) -> list[str]:
        parts = [f"reward {record['reward']:.3f} len {record['completions/mean_length']:.0f}"]
        if "val_reward" in record:
            parts.append(f"val reward {record['val_reward']:.3f}")
        return parts

    def validation(self) -> dict[str, float]:
        """Collective: one completion of each held-out prompt, sampled as in training: `val_reward` (the mean reward
        of those a reward scored) and `val_completions/mean_length`."""
        (held_out,) = self.data.validation
        slots = held_out.rows
        assert isinstance(slots, PromptBatch), "data=rl holds out prompts"
        drawn = self._sampled_completions(slots, 1)
        rewards, _ = self._rewarded(slots, drawn)
        device = self.model.runtime.device
        sums = torch.stack(
            [
                rewards.nan_to_num(0.0).sum(),
                (~rewards.isnan()).sum().double(),
                drawn.lengths.double().sum().to(device),
                torch.tensor(float(len(rewards)), dtype=torch.float64, device=device),
            ]
        )
        reward, rewarded, length, count = sum_over(sums, self.model.mesh.dp_mesh).tolist()
        return {"val_reward": reward / max(rewarded, 1), "val_completions/mean_length": length / max(count, 1)}


def _check_whole_groups(model: ParallelModel, config: RootConfig) -> None:
    """A ConfigError where a data-parallel rank's share of the batch is not whole groups (each group is sampled from
    one prefill on one rank)."""
    batch_size, group, dp = config.train.batch_size, config.rl.group_size, model.plan.dp_size
    per_rank = batch_size // dp
    if per_rank % group:
        raise ConfigError(
            f"train.batch_size={batch_size} over {dp} data-parallel ranks gives each {per_rank} completions, not "
            f"whole groups of rl.group_size={group} (a group is sampled from one prefill on one rank): set "
            f"train.batch_size to a multiple of {dp * group}"
        )


def _summed_pairs(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], model: ParallelModel) -> dict[str, torch.Tensor]:
    """Each metric's (numerator, denominator) summed over the data-parallel ranks, in one all-reduce."""
    summed = sum_over(torch.stack([torch.stack(pair) for pair in pairs.values()]), model.mesh.dp_mesh)
    return dict(zip(pairs, summed))
