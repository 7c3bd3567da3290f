"""What evaluation reads from a forward pass, row by row: sums over each row's scored positions (targets that are
not UNSCORED), so that the parts of a row which context parallelism splits add up, computed on vocabulary shards
where tensor parallelism's loss_parallel leaves the logits split (without gathering them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

UNSCORED = -100  # a target position no statistic reads (F.cross_entropy's ignore_index)
# A step's targets carry a weight per position where they have this many dimensions (rows, positions, 2 or 3): the
# target id (exact in fp32 below 2^24), the weight of its loss (preference tuning's, train/dpo.py) and, where there
# is a third, the temperature the logits are divided by (a policy's sampling temperature, train/grpo_objective.py).
# The layouts split them as plain targets (rows over ranks and micro-batches, positions over context-parallel ranks).
WEIGHTED_TARGETS = 3


@dataclass(frozen=True)
class TokenMarks:
    """What a step needs of the data's tokens beyond the tokens: the token after which a packed document ends (the
    tokenizer's end-of-text, or a chat template's separator; document attention and unscored end-of-text targets
    find documents by it; None: no tokenizer to say), and whether the data marks some targets UNSCORED itself
    (fine-tuning's prompts, data/packing.py)."""

    separator: int | None = None
    masked_targets: bool = False


NO_MARKS = TokenMarks()  # a model built without data: no separator, every target scored


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(rows, positions): the most likely next token at every position, the lowest id among equals (argmax's
    rule). On vocabulary shards each rank's best of its own shard and its score are gathered, not the logits."""
    if not isinstance(logits, DTensor):
        return logits.argmax(-1)
    last = logits.ndim - 1
    if tuple(logits.placements) != (Shard(last),):
        return logits.full_tensor().argmax(-1)
    mesh, local = logits.device_mesh, logits.to_local()
    shards, group = mesh.size(), mesh.get_group()
    index = local.argmax(-1)
    best = local.gather(-1, index.unsqueeze(-1)).squeeze(-1).contiguous()
    index = index + -(-logits.shape[last] // shards) * mesh.get_local_rank()  # Shard cuts as torch.chunk does
    bests, indices = [torch.empty_like(best) for _ in range(shards)], [torch.empty_like(index) for _ in range(shards)]
    dist.all_gather(bests, best, group=group)
    dist.all_gather(indices, index, group=group)
    winner = torch.stack(bests).argmax(0, keepdim=True)  # the first shard holding the maximum: the lowest id
    return torch.stack(indices).gather(0, winner).squeeze(0)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(rows, positions): the next-token cross-entropy (fp32) at each position, 0 at an unscored one; whole rows
    where tensor parallelism's loss_parallel computes it on vocabulary shards."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none", ignore_index=UNSCORED)
    if isinstance(losses, DTensor):
        losses = losses.full_tensor()
    return losses.view_as(targets)


def summed_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(rows, 3): per row, the next-token cross-entropy (fp32) summed over its scored positions, how many they
    are, and at how many of them the target is the most likely token (all of them: the greedy continuation)."""
    losses = token_losses(logits, targets)
    scored = targets != UNSCORED
    greedy = (greedy_tokens(logits) == targets) & scored
    # Summed in fp64: a long document's thousands of token losses keep the precision of each.
    columns = (losses.double().sum(1), scored.sum(1), greedy.sum(1))
    return torch.stack([column.to(torch.float64) for column in columns], dim=1)


def weighted_cross_entropy(logits: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy (fp32) at each scored position times its weight, summed. `weighted`: (rows,
    positions, 2 or 3), each position's target id, its weight and the temperature of its logits (WEIGHTED_TARGETS)."""
    targets, weights = weighted[..., 0].long(), weighted[..., 1]
    if weighted.shape[-1] > 2:
        temperature = weighted[..., 2:].to(logits.dtype)
        if isinstance(logits, DTensor):
            temperature = DTensor.from_local(temperature, logits.device_mesh, [Replicate()], run_check=False)
        logits = logits / temperature
    return (token_losses(logits, targets).flatten() * weights.flatten()).sum()


def weighted_targets(targets: torch.Tensor, weights: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
    """(rows, positions) target ids and a weight for each row (rows,) or position (rows, positions) -> the (rows,
    positions, 2) weighted targets a step trains on in place of plain ones (WEIGHTED_TARGETS); with a
    `temperature`, (rows, positions, 3), the logits divided by it."""
    weights = weights.to(torch.float32)
    columns = [targets.to(torch.float32), (weights if weights.ndim == 2 else weights[:, None]).expand(targets.shape)]
    if temperature is not None:
        columns.append(torch.full(targets.shape, temperature, dtype=torch.float32, device=targets.device))
    return torch.stack(columns, dim=-1)


def next_tokens(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(rows, 1): the most likely token after each row's one scored position (greedy decoding's next token)."""
    scored = targets != UNSCORED
    return (greedy_tokens(logits) * scored).sum(1, keepdim=True).to(torch.float64)


@dataclass(frozen=True)
class RowStatistic:
    """A per-row statistic (fp64 columns) and its width, which the pipeline's ranks without the last stage
    allocate."""

    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    columns: int


SUMMED_LOSSES = RowStatistic(summed_losses, 3)
NEXT_TOKENS = RowStatistic(next_tokens, 1)


def token_log_probs(positions: int, temperature: float = 1.0) -> RowStatistic:
    """(rows, 2 x positions): each scored target's log-probability under the model's logits divided by
    `temperature` (the fp32 cross-entropy negated), then the entropy of that distribution at each position, both 0
    at an unscored one: what a policy-gradient step weighs its tokens by and what it reports (train/grpo.py)."""

    def compute(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits / temperature
        log_probs = F.log_softmax(logits.float(), dim=-1)
        # the vocabulary's padding has probability 0 and log-probability -inf: clamped, it adds 0, not NaN
        entropies = -(log_probs.exp() * log_probs.clamp(min=torch.finfo(torch.float32).min)).sum(-1)
        if isinstance(entropies, DTensor):
            entropies = entropies.full_tensor()
        entropies = entropies.masked_fill(targets == UNSCORED, 0)
        return torch.cat([-token_losses(logits, targets), entropies], dim=1).to(torch.float64)

    return RowStatistic(compute, 2 * positions)
