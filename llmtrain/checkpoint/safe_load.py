"""Reading a checkpoint runs no code it holds: a checkpoint directory may come from a shared filesystem or a
download, and a pickle can call anything while it is read.

- The training stream's position (`data.pt`) is saved with `torch.save` and read with torch's weights-only
  unpickler, which builds tensors and plain containers and refuses anything else. numpy arrays in the position
  travel as tensors (a list of them as one).
- DCP's own `.metadata` is a pickle that torch reads without restriction; `read_dcp_metadata` reads it with an
  unpickler that admits only DCP's metadata records (dataclasses and enums), torch sizes, dtypes and layouts, and
  paths, so a checkpoint whose metadata would call anything else is refused before DCP ever reads it.
- DCP's entries: tensors are read weights-only by torch already, but every other entry (an optimizer's learning
  rate, betas, a step count) is read by torch's default load planner with a full unpickler. `load_dcp` reads them
  with the weights-only unpickler instead (`WeightsOnlyLoadPlanner`) and hands DCP the metadata read above
  (`CheckedReader`): every `dcp.load` in llmtrain goes through it.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import re
import warnings
from typing import Any, cast

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

DATA_POSITION = "data.pt"
# Written before the data position left pickle: never read by training (llmtrain.tools.upgrade_checkpoint
# converts one the user trusts).
PICKLED_DATA_POSITION = "data.pkl"


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file that would run code when read; the message says what it asked for."""


def write_data_position(directory: str, position: dict) -> None:
    """Save `position` as `read_data_position` reads it back (numpy arrays as tensors, numpy scalars as numbers)."""
    torch.save(_arrays_to_tensors(position), os.path.join(directory, DATA_POSITION))


def read_data_position(directory: str) -> dict:
    """The position saved in `directory`. Raises UnsafeCheckpointFile for a file that asks to run code, and
    OSError / EOFError / RuntimeError for one that is missing or damaged."""
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols other than its own
            warnings.simplefilter("ignore")
            stored = torch.load(os.path.join(directory, DATA_POSITION), weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointFile(what_it_asked(error)) from None
    return cast(dict, _arrays_from_tensors(stored))


def what_it_asked(error: pickle.UnpicklingError) -> str:
    """The global a weights-only read refused (e.g. `os.system`), from torch's message, which spans many lines."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    return found.group(1) if found else "more than plain data"


def read_dcp_metadata(directory: str) -> Metadata:
    """DCP's `.metadata` of the checkpoint in `directory`, read without running code (UnsafeCheckpointFile when
    it asks for anything but metadata records)."""
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointFile(f".metadata holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def load_dcp(state: dict[str, Any], directory: str, distributed: bool) -> None:
    """`dcp.load` of the checkpoint in `directory` into `state` (collective unless not `distributed`), running no
    code it holds: UnsafeCheckpointFile names the first entry (or the metadata) that asks for more than data."""
    reader = CheckedReader(directory, read_dcp_metadata(directory))
    try:
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=not distributed)
    except CheckpointException as error:  # every rank raises it, with each failing rank's own exception
        refused = [failure for failure, _ in error.failures.values() if isinstance(failure, UnsafeCheckpointFile)]
        if refused:
            raise refused[0] from None
        raise


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but its non-tensor entries are read with torch's weights-only unpickler (plain
    numbers, strings, containers and tensors), where the default unpickles anything."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointFile(f"entry {name} asks for {what_it_asked(error)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[name], loaded)
        else:
            self.state_dict[name] = loaded


class CheckedReader(FileSystemReader):
    """DCP's file reader handed metadata already read by `read_dcp_metadata`, so DCP never unpickles `.metadata`
    itself."""

    def __init__(self, directory: str, metadata: Metadata):
        super().__init__(directory)
        self.metadata = metadata

    def read_metadata(self) -> Metadata:  # type: ignore[override]  # no rank-local metadata: one file, checked
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


_DCP_RECORD_MODULES = ("torch.distributed.checkpoint.metadata",)
_ADMITTED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        found = super().find_class(module, name) if module in (*_DCP_RECORD_MODULES, "torch") else None
        if module == "torch" and isinstance(found, torch.dtype):
            return found
        is_record = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
        if module in _DCP_RECORD_MODULES and is_record and found.__module__ == module:
            return found
        raise UnsafeCheckpointFile(f".metadata asks for {module}.{name}, which is not checkpoint metadata")


# A list of 1-D numpy arrays (token runs, shuffle buffers of windows: thousands of them) travels as one flat
# tensor and the lengths: a tensor each would cost a pickled storage each, seconds per checkpoint.
_PACKED = "packed 1-D arrays"


def _packable(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 1
        and all(isinstance(item, np.ndarray) and item.ndim == 1 for item in value)
        and len({item.dtype for item in value}) == 1
    )


def _arrays_to_tensors(value: Any) -> Any:
    if _packable(value):
        flat = torch.from_numpy(np.concatenate(value))
        return {_PACKED: flat, "lengths": torch.tensor([len(item) for item in value])}
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: _arrays_to_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_arrays_to_tensors(item) for item in value)
    return value


def _arrays_from_tensors(value: Any) -> Any:
    if isinstance(value, dict) and _PACKED in value:
        flat, ends = value[_PACKED].numpy(), value["lengths"].cumsum(0).tolist()
        return list(np.split(flat, ends[:-1]))
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {key: _arrays_from_tensors(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_arrays_from_tensors(item) for item in value)
    return value
