"""`parallel=fsdp | zero2 | hsdp`: FSDP2 (`fully_shard`) over the data-parallel mesh dimensions.

Each transformer block is one FSDP unit, and the root (embeddings, final norm, head) another: a block's
parameters are all-gathered just before it runs and freed after, so a rank holds 1/N of the parameters,
gradients and AdamW state (Ψ/N + Ψ/N + 2Ψ/N) plus one or two gathered blocks at a time.
- `fsdp` (ZeRO-3): reshard after forward; per step all-gather Ψ in forward, again Ψ in backward, reduce-scatter
  Ψ of gradients: 3Ψ on the wire.
- `zero2` (ZeRO-2-like): keep the gathered parameters from forward to backward (reshard_after_forward=False):
  2Ψ on the wire, full parameters held during the step, gradients and optimizer state still sharded.
- `hsdp`: a 2-D mesh (dp_replicate x dp_shard): shard inside a node, replicate across nodes; gradients are
  reduce-scattered over dp_shard and all-reduced over dp_replicate.
On GPU with bf16 precision, parameters are gathered and computed in bf16 while gradients are reduced in fp32.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from llmtrain.parallel.registry import register
from llmtrain.parallel.tp import TensorParallel
from llmtrain.train.precision import uses_bf16


@register("fsdp")
class FSDP(TensorParallel):
    """FSDP over the data-parallel dimensions, on top of tensor parallelism when parallel.tp > 1 (2-D: TP inside,
    FSDP across, over DTensor parameters that are already TP-sharded)."""

    supported_dims = ("dp_replicate", "dp_shard", "tp")

    def describe(self) -> str:
        if self.degrees.dp_replicate > 1:
            kind = "HSDP" if self.degrees.dp_shard > 1 else "replicated"
        else:
            kind = "ZeRO-3" if self.cfg.parallel.reshard_after_forward else "ZeRO-2"
        offload = ", CPU offload" if self.cfg.parallel.cpu_offload else ""
        tp = f", TP{' + SP' if self.cfg.parallel.sequence_parallel else ''}" if self.degrees.tp > 1 else ""
        return f"{self.name} {kind}{offload}{tp} ({self.degrees.describe()})"

    @property
    def reshard_after_forward(self) -> bool:
        return self.cfg.parallel.reshard_after_forward

    def wrap(self, model: nn.Module) -> nn.Module:
        # A 2-D (replicate, shard) mesh makes fully_shard hybrid: sharded within, replicated across.
        mesh = self.mesh["dp_replicate", "dp_shard"] if self.degrees.dp_replicate > 1 else self.mesh["dp_shard"]
        mixed = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if uses_bf16(self.cfg.train.precision, self.runtime.device) else MixedPrecisionPolicy())
        options = dict(mesh=mesh, mp_policy=mixed,
                       offload_policy=CPUOffloadPolicy() if self.cfg.parallel.cpu_offload else OffloadPolicy())
        for block in model.blocks.values():
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        # The root's parameters (embeddings, final norm, tied head) are needed again at the start of backward.
        fully_shard(model, reshard_after_forward=False, **options)
        # The root returns the head's logits, which nn.Linear makes a view of its 2-D product; FSDP warns that an
        # in-place op on that view would skip its backward hook. The loss only reads the logits.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
        return model
