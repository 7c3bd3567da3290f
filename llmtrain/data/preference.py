"""Preference pairs (`data=preference`) for Direct Preference Optimization (train/dpo.py): a prompt, the answer
preferred and the one rejected.

A record holds `prompt`, `chosen` and `rejected`: text (the prompt one user turn, each answer one assistant turn) or
chat messages (`prompt` a list of turns; `chosen` and `rejected` each an assistant message, a list of them, or text),
as TRL's preference datasets. Each answer is rendered after the prompt with the tokenizer's chat template (the
prompt with its generation prompt, then the answer with the template's end of turn) and trained on the answer's
tokens alone, as data=sft trains an assistant turn (data/sft.py): the prompt is context.

A pair is two windows, the chosen answer's then the rejected one's, each one sequence padded with untrained tokens
(an answer cut where it is longer than a window, as the start summary counts). Epochs shuffle pairs, never their two
windows apart, so every global batch, and every rank's and micro-batch's part of it, holds whole pairs (an even
train.micro_batch_size, which the config's check asks for).
"""

from __future__ import annotations

import numpy as np

from llmtrain.data.packing import untrained
from llmtrain.data.sft import is_message, rendered_and_marked, starts_with
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import ConfigError

ANSWERS = ("chosen", "rejected")


def pair_of(record: object, where: str) -> dict[str, list[dict]]:
    """A record's pair as chat messages (`prompt`, `chosen`, `rejected`); ConfigError naming the record when it is
    not one."""
    if not (isinstance(record, dict) and all(field in record for field in ("prompt", *ANSWERS))):
        fields = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ConfigError(
            f"{where} is not a preference pair (fields: {fields}): give each record `prompt`, `chosen` and `rejected`"
        )
    prompt = record["prompt"]
    pair = {"prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt}
    for answer in ANSWERS:
        value = record[answer]
        pair[answer] = (
            [{"role": "assistant", "content": value}]
            if isinstance(value, str)
            else [value]
            if isinstance(value, dict)
            else value
        )
    if not all(isinstance(part, list) and part and all(is_message(m) for m in part) for part in pair.values()):
        raise ConfigError(f"{where}: the prompt and answers need text or messages with a `role` and a text `content`")
    if not all(m["role"] == "assistant" for answer in ANSWERS for m in pair[answer]):
        raise ConfigError(f"{where}: `chosen` and `rejected` are the assistant's answers: give them the assistant role")
    return pair


def tokenized_pairs(pairs: list[dict[str, list[dict]]], tokenizer: Tokenizer, backend, what: str) -> list[np.ndarray]:
    """Each pair's two answers after its prompt, in order (chosen, rejected, chosen, ...), the answers' tokens
    trained and the prompt's untrained."""

    def render(pair: dict[str, list[dict]]) -> list[str]:  # the prompt with its generation prompt, then each answer
        prompt = backend.apply_chat_template(pair["prompt"], tokenize=False, add_generation_prompt=True)
        return [prompt, *(backend.apply_chat_template(pair["prompt"] + pair[a], tokenize=False) for a in ANSWERS)]

    def mark(encoded: list[np.ndarray], where: str) -> list[np.ndarray]:
        prompt, *answers = encoded
        return [_answer_marked(answer, prompt, where) for answer in answers]

    return rendered_and_marked(pairs, tokenizer, render, mark, what, "pair")


def _answer_marked(answer: np.ndarray, prompt: np.ndarray, where: str) -> np.ndarray:
    """An answer's window: its prompt's tokens untrained, then its own trained."""
    if not starts_with(answer, prompt) or len(answer) == len(prompt):
        raise ConfigError(
            f"{where}: the chat template renders the prompt differently before an answer than with its generation "
            f"prompt (or the answer is empty), so the answer's tokens cannot be told apart: use a template that "
            f"renders turn by turn"
        )
    return np.concatenate([untrained(answer[: len(prompt)]), answer[len(prompt) :]])
