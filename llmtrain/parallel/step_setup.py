"""What every executor (executor.py) does alike around this rank's forward passes, whichever runs the micro-batches:
which targets are scored, this rank's part of each sequence under context parallelism, the packed documents keyword,
the factor that turns summed micro-batch losses into the global batch's mean, and the contexts the forward and the
loss run in."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from llmtrain.errors import ConfigError
from llmtrain.model import chunked_cross_entropy, summed_cross_entropy
from llmtrain.model.documents import document_starts
from llmtrain.model.scoring import UNSCORED, WEIGHTED_TARGETS, TokenMarks, weighted_cross_entropy
from llmtrain.parallel.context import shard_tokens
from llmtrain.parallel.mesh import RankMesh, sum_over
from llmtrain.parallel.precision import PrecisionContext
from llmtrain.parallel.tensors import MicroBatches
from llmtrain.parallel.tp import loss_context
from llmtrain.parallel_plan import ParallelPlan
from llmtrain.process.runtime import Runtime


@dataclass(frozen=True)
class StepSetup:
    """Where this rank sits (`plan`, `mesh`, `runtime`) and the step's conventions there; `of` checks that the run
    can follow them."""

    plan: ParallelPlan
    mesh: RankMesh
    runtime: Runtime
    precision: PrecisionContext  # the forward passes' context (precision.py)
    separator: int | None  # the end-of-text id packed documents are found by; None: causal attention
    unscored_input: int | None  # the end-of-text id whose next target is not scored; None: every target counts
    # Whether some targets may be unscored, so the loss's denominator is counted: at end-of-text tokens, or
    # wherever the data says (fine-tuning trains the assistant's tokens alone).
    counts_scored: bool
    # The summed cross-entropy of the step's losses: with train.compile a graph of its own where the logits are
    # whole (not tensor parallelism's vocabulary shards), which reads the logits once to upcast and reduce them
    # instead of writing an fp32 copy of (tokens x vocabulary) first; eagerly, over vocabulary shards as it is,
    # and over whole logits a chunk of positions at a time (model.chunked_cross_entropy).
    cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    compiles_loss: bool  # whether cross_entropy is that graph

    @classmethod
    def of(
        cls,
        plan: ParallelPlan,
        mesh: RankMesh,
        runtime: Runtime,
        precision: PrecisionContext,
        marks: TokenMarks,
    ) -> StepSetup:
        """`marks`: the data's document separator, which document attention and unscored end-of-text targets need,
        and whether it marks targets UNSCORED itself."""
        eos_id = marks.separator
        needs_eos = "train.attention=document" if plan.train.attention == "document" else None
        needs_eos = needs_eos or (None if plan.train.score_after_eos else "train.score_after_eos=false")
        if eos_id is None and needs_eos:
            raise ConfigError(
                f"{needs_eos}: no end-of-text token to find documents by; build the model with a tokenizer"
            )
        separator = eos_id if plan.train.attention == "document" else None
        unscored_input = None if plan.train.score_after_eos else eos_id
        counts_scored = marks.masked_targets or unscored_input is not None
        compiled = plan.train.compile and plan.degrees.tp == 1
        vocabulary_split = plan.degrees.tp > 1 and plan.parallel.loss_parallel
        cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            torch.compile(summed_cross_entropy, backend=plan.train.compile_backend)
            if compiled
            else summed_cross_entropy
            if vocabulary_split
            else chunked_cross_entropy
        )
        return cls(plan, mesh, runtime, precision, separator, unscored_input, counts_scored, cross_entropy, compiled)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed training loss: the cross-entropy, each position's weighted where the targets
        carry weights (scoring.WEIGHTED_TARGETS)."""
        if targets.ndim == WEIGHTED_TARGETS:
            return weighted_cross_entropy(logits, targets)
        return self.cross_entropy(logits, targets)

    def loss_context(self) -> AbstractContextManager:
        """Context around the loss and its backward (tensor parallelism computes it on vocabulary shards)."""
        return loss_context(self.plan.degrees.tp, self.plan.parallel.loss_parallel)

    def context_shard(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of every sequence of `tokens` (batch, seq): all of it without context parallelism."""
        cp = self.mesh.cp_mesh
        return tokens if cp is None else shard_tokens(tokens, cp.size(), cp.get_local_rank())

    def documents(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The forward's `documents` keyword for whole windows `tokens` (batch, seq): where the packed document of
        each position this rank holds starts (model/documents.py); nothing under causal attention."""
        if self.separator is None:
            return {}
        starts = self.context_shard(document_starts(tokens, self.separator))
        return {"documents": starts.to(self.runtime.device)}

    def scored(self, micro_batches: MicroBatches) -> MicroBatches:
        """The micro-batches with the target at each end-of-text token unscored where train.score_after_eos is off."""
        if self.unscored_input is None:
            return micro_batches
        # weighted targets (scoring.WEIGHTED_TARGETS) were made from scored ones
        return [(x, y if y.ndim == WEIGHTED_TARGETS else y.masked_fill(x == self.unscored_input, UNSCORED))
                for x, y in micro_batches]  # fmt: skip

    def loss_scale(self, micro_batches: MicroBatches, pieces: int) -> float | torch.Tensor:
        """What a micro-batch's summed loss (over this rank's scored targets) is multiplied by so that the means the
        layout then takes, over `pieces` micro-batches and over the data- and context-parallel ranks (of losses,
        and of gradients by DDP / FSDP), give the mean over every scored target of the global batch: those ranks
        x pieces / the global batch's scored targets. Known without communication when every target is scored;
        otherwise the counts (of whole rows, the same on each context-parallel rank) are summed over the
        data-parallel ranks, on the device, without a host read."""
        ranks = self.plan.dp_size * self.plan.degrees.cp * pieces
        if micro_batches and micro_batches[0][1].ndim == WEIGHTED_TARGETS:  # the weights hold the normalisation
            return ranks
        if not self.counts_scored:
            return ranks / (sum(targets.numel() for _, targets in micro_batches) * self.plan.dp_size)
        counts = [(targets != UNSCORED).sum() for _, targets in micro_batches]
        scored = sum_over(torch.stack(counts).sum().to(self.runtime.device, torch.float32), self.mesh.dp_mesh)
        return ranks / scored.clamp(min=1)
