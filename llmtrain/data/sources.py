"""Document sources as streamed Hugging Face `IterableDataset`s with a single `text` column.

Every source ends in the same shape, so tokenisation, packing and batching never know where text came from:
- `stdlib`: the running Python's standard-library source files, one document per file (offline, on every machine);
- `local`: .txt (one document per file), .jsonl and .parquet (one document per record, text in `text_field`);
- `hf`: a hub dataset by name, with `streaming=True`.
The validation stream is the dataset's own validation split when `data.val_split` names one; otherwise the
documents whose text hashes into `val_fraction` are held out of training, which keeps the two disjoint and stable.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections import defaultdict
from collections.abc import Iterator

import datasets
from datasets import IterableDataset

from llmtrain.config import ConfigError, local_data_files

TRAIN, VALIDATION = "train", "validation"
_HASH_BUCKETS = 1_000_000


def stdlib_files() -> list[str]:
    """The standard library's .py files (site-packages excluded), sorted for a machine-independent order."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
        found.extend(os.path.join(directory, f) for f in files if f.endswith(".py"))
    return sorted(found)


def _read_text_files(paths: list[str]) -> Iterator[dict]:
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield {"text": f.read()}


def _from_text_files(paths: list[str]) -> IterableDataset:
    # `paths` as a gen_kwargs list makes each file a shard, so dataset.shuffle reorders files too.
    return IterableDataset.from_generator(
        _read_text_files, gen_kwargs={"paths": paths}, features=datasets.Features({"text": datasets.Value("string")})
    )


def _text_column(ds: IterableDataset, text_field: str, origin: str) -> IterableDataset:
    columns = ds.column_names or []
    if text_field not in columns:
        raise ConfigError(
            f"{origin} has no field {text_field!r} (fields: {', '.join(columns)}): "
            f"set data.text_field to the field that holds the text"
        )
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    return ds.select_columns(["text"])


def _local_dataset(data_cfg) -> IterableDataset:
    by_kind: dict[str, list[str]] = defaultdict(list)
    for path in local_data_files(data_cfg.path):
        by_kind[os.path.splitext(path)[1]].append(path)
    parts = []
    if ".txt" in by_kind:
        parts.append(_from_text_files(by_kind[".txt"]))
    for ext, builder in ((".jsonl", "json"), (".parquet", "parquet")):
        if ext in by_kind:
            ds = datasets.load_dataset(builder, data_files=by_kind[ext], split="train", streaming=True)
            parts.append(_text_column(ds, data_cfg.text_field, by_kind[ext][0]))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _hub_dataset(data_cfg, split: str) -> IterableDataset:
    ds = datasets.load_dataset(data_cfg.name, data_cfg.subset, split=split, streaming=True)
    return _text_column(ds, data_cfg.text_field, f"dataset {data_cfg.name}")


def _in_validation(example: dict, fraction: float) -> bool:
    return zlib.crc32(example["text"].encode("utf-8", "replace")) % _HASH_BUCKETS < fraction * _HASH_BUCKETS


def open_documents(data_cfg, split: str) -> IterableDataset:
    """The document stream of `split` (TRAIN or VALIDATION), unshuffled, as an IterableDataset of {"text"}."""
    if data_cfg.source == "hf" and data_cfg.val_split is not None:
        return _hub_dataset(data_cfg, data_cfg.split if split == TRAIN else data_cfg.val_split)
    if data_cfg.source == "stdlib":
        ds = _from_text_files(stdlib_files())
    elif data_cfg.source == "local":
        ds = _local_dataset(data_cfg)
    else:
        ds = _hub_dataset(data_cfg, data_cfg.split)
    fraction = data_cfg.val_fraction
    if split == VALIDATION:
        return ds.filter(lambda ex: _in_validation(ex, fraction))
    return ds.filter(lambda ex: not _in_validation(ex, fraction))
