"""Point-to-point messages between pipeline ranks, for the hand-written schedule and pipelined evaluation.

Messages go out as `P2POp`s posted together by `exchange` (`dist.batch_isend_irecv`): on NCCL the sends and
receives between two ranks run in order on one stream, so a schedule that posts "send to you" and "receive from
you" one at a time can wait forever on a peer doing the same the other way round; posted together, as one group,
they complete together. (gloo buffers sends, so the one-at-a-time version passes on CPU and hangs on GPUs.)

An activation's shape and dtype travel once per step (once per stage in evaluation), ahead of the first
micro-batch (`send_header` / `recv_header`): reading a header is a host synchronisation, and the micro-batches
after the first have the same trailing shape and dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # ndim, dtype code, up to 6 dimensions


def exchange(ops: list[dist.P2POp]) -> None:
    """Post `ops` as one group and wait for all of them (the received tensors are then filled)."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def send_header(like: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    # Written entry by entry on the device (each a fill): a header built on the host would be copied over, one
    # more synchronisation per step on the sending rank.
    header = torch.zeros(_HEADER, dtype=torch.int64, device=like.device)
    for index, value in enumerate([like.ndim, _DTYPES.index(like.dtype), *like.shape]):
        header[index] = value
    exchange([dist.P2POp(dist.isend, header, dst, group)])


def recv_header(src: int, group: dist.ProcessGroup, device: torch.device) -> tuple[list[int], torch.dtype]:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    exchange([dist.P2POp(dist.irecv, header, src, group)])
    ndim, dtype_code, *shape = header.tolist()  # the one host read
    return shape[:ndim], _DTYPES[dtype_code]
