"""Each data source's reader (llmtrain/catalog/data_sources.py names one per source): (the job's config, the
tokenizer, where this rank reads) -> Data. Streamed text (stdlib, local, hf: stream.py), a prepared store
(prepared.py), a mixture of stores (mixture.py), conversations (sft.py), preference pairs (preference.py) and prompts
to sample and reward (rl.py)."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np

from llmtrain.catalog import data_source
from llmtrain.config import DataConfig, RootConfig
from llmtrain.data.prefetch import Prefetched
from llmtrain.data.reading import Data, DataReading, ValidationSet
from llmtrain.data.sources import TRAIN, VALIDATION, open_documents, source_name
from llmtrain.data.stream import StreamedBatches, TrainingWindows, validation_windows
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import ConfigError


def read_text(config: RootConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """data=stdlib, local or hf: the documents streamed into seeded windows, every rank tokenising the whole stream
    to keep its rows; a validation set held out of the same stream."""
    data_cfg, seq_len, val_slice = config.data, config.train.seq_len, reading.validation
    windows = training_windows(data_cfg, tokenizer, seq_len, config.seed)
    if reading.position is not None:
        windows.load_state_dict(reading.position)
    validation = []
    if val_slice is not None:
        val = _validation_windows(data_cfg, tokenizer, seq_len, val_slice.batch_size)
        if len(val) < val_slice.batch_size:
            fix = _validation_fix(data_cfg, tokenizer, seq_len, reading, len(val))
            raise ConfigError(
                f"the validation set holds only {len(val)} windows of {seq_len + 1} tokens, {val_slice.batch_size} "
                f"needed (train.eval_batches x train.batch_size): {fix}"
            )
        validation = [ValidationSet(None, 1.0, val_slice.rows(val))]
    description = (
        f"{data_cfg.source} streamed (every rank tokenises the whole stream), tokenizer {data_cfg.tokenizer.kind}"
    )
    return Data(tokenizer, Prefetched(StreamedBatches(windows, reading.train)), validation, description)


def read_prepared(config: RootConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """data=prepared: a store's windows by index, each rank reading its own rows."""
    from llmtrain.data.prepared import PreparedBatches, prepared_validation_rows

    data_cfg, seq_len, val_slice = config.data, config.train.seq_len, reading.validation
    assert data_cfg.path is not None, "config.validate requires data.path for data=prepared"
    validation = (
        [ValidationSet(None, 1.0, prepared_validation_rows(data_cfg.path, seq_len, val_slice))] if val_slice else []
    )
    batches = PreparedBatches(data_cfg.path, seq_len, config.seed, reading.train, reading.position)
    description = (
        f"prepared {data_cfg.path} ({batches.windows.count:,} windows, each rank reads its rows), "
        f"tokenizer {batches.tokenizer_kind}"
    )
    return Data(tokenizer, Prefetched(batches), validation, description)


def read_mixture(config: RootConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """data=mix: the sources' batches by weight, and each source's validation set."""
    from llmtrain.data.mixture import MixtureBatches, describe_mixture, mixture_sources, mixture_validation_rows

    data_cfg, seq_len, val_slice = config.data, config.train.seq_len, reading.validation
    sources = mixture_sources(list(data_cfg.sources or []))
    stop = data_cfg.on_exhausted == "stop"
    batches = MixtureBatches(sources, seq_len, config.seed, reading.train, stop, reading.position)
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
    return Data(tokenizer, Prefetched(batches), validation, describe_mixture(sources, batches, config.train.steps))


def read_conversations(config: RootConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """data=sft: the conversations tokenised with their assistant's tokens marked, in windows (packed with
    train.attention=document)."""
    from llmtrain.data import sft

    data_cfg, seq_len, val_slice = config.data, config.train.seq_len, reading.validation
    packed = config.train.attention == "document"
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
    batches = sft.ConversationBatches(train, config.seed, reading.train, reading.position)
    return Data(tokenizer, Prefetched(batches), validation, description, masks_targets=True, separator=separator)


def read_pairs(config: RootConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """data=preference: each pair's two answers after its prompt, a window each, trained on the answers' tokens."""
    from llmtrain.data import preference, sft

    data_cfg, val_slice, window = config.data, reading.validation, config.train.seq_len + 1
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
    batches = sft.ConversationBatches(train, config.seed, reading.train, reading.position)
    return Data(tokenizer, Prefetched(batches), validation, description, masks_targets=True)


def read_prompts(config: RootConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """data=rl: the prompts, each global batch their completions' slots (data/rl.py): rl.group_size of each prompt,
    each batch taken rl.iterations times, rl.max_new_tokens kept after every prompt for its completion."""
    from llmtrain.data import rl, sft

    data_cfg, val_slice, group = config.data, reading.validation, config.rl.group_size
    longest = config.train.seq_len - config.rl.max_new_tokens
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
        prompt_slice = dataclasses.replace(val_slice, batch_size=val_slice.batch_size // group)
        if len(held_out.tokens) < prompt_slice.batch_size:
            raise ConfigError(
                f"the held-out prompts are {len(held_out.tokens)}, {prompt_slice.batch_size} needed (the prompts of "
                f"train.eval_batches batches): lower train.eval_batches, raise data.val_fraction or name validation "
                f"prompts with data.val_path"
            )
        # negative draw numbers: the held-out prompts' completions are seeded apart from any training prompt's
        every = range(prompt_slice.batch_size)
        slots = rl.PromptBatch(held_out, list(every), [-1 - i for i in every])
        validation = [ValidationSet(None, 1.0, slots.sliced(prompt_slice))]
    description = (
        f"rl: {train.describe()}; {group} completions of each, of {config.rl.max_new_tokens} tokens at most, "
        f"stopping at "
        f"{', '.join(_token_name(tokenizer, token) for token in train.stop_ids)}"
    )
    batches = rl.PromptBatches(train, group, config.rl.iterations, config.seed, reading.train, reading.position)
    return Data(tokenizer, Prefetched(batches), validation, description)


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


def _validation_fix(data_cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, reading: DataReading, held: int) -> str:
    """Changes that give `reading`'s validation set, of which the corpus holds `held` windows, enough of them; a
    val_fraction is only named once it was tried."""
    assert reading.validation is not None, "only a run with a validation set needs it fixed"
    needed, batch_size = reading.validation.batch_size, reading.train.batch_size
    fits = [f"lower train.eval_batches to {held // batch_size}"] if held >= batch_size else []
    if data_cfg.val_split is not None or data_cfg.val_path is not None:
        named = "data.val_split" if data_cfg.val_split is not None else "data.val_path"
        return " or ".join([*fits, f"name more validation text with {named}", "lower train.batch_size"])
    if (fraction := _enough_val_fraction(data_cfg, tokenizer, seq_len, held, needed)) is not None:
        return " or ".join([f"raise data.val_fraction to {fraction:g}", *fits])
    named = "data.val_path=<validation files>" if data_source(data_cfg.source).local_files else "a larger corpus"
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
