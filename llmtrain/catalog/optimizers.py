"""The optimizers (optim.name), the bytes their state takes, and the learning-rate schedules (optim.lr_schedule,
optim.decay_shape)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llmtrain.errors import ConfigError


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer `optim.name` builds (llmtrain/optim/__init__.py: build_optimizer), over the parameter groups of
    llmtrain/optim/groups.py; conf/optim/<name>.yaml sets its defaults."""

    description: str  # one line: what it updates, how; optim.name's --help and docs/config.md
    # "module:Name" of what builds it: (parameter groups, the optim config, llmtrain/optim/compute.py's Compute) ->
    # the torch.optim.Optimizer
    builder: str
    moments: int  # fp32 buffers it keeps per element of a parameter outside the blocks' weight matrices
    matrix_moments: int  # the same, per element of the blocks' weight matrices (the planner's memory counts both)
    # Its update of the blocks' hidden matrices needs each matrix whole (Muon's orthogonalisation): those form a
    # group of their own, and a layout that splits them gathers them in the optimizer step.
    needs_whole_matrices: bool = False
    # "module:Class" of its form over ZeRO-1's flat slices (llmtrain/parallel/zero.py): (the model, the optim config,
    # the data-parallel mesh, Compute) -> the optimizer; None: parallel=zero1 refuses it (zero1_form).
    zero1: str | None = None


# optim.name -> what it updates, and how.
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(
        description="AdamW on every parameter",
        builder="llmtrain.optim:adamw",
        moments=2,
        matrix_moments=2,
        zero1="llmtrain.parallel.zero:ZeroOneAdamW",
    ),
    "muon": OptimizerSpec(
        description=(
            "Muon on the blocks' weight matrices (experts: each expert's), AdamW on embeddings, head, norms, biases"
        ),
        builder="llmtrain.optim.muon:Muon",
        moments=2,
        matrix_moments=1,
        needs_whole_matrices=True,
        zero1="llmtrain.parallel.zero:ZeroOneMuon",
    ),
}


def zero1_form(optimizer: str) -> str:
    """The import string of `optimizer`'s form over ZeRO-1's flat slices; a ConfigError when it has none."""
    form = OPTIMIZERS[optimizer].zero1
    if form is None:
        sliced = ", ".join(name for name, spec in OPTIMIZERS.items() if spec.zero1)
        raise ConfigError(
            f"optim.name={optimizer} has no form over parallel=zero1's flat slices (its row's zero1 in "
            f"llmtrain/catalog/optimizers.py): use parallel=zero2 or fsdp, which shard any optimizer's state, or an "
            f"optimizer zero1 slices: {sliced}"
        )
    return form


# The moments plan.optimizer_bytes counts per parameter (AdamW's): the planner takes the difference to an
# optimizer's own.
ADAMW_MOMENTS = 2
# optim.state_bits -> bytes per element of each AdamW moment: fp32, or torchao's 8-bit codes with one fp32 scale per
# block of 256 (llmtrain/optim/__init__.py).
MOMENT_BYTES: dict[int, float] = {32: 4.0, 8: 1.0 + 4 / 256}
# optim.lr_schedule (llmtrain/optim/lr_schedule.py describes each).
LR_SCHEDULES = ("cosine", "wsd", "constant")
# optim.decay_shape: progress p through a WSD decay, 0 to 1 -> the share of (peak - floor) still left.
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1 - math.sqrt(p),
}
