"""A weighted mixture of prepared stores (`data=mix`, `data.sources`) in one global sample order.

Sample i of the run comes from the source whose count is furthest behind its share, weight x (i + 1) (Megatron's
blending rule): after every sample each source's count is within one of its target, so over any N global batches of
B samples each source's share of the samples (and of the tokens: every sample is one window) is its weight within
2 / (N x B). The rows of global batch k are then put in a seeded order, so no rank always draws the same source. A
source's n-th sample is window n of a seeded permutation of its windows, a new one each epoch. Which source and
which window fill each row of batch k depends only on the seed, the sources and k, never on the number of ranks;
each rank reads only its own rows, and the position is the sample index with each source's count.

A source with `max_epochs` stops at that many passes: its weight is shared out among the others in proportion to
theirs from that sample on (`data.on_exhausted=redistribute`, logged once with the step), or the run stops there
(`stop`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmtrain.data.prepared import store_tokenizer
from llmtrain.data.sources import TRAIN, VALIDATION
from llmtrain.data.store import TOKENIZER_DIR, VOCAB_HASH, TokenWindows, read_manifest
from llmtrain.data.stream import RankSlice
from llmtrain.data.tokenizers import Tokenizer, load_saved_tokenizer, vocabulary_sha256
from llmtrain.errors import ConfigError, RunError

log = logging.getLogger("llmtrain")


class SourceExhausted(RunError):
    """A mixture that cannot go on: a source due past its max_epochs with data.on_exhausted=stop, or every source
    at its cap (every rank reaches it at the same sample)."""

    ranks_meet = True


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture: a prepared store's training windows, its weight and its cap."""

    name: str
    path: str
    weight: float
    max_epochs: float | None

    @property
    def key(self) -> str:
        return f"data.sources[{self.name}]"


def mixture_sources(entries: list[dict[str, Any]]) -> list[MixtureSource]:
    return [MixtureSource(str(e["name"]), str(e["path"]), float(e["weight"]), e.get("max_epochs")) for e in entries]


def mixture_tokenizer(data_cfg) -> Tokenizer:
    """The tokenizer every source was tokenised with (the first store's, checked against data.tokenizer as
    data=prepared checks it); a one-line error naming the first source tokenised otherwise."""
    sources = mixture_sources(list(data_cfg.sources))
    check_one_tokenizer(sources)
    return store_tokenizer(dataclasses.replace(data_cfg, path=sources[0].path))


def check_one_tokenizer(sources: list[MixtureSource]) -> None:
    """A one-line error naming the first source whose tokenizer is not the first source's."""
    first = sources[0]
    expected = _tokenizer_identity(first)
    for source in sources[1:]:
        if (theirs := _tokenizer_identity(source)) != expected:
            raise ConfigError(
                f"{source.key}.path={source.path!r} was tokenised with {_described(theirs)}, {first.key} with "
                f"{_described(expected)}: prepare every source of a mixture with one tokenizer"
            )


def _tokenizer_identity(source: MixtureSource) -> dict[str, Any]:
    """What says whether an id means one thing in two stores: the tokenizer's kind, size, end-of-text id and
    vocabulary. Not the BPE training keys the manifest also holds (vocab_size, train_chars): their defaults differ
    per data group, also for the tokenizers that ignore them, and a trained BPE's vocabulary is in its hash. A store
    prepared before the hash was recorded gets it from its tokenizer/ directory."""
    entry = read_manifest(source.path)["tokenizer"]
    if VOCAB_HASH not in entry:
        directory = os.path.join(source.path, TOKENIZER_DIR)
        tokenizer = load_saved_tokenizer(directory, entry["kind"], entry["eos_id"], entry["size"])
        entry = {**entry, VOCAB_HASH: vocabulary_sha256(tokenizer)}
    return {key: entry[key] for key in ("kind", "size", "eos_id", VOCAB_HASH)}


def _described(identity: dict[str, Any]) -> str:
    shown = {**identity, VOCAB_HASH: identity[VOCAB_HASH][:12]}  # enough to tell two apart, short for one line
    return ", ".join(f"{key}={value}" for key, value in shown.items())


class MixtureBatches:
    """This rank's rows of global batch k, k = 0, 1, ..., drawn from the sources by weight."""

    def __init__(
        self,
        sources: list[MixtureSource],
        seq_len: int,
        seed: int,
        rank_slice: RankSlice,
        stop_when_exhausted: bool,
        position: dict[str, Any] | None,
    ):
        self.sources = sources
        self.windows = [TokenWindows(s.path, TRAIN, seq_len + 1, read_manifest(s.path)) for s in sources]
        for source, windows in zip(sources, self.windows):
            if windows.count == 0:
                raise ConfigError(
                    f"{source.key}.path={source.path!r} holds less than one window of train.seq_len + 1 = "
                    f"{seq_len + 1} training tokens: lower train.seq_len or prepare more text"
                )
        self.seed = seed
        self.rank_slice = rank_slice
        self.stop_when_exhausted = stop_when_exhausted
        self.caps = [
            np.inf if s.max_epochs is None else max(1, int(s.max_epochs * w.count))
            for s, w in zip(sources, self.windows)
        ]
        self.next_sample = 0
        self.taken = np.zeros(len(sources), dtype=np.int64)  # samples drawn from each source so far
        # Targets run from the last change of weights (a source running out): base sample and counts there.
        self.base_sample = 0
        self.base_taken = np.zeros(len(sources), dtype=np.int64)
        self.active = np.ones(len(sources), dtype=bool)
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        if position is not None:
            self.load_state_dict(position)

    @property
    def weights(self) -> np.ndarray:
        """The sources' shares now: their weights, a run-out source's shared among the others."""
        weights = np.array([s.weight for s in self.sources]) * self.active
        return weights / weights.sum()

    def _draw(self, count: int) -> np.ndarray:
        """The sources of the next `count` samples of the global order, advancing the counts (plain Python over a
        few sources: a microsecond a sample)."""
        drawn = np.empty(count, dtype=np.int64)
        shares, base, taken = self.weights.tolist(), self.base_taken.tolist(), self.taken.tolist()
        for i in range(count):
            sample = self.next_sample + i
            progress = sample + 1 - self.base_sample
            source, most_behind = -1, -np.inf
            for s, share in enumerate(shares):
                behind = base[s] + share * progress - taken[s]
                if share > 0 and behind > most_behind:  # the lowest index among equals
                    source, most_behind = s, behind
            if taken[source] >= self.caps[source]:  # due again past its cap (data.on_exhausted=stop)
                raise SourceExhausted(
                    f"{self._reached(source, sample)} and data.on_exhausted=stop: the run stops; its last checkpoint "
                    f"is intact. Raise the source's max_epochs, lower train.steps, or set "
                    f"data.on_exhausted=redistribute"
                )
            drawn[i] = source
            taken[source] += 1
            if taken[source] >= self.caps[source] and not self.stop_when_exhausted:
                self.taken[:] = taken
                self._redistribute(source, sample + 1)
                shares, base = self.weights.tolist(), self.base_taken.tolist()
        self.taken[:] = taken
        return drawn

    def _reached(self, source: int, sample: int) -> str:
        spec, step = self.sources[source], sample // self.rank_slice.batch_size + 1
        return f"{spec.key} reached max_epochs={spec.max_epochs:g} ({self.caps[source]:,} samples) in step {step}"

    def _redistribute(self, source: int, samples: int) -> None:
        """`source` out from sample `samples` on: the targets start again there with the others' weights."""
        what = self._reached(source, samples - 1)
        self.active[source] = False
        if not self.active.any():
            raise SourceExhausted(
                f"{what}, the last source with data left: the run stops; its last checkpoint is intact. Raise the "
                f"sources' max_epochs or lower train.steps"
            )
        self.base_sample, self.base_taken = samples, self.taken.copy()
        log.info(f"data: {what}; its share goes to the other sources in proportion to their weights")

    def _window_order(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 2 * len(self.sources):  # keep the current epochs' orders only
                self._orders.clear()
            self._orders[key] = np.random.default_rng([self.seed, source, epoch]).permutation(
                self.windows[source].count
            )
        return self._orders[key]

    def next(self) -> np.ndarray:
        """(per_rank, seq_len + 1) int64: this rank's rows of the next global batch."""
        batch = self.rank_slice.batch_size
        first_taken = self.taken.copy()
        sources = self._draw(batch)
        # Each row's index within its source: the count before this batch plus its rank among the batch's rows
        # of that source, in drawing order; then the rows are put in the batch's own seeded order.
        within = np.empty(batch, dtype=np.int64)
        for source in range(len(self.sources)):
            rows = np.flatnonzero(sources == source)
            within[rows] = first_taken[source] + np.arange(len(rows))
        order = np.random.default_rng([self.seed, self.next_sample]).permutation(batch)
        sources, within = sources[order], within[order]
        start = self.rank_slice.dp_rank * self.rank_slice.per_rank
        mine = slice(start, start + self.rank_slice.per_rank)
        rows = np.empty((self.rank_slice.per_rank, self.windows[0].window), dtype=np.int64)
        for source in np.unique(sources[mine]):
            here = np.flatnonzero(sources[mine] == source)
            epochs, offsets = np.divmod(within[mine][here], self.windows[source].count)
            indices = np.array([self._window_order(int(source), int(e))[o] for e, o in zip(epochs, offsets)])
            rows[here] = self.windows[source].read(indices)
        self.next_sample += batch
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_sample": self.next_sample,
            "sources": {
                s.name: {"taken": int(t), "windows": w.count, "active": bool(a), "base_taken": int(b)}
                for s, t, w, a, b in zip(self.sources, self.taken, self.windows, self.active, self.base_taken)
            },
            "base_sample": self.base_sample,
            "window": self.windows[0].window,
        }

    def load_state_dict(self, position: dict[str, Any]) -> None:
        saved = position.get("sources")
        if saved is None:
            raise ConfigError(
                "the checkpoint's data position is not a mixture's, this run reads data=mix: resume with the data "
                "config it was saved with, or start afresh with checkpoint.resume=none"
            )
        names = [s.name for s in self.sources]
        if list(saved) != names or position["window"] != self.windows[0].window:
            raise ConfigError(
                f"the checkpoint was saved reading the sources {', '.join(saved)} in windows of {position['window']} "
                f"tokens, this run reads {', '.join(names)} in windows of {self.windows[0].window}: resume with the "
                f"data.sources and train.seq_len it was saved with"
            )
        for source, windows in zip(self.sources, self.windows):
            if saved[source.name]["windows"] != windows.count:
                raise ConfigError(
                    f"{source.key}.path={source.path!r} holds {windows.count} windows, the checkpoint's holds "
                    f"{saved[source.name]['windows']}: resume with the stores it was saved with"
                )
        self.next_sample, self.base_sample = position["next_sample"], position["base_sample"]
        self.taken = np.array([saved[n]["taken"] for n in names], dtype=np.int64)
        self.base_taken = np.array([saved[n]["base_taken"] for n in names], dtype=np.int64)
        self.active = np.array([saved[n]["active"] for n in names], dtype=bool)


def mixture_validation_rows(sources: list[MixtureSource], seq_len: int, val_slice: RankSlice) -> dict[str, np.ndarray]:
    """This rank's rows of each source's validation set (the first val_slice.batch_size windows of its validation
    split), for the sources whose split holds that many."""
    rows = {}
    for source in sources:
        windows = TokenWindows(source.path, VALIDATION, seq_len + 1, read_manifest(source.path))
        if windows.count >= val_slice.batch_size:
            start = val_slice.dp_rank * val_slice.per_rank
            rows[source.name] = windows.read(np.arange(start, start + val_slice.per_rank))
    return rows


def describe_mixture(sources: list[MixtureSource], batches: MixtureBatches, steps: int) -> str:
    """The start summary's data line: each source's share, windows, and the epochs train.steps implies."""
    planned = steps * batches.rank_slice.batch_size
    parts = []
    for source, share, windows in zip(sources, batches.weights, batches.windows):
        epochs = share * planned / windows.count
        cap = f", max {source.max_epochs:g}" if source.max_epochs is not None else ""
        parts.append(f"{source.name} {share:.3g} ({windows.count:,} windows, {epochs:.2g} epochs{cap})")
    return f"mixture of {len(sources)} prepared stores, each rank reads its rows: " + "; ".join(parts)
