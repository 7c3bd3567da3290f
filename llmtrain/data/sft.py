"""Supervised fine-tuning data (`data=sft`): conversations, trained on the assistant's tokens alone.

A record is a conversation (`messages: [{role, content}, ...]`) or a prompt/response pair (`prompt` with `response`
or `completion`). Each is rendered with the tokenizer's own chat template (transformers' `apply_chat_template`, the
template saved with the model) and its tokens marked trained or not: the assistant's turns are trained, with the
template's end of turn (so the model learns to stop); system and user turns and the template's role headers are
context only. A trained token is stored as its id, an untrained one as its bitwise complement (packing.untrained), so a
window stays one int64 array through shuffling, batching and checkpoints; the micro-batches give the target of an
untrained token UNSCORED (stream.RankSlice), and the loss is the mean over trained targets.

The assistant's tokens are found by rendering growing prefixes of the conversation: assistant turn i spans the
tokens between the render up to its prompt (with the generation prompt) and the render up to its end. Where those
renders are prefixes of the whole conversation's, it is one sample with every assistant turn trained. A template
that renders an earlier turn otherwise than a last one (Qwen3's keeps a last answer's reasoning in <think> and
drops an earlier one's) gives one sample per assistant turn instead: the conversation up to that turn, rendered as
the template renders it, with that turn trained, so each answer is learned as the model is asked for it. A template
whose render up to a turn does not begin with that turn's prompt cannot be split at all and is refused by name.

Windows: with `train.attention=document` whole conversations follow each other in a window, each ended by the
tokenizer's end-of-text token, which separates packed documents (model/documents.py): a conversation never attends
to another. With causal attention a window holds one conversation. Either way the rest of a window is padding that
is never trained. A conversation longer than a window is cut to it (the start summary says how many and how many
trained tokens that drops). Each epoch shuffles the conversations with the seed and the epoch; global batch k is
windows [k B, (k + 1) B) of the epochs' windows in turn, so a position is (epoch, window) and a resumed run reads
exactly what the original would have.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch.distributed as dist

from llmtrain.data.files import local_data_files
from llmtrain.data.packing import untrained, window_tokens
from llmtrain.data.stream import RankSlice
from llmtrain.data.tokenizers import FastTokenizer, Tokenizer
from llmtrain.errors import ConfigError, first_line
from llmtrain.hub import from_hub

T = TypeVar("T")

# Conversations rendered and tokenised together: the fast tokenizer encodes a batch in parallel.
RENDER_BATCH = 256


# -- reading ----------------------------------------------------------------------------------------------------
def _messages_of(record: object, where: str) -> list[dict]:
    """A record's conversation as chat messages; ConfigError naming the record when it is not one."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        messages = record["messages"]
    elif isinstance(record, dict) and "prompt" in record and ("response" in record or "completion" in record):
        answer = record["response"] if "response" in record else record["completion"]
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": answer}]
    else:
        fields = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ConfigError(
            f"{where} is not a conversation (fields: {fields}): give each record `messages: [{{role, content}}, ...]` "
            f"or `prompt` with `response`"
        )
    if not all(is_message(m) for m in messages):
        raise ConfigError(f"{where}: each message needs a `role` and a text `content`: fix that record")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where} has no assistant turn, so nothing of it would be trained: remove it or answer it")
    return messages


def is_message(message: object) -> bool:
    """Whether `message` is a chat message: a `role` and a text `content`."""
    return isinstance(message, dict) and isinstance(message.get("content"), str) and "role" in message


def _records_of_file(path: str, key: str) -> Iterator[tuple[str, object]]:
    """(where, record) for each record of a .jsonl or .parquet file."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for row, record in enumerate(pq.read_table(path).to_pylist()):
            yield f"{key}: {path}, row {row}", record
        return
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{key}: {path}, line {number}"
            try:
                yield where, json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ConfigError(f"{where} is not a JSON object ({first_line(error)}): fix or remove it") from None


def read_conversations(data_cfg, split: str) -> list[list[dict]]:
    """The conversations of `split` ("train" or "validation"): read_records of each record's messages."""
    return read_records(data_cfg, split, _messages_of)


def read_records(data_cfg, split: str, parse: Callable[[object, str], T]) -> list[T]:
    """What `parse` makes of each record (given where it is) of `split` ("train" or "validation"): the files of
    data.path (data.val_path) or the hub dataset's split (data.val_split); without those, validation holds out
    data.val_fraction of them, chosen by a hash of each one (the same on every run and every rank)."""
    validation = split == "validation"
    separate = data_cfg.val_path if data_cfg.path else data_cfg.val_split
    if validation and separate is not None:
        return [
            parse(r, where) for where, r in _records(data_cfg, "data.val_path" if data_cfg.path else "data.val_split")
        ]
    every = (parse(r, where) for where, r in _records(data_cfg, "data.path" if data_cfg.path else "data.split"))
    if separate is not None:
        return list(every)
    return [item for item in every if _held_out(item, data_cfg.val_fraction) == validation]


def _held_out(item: object, fraction: float) -> bool:
    return zlib.crc32(json.dumps(item, sort_keys=True).encode()) / 2**32 < fraction


def _records(data_cfg, key: str) -> Iterator[tuple[str, object]]:
    """(where, record) of each record data.path (data.val_path) or the hub dataset's split names."""
    if key in ("data.path", "data.val_path"):
        for path in local_data_files(getattr(data_cfg, key.removeprefix("data."))):
            yield from _records_of_file(path, key)
        return
    import datasets

    split = getattr(data_cfg, key.removeprefix("data."))
    rows = from_hub(
        "data.name",
        data_cfg.name,
        lambda: datasets.load_dataset(data_cfg.name, data_cfg.subset, split=split),
        repo_type="dataset",
    )
    for row, record in enumerate(rows):
        yield f"dataset {data_cfg.name} ({split}), row {row}", record


# -- rendering ---------------------------------------------------------------------------------------------------
def chat_template_of(tokenizer: Tokenizer, name: str | None):
    """The transformers tokenizer whose chat template renders conversations; ConfigError when there is none."""
    backend = getattr(tokenizer, "backend", None)
    if not isinstance(tokenizer, FastTokenizer) or not hasattr(backend, "apply_chat_template"):
        raise ConfigError(
            "data=sft and data=preference render text with a transformers tokenizer's chat template: set "
            "data.tokenizer.kind=hf data.tokenizer.name=<the model's directory or hub name>"
        )
    if not getattr(backend, "chat_template", None):
        raise ConfigError(
            f"data.tokenizer.name={name}: the tokenizer has no chat template, so conversations cannot be rendered: "
            f"use the chat (instruct) model's tokenizer, or add `chat_template` to its tokenizer_config.json"
        )
    return backend


def _renders(backend, messages: list[dict]) -> list[str]:
    """The conversation's render, then for each assistant turn the renders up to its prompt and up to its end."""
    texts = [backend.apply_chat_template(messages, tokenize=False)]
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            texts.append(backend.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
            texts.append(backend.apply_chat_template(messages[: i + 1], tokenize=False))
    return texts


def _marked(encoded: list[np.ndarray], where: str) -> list[np.ndarray]:
    """The conversation's samples from its renders' tokens, the assistant's kept as ids and the rest untrained: the
    whole conversation, or, where the template renders an earlier turn otherwise within the conversation than as
    its last (Qwen3 drops an earlier answer's reasoning), one sample per assistant turn, the conversation up to it."""
    whole, spans = encoded[0], encoded[1:]
    turns = list(zip(spans[::2], spans[1::2]))
    if not all(starts_with(turn, prompt) for prompt, turn in turns):
        raise ConfigError(
            f"{where}: the chat template renders a conversation's turns differently after the generation prompt than "
            f"with the answer, so the assistant's tokens cannot be told apart: use a template that renders turn by turn"
        )
    if all(starts_with(whole, turn) for _, turn in turns):
        trained = np.zeros(len(whole), dtype=bool)
        for prompt, turn in turns:
            trained[len(prompt) : len(turn)] = True
        return [np.where(trained, whole, untrained(whole))]
    return [np.concatenate([untrained(turn[: len(prompt)]), turn[len(prompt) :]]) for prompt, turn in turns]


def starts_with(tokens: np.ndarray, prefix: np.ndarray) -> bool:
    return len(prefix) <= len(tokens) and bool(np.array_equal(tokens[: len(prefix)], prefix))


def tokenized(conversations: list[list[dict]], tokenizer: Tokenizer, backend, what: str) -> list[np.ndarray]:
    """The conversations' samples (`_marked`: one a conversation, or one an assistant turn), their tokens marked (the
    assistant's trained)."""
    return rendered_and_marked(
        conversations, tokenizer, lambda messages: _renders(backend, messages), _marked, what, "conversation"
    )


def rendered_and_marked(
    items: list[T],
    tokenizer: Tokenizer,
    render: Callable[[T], list[str]],
    mark: Callable[[list[np.ndarray], str], list[np.ndarray]],
    what: str,
    unit: str,
) -> list[np.ndarray]:
    """The samples `mark` makes of each item's renders' tokens (given where the item is), rendered and encoded in
    batches of RENDER_BATCH items, with a progress bar on the first rank when there are many."""
    from tqdm import tqdm

    result: list[np.ndarray] = []
    first_rank = not dist.is_initialized() or dist.get_rank() == 0
    show = first_rank and len(items) > 4 * RENDER_BATCH
    with tqdm(total=len(items), desc=f"tokenising {what}", unit=f" {unit}s", disable=not show) as bar:
        for start in range(0, len(items), RENDER_BATCH):
            chunk = items[start : start + RENDER_BATCH]
            renders = [render(item) for item in chunk]
            encoded = iter(tokenizer.encode_batch([text for texts in renders for text in texts]))
            for i, texts in enumerate(renders):
                result.extend(mark([next(encoded) for _ in texts], f"{what}, {unit} {start + i}"))
            bar.update(len(chunk))
    return result


# -- windows -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Conversations:
    """Tokenised conversations and the windows they fill: `tokens` each marked (and, when packed, ended by the
    untrained separator), `cut` how many were longer than a window and lost their tail, `cut_trained` the trained
    tokens those tails held."""

    tokens: list[np.ndarray]
    window: int
    separator: int
    packed: bool
    cut: int
    cut_trained: int
    group: int = 1  # samples that stay together, in order, when an epoch shuffles them (a preference pair: 2)

    @classmethod
    def of(cls, marked: list[np.ndarray], window: int, separator: int, packed: bool, group: int = 1) -> Conversations:
        """`marked` conversations (`tokenized`) in windows of `window` tokens; `packed`: several to a window, each
        ended by `separator` (`packing_separator`), which occurs in none of them; `group`: consecutive samples
        shuffled as one."""
        ended = [np.append(t, untrained(np.int64(separator))) if packed else t for t in marked]
        cut = [t for t in ended if len(t) > window]
        cut_trained = sum(int((t[window:] >= 0).sum()) for t in cut)
        return cls([t[:window] for t in ended], window, separator, packed, len(cut), cut_trained, group)

    def windows(self, order: np.ndarray | range) -> np.ndarray:
        """(n, window) windows of the conversations in `order`, each padded with untrained separators."""
        rows: list[np.ndarray] = []
        current: list[np.ndarray] = []
        used = 0
        pad = untrained(np.int64(self.separator))
        for i in order:
            tokens = self.tokens[i]
            if current and (not self.packed or used + len(tokens) > self.window):
                rows.append(np.concatenate([*current, np.full(self.window - used, pad)]))
                current, used = [], 0
            current.append(tokens)
            used += len(tokens)
        if current:
            rows.append(np.concatenate([*current, np.full(self.window - used, pad)]))
        return np.stack(rows) if rows else np.zeros((0, self.window), dtype=np.int64)

    def epoch(self, seed: int, epoch: int) -> np.ndarray:
        groups = np.random.default_rng([seed, epoch]).permutation(len(self.tokens) // self.group)
        return self.windows((groups[:, None] * self.group + np.arange(self.group)).ravel())

    def describe(self) -> str:
        trained = sum(int((t >= 0).sum()) for t in self.tokens)
        line = f"{len(self.tokens):,} samples, {trained:,} trained tokens"
        if self.cut:
            line += (
                f"; {self.cut:,} longer than a window of {self.window} tokens are cut to it, dropping "
                f"{self.cut_trained:,} trained tokens (raise train.seq_len to keep them)"
            )
        return line


def special_tokens(tokenizer: Tokenizer, backend) -> list[int]:
    """The tokenizer's end-of-text token, then its other special tokens in id order: the candidates to separate
    packed conversations."""
    specials = sorted(i for i, token in backend.added_tokens_decoder.items() if token.special)
    return [tokenizer.eos_id, *(i for i in specials if i != tokenizer.eos_id)]


def packing_separator(marked: list[np.ndarray], candidates: list[int]) -> int:
    """The first of `candidates` that no conversation holds: the token that ends each packed conversation, so that
    none attends to the next (model/documents.py finds documents by it). A chat template that ends every turn with
    the tokenizer's end-of-text (Llama 3 Instruct's `<|eot_id|>`) leaves another special token free (its
    `<|end_of_text|>`)."""
    held = set(np.unique(np.concatenate([window_tokens(t) for t in marked])).tolist()) if marked else set()
    free = [token for token in candidates if token not in held]
    if not free:
        raise ConfigError(
            f"every special token of the tokenizer ({len(candidates)}, end-of-text id {candidates[0]} first) occurs "
            f"inside conversations, so none can separate packed ones: set train.attention=causal (one conversation "
            f"per window)"
        )
    return free[0]


class ConversationBatches:
    """This rank's rows of global batch k of the epochs' windows in turn (the Batches protocol of prefetch.py)."""

    def __init__(self, conversations: Conversations, seed: int, rank_slice: RankSlice, position: dict | None):
        self._conversations, self._seed, self._slice = conversations, seed, rank_slice
        self._epoch: int = position["epoch"] if position else 0
        self._offset: int = position["window"] if position else 0
        self._rows = conversations.epoch(seed, self._epoch)

    def next(self) -> np.ndarray:
        taken: list[np.ndarray] = []
        needed = self._slice.batch_size
        while needed:
            if self._offset == len(self._rows):
                self._epoch, self._offset = self._epoch + 1, 0
                self._rows = self._conversations.epoch(self._seed, self._epoch)
            part = self._rows[self._offset : self._offset + needed]
            taken.append(part)
            self._offset += len(part)
            needed -= len(part)
        return self._slice.rows(np.concatenate(taken))

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "window": self._offset}
