"""What each config key accepts, declared next to the key in llmtrain/config/ with `key(default, domain)`.

A domain answers three questions: is this value acceptable (`complaint`: None, or what is wrong with it), what does
the key accept (`accepts`: the phrase `--help` prints and errors end with), and which values lie just outside it
(`outside`: what tests/config/test_bad_input.py feeds every key). `None` is always acceptable for an Optional key: it
means
"the default behaviour" and the key's comment says which. Rules that involve several keys stay in
`config.validate`.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

# A Hugging Face hub id: `name` or `owner/name`, letters, digits, '-', '_' and '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# Files a transformers tokenizer directory holds at least one of.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class Domain:
    def complaint(self, value: Any) -> str | None:
        raise NotImplementedError

    def accepts(self) -> str:
        raise NotImplementedError

    def outside(self) -> list[Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class Number(Domain):
    """A number in [low, high] (either end open, either end absent); `whole` for integer keys."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    whole: bool = False

    def complaint(self, value: Any) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return "is not a finite number"
        if self.whole and not float(value).is_integer():
            return "is not a whole number"
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        return "is out of range" if below or above else None

    def accepts(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{kind} in {left}{_number(self.low)}, {_number(self.high)}{right}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {_number(self.high)}"
        return kind

    def outside(self) -> list[Any]:
        step = 1 if self.whole else 0.5
        ends = []
        if self.low is not None:
            ends.append(self.low if self.low_open else self.low - step)
        if self.high is not None:
            ends.append(self.high if self.high_open else self.high + step)
        return [int(v) for v in ends] if self.whole else [float(v) for v in ends] + [float("nan")]


def at_least(low: int) -> Number:
    return Number(low=low, whole=True)


def positive() -> Number:
    return Number(low=0, low_open=True)


def fraction(high_open: bool = True) -> Number:
    """In [0, 1): a probability of dropping, a momentum; [0, 1] with high_open=False."""
    return Number(low=0, high=1, high_open=high_open)


@dataclass(frozen=True)
class MeshDegree(Domain):
    """A degree of the device mesh: a number of ranks, or -1 for the ranks the other degrees leave."""

    def complaint(self, value: Any) -> str | None:
        return None if value == -1 or value >= 1 else "is neither a number of ranks nor -1"

    def accepts(self) -> str:
        return "a whole number >= 1 (1: not split), or -1 (the remaining ranks)"

    def outside(self) -> list[Any]:
        return [0, -2]


@dataclass(frozen=True)
class OneOf(Domain):
    # a tuple, or a catalog table whose names are the choices (read when a value is checked: a row added is one)
    choices: Collection[Any]

    def complaint(self, value: Any) -> str | None:
        return None if value in self.choices else "is not one of the choices"

    def accepts(self) -> str:
        return "one of " + ", ".join(map(str, self.choices))

    def outside(self) -> list[Any]:
        if all(isinstance(choice, int) for choice in self.choices):
            return [max(self.choices) + 1]
        return ["", "not-a-choice"]


@dataclass(frozen=True)
class ListOf(Domain):
    """A non-empty list, each item in `item`."""

    item: Domain

    def complaint(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)) or not value:
            return "is not a non-empty list"
        wrong = [v for v in value if self.item.complaint(v) is not None]
        return f"holds {', '.join(map(_shown, wrong))}, not {self.item.accepts()}" if wrong else None

    def accepts(self) -> str:
        return f"a non-empty list, each {self.item.accepts()}"

    def outside(self) -> list[Any]:
        return [[], [self.item.outside()[0]]] if self.item.outside() else [[]]


@dataclass(frozen=True)
class OneOrListOf(Domain):
    """One item in `item`, or a non-empty list of them (as TRL's `reward_funcs` takes one function or a list)."""

    item: Domain

    def complaint(self, value: Any) -> str | None:
        if isinstance(value, (list, tuple)):
            return ListOf(self.item).complaint(value)
        return None if self.item.complaint(value) is None else f"is not {self.accepts()}"

    def accepts(self) -> str:
        return f"{self.item.accepts()}, or a non-empty list, each {self.item.accepts()}"

    def outside(self) -> list[Any]:
        return [[], *self.item.outside()[:1]]


@dataclass(frozen=True)
class StepSpan(Domain):
    """[first, last]: two whole step numbers, 1 <= first <= last."""

    def complaint(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            return "is not a list of two steps"
        first, last = value
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "holds something other than whole numbers"
        return None if 1 <= first <= last else "is not [first, last] with 1 <= first <= last"

    def accepts(self) -> str:
        return "[first, last], two steps with 1 <= first <= last"

    def outside(self) -> list[Any]:
        return [[0, 2], [3, 2], [1]]


@dataclass(frozen=True)
class Flag(Domain):
    def complaint(self, value: Any) -> str | None:
        return None

    def accepts(self) -> str:
        return "true or false"

    def outside(self) -> list[Any]:
        return []  # every boolean is valid; the schema walk's wrong-type values cover the rest


@dataclass(frozen=True)
class Text(Domain):
    """Free text (a name, a split, a field); it must not be empty."""

    def complaint(self, value: Any) -> str | None:
        if not isinstance(value, str):  # a key that takes one or a list (data.reward) keeps a number as it came
            return "is not a string"
        return "is empty" if not value.strip() else None

    def accepts(self) -> str:
        return "a non-empty string"

    def outside(self) -> list[Any]:
        return ["", "  "]


@dataclass(frozen=True)
class ExistingPath(Domain):
    """A path that exists: `file`, `dir`, or `glob` (a file, a folder or a glob matching something)."""

    kind: str = "file"

    def complaint(self, value: Any) -> str | None:
        path = os.path.expanduser(str(value))
        if not str(value).strip():
            return "is empty"
        if self.kind == "glob":
            return None if os.path.exists(path) or glob.glob(path, recursive=True) else "does not exist"
        if not os.path.exists(path):
            return "does not exist"
        if self.kind == "dir" and not os.path.isdir(path):
            return "is not a directory"
        if self.kind == "file" and not os.path.isfile(path):
            return "is not a file"
        return None

    def accepts(self) -> str:
        return {"file": "an existing file", "dir": "an existing directory", "glob": "an existing file, folder or glob"}[
            self.kind
        ]

    def outside(self) -> list[Any]:
        return ["", "/nonexistent/llmtrain-input"]


@dataclass(frozen=True)
class DirectoryOrHub(Domain):
    """A local directory in Hugging Face format (holding one of `required_files`) or a hub id. A value that looks
    like a path (it has a leading /, ., ~ or is not a valid hub id) must be a directory: it is never sent to the
    hub, where it would fail with the hub client's message instead of ours."""

    required_files: tuple[str, ...]

    def complaint(self, value: Any) -> str | None:
        text = str(value)
        path = os.path.expanduser(text)
        if os.path.isdir(path):
            if not any(os.path.exists(os.path.join(path, name)) for name in self.required_files):
                return f"is a directory without {' or '.join(self.required_files)}"
            return None
        if os.path.exists(path):
            return "is a file, not a directory"
        if text.startswith(("/", ".", "~")) or not _HUB_ID.match(text) or "--" in text or ".." in text:
            return "is neither an existing directory nor a hub id (owner/name)"
        return None

    def accepts(self) -> str:
        return f"a directory holding {' or '.join(self.required_files)}, or a hub id (owner/name)"

    def outside(self) -> list[Any]:
        return ["", "/nonexistent/llmtrain-model", "not a hub id"]


@dataclass(frozen=True)
class WritableDirectory(Domain):
    """A directory that exists and is writable, or can be created (its nearest existing ancestor is a directory)."""

    def complaint(self, value: Any) -> str | None:
        text = str(value)
        if not text.strip():
            return "is empty"
        path = os.path.abspath(os.path.expanduser(text))
        while not os.path.exists(path):
            path = os.path.dirname(path)
        if not os.path.isdir(path):
            return f"cannot be created: {path} is a file"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"cannot be written: {path} is not writable"
        return None

    def accepts(self) -> str:
        return "a directory that exists and is writable or can be created"

    def outside(self) -> list[Any]:
        return ["", os.path.join(os.path.abspath(__file__), "not-a-directory")]


@dataclass(frozen=True)
class CheckpointSource(Domain):
    """`auto`, `none` or the path of a checkpoint (a step-* directory or a directory of them)."""

    def complaint(self, value: Any) -> str | None:
        if value in ("auto", "none"):
            return None
        return ExistingPath("dir").complaint(value)

    def accepts(self) -> str:
        return "auto, none, or an existing checkpoint directory"

    def outside(self) -> list[Any]:
        return ["", "/nonexistent/step-5"]


@dataclass(frozen=True)
class MixtureSources(Domain):
    """`data=mix`'s sources: a non-empty list of {name, path, weight, max_epochs}, each path a prepared store, each
    weight a number > 0, max_epochs a number > 0 or absent, the names distinct."""

    def complaint(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)) or not value:
            return "is not a non-empty list"
        names: list[str] = []
        for i, entry in enumerate(value):
            if not isinstance(entry, dict):
                return f"holds {_shown(entry)} (item {i}), not a source {{name, path, weight}}"
            problem = _source_problem(entry, names)
            if problem is not None:
                return f"(source {entry.get('name') or i}): {problem}"
            names.append(entry["name"])
        return None

    def accepts(self) -> str:
        return "a non-empty list of {name, path (a prepared store), weight > 0, max_epochs > 0 (optional)}"

    def outside(self) -> list[Any]:
        return [[], [{"name": "web", "path": "/nonexistent/llmtrain-store", "weight": 1}]]


def _source_problem(entry: dict, names: list[str]) -> str | None:
    unknown = sorted(set(entry) - {"name", "path", "weight", "max_epochs"})
    if unknown:
        return f"{', '.join(unknown)} is not a key of a source (name, path, weight, max_epochs)"
    name, path, weight, epochs = (entry.get(k) for k in ("name", "path", "weight", "max_epochs"))
    if not isinstance(name, str) or not name.strip():
        return "name is not set: give each source a name (it names the source's metrics)"
    if name in names:
        return f"name {name!r} is given twice: give each source its own name"
    if not isinstance(path, str) or not os.path.isfile(os.path.join(os.path.expanduser(path), "manifest.json")):
        return f"path={_shown(path)} is not a prepared store: write one with python -m llmtrain.data.prepare"
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        return f"weight={_shown(weight)} is not a number > 0"
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0):
        return f"max_epochs={_shown(epochs)} is not a number > 0"
    return None


def key(default: Any, domain: Domain, doc: str) -> Any:
    """A config key, declared once: its default, its domain and a one-line doc (read back by config.schema_keys;
    --help and docs/config.md are generated from them). A list default is copied for each config made."""
    metadata = {"domain": domain, "doc": doc}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def describe(key_name: str, value: Any, domain: Domain) -> str | None:
    """The one-line error for `key_name=value`, or None when the domain accepts it."""
    problem = domain.complaint(value)
    if problem is None:
        return None
    return f"{key_name}={_shown(value)} {problem}: set {key_name} to {domain.accepts()}"


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
