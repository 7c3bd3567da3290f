"""`parallel=ddp`: DistributedDataParallel over the data-parallel ranks.

Every rank holds all of it: parameters Ψ, gradients Ψ, AdamW state 2Ψ. Per optimizer step one all-reduce of the
gradients (2Ψ on the wire: reduce-scatter + all-gather), in buckets that overlap the backward pass. During gradient
accumulation `no_sync` skips the all-reduce on every micro-batch but the last.
"""

from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llmtrain.parallel.registry import register
from llmtrain.parallel.strategy import Strategy


@register("ddp")
class DDP(Strategy):
    supported_dims = ("dp_replicate",)

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.runtime.device] if self.runtime.device.type == "cuda" else None
        # Gradients as views into the communication buckets: no second copy of Ψ gradients.
        return DistributedDataParallel(model, device_ids=device_ids, process_group=self.dp_mesh.get_group(),
                                       gradient_as_bucket_view=True)

    def grad_sync(self, model: nn.Module, is_last_micro_batch: bool) -> AbstractContextManager:
        return nullcontext() if is_last_micro_batch else model.no_sync()
