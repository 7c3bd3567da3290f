"""Ring attention: causal attention over a sequence split across the ranks of a context-parallel group, written out
as the readable reference (and the path gloo and CPUs run; torch's own `context_parallel` has no rule for the CPU
attention kernel).

The sequence is cut into 2·cp chunks and rank r holds chunks r and 2·cp-1-r ("zigzag", llmtrain/parallel/
context.py), so its queries sit at one early and one late position range. Key/value blocks travel around the ring
(rank r sends to r+1, receives from r-1); at step s rank r holds the keys and values of rank j = r - s:
  - j = r (its own): causal attention of its 2c queries over its 2c keys, in order (its positions ascend);
  - j < r: all its queries see j's early chunk in full and none of j's late chunk;
  - j > r: only its late chunk of queries sees j's keys, all of them.
So every step after the first costs the same 2c x c block on every rank: the causal work is balanced.

Each block gives a partial output and the log-sum-exp of its scores; partials merge by the online-softmax rule
out = Σ_i exp(lse_i - lse) out_i with lse = log Σ_i exp(lse_i), exact in any order.

Backward is a custom autograd Function that recomputes each block's probabilities from the saved global
log-sum-exp (as flash attention's backward does) instead of storing them: per layer the ring keeps only q, k, v,
the output and the log-sum-exp, O(t/cp) per rank. The keys and values circulate again, each with the gradient
accumulated for it so far, which returns to its owner after the last step.

Transfers overlap compute: the next block's send/receive is posted (as one group, so NCCL pairs them: see
pipeline/p2p.py) before this block is computed, and waited for after. Scores are computed in fp32 a tile of
queries at a time (SCORE_TILE scores), so the transient memory is a few tiles, not the block's score matrix.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

SCORE_TILE = 2**19  # score elements (fp32: 2 MiB) materialised at once: a tile of query rows over a block's keys


@dataclass
class RingTimes:
    """Seconds spent computing blocks and waiting for transfers after the compute was done (collected when
    enabled, for bench/ring_overlap.py): a transfer fully hidden behind compute waits ~0."""

    enabled: bool = False
    compute: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)


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


@contextmanager
def _timed(into: list[float]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    if RING_TIMES.enabled:
        into.append(time.perf_counter() - start)


def _wait(works: list) -> None:
    with _timed(RING_TIMES.wait):
        for work in works:
            work.wait()


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads they serve (grouped-query attention)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _tile_rows(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query rows per tile: SCORE_TILE scores over all heads of the batch, at least one row."""
    return max(1, SCORE_TILE // (q.shape[0] * q.shape[1] * k.shape[-2]))


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, row0: int) -> torch.Tensor:
    """Scaled scores of query rows row0.. over all keys, fp32; causal: key i is seen by query rows >= i."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        rows = torch.arange(row0, row0 + q.shape[-2], device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > rows, float("-inf"))
    return scores


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """Softmax attention of q over one key/value block: its output and log-sum-exp, fp32."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    outs, lses = [], []
    tile = _tile_rows(q, k)
    for row0 in range(0, q.shape[-2], tile):
        scores = _scores(q[..., row0 : row0 + tile, :], k, causal, row0)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.exp(scores - lse[..., None]) @ v)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's partial result into (out, lse), in place (the online-softmax rule)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged)[..., None]).add_(block_out * torch.exp(block_lse - merged)[..., None])
    lse.copy_(merged)


def _block_backward(q, k, v, out_grad, lse, delta, causal: bool):
    """Gradients of one block from the global log-sum-exp and delta = rowsum(dO · O): dq, and dk, dv summed back
    to the key/value heads."""
    heads = q.shape[1]
    k_full, v_full = _expand(k, heads), _expand(v, heads)
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(k_full), torch.zeros_like(v_full)
    scale = q.shape[-1] ** -0.5
    tile = _tile_rows(q, k_full)
    for row0 in range(0, q.shape[-2], tile):
        rows = slice(row0, row0 + tile)
        p = torch.exp(_scores(q[..., rows, :], k_full, causal, row0) - lse[..., rows, None])
        dv += p.transpose(-2, -1) @ out_grad[..., rows, :]
        dp = out_grad[..., rows, :] @ v_full.transpose(-2, -1)
        ds = p * (dp - delta[..., rows, None]) * scale
        dq[..., rows, :] = ds @ k_full
        dk += ds.transpose(-2, -1) @ q[..., rows, :]
    groups = heads // k.shape[1]
    fold = (lambda g: g.unflatten(1, (k.shape[1], groups)).sum(2)) if groups > 1 else (lambda g: g)
    return dq, fold(dk), fold(dv)


def _halves(x: torch.Tensor) -> tuple[slice, slice]:
    c = x.shape[-2] // 2
    return slice(0, c), slice(c, 2 * c)


def _forward_step(q, k, v, source: int, rank: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold the block of ring rank `source` into this rank's (out, lse): the zigzag cases of the module doc."""
    early, late = _halves(q)
    if source == rank:
        _merge(out, lse, *_block_forward(q, k, v, causal=True))
    elif source < rank:
        _merge(out, lse, *_block_forward(q, k[..., early, :], v[..., early, :], causal=False))
    else:
        _merge(out[..., late, :], lse[..., late], *_block_forward(q[..., late, :], k, v, causal=False))


def _backward_step(q, k, v, out_grad, lse, delta, source: int, rank: int, dq: torch.Tensor) -> torch.Tensor:
    """Add this rank's queries' gradient from the block of `source` to dq; return the block's (dk, dv) stacked."""
    early, late = _halves(q)
    block = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
    if source == rank:
        dq_block, block[0], block[1] = _block_backward(q, k, v, out_grad, lse, delta, causal=True)
        dq.add_(dq_block)
    elif source < rank:
        dq_block, block[0][..., early, :], block[1][..., early, :] = _block_backward(
            q, k[..., early, :], v[..., early, :], out_grad, lse, delta, causal=False
        )
        dq.add_(dq_block)
    else:
        dq_block, block[0], block[1] = _block_backward(
            q[..., late, :], k, v, out_grad[..., late, :], lse[..., late], delta[..., late], causal=False
        )
        dq[..., late, :].add_(dq_block)
    return block


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ring = Ring(group)
        qf = q.float()
        kv = torch.stack([k, v])
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), device=q.device)
        for step in range(ring.size):
            incoming, works = ring.start(kv) if step < ring.size - 1 else (None, [])
            with _timed(RING_TIMES.compute):
                _forward_step(qf, kv[0].float(), kv[1].float(), (ring.rank - step) % ring.size, ring.rank, out, lse)
            _wait(works)
            if incoming is not None:
                kv = incoming
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring = Ring(ctx.group)
        qf, dof = q.float(), out_grad.float()
        delta = (dof * out).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v])
        # The gradient accumulated so far for the block held now travels with it, one step behind its keys.
        dkv: torch.Tensor | None = None
        dkv_works: list = []
        for step in range(ring.size):
            incoming, works = ring.start(kv) if step < ring.size - 1 else (None, [])
            with _timed(RING_TIMES.compute):
                source = (ring.rank - step) % ring.size
                block = _backward_step(qf, kv[0].float(), kv[1].float(), dof, lse, delta, source, ring.rank, dq)
            if dkv is not None:
                _wait(dkv_works)
                block += dkv
            dkv, dkv_works = ring.start(block)
            _wait(works)
            if incoming is not None:
                kv = incoming
        _wait(dkv_works)  # the last hop brings each rank its own block's gradient, from every rank
        assert dkv is not None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries (batch, heads, 2c, head_dim) over the whole sequence's keys
    and values (batch, kv_heads, 2c, head_dim on each rank of `group`)."""
    return RingAttention.apply(q, k, v, group)
