"""What DCP saves of a parallel model, or loads in place: its model and optimizer state under the unsplit model's
names (so a checkpoint saved under one layout loads under any other), with every tied parameter stored once.

A tied parameter (the LM head's weight is the embedding matrix: one tensor in one model, equal copies on two
pipeline stages) is stored under its source's names and handed back to every parameter that uses it on load.

A model with low-rank adapters stores the adapters alone: its frozen base is what the run started from (its
checkpoints name it, training.py), and is loaded from there, not from every checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from llmtrain.model.lora import is_adapter
from llmtrain.parallel.parallel_model import ParallelModel


@dataclass(frozen=True)
class CheckpointState:
    """What DCP saves, or loads in place (`values`: "model" and "optimizer" state), and for each part which keys of
    this rank's state each stored key stands for (a tied parameter is stored once)."""

    values: dict[str, dict]
    stored_as: dict[str, dict[str, list[str]]]
    kept: dict[str, Any] = field(default_factory=dict)  # model state not stored: the frozen base's, as it is


def checkpoint_state(model: ParallelModel, adapters_only: bool = False) -> CheckpointState:
    """`model`'s state as this rank holds it (DTensor shards where sharded), each tied parameter folded into its
    source; `adapters_only`: of the weights, the low-rank adapters alone."""
    model_state, optimizer_state = model.model_and_optimizer_state()
    model_state, kept = _stored_and_kept(model_state, adapters_only)
    state = CheckpointState({}, {}, kept)
    for part, values in (("model", model_state), ("optimizer", optimizer_state)):
        state.values[part], state.stored_as[part] = _store_tied_once(values, model.tied_parameters)
    return state


def load_checkpoint_state(model: ParallelModel, state: CheckpointState) -> None:
    """Put a `checkpoint_state` whose values DCP has filled back into the model and its optimizer."""
    model_state, optimizer_state = (
        _restore_tied(state.values[part], state.stored_as[part]) for part in ("model", "optimizer")
    )
    model.load_model_and_optimizer_state({**state.kept, **model_state}, optimizer_state)


def model_weights_state(model: ParallelModel, adapters_only: bool = False) -> CheckpointState:
    """The model's part of checkpoint_state alone, for evaluation."""
    weights, kept = _stored_and_kept(model.model_state(), adapters_only)
    values, stored_as = _store_tied_once(weights, model.tied_parameters)
    return CheckpointState({"model": values}, {"model": stored_as}, kept)


def load_model_weights_state(model: ParallelModel, state: CheckpointState) -> None:
    """Put a `model_weights_state` whose values DCP has filled back into the model."""
    model.load_model_state({**state.kept, **_restore_tied(state.values["model"], state.stored_as["model"])})


def _stored_and_kept(model_state: dict, adapters_only: bool) -> tuple[dict, dict]:
    """(what a checkpoint stores, what it leaves as the model holds it): everything, or the low-rank adapters
    alone beside the frozen base."""
    kept = {key: value for key, value in model_state.items() if adapters_only and not is_adapter(key)}
    return {key: value for key, value in model_state.items() if key not in kept}, kept


def _store_tied_once(values: dict, tied: dict[str, str]) -> tuple[dict, dict[str, list[str]]]:
    """`values` with every key of a tied parameter folded into its source's twin (one kept when a rank holds
    both), and which original keys each stored key stands for."""
    stored: dict = {}
    stands_for: dict[str, list[str]] = {}
    for key, value in values.items():
        name = key
        for tied_name, source in tied.items():
            name = name.replace(tied_name, source)
        stands_for.setdefault(name, []).append(key)
        stored.setdefault(name, value)
    return stored, stands_for


def _restore_tied(stored: dict, stands_for: dict[str, list[str]]) -> dict:
    """The inverse of _store_tied_once, after loading: a second key gets its own copy of the tensor."""
    values = {}
    for name, keys in stands_for.items():
        for i, key in enumerate(keys):
            value = stored[name]
            values[key] = value.clone() if i and torch.is_tensor(value) else value
    return values
