"""Document sources as streamed Hugging Face `IterableDataset`s with a single `text` column.

Every source ends in the same shape, so tokenisation, packing and batching never know where text came from:
- `stdlib`: the running Python's standard-library source files, one document per file (offline, on every machine);
- `local`: .txt (one document per file), .jsonl and .parquet (one document per record, text in `text_field`);
- `hf`: a hub dataset by name, with `streaming=True`.
The validation stream is the dataset's own validation split when `data.val_split` names one, or the files
`data.val_path` names for local data; otherwise `val_fraction` of the text is held out of training by chunk
(`held_out_chunks`), which keeps the two disjoint and stable and gives even a one-file corpus a validation set.
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
# Documents are held out for validation in pieces of about this many characters (cut at line ends).
HOLDOUT_CHUNK_CHARS = 4096


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


def _local_dataset(data_cfg, files: str) -> IterableDataset:
    by_kind: dict[str, list[str]] = defaultdict(list)
    for path in local_data_files(files):
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


def _holdout_chunks(text: str) -> list[str]:
    """`text` cut into consecutive pieces of about HOLDOUT_CHUNK_CHARS characters, each ending at a line end
    where one follows within another chunk's length."""
    chunks, start = [], 0
    while start < len(text):
        end = start + HOLDOUT_CHUNK_CHARS
        if end < len(text):
            line_end = text.find("\n", end, end + HOLDOUT_CHUNK_CHARS)
            end = line_end + 1 if line_end != -1 else end
        chunks.append(text[start:end])
        start = end
    return chunks


def held_out_chunks(text: str, fraction: float) -> list[tuple[str, bool]]:
    """The document's holdout chunks, each with whether it belongs to validation.

    Chunk j is held out when floor(u + (j + 1) * fraction) > floor(u + j * fraction). A document of n >= 1 /
    fraction chunks takes u = 0.5: exactly round(n * fraction) chunks, spread evenly through it, so a one-file
    corpus's validation set grows in proportion to `fraction`. A shorter one takes u from a hash of its text: it
    is held out whole (n = 1) or by one chunk with probability about n * fraction. Either way the split depends
    only on the text: the same on every run and every rank."""
    chunks = _holdout_chunks(text)
    long_document = len(chunks) * fraction >= 1
    offset = 0.5 if long_document else zlib.crc32(text.encode("utf-8", "replace")) / 2**32
    return [(chunk, int(offset + (j + 1) * fraction) > int(offset + j * fraction)) for j, chunk in enumerate(chunks)]


def _split_for(texts: list[str], fraction: float, validation: bool) -> list[str]:
    """The pieces of `texts` on one side of the holdout: maximal runs of consecutive chunks on that side, each a
    document of its own."""
    pieces = []
    for text in texts:
        run: list[str] = []
        for chunk, held_out in held_out_chunks(text, fraction):
            if held_out == validation:
                run.append(chunk)
            elif run:
                pieces.append("".join(run))
                run = []
        if run:
            pieces.append("".join(run))
    return pieces


def open_documents(data_cfg, split: str) -> IterableDataset:
    """The document stream of `split` (TRAIN or VALIDATION), unshuffled, as an IterableDataset of {"text"}."""
    if data_cfg.source == "hf" and data_cfg.val_split is not None:
        return _hub_dataset(data_cfg, data_cfg.split if split == TRAIN else data_cfg.val_split)
    if data_cfg.source == "local" and data_cfg.val_path is not None:
        return _local_dataset(data_cfg, data_cfg.path if split == TRAIN else data_cfg.val_path)
    if data_cfg.source == "stdlib":
        ds = _from_text_files(stdlib_files())
    elif data_cfg.source == "local":
        ds = _local_dataset(data_cfg, data_cfg.path)
    else:
        ds = _hub_dataset(data_cfg, data_cfg.split)
    return ds.map(
        _split_side,
        batched=True,
        batch_size=16,
        fn_kwargs={"fraction": data_cfg.val_fraction, "validation": split == VALIDATION},
    )


def _split_side(batch: dict, fraction: float, validation: bool) -> dict:
    return {"text": _split_for(batch["text"], fraction, validation)}
