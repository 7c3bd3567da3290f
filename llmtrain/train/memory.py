"""What a rank holds, and the peak of building it: the start-up summary's memory line and the layout tools.

Bytes held are counted from this rank's own tensors (DTensor local shards, distinct storages), so they show the
shard a layout gave. The build's peak is measured, not computed: on CUDA `max_memory_allocated` since the build
began; on the CPU the process's resident-set high-water mark (VmHWM, reset at the start of the build through
/proc/self/clear_refs) above the resident set at that moment. The CPU figure can read low when the process had
freed memory it has not returned to the system (a trained tokenizer, say), which the build then reuses; the
layout tools measure in a fresh process.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from llmtrain.config import OptimConfig
from llmtrain.errors import OutOfMemory
from llmtrain.optim.state_bits import moment_bytes
from llmtrain.parallel.tensors import local_tensor

MIB = 2**20


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    storages = {}
    for tensor in tensors:
        for local in storage_tensors(local_tensor(tensor)):
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def storage_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding `tensor`'s data: itself, or those inside a wrapper subclass (torchao's float8
    weights, 8-bit optimizer moments: codes and scales)."""
    if is_traceable_wrapper_subclass(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            yield from storage_tensors(getattr(tensor, name))
    else:
        yield tensor


@dataclass(frozen=True)
class HeldBytes:
    params: int
    grads: int
    optimizer: int
    optimizer_on_host: bool = False  # optim.offload: the state (and an fp32 copy of the weights) in host memory

    def describe(self) -> str:
        where = " in host memory" if self.optimizer_on_host else ""
        return (
            f"parameters {self.params / MIB:,.1f} MiB, gradients {self.grads / MIB:,.1f} MiB, "
            f"optimizer state {self.optimizer / MIB:,.1f} MiB{where}"
        )


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig | None = None) -> HeldBytes:
    """What this rank holds once training runs: its parameters, a gradient per trainable parameter it holds, and
    AdamW's two moments per parameter the optimizer updates (its own slices, under ZeRO-1) in `optim.state_bits`;
    with `optim.offload` those moments and a copy of the weights, in host memory."""
    state_bits, offload = (32, False) if optim_cfg is None else (optim_cfg.state_bits, optim_cfg.offload)
    params = list(model.parameters())
    trainable = [local_tensor(p) for p in params if p.requires_grad]
    updated = [local_tensor(p) for group in optimizer.param_groups for p in group["params"]]
    moments = 2 * sum(moment_bytes(t, state_bits) for t in updated)
    host_weights = sum(t.numel() * 4 for t in updated) if offload else 0
    return HeldBytes(
        params=tensor_bytes(params),
        grads=sum(t.numel() * t.element_size() for t in trainable),
        optimizer=int(moments + host_weights),
        optimizer_on_host=offload,
    )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if found is None:
        raise OSError(f"/proc/self/status has no {field}")
    return int(found.group(1))


def reset_peak(device: torch.device) -> int | None:
    """Start a new high-water mark at what the process holds now (CUDA: allocated tensors; CPU: resident memory,
    through /proc/self/clear_refs); that amount, or None where it cannot be measured."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        return _status_kib("VmRSS") * 1024
    except OSError:
        return None


def peak_since_reset(device: torch.device) -> int:
    """The high-water mark since the last reset_peak (bytes held at once, absolute)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


class MemoryPeak:
    """`with MemoryPeak(device) as peak: ...`, then `peak.bytes`: the most memory the block held at once above
    what the process held when it began (CUDA: allocated tensors; CPU: resident memory), or None where it cannot
    be measured (a CPU without Linux's /proc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: int | None = None
        self._start: int | None = None

    def __enter__(self) -> MemoryPeak:
        self._start = reset_peak(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self._start is not None:
            self.bytes = peak_since_reset(self.device) - self._start


def allocation_failed(error: BaseException) -> bool:
    """Whether `error` is an allocator running out: CUDA's OutOfMemoryError, or the host allocator's RuntimeError
    (torch raises no dedicated type for host memory)."""
    return isinstance(error, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error)


def out_of_memory(rank: int, where: str, device: torch.device, micro_batch_size: int, plan: str) -> OutOfMemory:
    """The one-line account of an out-of-memory error on `rank` `where` (e.g. "in step 12"); `plan` is the planner
    command that shows what fits."""
    gib = 2**30
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        held = (
            f"{torch.cuda.memory_allocated(device) / gib:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved(device) / gib:.2f} GiB reserved of {total / gib:.2f} GiB"
        )
    else:
        held = f"{_status_kib('VmRSS') * 1024 / gib:.2f} GiB resident"
    return OutOfMemory(
        f"rank {rank} ran out of {device.type} memory {where} ({held}): lower train.micro_batch_size (now "
        f"{micro_batch_size}; gradient accumulation keeps the global batch), set train.activation_checkpointing="
        f"selective or full, or shard the model over more ranks (parallel=fsdp, or parallel=pp across GPUs); "
        f"what fits: {plan}"
    )
