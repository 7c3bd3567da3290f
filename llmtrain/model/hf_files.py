"""Reading a model in Hugging Face format: a local directory or a hub snapshot, and its weights one tensor at a
time (safetensors memory-mapped, or an older pytorch_model.bin loaded weights-only and memory-mapped), so that no
rank ever holds the whole checkpoint."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from llmtrain.errors import ConfigError, first_line


def local_hf_directory(path: str) -> str:
    """`path` when it is a directory, else the hub snapshot of that name (config and weights only)."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    from llmtrain.hub import from_hub

    patterns = ["config.json", "*.safetensors", "pytorch_model.bin"]
    return from_hub("model.init_from", path, lambda: snapshot_download(path, allow_patterns=patterns))


def lazy_tensors(directory: str) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """(names, read) of the weights a Hugging Face directory holds: model.safetensors memory-mapped, or an older
    pytorch_model.bin pickle, memory-mapped; each tensor is read when asked for."""
    safetensors_file = os.path.join(directory, "model.safetensors")
    pickle_file = os.path.join(directory, "pytorch_model.bin")
    try:
        if os.path.isfile(safetensors_file):
            from safetensors import safe_open

            handle = safe_open(safetensors_file, framework="pt")
            return set(handle.keys()), handle.get_tensor
        if os.path.isfile(pickle_file):
            state = torch.load(pickle_file, map_location="cpu", mmap=True, weights_only=True)
            return set(state), state.__getitem__
    except Exception as error:  # safetensors and torch.load raise their own types for a truncated or foreign file
        raise ConfigError(
            f"model.init_from={directory}: its weights cannot be read ({first_line(error)}): the "
            f"file is damaged or incomplete; download it again"
        ) from None
    raise ConfigError(
        f"model.init_from={directory} holds neither model.safetensors nor pytorch_model.bin (weights split over "
        f"several files are not read yet): save the model as one file (save_pretrained(max_shard_size='100GB'))"
    )
