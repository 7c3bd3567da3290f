"""Batches made ahead in a background thread, so reading (and, streamed, tokenising) overlaps the training step
instead of stalling it between steps."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Generic, Protocol, TypeVar

Batch = TypeVar("Batch", covariant=True)


class Batches(Protocol[Batch]):
    def next(self) -> Batch:
        """This rank's part of the next global batch: (per_rank, seq_len + 1) int64 token rows, or a source's own
        kind (data=rl's completion slots)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch taken: what a checkpoint stores to resume exactly there."""
        ...


class Prefetched(Generic[Batch]):
    """`source`'s batches, up to `prefetch` of them made ahead by a daemon thread. Each comes with the source's
    position after it, so `state_dict()` is the position after the last batch *taken*, however far the thread
    has read ahead. The source is only ever touched by that thread."""

    def __init__(self, source: Batches[Batch], prefetch: int = 2):
        self._source = source
        self._position = source.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._produce, daemon=True, name="llmtrain-data")
        self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._closing.is_set():
                rows = self._source.next()
                self._queue.put((rows, self._source.state_dict()))
        except BaseException as error:  # surfaced to the training thread, which owns error handling
            self._queue.put(error)

    def close(self) -> None:
        """Stop the thread and wait for it: a process that exits while the thread is inside a native tokenizer
        aborts (SIGABRT) instead of leaving with its own exit code."""
        self._closing.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):  # make room for a put the thread is blocked in
                self._queue.get(timeout=0.05)
        self._thread.join()

    def next(self) -> Batch:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        rows, self._position = item
        return rows

    def state_dict(self) -> dict[str, Any]:
        return self._position
