"""The schemas' keys as dotted names: listing them with their domains and docs (`--help`), checking a composed
config against them, and the one line for a key that is not one of them."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import textwrap
import typing
from collections.abc import Collection, Iterator
from typing import Any, cast

from omegaconf import MISSING, DictConfig, OmegaConf

from llmtrain.domains import Domain, describe
from llmtrain.errors import ConfigError


def keys_help(cfg: DictConfig, schema: type, only: Collection[str] | None = None) -> str:
    """Per key (of `only` where given) its composed value and what it accepts, then what it does on a line below."""
    rows = []
    sections = {f.name: _plain(cfg[f.name]) if isinstance(cfg[f.name], DictConfig) else cfg[f.name]
                for f in dataclasses.fields(schema)}  # fmt: skip
    for dotted, item, nullable in schema_fields(schema):
        if only is not None and dotted not in only:
            continue
        missing, value = _lookup(sections, dotted)
        shown = "???" if missing else OmegaConf.to_yaml({"v": value})[3:].strip()  # null, true, 0.001 as typed
        accepts = item.metadata["domain"].accepts() + (", or null" if nullable else "")
        rows.append((f"{dotted}={shown}", accepts, item.metadata["doc"]))
    width = max(len(setting) for setting, _, _ in rows) + 3
    wrap = functools.partial(textwrap.fill, width=116, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(f"  {setting:<{width}} {accepts}\n{wrap(doc)}" for setting, accepts, doc in rows)


def schema_fields(schema: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, bool]]:
    """(dotted key, its field, whether it may be null) for every leaf of a schema dataclass."""
    hints = typing.get_type_hints(schema)
    for item in dataclasses.fields(schema):
        kind = hints[item.name]
        args = typing.get_args(kind)
        inner = next((a for a in args if a is not type(None)), kind)  # Optional[X] -> X
        if dataclasses.is_dataclass(inner):
            yield from schema_fields(inner, f"{prefix}{item.name}.")  # type: ignore[arg-type]
        else:
            yield f"{prefix}{item.name}", item, type(None) in args


@functools.cache
def schema_keys(schema: type) -> tuple[tuple[str, Domain | None], ...]:
    """Every leaf key of a schema dataclass, dotted, with its declared domain (None: none declared)."""
    return tuple((dotted, item.metadata.get("domain")) for dotted, item, _ in schema_fields(schema))


# Keys an earlier version had -> their names now: a config that still sets one is told the new name.
RENAMED_KEYS = {
    "parallel.strategy": "parallel.layout",
    "optim.schedule": "optim.lr_schedule",
    "plan.mfu": "hardware.mfu",
}


def unknown_key_line(name: str, keys: list[str]) -> str:
    """`name` is not among `keys` (dotted leaf keys): its new name if it was renamed, else the closest key of the
    same section, and the section's keys."""
    if name in RENAMED_KEYS:
        return f"{name} is now {RENAMED_KEYS[name]}: set {RENAMED_KEYS[name]} instead"
    parent = name.rpartition(".")[0]
    prefix = f"{parent}." if parent else ""
    siblings = sorted({k[len(prefix) :].split(".")[0] for k in keys if k.startswith(prefix)})
    near = difflib.get_close_matches(name.rpartition(".")[2], siblings, n=1)
    hint = f": did you mean {prefix}{near[0]}?" if near else ""
    return f"{name} is not a key{hint} (the keys of {parent or 'the config'}: {', '.join(siblings)})"


def check_domains(cfg, schema: type, prefix: str = "") -> None:
    """Each key of `cfg` (composed from `schema`, its keys under `prefix`) against its domain; ConfigError on the
    first key that is unset or outside."""
    values = _plain(cfg)
    keys = dict(schema_keys(schema))
    for dotted in _leaf_keys(values):
        if dotted not in keys:  # added with +key=value, which Hydra lets through a structured config
            raise ConfigError(unknown_key_line(prefix + dotted, [prefix + k for k in keys]))
    for dotted, domain in keys.items():
        name = prefix + dotted
        missing, value = _lookup(values, dotted)
        if missing:
            accepts = domain.accepts() if domain else "a value"
            raise ConfigError(f"{name} is not set: set {name} to {accepts} (in its conf/ group or on the command line)")
        if value is not None and domain is not None and (line := describe(name, value, domain)):
            raise ConfigError(line)


def _plain(cfg) -> dict:
    """`cfg` (a DictConfig or a schema dataclass) as nested dicts: read key by key, an OmegaConf node costs 100x."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return cast(dict, OmegaConf.to_container(node, resolve=True, throw_on_missing=False))


def _lookup(values: dict, dotted: str) -> tuple[bool, Any]:
    """(whether the key is unset: ??? or deleted with ~key, its value)."""
    *parents, last = dotted.split(".")
    for part in parents:
        values = values.get(part)  # type: ignore[assignment]
        if not isinstance(values, dict):
            return True, None
    if last not in values or values[last] == MISSING:
        return True, None
    return False, values[last]


def _leaf_keys(values: dict, prefix: str = "") -> Iterator[str]:
    for name, value in values.items():
        if isinstance(value, dict):
            yield from _leaf_keys(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"
