"""The DDP step of `parallel=ddp`: DistributedDataParallel over the data-parallel ranks.

Every rank holds all of it: parameters Ψ, gradients Ψ, AdamW state 2Ψ. Per optimizer step one all-reduce of the
gradients (2Ψ on the wire: reduce-scatter + all-gather), in buckets that overlap the backward pass. During gradient
accumulation `no_sync` skips the all-reduce on every micro-batch but the last.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llmtrain.model.quantize import is_nf4


def apply_ddp(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> DistributedDataParallel:
    """Wrap a materialised model (DDP broadcasts rank 0's weights when it is built)."""
    device_ids = [device] if device.type == "cuda" else None
    # NF4 weights (model.quantize_base) are frozen and drawn alike on every rank; DDP's broadcast of rank 0's
    # weights would flatten them as plain tensors.
    quantized = [name for name, param in model.named_parameters() if is_nf4(param)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, quantized)
    # Gradients as views into the communication buckets: no second copy of Ψ gradients.
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group, gradient_as_bucket_view=True)
