"""Verifiable rewards for reinforcement learning (data=rl): functions that score completions against what a record
knows, with TRL's calling convention, `reward(prompts, completions, **columns) -> [float | None per completion]`
(`columns`: the records' other fields, a list each; None: the function does not score that completion). The
built-in ones are named in llmtrain/catalog/objectives.py's REWARDS; any other is `module:function`, imported from
the working directory or PYTHONPATH. Several rewards add up with weights, a None left out (TRL's nansum). As in TRL, a
completion is text where its prompt was text, and a list holding the assistant's message where it was messages."""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmtrain.catalog import REWARDS, imported
from llmtrain.config.data import reward_names
from llmtrain.errors import ConfigError

RewardFunction = Callable[..., list[float | None]]
Completion = str | list[dict[str, Any]]  # text, or [{"role": "assistant", "content": text}]

# A number as people write answers: a sign, thousands separators (groups of exactly three digits: "2,3,5" is three
# numbers), a decimal part, an exponent.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def numbers(text: str) -> list[float]:
    """The numbers in `text`, in order. A hyphen right after a digit or letter joins ("pages 10-12", "x-2") rather
    than negates, so it is no sign."""
    found = []
    for match in _NUMBER.finditer(text):
        token = match.group()
        if token.startswith("-") and match.start() > 0 and (text[match.start() - 1].isalnum()):
            token = token[1:]
        found.append(float(token.replace(",", "")))
    return found


def final_number(text: str) -> float | None:
    """The number a completion ends its answer with: the first after GSM8K's `####` where the text has one, else the
    last number in it; None where it has none."""
    _, marked, after = text.rpartition("####")
    found = numbers(after if marked else text)
    if not found:
        return None
    return found[0] if marked else found[-1]


def answer_number(text: str) -> float | None:
    """A record's answer as one number: the one after GSM8K's `####`, or the answer's only number; None where it
    holds none or several (a range, a list: which one is meant is not guessed)."""
    found = numbers(marked_answer(text))
    return found[0] if len(found) == 1 else None


def marked_answer(text: str) -> str:
    """A record's answer: what follows GSM8K's `####` in a worked solution, else the whole text."""
    _, marked, after = text.rpartition("####")
    return after if marked else text


def text_of(completion: Completion) -> str:
    """A completion's text, whether it came as text or as the assistant's message."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def exact_number(
    prompts: Sequence[Any], completions: Sequence[Completion], answer: Sequence[str], **_: Any
) -> list[float | None]:
    """1 where the completion's final number is the record's `answer`'s (a number, or a worked GSM8K solution
    ending `#### n`), 0 where it is another or none; None where the answer holds no number, or several."""
    scores: list[float | None] = []
    for completion, expected in zip(completions, answer):
        wanted, given = answer_number(str(expected)), final_number(text_of(completion))
        scores.append(None if wanted is None else float(given is not None and math.isclose(given, wanted)))
    return scores


def math_answer(
    prompts: Sequence[Any], completions: Sequence[Completion], answer: Sequence[str], **_: Any
) -> list[float | None]:
    """1 where Hugging Face's math-verify finds the completion's answer equal to the record's `answer` (LaTeX,
    fractions, sets, intervals, units: MATH's `\\boxed{}`; a GSM8K solution's `#### n`), 0 where it does not or finds
    none; None where the record's answer parses to nothing (open-r1's and TRL's accuracy reward)."""
    from math_verify import parse, verify

    scores: list[float | None] = []
    for completion, expected in zip(completions, answer):
        gold = parse(marked_answer(str(expected)))
        scores.append(float(verify(gold, parse(text_of(completion)))) if gold else None)
    return scores


def matching(pattern: str) -> RewardFunction:
    """1 where a completion matches `pattern` (re.search, DOTALL: a format to keep), 0 where it does not."""
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts: Sequence[Any], completions: Sequence[Completion], **_: Any) -> list[float | None]:
        return [float(compiled.search(text_of(completion)) is not None) for completion in completions]

    return reward


def reward_function(name: str, pattern: str | None = None) -> RewardFunction:
    """The reward `name` names: a built-in (REWARDS; `regex` matching `pattern`), or `module:function` imported from
    the working directory or PYTHONPATH. ConfigError naming data.reward where it is neither."""
    if name in REWARDS:
        built = imported(REWARDS[name].implementation)
        if REWARDS[name].takes_pattern:
            if not pattern:
                raise ConfigError(f"data.reward={name} matches a pattern: set data.reward_pattern (a regex)")
            return built(pattern)
        return built
    module, colon, function = name.partition(":")
    if not colon or not module or not function:
        raise ConfigError(
            f"data.reward={name!r} is neither a built-in reward ({', '.join(REWARDS)}) nor module:function"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as error:
        raise ConfigError(
            f"data.reward={name}: {error}; it is imported from the working directory ({os.getcwd()}) or PYTHONPATH"
        ) from None
    if not callable(found):
        raise ConfigError(f"data.reward={name} is not a function")
    return found


def scored(
    functions: Sequence[RewardFunction],
    weights: Sequence[float],
    prompts: Sequence[Any],
    completions: Sequence[Completion],
    columns: dict[str, list[Any]],
    names: Sequence[str] = (),
) -> tuple[list[float], list[list[float]]]:
    """Each completion's reward, the weighted sum of the functions' scores with a None left out (NaN where every
    function left it out), and each function's scores (NaN for None). A score that is not a finite number (inf, NaN,
    text) is a ConfigError naming the function (`names`, else its own name): it would silently zero its group."""
    each = []
    for index, function in enumerate(functions):
        name = names[index] if index < len(names) else getattr(function, "__name__", repr(function))
        scores = function(list(prompts), list(completions), **columns)
        if len(scores) != len(completions):
            raise ConfigError(
                f"data.reward {name} returned {len(scores)} scores for {len(completions)} completions: return one "
                f"per completion (None where it does not score one)"
            )
        each.append([_checked_score(score, name) for score in scores])
    totals = []
    for row in zip(*each):
        kept = [weight * score for weight, score in zip(weights, row) if not math.isnan(score)]
        totals.append(sum(kept) if kept else math.nan)
    return totals, each


def _checked_score(score: Any, name: str) -> float:
    """A function's score as a float (NaN for None); ConfigError where it is not a finite number."""
    if score is None:
        return math.nan
    try:
        value = math.nan if isinstance(score, (str, bytes)) else float(score)  # a number of any kind, a 0-d tensor
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(
            f"data.reward {name} returned {score!r} for a completion: a reward is a finite number, or None where it "
            f"does not score that completion"
        )
    return value


@dataclass(frozen=True)
class Rewards:
    """data.reward's functions with their weights, each under the name TRL logs it by (`rewards/<name>/mean`)."""

    functions: list[RewardFunction]
    weights: list[float]
    names: list[str]

    @classmethod
    def of(cls, data_cfg) -> Rewards:
        """data.reward, data.reward_weights (None: 1 each) and data.reward_pattern's rewards; ConfigError naming
        data.reward where one is neither a built-in nor importable."""
        names = reward_names(data_cfg)
        return cls(
            [reward_function(name, data_cfg.reward_pattern) for name in names],
            list(data_cfg.reward_weights or [1.0] * len(names)),
            [name.partition(":")[2] or name for name in names],
        )

    def scored(
        self, prompts: Sequence[Any], completions: Sequence[Completion], columns: dict[str, list[Any]]
    ) -> tuple[list[float], list[list[float]]]:
        """`scored` with these functions and weights."""
        return scored(self.functions, self.weights, prompts, completions, columns, self.names)
