"""Point-to-point messages between pipeline ranks, for the hand-written schedule and pipelined evaluation.

An activation travels as two messages: a small header (rank count, shape, dtype) so the receiver can allocate
the buffer, then the data. A gradient needs no header: it has the shape and dtype of the activation the receiver
itself sent. Sends are asynchronous; the caller keeps the returned `Work` handles (and so the tensors) alive and
waits for them before the tensors are freed or reused, which is also what lets two neighbours send to each other at
the same time without deadlocking.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # ndim, dtype code, up to 6 dimensions


def _isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> dist.Work:
    work = dist.isend(tensor, dst, group=group)
    assert work is not None, "this rank is in the group"
    return work


def send_activation(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> list[dist.Work]:
    header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = tensor.ndim, _DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.ndim] = torch.tensor(tensor.shape)
    return [_isend(header, dst, group), _isend(tensor.contiguous(), dst, group)]


def recv_activation(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(tensor, src, group=group)
    return tensor


def send_gradient(grad: torch.Tensor, dst: int, group: dist.ProcessGroup) -> list[dist.Work]:
    return [_isend(grad.contiguous(), dst, group)]


def recv_gradient(like: torch.Tensor, src: int, group: dist.ProcessGroup) -> torch.Tensor:
    grad = torch.empty_like(like)
    dist.recv(grad, src, group=group)
    return grad
