"""The `optim` group's keys (conf/optim/): the optimizer, its learning-rate schedule, and where its state lives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from llmtrain import catalog
from llmtrain.domains import Flag, Number, OneOf, at_least, fraction, key, positive


@dataclass
class OptimConfig:
    name: str = key(
        "adamw",
        OneOf(tuple(catalog.OPTIMIZERS)),
        "the `optim` option (llmtrain/catalog/optimizers.py OPTIMIZERS): " + catalog.described(catalog.OPTIMIZERS),
    )
    lr: float = key(1e-3, positive(), "peak learning rate (under `muon`, of the AdamW parameters)")
    lr_schedule: str = key(
        "cosine",
        OneOf(catalog.LR_SCHEDULES),
        "after the linear warmup: `cosine` (decay to lr × min_lr_ratio at the last step), `wsd` (the peak held, then "
        "a decay over the last `decay_fraction` of the steps: a run resumed from a stable-phase checkpoint with a "
        "larger `train.steps` continues as if planned that long) or `constant`",
    )
    min_lr_ratio: float = key(0.1, fraction(high_open=False), "`cosine` and `wsd` decay to lr × min_lr_ratio")
    decay_fraction: float = key(
        0.2,
        Number(low=0, high=1, low_open=True),
        "`wsd`: the share of `train.steps` the decay takes, at the end",
    )
    decay_shape: str = key(
        "1-sqrt",
        OneOf(tuple(catalog.DECAY_SHAPES)),
        "`wsd`: `linear`, `cosine` or `1-sqrt` (1 - sqrt(progress): Hägele et al. 2024's best)",
    )
    weight_decay: float = key(
        0.1,
        Number(low=0),
        "decoupled, on Linear weights and embeddings (and Muon's matrices); never on biases and norms",
    )
    beta1: float = key(0.9, fraction(), "AdamW's decay of the gradient's running mean (Muon's AdamW groups too)")
    beta2: float = key(0.95, fraction(), "AdamW's decay of the squared gradient's running mean")
    eps: float = key(1e-8, positive(), "AdamW's epsilon, added to the root of the second moment")
    warmup_steps: int = key(20, at_least(0), "linear warmup steps")
    grad_clip: float = key(1.0, Number(low=0), "clip the global gradient norm; 0 disables")
    state_bits: int = key(
        32,
        OneOf((32, 8)),
        "bits per element of AdamW's two moments: `32`, or `8` (torchao's 8-bit moments, the `fp8` extra, updated in "
        "chunks by one compiled call: 2 bytes a parameter instead of 8; checkpoints keep them in fp32 and reshard "
        "across layouts; a checkpoint of one setting refuses the other). Not with `optim=muon` or `parallel=zero1`",
    )
    offload: bool = key(
        False,
        Flag(),
        "AdamW's moments, an fp32 copy of the weights and the update in host memory (`optim/offload.py`): 8 bytes a "
        "parameter less on the device, 12 more on the host, gradients down and weights up the host link each step. "
        "Not with `optim=muon`, `optim.state_bits=8` or `parallel.cpu_offload` (which offloads the state already)",
    )
    muon_lr: Optional[float] = key(
        None,
        positive(),
        "`muon`: peak learning rate of the matrices; null = `lr` (their updates are scaled to AdamW's RMS, so "
        "AdamW's rate carries over)",
    )
    momentum: float = key(0.95, fraction(), "`muon`: momentum of the matrices' gradients")
    nesterov: bool = key(True, Flag(), "`muon`: orthogonalise the Nesterov look-ahead rather than the momentum")
    ns_steps: int = key(5, at_least(1), "`muon`: Newton-Schulz iterations (in bf16 where the run computes in bf16)")
    update_rms: float = key(
        0.2,
        positive(),
        "`muon`: the RMS of each matrix's update per unit of learning rate (lr × update_rms × sqrt(max(rows, "
        "cols)) times the orthogonalised matrix); 0.2 matches AdamW's, Moonlight's rule",
    )
    whole_matrices: str = key(
        "spread",
        OneOf(("spread", "gather")),
        "`muon` under sharding: `spread` sends each split matrix whole to one of the ranks sharing it (all-to-all), "
        "orthogonalises it there and sends the pieces back; `gather` has every rank gather and orthogonalise every "
        "matrix it holds a piece of. A matrix split two ways (FSDP × tensor parallel) is always gathered",
    )
