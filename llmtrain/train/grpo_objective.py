"""GRPO on the objective seam (train.objective=grpo, data=rl): each step samples `rl.group_size` completions of each
of its prompts on the laid-out policy (parallel/sampling.py), scores them with data.reward, and trains the loss of
train/grpo.py on them.

A step, on each rank over its own rows (data/rl.py's completion slots):
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

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmtrain.config import RootConfig
from llmtrain.data import Data, RankSlice
from llmtrain.data.rewards import reward_function, scored
from llmtrain.data.rl import PromptSet, SlotRows
from llmtrain.errors import ConfigError
from llmtrain.model.lora import adapters_disabled
from llmtrain.model.sampling import Completions, SamplingSettings
from llmtrain.model.scoring import UNSCORED, token_log_probs, weighted_targets
from llmtrain.parallel.mesh import sum_over
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel.sampling import check_samples, sample_completions
from llmtrain.parallel.tensors import MicroBatches
from llmtrain.planner.resolve import predicted
from llmtrain.train.grpo import GlobalBatch, GRPOSettings, advantages, loss_and_weights
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
    sampled: torch.Tensor  # (metrics, 2): the rollout's own metrics (rewards, lengths) as numerator, denominator


class GroupRelative(Objective):
    """GRPO over data=rl's prompts, as config.rl says."""

    def __init__(self, model: ParallelModel, data: Data, val_slice: RankSlice, config: RootConfig):
        check_samples(model.plan)
        rl, t = config.rl, config.train
        per_rank = t.batch_size // model.plan.dp_size
        if per_rank % rl.group_size:
            whole = model.plan.dp_size * rl.group_size
            raise ConfigError(
                f"train.batch_size={t.batch_size} over {model.plan.dp_size} data-parallel ranks gives each "
                f"{per_rank} completions, not whole groups of rl.group_size={rl.group_size} (a group is sampled "
                f"from one prefill on one rank): set train.batch_size to a multiple of {whole}"
            )
        assert data.rollout is not None, "the config's check gives grpo data=rl's prompts"
        self.model, self.data, self._prompts = model, data, data.rollout
        self._seed, self._seq_len = config.seed, t.seq_len
        self.group, self.scale, self.temperature = rl.group_size, rl.scale_rewards, rl.temperature
        self.settings = GRPOSettings(
            rl.loss, rl.beta, rl.epsilon, rl.epsilon if rl.epsilon_high is None else rl.epsilon_high, rl.max_new_tokens
        )
        self.sampling = SamplingSettings(
            rl.max_new_tokens, rl.temperature, rl.top_k, rl.top_p, self._prompts.train.stop_ids
        )
        names = list(config.data.reward or [])
        self.rewards = [reward_function(name, config.data.reward_pattern) for name in names]
        self.weights = list(config.data.reward_weights or [1.0] * len(names))
        # TRL logs a function's rewards under its name
        self.reward_names = [name.partition(":")[2] or name for name in names]
        self.metrics = (
            "reward",
            "reward_std",
            *(f"rewards/{name}/mean" for name in self.reward_names),
            "frac_reward_zero_std",
            "completions/mean_length",
            "completions/clipped_ratio",
            "entropy",
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
            "clip_ratio/region_mean",
            *(("kl",) if self.settings.beta else ()),
        )
        self.gather_once = self._gathers_once(config)
        self.current: Rollout | None = None  # the rollout the last step trained on
        self._rollout_seconds = 0.0  # the last step's sampling (0 where it reused a rollout)
        self._told_zero_std = False

    def _gathers_once(self, config: RootConfig) -> bool:
        """Collective: whether a rollout gathers FSDP's weights once (rl.gather_weights; `auto`: rank 0's planner
        says whether the whole model fits beside the cache), not for every decoded token."""
        if config.rl.gather_weights != "auto":
            return config.rl.gather_weights == "once"
        runtime = self.model.runtime
        mine = None
        if runtime.is_main:
            mine = bool(predicted(config, runtime, self.data.tokenizer.vocab_size).get("gathers_once", False))
        return bool(runtime.from_main(mine))

    # -- the rollout ---------------------------------------------------------------------------------------------
    def rollout(self, slots: SlotRows, prompts: PromptSet, group: int) -> Rollout:
        """Collective: the completions of this rank's slots (`group` consecutive ones a prompt), rewarded and
        scored (the module docstring's step 1)."""
        device = self.model.runtime.device
        first = slice(None, None, group)
        drawn = sample_completions(
            self.model, slots.prompts[first], slots.draws[first], group, self.sampling, self._seed, self.gather_once
        )
        rewards, each = self._rewarded(slots, prompts, drawn)
        rows, scored = self._rows(slots.prompts, drawn)
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
            advantages(rewards.nan_to_num(0.0), group, self.scale),
            old,
            entropies,
            reference,
            batch,
            self._sampled(rewards, each, drawn, group),
        )

    def _rewarded(self, slots: SlotRows, prompts: PromptSet, drawn: Completions) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows,) each completion's reward, NaN where no function scored it; (functions, rows) each one's score."""
        stops = set(self.sampling.stop_ids)
        texts = []
        for tokens in drawn.rows():
            ended = tokens[:-1] if tokens and tokens[-1] in stops else tokens
            texts.append(self.data.tokenizer.decode(ended))
        given = [prompts.prompts[record] for record in slots.records]
        completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}] for p, t in zip(given, texts)]
        columns = {name: [values[record] for record in slots.records] for name, values in prompts.columns.items()}
        totals, each = scored(self.rewards, self.weights, given, completions, columns)
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

    def _sampled(self, rewards: torch.Tensor, each: torch.Tensor, drawn: Completions, group: int) -> torch.Tensor:
        """The rollout's metrics (reward ... completions/clipped_ratio), each as (numerator, denominator) summed
        over the data-parallel ranks."""
        grouped = rewards.nan_to_num(0.0).view(-1, group)
        spread = grouped.std(dim=1)
        rows = torch.tensor(float(len(rewards)), dtype=torch.float64, device=rewards.device)
        groups = torch.tensor(float(len(spread)), dtype=torch.float64, device=rewards.device)
        pairs = [
            (rewards.nan_to_num(0.0).sum(), rows),
            (spread.sum(), groups),
            *((scores.nan_to_num(0.0).sum(), (~scores.isnan()).sum().double()) for scores in each),
            ((spread < ZERO_STD).sum().double(), groups),
            (drawn.lengths.double().sum().to(rewards.device), rows),
            ((~drawn.stopped).sum().double().to(rewards.device), rows),
        ]
        return sum_over(torch.stack([torch.stack(pair) for pair in pairs]), self.model.mesh.dp_mesh)

    # -- a step ----------------------------------------------------------------------------------------------------
    def prepared(self, micro_batches: MicroBatches, rows: np.ndarray) -> PreparedStep:
        """Collective: the rollout (sampled on the first of its steps), the training rows weighted with GRPO's
        gradient, its loss and metrics."""
        slots = SlotRows.of(rows)
        fresh = self.current is None or self.current.draws != tuple(slots.draws)
        self._rollout_seconds = 0.0
        if fresh:
            self.current = None  # its memory is free before the next one's
            started = time.perf_counter()
            self.current = self.rollout(slots, self._prompts.train, self.group)
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
        mesh = self.model.mesh.dp_mesh
        stepped = sum_over(torch.stack([torch.stack(p) for p in self._stepped(log_probs, entropies, rollout)]), mesh)
        values = torch.cat([rollout.sampled, stepped])
        return PreparedStep(trained, sum_over(loss, mesh), values[:, 0] / values[:, 1].clamp(min=1))

    def _stepped(
        self, log_probs: torch.Tensor, entropies: torch.Tensor, rollout: Rollout
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This step's metrics (entropy, the clip ratios, kl) over this rank's completion tokens, as (numerator,
        denominator)."""
        mask, settings = rollout.scored.double(), self.settings
        tokens = mask.sum()
        ratio = torch.exp(log_probs - rollout.old)
        a = rollout.advantages[:, None]
        low = ((ratio < 1 - settings.epsilon) & (a < 0)).double() * mask
        high = ((ratio > 1 + settings.epsilon_high) & (a > 0)).double() * mask
        pairs = [(values.sum(), tokens) for values in (entropies * mask, low, high, low + high)]
        if settings.beta and rollout.reference is not None:
            gap = rollout.reference - log_probs
            pairs.append((((torch.exp(gap) - gap - 1) * mask).sum(), tokens))
        return pairs

    def recorded(self, values: list[float]) -> dict[str, Any]:
        record = {**dict(zip(self.metrics, values)), "rollout_seconds": self._rollout_seconds}
        if record["frac_reward_zero_std"] == 1 and not self._told_zero_std and self.model.runtime.is_main:
            self._told_zero_std = True
            log.warning(
                "every group's completions got the same reward this step, so every advantage is 0 and so is the "
                "gradient (but for rl.beta's KL term): the loss reads ~0, which is normal. If it persists, the task "
                "is too hard or too easy for the model: raise rl.group_size or rl.temperature, or change the data"
            )
        return record

    def validation(self) -> dict[str, float]:
        """Collective: one completion of each held-out prompt, sampled as in training: `val_reward` (their mean
        reward) and `val_completions/mean_length`."""
        (held_out,) = self.data.validation
        assert self._prompts.validation is not None, "validation rows come with their prompts"
        slots = SlotRows.of(held_out.rows)
        drawn = sample_completions(
            self.model, slots.prompts, slots.draws, 1, self.sampling, self._seed, self.gather_once
        )
        rewards, _ = self._rewarded(slots, self._prompts.validation, drawn)
        device = self.model.runtime.device
        sums = torch.stack(
            [
                rewards.nan_to_num(0.0).sum(),
                drawn.lengths.double().sum().to(device),
                torch.tensor(float(len(rewards)), dtype=torch.float64, device=device),
            ]
        )
        reward, length, count = sum_over(sums, self.model.mesh.dp_mesh).tolist()
        return {"val_reward": reward / max(count, 1), "val_completions/mean_length": length / max(count, 1)}
