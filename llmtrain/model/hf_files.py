"""Reading a model in Hugging Face format: a local directory or a hub snapshot, and its weights one tensor at a
time (safetensors memory-mapped, or an older pytorch_model.bin loaded weights-only and memory-mapped), so that no
rank ever holds the whole checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from llmtrain.errors import ConfigError, first_line


def local_hf_directory(path: str) -> str:
    """`path` when it is a directory, else the hub snapshot of that name (config and weights only)."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    from llmtrain.hub import from_hub

    patterns = ["config.json", "*.safetensors", "model.safetensors.index.json", "pytorch_model.bin"]
    return from_hub("model.init_from", path, lambda: snapshot_download(path, allow_patterns=patterns))


# The bytes read from each end of each weights file for a fingerprint: enough to tell two trainings of one shape
# apart (a base model from its instruct version), a few milliseconds for any size of model.
FINGERPRINT_BYTES = 1 << 16


def weights_fingerprint(directory: str) -> str:
    """A short hash that tells one model's weights from another's without reading them all: its config.json and,
    for each weights file, its name, size and the bytes at both ends."""
    digest = hashlib.sha256()
    names = sorted(f for f in os.listdir(directory) if f == "config.json" or f.endswith((".safetensors", ".bin")))
    for name in names:
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        digest.update(f"{name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            f.seek(max(size - FINGERPRINT_BYTES, 0))
            digest.update(f.read())
    return digest.hexdigest()[:16]


# What a shape error suggests where the command line chose a preset (model=) besides model.init_from.
PRESET_REMEDY = (
    "leave model= out to take the model from its config.json, or choose the preset that matches it, with its "
    "tokenizer (data.tokenizer.kind=hf)"
)
# The model keys the shape properties that differ from them stand for, in an error a user reads.
_SHAPE_KEY_NAMES = {
    "kv_heads": "n_kv_head",
    "head_size": "head_dim",
    "hidden": "d_ff",
    "layer_windows": "sliding_window",
    "expert_shape": "moe",
}


def check_same_shape(path: str, ours: Any, theirs: Any, keys: tuple[str, ...], remedy: str) -> None:
    """ConfigError naming every one of `keys` (GPTConfig fields or properties) on which the model config `ours`
    differs from `theirs`, the shape of the Hugging Face model at `path`, and `remedy`."""
    differences = [
        f"model.{_SHAPE_KEY_NAMES.get(key, key)}={getattr(ours, key)} (theirs: {getattr(theirs, key)})"
        for key in keys
        if getattr(ours, key) != getattr(theirs, key)
    ]
    if differences:
        raise ConfigError(f"model.init_from={path} has another shape: {', '.join(differences)}: {remedy}")


def lazy_tensors(directory: str) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """(names, read) of the weights a Hugging Face directory holds: model.safetensors (or the shards its
    model.safetensors.index.json lists) memory-mapped, or an older pytorch_model.bin pickle, memory-mapped; each
    tensor is read when asked for."""
    safetensors_file = os.path.join(directory, "model.safetensors")
    index_file = os.path.join(directory, "model.safetensors.index.json")
    pickle_file = os.path.join(directory, "pytorch_model.bin")
    try:
        if os.path.isfile(safetensors_file):
            from safetensors import safe_open

            handle = safe_open(safetensors_file, framework="pt")
            return set(handle.keys()), handle.get_tensor
        if os.path.isfile(index_file):
            return _sharded_safetensors(directory, index_file)
        if os.path.isfile(pickle_file):
            state = torch.load(pickle_file, map_location="cpu", mmap=True, weights_only=True)
            return set(state), state.__getitem__
    except Exception as error:  # safetensors and torch.load raise their own types for a truncated or foreign file
        raise ConfigError(
            f"model.init_from={directory}: its weights cannot be read ({first_line(error)}): the "
            f"file is damaged or incomplete; download it again"
        ) from None
    raise ConfigError(
        f"model.init_from={directory} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin: "
        f"point it at a directory save_pretrained wrote"
    )


def _sharded_safetensors(directory: str, index_file: str) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """A model saved in several safetensors files: each opened (memory-mapped) the first time one of its tensors
    is read."""
    from safetensors import safe_open

    with open(index_file, encoding="utf-8") as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    handles: dict[str, Any] = {}

    def read(name: str) -> torch.Tensor:
        file = weight_map[name]
        if file not in handles:
            handles[file] = safe_open(os.path.join(directory, file), framework="pt")
        return handles[file].get_tensor(name)

    return set(weight_map), read
