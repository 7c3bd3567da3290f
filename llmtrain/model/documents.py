"""Packed documents that never see each other (`train.attention=document`), and sliding attention windows.

Packing (llmtrain/data/packing.py) concatenates documents, each ended by the end-of-text token, and cuts the stream
into windows; with plain causal attention a token after a boundary attends to the unrelated documents before it.
Here the boundaries are read from the tokens themselves: a document starts at the window's first position and just
after each end-of-text token, so the streamed, prepared and mixed data paths, their stores and their resume
positions carry them unchanged. What a forward needs is one integer per position, where its document starts (in
positions of the whole window, whatever part of it a rank holds), from which follow

  - its position within the document (the learned position embedding's index, the rotary angle), restarting at 0;
  - which keys it sees: key j is visible to query i when start(i) <= j <= i.

The kernel each device runs it on:
  - CUDA: FlexAttention (`torch.nn.attention.flex_attention`, compiled), whose block mask skips the blocks no
    document reaches, so a window of short documents costs attention within each document only;
  - elsewhere: SDPA with the mask as a (batch, 1, t, t) tensor: FlexAttention has no backward on CPU.
A sliding window (model.sliding_window: a window per block, as nanochat's and modded-nanogpt's short and long ones)
narrows the same mask to each query's last `window` keys, with or without documents (without, the whole window is
one document). Both kernels compute softmax attention over the same visible keys; tests/model/test_documents.py holds
the FlexAttention forward to the SDPA path on CPU, and `llmtrain.tools.gpu_check` its forward and backward on the
GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import torch
import torch.nn.functional as F


def document_starts(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """(batch, t) int64: for each position of each window, where its document starts: the window's first
    position, or the one after the latest `separator` (end-of-text) token before it."""
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    after_separator = torch.zeros_like(tokens, dtype=torch.bool)
    after_separator[:, 1:] = tokens[:, :-1] == separator
    return torch.where(after_separator, index, 0).cummax(dim=1).values


def visible(starts: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(batch, 1, queries, keys) bool: which keys (window positions `keys`) each query (window positions `queries`,
    its document starting at `starts` (batch, queries)) attends to: those of its own document, up to itself, and
    with a sliding `window` only the last `window` of them (itself included)."""
    keys, queries = keys[None, None, :], queries[None, :, None]
    seen = (keys >= starts[:, :, None]) & (keys <= queries)
    if window is not None:
        seen &= keys > queries - window
    return seen[:, None]


@dataclass(frozen=True)
class PackedDocuments:
    """What attention within packed documents (or sliding windows, model.sliding_window) needs in one forward,
    made once per forward by the model's sequence layout (gpt.WholeSequence or context parallelism's shard) from
    the starts of the positions it holds: each position within its document, and per attention window of the
    model's blocks (None: the whole document) the mask in the form the layout's kernel takes."""

    starts: torch.Tensor  # (batch, t): where each held position's document starts in the window
    positions: torch.Tensor  # (batch, t): each held position's place within its document
    masks: dict[int | None, Any]  # window -> a bool tensor (SDPA), a BlockMask (FlexAttention), the starts (ring)


def whole_window_documents(starts: torch.Tensor, windows: Iterable[int | None] = (None,)) -> PackedDocuments:
    """The documents of whole windows (no context parallelism), a mask per attention window made for this
    device's kernel."""
    t = starts.shape[1]
    index = torch.arange(t, device=starts.device)
    if starts.device.type == "cuda":
        masks = {window: _block_mask(starts, window) for window in windows}
    else:
        masks = {window: visible(starts, index, index, window) for window in windows}
    return PackedDocuments(starts, index - starts, masks)


def _block_mask(starts: torch.Tensor, window: int | None) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_index, kv_index):
        seen = (kv_index >= starts[b, q_index]) & (kv_index <= q_index)
        return seen if window is None else seen & (q_index - kv_index < window)

    batch, t = starts.shape
    # compiled, it evaluates the mask block by block instead of materialising (batch, t, t) booleans
    return create_block_mask(same_document_causal, batch, None, t, t, device=starts.device, _compile=True)


@cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """FlexAttention compiled once per process: uncompiled it materialises the scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """FlexAttention of q (batch, heads, t, head_dim) over k, v (batch, kv_heads, t, head_dim) under a BlockMask
    (`_block_mask`), uncompiled where it runs on a CPU (forward only: what the tests compare)."""
    from torch.nn.attention.flex_attention import flex_attention

    grouped = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":
        return _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=grouped)
    return cast(torch.Tensor, flex_attention(q, k, v, block_mask=mask, enable_gqa=grouped))


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """Attention under one of PackedDocuments.masks on this device's kernel (the module doc). Grouped-query keys
    and values are repeated for SDPA: its fused CPU kernel takes a mask but not fewer key heads."""
    if not isinstance(mask, torch.Tensor):
        return flex_document_attention(q, k, v, mask)
    if q.shape[1] != k.shape[1]:
        k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
