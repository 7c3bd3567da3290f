"""Ring attention: causal attention over a sequence split across the ranks of a context-parallel group, written
out (the ring is what this layer teaches) on the fused attention kernels (attention_blocks.py), for gloo on CPUs and
NCCL on GPUs alike; torch's own `context_parallel` has no rule for the CPU attention kernel.

The sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp-1-r ("zigzag", llmtrain/parallel/
context.py), so its queries sit at one early and one late position range. Key/value blocks travel around the ring
(rank r sends to r+1, receives from r-1); at step s rank r holds the keys and values of rank j = r - s:
  - j = r (its own): causal attention of its 2c queries over its 2c keys, in order (its positions ascend);
  - j < r: all its queries see j's early chunk in full and none of j's late chunk;
  - j > r: only its late chunk of queries sees j's keys, all of them.
So every step after the first costs the same 2c x c block on every rank: the causal work is balanced.

Each block gives a partial output and the log-sum-exp of its scores (one fused kernel call); partials merge in
fp32 by the online-softmax rule out = Σ_i exp(lse_i - lse) out_i with lse = log Σ_i exp(lse_i), exact in any
order. Backward calls each block's fused backward with the merged output and log-sum-exp, which recomputes the
block's probabilities instead of storing them: per layer the ring keeps only q, k, v, the output and the
log-sum-exp, O(t/cp) per rank. The keys and values circulate again, each with the gradient accumulated for it so
far, which returns to its owner after the last step. That gradient travels in fp32, twice bf16's bytes: it is a
running sum that every rank adds to, and in bf16 each of the cp - 1 hops would round it again (8 mantissa bits; a
block's contribution below 1/256 of the sum is lost); the keys and values themselves travel in the compute dtype.

Transfers overlap compute: the next block's send/receive is posted (as one group, so NCCL pairs them: see
pipeline/p2p.py) before this block is computed, and waited for after.

Packed documents (train.attention=document, model/documents.py) mask each block further: every rank knows where
the document of each of its queries starts (a window position) and which window positions the block it holds came
from (the source rank's zigzag chunks), so it builds the block's mask itself and nothing more travels. The cases
above still cut what causality rules out; the document mask removes the rest.

The ring is one custom operator (`torch.ops.llmtrain.ring_attention`, its backward another): torch.compile keeps
the block around it in one graph, and the selective recomputation policy (model/recompute.py) saves its output
rather than replaying the ring's transfers in backward.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

from llmtrain.model.documents import visible
from llmtrain.parallel.attention_blocks import AttendedQueries, block_attention, block_attention_backward


@dataclass
class RingTimes:
    """Seconds spent computing blocks, and waiting for transfers once the compute was done (collected when
    enabled, for bench/ring_overlap.py): a transfer fully hidden behind compute waits ~0. On a GPU both are CUDA
    events on the compute stream (the host does not wait for NCCL): the wait is how long the stream stalled."""

    enabled: bool = False
    _marks: list[tuple[str, Any, Any]] = field(default_factory=list)

    @contextmanager
    def interval(self, kind: str, device: torch.device) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._marks.append((kind, start, end))
        else:
            began = time.perf_counter()
            yield
            self._marks.append((kind, began, time.perf_counter()))

    def seconds(self, kind: str) -> list[float]:
        """The measured intervals of one kind (compute or wait), in order."""
        found = []
        for mark_kind, start, end in self._marks:
            if mark_kind == kind:
                if isinstance(end, float):
                    found.append(end - start)
                else:
                    end.synchronize()
                    found.append(start.elapsed_time(end) / 1e3)
        return found

    def clear(self) -> None:
        self._marks.clear()


RING_TIMES = RingTimes()


class Ring:
    """Send to the next rank of the group and receive from the previous one, posted together."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, outgoing: torch.Tensor) -> tuple[torch.Tensor, list]:
        incoming = torch.empty_like(outgoing)
        ops = [
            dist.P2POp(dist.isend, outgoing, self.next, self.group),
            dist.P2POp(dist.irecv, incoming, self.previous, self.group),
        ]
        return incoming, dist.batch_isend_irecv(ops)


def _wait(works: list, device: torch.device) -> None:
    with RING_TIMES.interval("wait", device):
        for work in works:
            work.wait()


def _merged_dtype(q: torch.Tensor) -> torch.dtype:
    """Blocks merge, and gradients accumulate, in fp32 (fp64 for fp64 inputs, as the kernels' log-sum-exp)."""
    return torch.promote_types(q.dtype, torch.float32)


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's partial result into the fp32 (out, lse), in place (the online-softmax rule)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged)[..., None]).add_(block_out * torch.exp(block_lse - merged)[..., None])
    lse.copy_(merged)


def _halves(x: torch.Tensor) -> tuple[slice, slice]:
    c = x.shape[-2] // 2
    return slice(0, c), slice(c, 2 * c)


def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions cp rank `rank` holds: chunk `rank` and chunk 2·cp-1-rank of 2·cp equal chunks."""
    chunk = seq_len // (2 * cp)
    early = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    late = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([early, late])


@dataclass(frozen=True)
class HeldBlock:
    """The keys and values a rank holds at one step of the ring: whose they are, relative to itself (`source`: 0
    its own, -1 an earlier rank's, only whose early chunk it sees; 1 a later rank's, seen only by its late chunk of
    queries), and with packed documents (`starts`, (batch, 2c): where the document of each of its queries starts in
    the window; None: causal attention only) and a sliding `window` the mask of any part of the block."""

    ring: Ring
    holder: int  # the rank of the group whose keys these are
    starts: torch.Tensor | None
    window: int | None  # a sliding attention window (model.sliding_window): a query sees its last `window` keys

    @classmethod
    def at(cls, ring: Ring, step: int, starts: torch.Tensor | None, window: int | None) -> HeldBlock:
        return cls(ring, (ring.rank - step) % ring.size, starts, window)

    @property
    def source(self) -> int:
        return (self.holder > self.ring.rank) - (self.holder < self.ring.rank)

    @property
    def causal(self) -> bool:
        """The fused kernel's own causal mask applies (this rank's own keys, no documents)."""
        return self.source == 0 and self.starts is None

    def mask(self, rows: slice, keys: slice) -> torch.Tensor | None:
        """The document mask of this rank's queries `rows` over the block's keys `keys` (None without documents)."""
        if self.starts is None:
            return None
        t, size = self.starts.shape[1], self.ring.size
        queries = zigzag_positions(t * size, size, self.ring.rank, self.starts.device)[rows]
        held = zigzag_positions(t * size, size, self.holder, self.starts.device)[keys]
        return visible(self.starts[:, rows], queries, held, self.window)


def _forward_step(q, k, v, block: HeldBlock, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold `block` into this rank's (out, lse): the zigzag cases of the module doc."""
    early, late = _halves(q)
    whole = slice(None)
    if block.source == 0:
        merge_block(out, lse, *block_attention(q, k, v, block.causal, block.mask(whole, whole)))
    elif block.source < 0:
        result = block_attention(q, k[..., early, :], v[..., early, :], False, block.mask(whole, early))
        merge_block(out, lse, *result)
    else:
        result = block_attention(q[..., late, :], k, v, False, block.mask(late, whole))
        merge_block(out[..., late, :], lse[..., late], *result)


def _backward_step(queries: AttendedQueries, k, v, block: HeldBlock, dq: torch.Tensor, dkv: torch.Tensor) -> None:
    """Add this rank's queries' gradient from `block` to dq (fp32) and the block's key and value gradients to dkv
    (fp32, stacked)."""
    early, late = _halves(queries.q)
    whole = slice(None)
    if block.source == 0:
        dq_block, dk, dv = block_attention_backward(queries, k, v, block.causal, block.mask(whole, whole))
        dq.add_(dq_block)
        dkv[0].add_(dk)
        dkv[1].add_(dv)
    elif block.source < 0:
        dq_block, dk, dv = block_attention_backward(
            queries, k[..., early, :], v[..., early, :], False, block.mask(whole, early)
        )
        dq.add_(dq_block)
        dkv[0][..., early, :].add_(dk)
        dkv[1][..., early, :].add_(dv)
    else:
        dq_block, dk, dv = block_attention_backward(queries.rows(late), k, v, False, block.mask(late, whole))
        dq[..., late, :].add_(dq_block)
        dkv[0].add_(dk)
        dkv[1].add_(dv)


@torch.library.custom_op("llmtrain::ring_attention", mutates_args=())
def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor | None, window: int, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = Ring(_resolve_process_group(GroupName(group_name)))
    out = torch.zeros(q.shape, dtype=_merged_dtype(q), device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=_merged_dtype(q), device=q.device)
    kv = torch.stack([k, v])
    for step in range(ring.size):
        incoming, works = ring.start(kv) if step < ring.size - 1 else (None, [])
        with RING_TIMES.interval("compute", q.device):
            _forward_step(q, kv[0], kv[1], HeldBlock.at(ring, step, starts, window or None), out, lse)
        _wait(works, q.device)
        if incoming is not None:
            kv = incoming
    return out.to(q.dtype), lse


@_ring_forward.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor | None, window: int, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=_merged_dtype(q))  # contiguous, as the real ones


@torch.library.custom_op("llmtrain::ring_attention_backward", mutates_args=())
def _ring_backward(
    out_grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    starts: torch.Tensor | None,
    window: int,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = Ring(_resolve_process_group(GroupName(group_name)))
    queries = AttendedQueries(q, out, lse, out_grad.contiguous())
    dq = torch.zeros(q.shape, dtype=_merged_dtype(q), device=q.device)
    kv = torch.stack([k, v])
    # The gradient accumulated so far for the block held now travels with it, one step behind its keys.
    travelling: torch.Tensor | None = None
    travelling_works: list = []
    for step in range(ring.size):
        incoming, works = ring.start(kv) if step < ring.size - 1 else (None, [])
        dkv = torch.zeros(kv.shape, dtype=_merged_dtype(q), device=kv.device)
        with RING_TIMES.interval("compute", q.device):
            block = HeldBlock.at(ring, step, starts, window or None)
            _backward_step(queries, kv[0], kv[1], block, dq, dkv)
        if travelling is not None:
            _wait(travelling_works, q.device)
            dkv += travelling
        travelling, travelling_works = ring.start(dkv) if ring.size > 1 else (dkv, [])
        _wait(works, q.device)
        if incoming is not None:
            kv = incoming
    _wait(travelling_works, q.device)  # the last hop brings each rank its own block's gradient, from every rank
    assert travelling is not None
    return dq.to(q.dtype), travelling[0].to(k.dtype, copy=True), travelling[1].to(v.dtype, copy=True)


@_ring_backward.register_fake
def _(out_grad, q, k, v, out, lse, starts, window, group_name):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, starts, window, group_name = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, starts)
    ctx.window, ctx.group_name = window, group_name
    ctx.mark_non_differentiable(lse)


def _backward(ctx, out_grad: torch.Tensor, _lse_grad: torch.Tensor | None):
    q, k, v, out, lse, starts = ctx.saved_tensors
    return (*_ring_backward(out_grad, q, k, v, out, lse, starts, ctx.window, ctx.group_name), None, None, None)


torch.library.register_autograd("llmtrain::ring_attention", _backward, setup_context=_setup_context)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    starts: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries (batch, heads, 2c, head_dim) over the whole sequence's keys
    and values (batch, kv_heads, 2c, head_dim on each rank of `group`); with `starts` (batch, 2c: where each query's
    packed document starts in the window), within each query's document only, and with a `window` over each query's
    last `window` keys of it."""
    if window is not None and starts is None:  # one document: the whole window
        starts = torch.zeros(q.shape[0], q.shape[2], dtype=torch.long, device=q.device)
    out, _ = torch.ops.llmtrain.ring_attention(q, k, v, starts, window or 0, group.group_name)
    return out
