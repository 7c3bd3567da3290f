"""Prompts for online reinforcement learning (`data=rl`, train/grpo_objective.py): what to sample completions of,
and what the reward reads besides them.

A record holds `prompt` (text, or chat messages) and any other columns (GSM8K's `answer`, say), which reach the
reward functions as keywords, as TRL's GRPOTrainer passes them. A text prompt is tokenised as it is; messages are
rendered with the tokenizer's chat template and its generation prompt (the assistant's turn opened), as TRL renders
a conversational prompt. A completion ends at the tokenizer's end-of-text or, with a chat template, at the
template's end of turn (`stop_ids`).

Batches: a global batch holds `train.batch_size` completions, `rl.group_size` of each of its prompts in a row; each
is one completion's slot, and a rank's slots of a batch are a PromptBatch: each slot's record (its index in the
prompt set: its text, tokens and columns) and draw. `draw` numbers the prompt in the run's order of prompts (epoch x
prompts + position), which seeds its completions (model/sampling.py), so the same prompt drawn in another epoch
samples afresh and a resumed run draws what the original would have. Each epoch shuffles the prompts with the seed
and the epoch; with rl.iterations = μ the same prompts fill μ global batches in a row (their rollout is trained on μ
times). A prompt with no room for rl.max_new_tokens after it in train.seq_len tokens is left out, counted in the
start summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from llmtrain.data.sft import chat_template_of, is_message
from llmtrain.data.stream import RankSlice
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import ConfigError


def prompt_of(record: object, where: str) -> dict[str, Any]:
    """A record as {"prompt": text or messages, its other columns...}; ConfigError naming it when it is not one."""
    if not isinstance(record, dict) or "prompt" not in record:
        fields = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ConfigError(
            f"{where} is not a prompt (fields: {fields}): give each record `prompt` (text or chat messages) and the "
            f"columns its reward reads"
        )
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return record
    if isinstance(prompt, list) and prompt and all(is_message(m) for m in prompt):
        return record
    raise ConfigError(f"{where}: `prompt` is neither text nor chat messages with a `role` and a text `content`")


def end_of_turn(backend) -> int | None:
    """The token a chat template closes an assistant's turn with (Qwen's <|im_end|>, Llama 3's <|eot_id|>, Gemma's
    <end_of_turn>): the first after the answer in a rendered conversation."""
    user = [{"role": "user", "content": "Q"}]
    opened = backend.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    answered = backend.apply_chat_template([*user, {"role": "assistant", "content": "X"}], tokenize=False)
    closing = answered[len(opened) :].partition("X")[2]
    ids = backend(closing, add_special_tokens=False)["input_ids"]
    return ids[0] if ids else None


@dataclass(frozen=True)
class PromptSet:
    """Prompts as given (text or messages), their tokens, their records' other columns, the tokens a completion
    stops at, and how many prompts were left out for want of room."""

    prompts: list[Any]
    tokens: list[np.ndarray]
    columns: dict[str, list[Any]]
    stop_ids: tuple[int, ...]
    left_out: int

    @classmethod
    def of(cls, records: list[dict[str, Any]], tokenizer: Tokenizer, longest: int, what: str) -> PromptSet:
        """`records` (prompt_of's) tokenised, those of more than `longest` tokens left out; ConfigError where none
        is left, or where messages come without a chat template to render them."""
        backend = getattr(tokenizer, "backend", None)
        conversational = any(not isinstance(r["prompt"], str) for r in records)
        texts = [r["prompt"] for r in records]
        stops = [tokenizer.eos_id]
        if conversational:
            backend = chat_template_of(tokenizer, None)
            texts = [
                p if isinstance(p, str) else backend.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                for p in texts
            ]
        if backend is not None and getattr(backend, "chat_template", None):
            closing = end_of_turn(backend)
            stops += [closing] if closing is not None and closing != tokenizer.eos_id else []
        encoded = tokenizer.encode_batch(texts) if texts else []
        kept = [i for i, tokens in enumerate(encoded) if 0 < len(tokens) <= longest]
        if records and not kept:
            raise ConfigError(
                f"every one of the {len(records)} {what} is empty or longer than {longest} tokens (train.seq_len - "
                f"rl.max_new_tokens): raise train.seq_len or lower rl.max_new_tokens"
            )
        names = [name for name in records[0] if name != "prompt"] if records else []
        missing = [name for name in names if any(name not in records[i] for i in kept)]
        if missing:
            raise ConfigError(f"{what}: some records lack {', '.join(missing)}: give every record the same columns")
        return cls(
            [records[i]["prompt"] for i in kept],
            [np.asarray(encoded[i], dtype=np.int64) for i in kept],
            {name: [records[i][name] for i in kept] for name in names},
            tuple(stops),
            len(records) - len(kept),
        )

    def describe(self) -> str:
        lengths = [len(t) for t in self.tokens]
        line = f"{len(self.tokens):,} prompts of {min(lengths)}-{max(lengths)} tokens" if lengths else "no prompts"
        if self.columns:
            line += f", columns {', '.join(self.columns)}"
        if self.left_out:
            line += f"; {self.left_out:,} left out, longer than train.seq_len - rl.max_new_tokens tokens"
        return line


@dataclass(frozen=True)
class PromptBatch:
    """Completion slots of a batch, a rank's or a global one: each slot's record in `prompts` and its draw (the
    module docstring), the slots of one prompt consecutive."""

    prompts: PromptSet
    records: list[int]
    draws: list[int]

    def __len__(self) -> int:
        return len(self.records)

    @property
    def tokens(self) -> list[list[int]]:
        """Each slot's prompt tokens."""
        return [self.prompts.tokens[record].tolist() for record in self.records]

    @property
    def given(self) -> list[Any]:
        """Each slot's prompt as given: text, or chat messages."""
        return [self.prompts.prompts[record] for record in self.records]

    @property
    def columns(self) -> dict[str, list[Any]]:
        """Each slot's record's other columns, by name: what the rewards read beside the completions."""
        return {name: [values[record] for record in self.records] for name, values in self.prompts.columns.items()}

    def every(self, group: int) -> PromptBatch:
        """One slot of each prompt whose `group` slots are consecutive here."""
        return PromptBatch(self.prompts, self.records[::group], self.draws[::group])

    def sliced(self, rank_slice: RankSlice) -> PromptBatch:
        """This rank's slots of a global batch."""
        first = rank_slice.dp_rank * rank_slice.per_rank
        mine = slice(first, first + rank_slice.per_rank)
        return PromptBatch(self.prompts, self.records[mine], self.draws[mine])


class PromptBatches:
    """This rank's slots of global batch k (the Batches protocol of prefetch.py): the epochs' shuffled prompts in
    turn, batch_size / group of them a batch, each `group` times, each batch `repeats` times in a row."""

    def __init__(
        self,
        prompts: PromptSet,
        group: int,
        repeats: int,
        seed: int,
        rank_slice: RankSlice,
        position: dict | None,
    ):
        self._prompts, self._group, self._repeats = prompts, group, repeats
        self._seed, self._slice = seed, rank_slice
        self._taken: int = position["taken"] if position else 0  # global batches taken

    def next(self) -> PromptBatch:
        per_batch, count = self._slice.batch_size // self._group, len(self._prompts.tokens)
        first = self._taken // self._repeats * per_batch  # the batch's first draw
        draws = list(range(first, first + per_batch))
        orders: dict[int, np.ndarray] = {}
        for drawn in draws:
            if drawn // count not in orders:
                orders[drawn // count] = np.random.default_rng([self._seed, drawn // count]).permutation(count)
        records = [int(orders[drawn // count][drawn % count]) for drawn in draws]
        self._taken += 1
        repeated = [(record, drawn) for record, drawn in zip(records, draws) for _ in range(self._group)]
        slots = PromptBatch(self._prompts, [record for record, _ in repeated], [drawn for _, drawn in repeated])
        return slots.sliced(self._slice)

    def state_dict(self) -> dict:
        return {"taken": self._taken}
