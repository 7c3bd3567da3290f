"""Data: sources -> tokenizer -> packed windows in one global order -> this rank's rows of batch k.

Two paths give the same kind of batches: streamed (stdlib / local / hf, tokenised while training; stream.py) and
prepared (tokenised once by `python -m llmtrain.data.prepare`, read by index; prepared.py)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llmtrain.config import DataConfig, reads_prepared_stores
from llmtrain.data.prefetch import Batches, Prefetched
from llmtrain.data.rl import PromptSet, RolloutShape
from llmtrain.data.sources import TRAIN, VALIDATION, open_documents, source_name
from llmtrain.data.stream import RankSlice, StreamedBatches, TrainingWindows, validation_windows
from llmtrain.data.tokenizers import Tokenizer, build_bpe, load_tokenizer
from llmtrain.errors import ConfigError
from llmtrain.model.scoring import TokenMarks

# The BPE is trained on a fixed shuffle of the training documents, so it does not change with the run's seed.
TOKENIZER_TRAINING_SEED = 0


@dataclass(frozen=True)
class ValidationSet:
    """This rank's rows of a fixed validation set: the run's one (name None), or a mixture source's (`val_loss` is
    then the weighted mean over the sources, each also logged as `val_loss/<name>`)."""

    name: str | None
    weight: float
    rows: np.ndarray


@dataclass(frozen=True)
class DataReading:
    """What this rank reads: windows of seq_len + 1 tokens in the order `seed` gives, its rows of each global
    training batch (`train`) and of the validation set (`validation`; None when eval is off), from `position` (a
    checkpoint's) when resuming."""

    seq_len: int
    seed: int
    train: RankSlice
    validation: RankSlice | None = None
    position: dict | None = None
    rollout: RolloutShape | None = None  # data=rl: how its prompts fill a batch


@dataclass(frozen=True)
class RolloutPrompts:
    """data=rl's prompts, which the slot rows of its training batches (`train`) and validation set (`validation`;
    None when eval is off) index."""

    train: PromptSet
    validation: PromptSet | None


@dataclass
class Data:
    tokenizer: Tokenizer
    train: Prefetched
    validation: list[ValidationSet]  # empty when eval is disabled
    description: str  # for the start summary
    masks_targets: bool = False  # some tokens are context only, their targets untrained (fine-tuning, packing.py)
    rollout: RolloutPrompts | None = None  # data=rl: rows are completion slots of these prompts (data/rl.py)
    separator: int | None = None  # the token between packed documents where it is not the tokenizer's end-of-text

    @property
    def document_separator(self) -> int:
        """The token after which a packed document ends (model/documents.py)."""
        return self.tokenizer.eos_id if self.separator is None else self.separator

    @property
    def marks(self) -> TokenMarks:
        """What a step needs of these tokens: their document separator, whether they leave targets untrained."""
        return TokenMarks(self.document_separator, self.masks_targets)

    def close(self) -> None:
        self.train.close()

    def source_tokens(self, seq_len: int) -> dict[str, int]:
        """`tokens/<source>`: the tokens trained on from each source of a mixture so far ({} for one source)."""
        sources = self.train.state_dict().get("sources", {})
        return {f"tokens/{name}": entry["taken"] * seq_len for name, entry in sources.items()}


# Above this many data-parallel ranks the streamed path's repeated tokenisation is worth a warning (README, "Data").
STREAMING_DP_LIMIT = 8


def streaming_scale_warning(data_cfg: DataConfig, dp_size: int) -> str | None:
    """The start-up warning for a streamed source read by more than STREAMING_DP_LIMIT data-parallel ranks."""
    if reads_prepared_stores(data_cfg) or dp_size <= STREAMING_DP_LIMIT:
        return None
    return (
        f"warning: data={data_cfg.source} is streamed, so each of the {dp_size} data-parallel ranks tokenises the "
        f"whole stream to keep 1/{dp_size} of it: tokenise once with `python -m llmtrain.data.prepare "
        f"data={data_cfg.source} ... prepare.out=DIR` and train with data=prepared data.path=DIR"
    )


def build_tokenizer(data_cfg, is_main: bool, barrier: Callable[[], None]) -> Tokenizer:
    """Load the configured tokenizer (a prepared store's own); a BPE not yet cached is trained by rank 0 while the
    others wait."""
    if data_cfg.source == "prepared":
        from llmtrain.data.prepared import store_tokenizer

        return store_tokenizer(data_cfg)
    if data_cfg.source == "mix":
        from llmtrain.data.mixture import mixture_tokenizer

        return mixture_tokenizer(data_cfg)
    bpe_path = None
    if data_cfg.tokenizer.kind == "bpe":
        if is_main:
            docs = open_documents(data_cfg, TRAIN).shuffle(
                seed=TOKENIZER_TRAINING_SEED, buffer_size=data_cfg.doc_shuffle_buffer
            )
            bpe_path = build_bpe(data_cfg, (ex["text"] for ex in docs))
        barrier()
    return load_tokenizer(data_cfg, bpe_path)


def build_data(
    data_cfg: DataConfig, tokenizer: Tokenizer, reading: DataReading, steps: int = 0, packs_documents: bool = False
) -> Data:
    """This rank's training batches and its rows of the validation set(s), as `reading` says; `steps`, the run's
    length, goes into a mixture's description (the epochs it implies); `packs_documents` (train.attention=document):
    conversations share windows."""
    if data_cfg.source == "sft":
        return _conversations(data_cfg, tokenizer, reading, packs_documents)
    if data_cfg.source == "preference":
        return _preferences(data_cfg, tokenizer, reading)
    if data_cfg.source == "rl":
        return _prompts(data_cfg, tokenizer, reading)
    if data_cfg.source == "mix":
        return _mixture(data_cfg, tokenizer, reading, steps)
    seq_len, train_slice, val_slice = reading.seq_len, reading.train, reading.validation
    if data_cfg.source == "prepared":
        from llmtrain.data.prepared import PreparedBatches, prepared_validation_rows

        assert data_cfg.path is not None, "config.validate requires data.path for data=prepared"
        validation = (
            [ValidationSet(None, 1.0, prepared_validation_rows(data_cfg.path, seq_len, val_slice))] if val_slice else []
        )
        batches = PreparedBatches(data_cfg.path, seq_len, reading.seed, train_slice, reading.position)
        description = (
            f"prepared {data_cfg.path} ({batches.windows.count:,} windows, each rank reads its rows), "
            f"tokenizer {batches.tokenizer_kind}"
        )
        return Data(tokenizer, Prefetched(batches), validation, description)

    windows = training_windows(data_cfg, tokenizer, seq_len, reading.seed)
    if reading.position is not None:
        windows.load_state_dict(reading.position)
    validation = []
    if val_slice is not None:
        val = _validation_windows(data_cfg, tokenizer, seq_len, val_slice.batch_size)
        if len(val) < val_slice.batch_size:
            fix = _validation_fix(data_cfg, tokenizer, reading, len(val))
            raise ConfigError(
                f"the validation set holds only {len(val)} windows of {seq_len + 1} tokens, {val_slice.batch_size} "
                f"needed (train.eval_batches x train.batch_size): {fix}"
            )
        validation = [ValidationSet(None, 1.0, val_slice.rows(val))]
    description = (
        f"{data_cfg.source} streamed (every rank tokenises the whole stream), tokenizer {data_cfg.tokenizer.kind}"
    )
    return Data(tokenizer, Prefetched(StreamedBatches(windows, train_slice)), validation, description)


def _mixture(data_cfg: DataConfig, tokenizer: Tokenizer, reading: DataReading, steps: int) -> Data:
    """build_data for data=mix: the sources' batches by weight, and each source's validation set."""
    from llmtrain.data.mixture import MixtureBatches, describe_mixture, mixture_sources, mixture_validation_rows

    sources = mixture_sources(list(data_cfg.sources or []))
    seq_len, val_slice, stop = reading.seq_len, reading.validation, data_cfg.on_exhausted == "stop"
    batches = MixtureBatches(sources, seq_len, reading.seed, reading.train, stop, reading.position)
    validation = []
    if val_slice is not None:
        rows = mixture_validation_rows(sources, seq_len, val_slice)
        if not rows:
            raise ConfigError(
                f"no source of the mixture holds {val_slice.batch_size} validation windows of {seq_len + 1} tokens "
                f"(train.eval_batches x train.batch_size): lower train.eval_batches, or prepare the sources with a "
                f"larger data.val_fraction"
            )
        validation = [ValidationSet(s.name, s.weight, rows[s.name]) for s in sources if s.name in rows]
    return Data(tokenizer, Prefetched(batches), validation, describe_mixture(sources, batches, steps))


def _conversations(data_cfg: DataConfig, tokenizer: Tokenizer, reading: DataReading, packed: bool) -> Data:
    """build_data for data=sft: the conversations tokenised with their assistant's tokens marked, in windows."""
    from llmtrain.data import sft

    seq_len, val_slice = reading.seq_len, reading.validation
    backend = sft.chat_template_of(tokenizer, data_cfg.tokenizer.name)
    splits = [TRAIN, VALIDATION] if val_slice is not None else [TRAIN]
    marked = {
        split: sft.tokenized(sft.read_conversations(data_cfg, split), tokenizer, backend, f"{split} conversations")
        for split in splits
    }
    if not marked[TRAIN]:
        raise ConfigError("data=sft found no training conversations: check data.path / data.name and data.val_fraction")
    every = [tokens for split in splits for tokens in marked[split]]
    separator = sft.packing_separator(every, sft.special_tokens(tokenizer, backend)) if packed else tokenizer.eos_id
    train = sft.Conversations.of(marked[TRAIN], seq_len + 1, separator, packed)
    validation = []
    if val_slice is not None:
        held_out = sft.Conversations.of(marked[VALIDATION], seq_len + 1, separator, packed)
        rows = held_out.windows(range(len(held_out.tokens)))
        if len(rows) < val_slice.batch_size:
            raise ConfigError(
                f"the held-out conversations fill {len(rows)} windows of {seq_len + 1} tokens, {val_slice.batch_size} "
                f"needed (train.eval_batches x train.batch_size): lower train.eval_batches, raise data.val_fraction "
                f"or name validation conversations with data.val_path"
            )
        validation = [ValidationSet(None, 1.0, val_slice.rows(rows[: val_slice.batch_size]))]
    ended = f"{backend.convert_ids_to_tokens(separator)} (id {separator})"
    windows = f"packed with document masking, each ended by {ended}" if packed else "one per window"
    description = f"sft: {train.describe()}, {windows}; trained on the assistant's tokens"
    batches = sft.ConversationBatches(train, reading.seed, reading.train, reading.position)
    return Data(tokenizer, Prefetched(batches), validation, description, masks_targets=True, separator=separator)


def _preferences(data_cfg: DataConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """build_data for data=preference: each pair's two answers after its prompt, a window each, trained on the
    answers' tokens."""
    from llmtrain.data import preference, sft

    val_slice, window = reading.validation, reading.seq_len + 1
    backend = sft.chat_template_of(tokenizer, data_cfg.tokenizer.name)
    splits = [TRAIN, VALIDATION] if val_slice is not None else [TRAIN]
    marked = {
        split: preference.tokenized_pairs(
            sft.read_records(data_cfg, split, preference.pair_of), tokenizer, backend, f"{split} pairs"
        )
        for split in splits
    }
    if not marked[TRAIN]:
        raise ConfigError("data=preference found no training pairs: check data.path / data.name and data.val_fraction")
    train = sft.Conversations.of(marked[TRAIN], window, tokenizer.eos_id, packed=False, group=2)
    validation = []
    if val_slice is not None:
        held_out = marked[VALIDATION]
        if len(held_out) < val_slice.batch_size:
            raise ConfigError(
                f"the held-out pairs fill {len(held_out)} windows, {val_slice.batch_size} needed (train.eval_batches x "
                f"train.batch_size): lower train.eval_batches, raise data.val_fraction or name validation pairs with "
                f"data.val_path"
            )
        rows = sft.Conversations.of(held_out, window, tokenizer.eos_id, packed=False).windows(range(len(held_out)))
        validation = [ValidationSet(None, 1.0, val_slice.rows(rows[: val_slice.batch_size]))]
    pairs = f"{len(train.tokens) // 2:,} pairs, {train.describe().replace(' samples', ' answers', 1)}"
    description = f"preference: {pairs}; each answer a window after its prompt, trained on the answer's tokens"
    batches = sft.ConversationBatches(train, reading.seed, reading.train, reading.position)
    return Data(tokenizer, Prefetched(batches), validation, description, masks_targets=True)


def _prompts(data_cfg: DataConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """build_data for data=rl: the prompts, each global batch their completions' slot rows (data/rl.py)."""
    from llmtrain.data import rl, sft

    shape, val_slice, window = reading.rollout, reading.validation, reading.seq_len + 1
    assert shape is not None, "data=rl is read with the rollout's shape"
    longest = window - shape.room - rl.HEADER
    sets = {
        split: rl.PromptSet.of(sft.read_records(data_cfg, split, rl.prompt_of), tokenizer, longest, f"{split} prompts")
        for split in ([TRAIN, VALIDATION] if val_slice is not None else [TRAIN])
    }
    train = sets[TRAIN]
    if not train.tokens:
        raise ConfigError("data=rl found no training prompts: check data.path / data.name and data.val_fraction")
    validation = []
    held_out = sets.get(VALIDATION)
    if held_out is not None and val_slice is not None:
        # the prompts of train.eval_batches global batches, one completion each
        prompt_slice = dataclasses.replace(val_slice, batch_size=val_slice.batch_size // shape.group)
        if len(held_out.tokens) < prompt_slice.batch_size:
            raise ConfigError(
                f"the held-out prompts are {len(held_out.tokens)}, {prompt_slice.batch_size} needed (the prompts of "
                f"train.eval_batches batches): lower train.eval_batches, raise data.val_fraction or name validation "
                f"prompts with data.val_path"
            )
        # negative draw numbers: the held-out prompts' completions are seeded apart from any training prompt's
        every = range(prompt_slice.batch_size)
        slots = held_out.rows(every, [-1 - i for i in every], window)
        validation = [ValidationSet(None, 1.0, prompt_slice.rows(slots))]
    description = (
        f"rl: {train.describe()}; {shape.group} completions of each, of {shape.room} tokens at most, stopping at "
        f"{', '.join(_token_name(tokenizer, token) for token in train.stop_ids)}"
    )
    batches = rl.PromptBatches(train, window, shape.group, shape.repeats, reading.seed, reading.train, reading.position)
    return Data(tokenizer, Prefetched(batches), validation, description, rollout=RolloutPrompts(train, held_out))


def _token_name(tokenizer: Tokenizer, token: int) -> str:
    """A token as the start summary names it: its text, or its id where it has none (a byte tokenizer's end)."""
    text = tokenizer.decode([token])
    return repr(text) if text else f"id {token}"


def training_windows(data_cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, seed: int) -> TrainingWindows:
    """The streamed path's seeded window stream for `data_cfg`, from its start."""
    return TrainingWindows(
        open_documents(data_cfg, TRAIN),
        tokenizer,
        seq_len,
        seed,
        data_cfg.doc_shuffle_buffer,
        data_cfg.window_shuffle_buffer,
        source=source_name(data_cfg),
    )


def _validation_windows(data_cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, count: int) -> np.ndarray:
    return validation_windows(open_documents(data_cfg, VALIDATION), tokenizer, seq_len, count)


def _validation_fix(data_cfg: DataConfig, tokenizer: Tokenizer, reading: DataReading, held: int) -> str:
    """Changes that give `reading`'s validation set, of which the corpus holds `held` windows, enough of them; a
    val_fraction is only named once it was tried."""
    assert reading.validation is not None, "only a run with a validation set needs it fixed"
    needed, batch_size = reading.validation.batch_size, reading.train.batch_size
    fits = [f"lower train.eval_batches to {held // batch_size}"] if held >= batch_size else []
    if data_cfg.val_split is not None or data_cfg.val_path is not None:
        named = "data.val_split" if data_cfg.val_split is not None else "data.val_path"
        return " or ".join([*fits, f"name more validation text with {named}", "lower train.batch_size"])
    if (fraction := _enough_val_fraction(data_cfg, tokenizer, reading.seq_len, held, needed)) is not None:
        return " or ".join([f"raise data.val_fraction to {fraction:g}", *fits])
    named = "data.val_path=<validation files>" if data_cfg.source == "local" else "a larger corpus"
    return " or ".join([f"use {named}", *fits, "lower train.eval_batches or train.batch_size"])


def _enough_val_fraction(
    data_cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, held: int, needed: int
) -> float | None:
    """The first of a few growing val_fraction values (below the 0.5 cap) whose validation set holds `needed`
    windows, each tried on the corpus (this only runs when the set was too small, so the corpus is finite and
    was just read whole); None when none does."""
    fraction = data_cfg.val_fraction
    for _ in range(4):
        # The held-out text grows about in proportion to val_fraction, give or take a ~4 KB chunk per document.
        fraction *= 1.2 * needed / held if held else 4
        scale = 10.0 ** (math.floor(math.log10(fraction)) - 1)
        fraction = round(math.ceil(fraction / scale) * scale, 6)  # two significant digits, rounded up
        if fraction >= 0.5:
            return None
        trial = copy.deepcopy(data_cfg)
        trial.val_fraction = fraction
        held = len(_validation_windows(trial, tokenizer, seq_len, needed))
        if held >= needed:
            return fraction
    return None


__all__ = [
    "Batches",
    "Data",
    "DataReading",
    "RankSlice",
    "RolloutPrompts",
    "ValidationSet",
    "build_data",
    "build_tokenizer",
    "streaming_scale_warning",
    "training_windows",
]
