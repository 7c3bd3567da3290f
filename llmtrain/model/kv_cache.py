"""Decoding with a cache of keys and values: each forward pass computes only the new positions, attending over the
keys and values kept from the positions before. A KVCache stands where the whole sequence stands in training (the
model's and each attention's `sequence`, gpt.WholeSequence's interface): it gives each row's positions and runs each
block's attention over its cached keys.

Rows are left-padded so that every row's next position is the same column: row r's tokens start at column
starts[r], its positions count from there, and no query sees a key before it. A sliding-window block sees its last
`window` keys, as in training. Under tensor parallelism each rank caches its own key/value heads (the attention's
projections are split by heads), so the cache is split with them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from llmtrain.model.documents import PackedDocuments

# Columns a block's cache holds at first (or the prefill's, if more); it doubles as an answer grows, up to `length`.
FIRST_COLUMNS = 256


class KVCache:
    """Every block's keys and values for `starts.numel()` rows of up to `length` columns, in its keys' dtype and
    device: (rows, key/value heads, columns, head width) each, grown with what is written (doubling, never past
    `length`), so a short answer in a long context holds little. `filled` columns hold keys; a forward pass writes
    the next ones and `advance` moves past them."""

    # The attention windows of the blocks apply per query here; training's sequence makes documents for them.
    windows_by_documents = False

    def __init__(self, starts: torch.Tensor, length: int):
        self.starts, self.length, self.filled = starts, length, 0
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        # this forward pass's, shared by its blocks: masks by (t, window), positions by t
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}
        self._positions: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """The bytes its blocks' keys and values hold."""
        return sum(tensor.nbytes for store in (self._keys, self._values) for tensor in store.values())

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """(rows, t): each row's positions of the next t columns (pads at 0: masked out anyway)."""
        if t not in self._positions:
            columns = torch.arange(self.filled, self.filled + t, device=device)
            self._positions[t] = (columns[None, :] - self.starts.to(device)[:, None]).clamp(min=0)
        return self._positions[t]

    def documents(self, starts: torch.Tensor, windows: Iterable[int | None]) -> PackedDocuments:
        raise NotImplementedError("packed documents are not decoded with a cache: each row is one document")

    def layer(self, index: int) -> LayerCache:
        """Block `index`'s view: its attention writes and reads its own keys."""
        return LayerCache(self, index)

    def advance(self, t: int) -> None:
        """The forward pass that wrote the next `t` columns in every block is over."""
        self.filled += t
        self._masks.clear()
        self._positions.clear()

    def repeat_rows(self, times: int) -> None:
        """Each row `times` times over, in place, consecutively (a prompt's prefill shared by its group)."""
        self.starts = self.starts.repeat_interleave(times)
        self._masks.clear()
        self._positions.clear()
        for store in (self._keys, self._values):
            for index, tensor in store.items():
                store[index] = tensor.repeat_interleave(times, dim=0)

    def attend(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        """Block `index`'s attention of the new queries q (rows, heads, t, head width) over every cached key and
        the new k, v, which it caches."""
        t = q.shape[2]
        end = self.filled + t
        if end > self.length:
            raise ValueError(f"the cache holds {self.length} columns: {end} asked")
        self._make_room(index, k, v, end)
        self._keys[index][:, :, self.filled : end] = k
        self._values[index][:, :, self.filled : end] = v
        keys, values = self._keys[index][:, :, :end], self._values[index][:, :, :end]
        if (t, window) not in self._masks:  # every block of a window shares its mask within a forward pass
            self._masks[t, window] = self._mask(t, end, window, q.device)
        # grouped-query attention: each key/value head serves its query heads, in the kernel (no copy of the cache)
        grouped = keys.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self._masks[t, window], enable_gqa=grouped)

    def _make_room(self, index: int, k: torch.Tensor, v: torch.Tensor, end: int) -> None:
        """Block `index`'s keys and values hold at least `end` columns: allocated, or grown by doubling (the
        columns written so far copied over), never past `length`."""
        held = self._keys[index].shape[2] if index in self._keys else 0
        if end <= held:
            return
        columns = min(self.length, max(end, 2 * held, FIRST_COLUMNS))
        for store, new in ((self._keys, k), (self._values, v)):
            grown = new.new_zeros((new.shape[0], new.shape[1], columns, new.shape[3]))
            if held:
                grown[:, :, :held] = store[index]
            store[index] = grown

    def _mask(self, t: int, end: int, window: int | None, device: torch.device) -> torch.Tensor:
        """(rows, 1, t, end): query i (column filled + i) sees key j from its row's start up to itself, within the
        window; a padding column sees itself alone (a query that saw nothing would make NaNs, which the padding's
        keys would carry into every later block)."""
        query = torch.arange(self.filled, end, device=device)[:, None]
        key = torch.arange(end, device=device)[None, :]
        seen = (key <= query) & ((key >= self.starts.to(device)[:, None, None]) | (key == query))
        if window is not None:
            seen = seen & (key > query - window)
        return seen[:, None]


class LayerCache:
    """One block's view of a KVCache: what its attention calls where the whole sequence would stand."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        return self.cache.positions(t, device)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: PackedDocuments | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        return self.cache.attend(self.index, q, k, v, window)
