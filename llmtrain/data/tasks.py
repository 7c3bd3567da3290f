"""Multiple-choice tasks for evaluation in the training loop (`eval.tasks`): local jsonl files, one example a line,

    {"context": "A man sits on a roof. He", "choices": ["starts pulling up roofing.", "..."], "label": 0}

or HellaSwag's own fields (`ctx`, `endings`, `label`, the label possibly a string). Each choice is scored as the
continuation of its context (build-nanogpt's protocol): the row holds context + " " + choice, and only the choice's
tokens are scored, so the model's loss on them ranks the choices.
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


@dataclass(frozen=True)
class Task:
    """A task's rows, one per (example, choice), examples in file order."""

    name: str  # the file's name without its extension
    inputs: np.ndarray  # (rows, width <= seq_len) token ids, padded with 0 after the choice
    targets: np.ndarray  # (rows, width) the next tokens where a choice token is predicted, UNSCORED elsewhere
    choices: np.ndarray  # (examples,) choices per example
    labels: np.ndarray  # (examples,) the right choice's index


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


def read_task(path: str, tokenizer: Tokenizer, seq_len: int, limit: int | None) -> Task:
    """The first `limit` examples of the jsonl file at `path` (all: None) as scoring rows. A row longer than
    seq_len + 1 tokens keeps its end: the choice whole, the context's beginning cut."""
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
    texts = [text for context, choices, _ in examples for text in (context, *(" " + c for c in choices))]
    encoded = iter(tokenizer.encode_batch(texts))
    rows, scored = [], []  # each row's tokens (at most seq_len + 1, its end kept), and its choice's length
    for _, choices, _ in examples:
        context_ids = next(encoded)
        for _choice in choices:
            choice_ids = next(encoded)
            row = np.concatenate([context_ids, choice_ids])[-(seq_len + 1) :]
            rows.append(row)
            scored.append(min(len(choice_ids), len(row) - 1))
    inputs, targets = scoring_rows(rows, scored, seq_len)
    name = os.path.splitext(os.path.basename(path))[0]
    return Task(
        name,
        inputs,
        targets,
        np.array([len(choices) for _, choices, _ in examples]),
        np.array([label for _, _, label in examples]),
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
