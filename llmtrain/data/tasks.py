"""Multiple-choice tasks for evaluation in the training loop (`eval.tasks`): local jsonl files, one example a line,

    {"context": "A man sits on a roof. He", "choices": ["starts pulling up roofing.", "..."], "label": 0}

or HellaSwag's own fields (`ctx`, `endings`, `label`, the label possibly a string). Each choice is scored as
lm-evaluation-harness scores a multiple-choice task (its default `target_delimiter`, " "): the request is
(context, " " + choice), split into tokens as lm-eval's Hugging Face backend splits it (`request_tokens`), and only
the continuation's tokens are scored. acc_norm divides by the choice's length in characters (`Task.lengths`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import ConfigError
from llmtrain.model.scoring import UNSCORED

# Rows are padded to a multiple of this: context and sequence parallelism split each row into 2 cp (or tp) parts.
ROW_MULTIPLE = 64
# What lm-eval puts between a context and each choice where a task names nothing else (its default target_delimiter).
TARGET_DELIMITER = " "


@dataclass(frozen=True)
class Task:
    """A task's rows, one per (example, choice), examples in file order."""

    name: str  # the file's name without its extension
    inputs: np.ndarray  # (rows, width <= seq_len) token ids, padded with 0 after the choice
    targets: np.ndarray  # (rows, width) the next tokens where a choice token is predicted, UNSCORED elsewhere
    choices: np.ndarray  # (examples,) choices per example
    labels: np.ndarray  # (examples,) the right choice's index
    lengths: np.ndarray  # (rows,) each choice string's length in characters (the delimiter not counted): acc_norm's


def _example(record: dict, where: str) -> tuple[str, list[str], int]:
    context = record.get("context", record.get("ctx"))
    choices = record.get("choices", record.get("endings"))
    label = record.get("label")
    if not isinstance(context, str) or not isinstance(choices, list) or not choices or label is None:
        raise ConfigError(f"{where} is not an example: give context (or ctx), choices (or endings) and label")
    index = int(label)
    if not 0 <= index < len(choices):
        raise ConfigError(f"{where}: label {label} is not one of its {len(choices)} choices")
    return context, [str(choice) for choice in choices], index


def request_tokens(tokenizer: Tokenizer, requests: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(context tokens, continuation tokens) of each (context, continuation), split as lm-eval's Hugging Face
    backend splits a request (TemplateLM.loglikelihood), so that the same text scores the same tokens:

    - the context's trailing whitespace moves to the continuation (it belongs to the next word's token);
    - the continuation's tokens are those of context + continuation after the context's own tokens, so a token
      that a tokenizer would merge across the boundary is encoded as in the whole text;
    - an empty context is the end-of-text token (lm-eval's prefix token)."""
    texts = []
    for context, continuation in requests:
        stripped = context.rstrip()
        texts += [stripped, context + continuation]
    encoded = iter(tokenizer.encode_batch(texts))
    pairs = []
    for context, _ in requests:
        context_ids, whole = next(encoded).tolist(), next(encoded).tolist()
        if context:
            pairs.append((context_ids, whole[len(context_ids) :]))
        else:
            pairs.append(([tokenizer.eos_id], whole))
    return pairs


def read_task(path: str, tokenizer: Tokenizer, seq_len: int, limit: int | None) -> Task:
    """The first `limit` examples of the jsonl file at `path` (all: None) as scoring rows. A row longer than
    seq_len + 1 tokens keeps its end, as lm-eval cuts one: the choice whole, the context's beginning cut."""
    examples = []
    with open(os.path.expanduser(path), encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"eval.tasks: {path} line {number} is not JSON ({error.msg})") from None
                examples.append(_example(record, f"eval.tasks: {path} line {number}"))
            if limit is not None and len(examples) == limit:
                break
    requests = [(context, TARGET_DELIMITER + choice) for context, choices, _ in examples for choice in choices]
    rows, scored = [], []  # each row's tokens (at most seq_len + 1, its end kept), its continuation's token count
    for context_ids, continuation_ids in request_tokens(tokenizer, requests):
        row = np.asarray(context_ids + continuation_ids, dtype=np.int64)[-(seq_len + 1) :]
        rows.append(row)
        scored.append(min(len(continuation_ids), len(row) - 1))
    inputs, targets = scoring_rows(rows, scored, seq_len)
    name = os.path.splitext(os.path.basename(path))[0]
    return Task(
        name,
        inputs,
        targets,
        np.array([len(choices) for _, choices, _ in examples]),
        np.array([label for _, _, label in examples]),
        np.array([len(choice) for _, choices, _ in examples for choice in choices], dtype=np.float64),
    )


def scoring_rows(rows: list[np.ndarray], scored: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of token rows of at most seq_len + 1 tokens whose last `scored[i]` tokens are scored:
    inputs a row's tokens but its last, padded with 0; targets the next token where a scored token is predicted,
    UNSCORED elsewhere. As wide as the longest row (rounded up to a multiple of ROW_MULTIPLE, which the layouts'
    sequence splits divide), not seq_len: rows of few tokens cost what their tokens cost."""
    width = min(seq_len, -(-max((len(row) - 1 for row in rows), default=1) // ROW_MULTIPLE) * ROW_MULTIPLE)
    inputs = np.zeros((len(rows), width), dtype=np.int64)
    targets = np.full((len(rows), width), UNSCORED, dtype=np.int64)
    for i, (row, length) in enumerate(zip(rows, scored)):
        inputs[i, : len(row) - 1] = row[:-1]
        targets[i, len(row) - 1 - length : len(row) - 1] = row[len(row) - length :]
    return inputs, targets
