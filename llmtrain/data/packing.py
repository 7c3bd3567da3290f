"""From documents to fixed-length training windows.

Documents are tokenised in small batches, each followed by the end-of-text token, concatenated into one token
stream and cut into non-overlapping windows of `seq_len + 1` tokens (inputs are the first seq_len, targets the
last seq_len). Nothing is padded, so every position of every window is a real next-token target.

Fine-tuning windows (sft.py) also hold tokens that are context only, whose prediction is not trained (a prompt's,
padding): such a token is stored as its bitwise complement, a negative number (`untrained`), so a window stays one
int64 array wherever it goes; `window_tokens` reads the ids back.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Iterator

import numpy as np

from llmtrain.data.tokenizers import Tokenizer


def untrained(tokens: np.ndarray) -> np.ndarray:
    """`tokens` marked context only: what predicts them is not trained (stored as ~id, a negative number)."""
    return ~tokens


def window_tokens(rows: np.ndarray) -> np.ndarray:
    """The token ids of windows, whether or not they hold untrained tokens."""
    return np.where(rows < 0, ~rows, rows)


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer, batch_docs: int = 64) -> Iterator[np.ndarray]:
    """Each document's token ids followed by the end-of-text id."""
    texts = iter(texts)
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    while chunk := list(itertools.islice(texts, batch_docs)):
        for ids in tokenizer.encode_batch(chunk):
            yield np.concatenate([ids, eos])


class WindowPacker:
    """Cuts the concatenation of the token chunks it is given into consecutive windows of `window` tokens.

    It holds the tokens not yet cut and the windows not yet taken as arrays that are never modified in place, so
    `state_dict()` is a cheap snapshot and a packer restored from it yields exactly the windows the original would
    have (the training stream's checkpointed position relies on it). Training and validation both pack with it.
    """

    def __init__(self, window: int):
        self.window = window
        self._tokens: list[np.ndarray] = []  # not yet cut: fewer than `window` tokens in all
        self._n_tokens = 0
        self._windows: collections.deque[np.ndarray] = collections.deque()  # cut, not yet taken

    def add(self, tokens: np.ndarray) -> None:
        """Append `tokens` to the stream and cut every window it completes."""
        self._tokens.append(tokens)
        self._n_tokens += len(tokens)
        if self._n_tokens < self.window:
            return
        stream = np.concatenate(self._tokens)
        n_full = len(stream) // self.window
        self._windows.extend(stream[: n_full * self.window].reshape(n_full, self.window))
        rest = stream[n_full * self.window :]
        self._tokens, self._n_tokens = [rest], len(rest)

    def take(self) -> np.ndarray | None:
        """The next cut window, or None until more tokens are added."""
        return self._windows.popleft() if self._windows else None

    def windows(self) -> Iterator[np.ndarray]:
        """Take every window cut so far."""
        while self._windows:
            yield self._windows.popleft()

    def state_dict(self) -> dict:
        return {"tokens": list(self._tokens), "windows": list(self._windows)}

    def load_state_dict(self, state: dict) -> None:
        self._tokens, self._windows = list(state["tokens"]), collections.deque(state["windows"])
        self._n_tokens = sum(len(t) for t in self._tokens)


def pack_windows(token_chunks: Iterable[np.ndarray], window: int) -> Iterator[np.ndarray]:
    """Cut the concatenation of `token_chunks` into consecutive windows of `window` tokens; a final partial
    window is dropped."""
    packer = WindowPacker(window)
    for chunk in token_chunks:
        packer.add(chunk)
        yield from packer.windows()
