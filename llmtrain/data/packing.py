"""From documents to fixed-length training windows.

Documents are tokenised in small batches, each followed by the end-of-text token, concatenated into one token
stream and cut into non-overlapping windows of `seq_len + 1` tokens (inputs are the first seq_len, targets the
last seq_len). Nothing is padded, so every position of every window is a real next-token target.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

import numpy as np

from llmtrain.data.tokenizers import Tokenizer


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer, batch_docs: int = 64) -> Iterator[np.ndarray]:
    """Each document's token ids followed by the end-of-text id."""
    texts = iter(texts)
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    while chunk := list(itertools.islice(texts, batch_docs)):
        for ids in tokenizer.encode_batch(chunk):
            yield np.concatenate([ids, eos])


def pack_windows(token_chunks: Iterable[np.ndarray], window: int) -> Iterator[np.ndarray]:
    """Cut the concatenation of `token_chunks` into consecutive windows of `window` tokens; a final partial
    window is dropped."""
    pending: list[np.ndarray] = []
    n_pending = 0
    for chunk in token_chunks:
        pending.append(chunk)
        n_pending += len(chunk)
        if n_pending < window:
            continue
        stream = np.concatenate(pending)
        n_full = len(stream) // window
        yield from stream[: n_full * window].reshape(n_full, window)
        rest = stream[n_full * window:]
        pending, n_pending = [rest], len(rest)
