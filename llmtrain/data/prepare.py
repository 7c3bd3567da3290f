"""`python -m llmtrain.data.prepare data=<source> [data.* keys] prepare.out=DIR`: tokenise a corpus once.

The documents of each split (the same ones training would stream: llmtrain/data/sources.py) are read here, in
order, and tokenised by `prepare.num_proc` worker processes in batches of about a megabyte of text; the batches are
written in the order they were read, so the store is the same for any number of workers. Everything is written to
DIR.partial and renamed to DIR after the manifest, so an interrupted run leaves nothing that looks complete, and a
second run on the same inputs finds the manifest and does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from multiprocessing import get_context
from typing import Any, cast

import hydra
import numpy as np
from omegaconf import OmegaConf
from tqdm import tqdm

from llmtrain.catalog import DATA_SOURCES, data_source
from llmtrain.config import (
    CONF_DIR,
    DataConfig,
    PrepareConfig,
    PrepareRootConfig,
    check_domains,
    reads_local_files,
    reads_prepared_stores,
    register_schemas,
    validate_data,
)
from llmtrain.config.composition import job, run_entry
from llmtrain.data import build_tokenizer
from llmtrain.data.files import check_data_files, local_data_files
from llmtrain.data.sources import TRAIN, VALIDATION, open_documents, stdlib_files
from llmtrain.data.store import (
    MANIFEST,
    STORE_VERSION,
    TOKENIZER_DIR,
    VOCAB_HASH,
    SplitWriter,
    read_manifest,
    split_file,
    token_dtype,
)
from llmtrain.data.tokenizers import Tokenizer, load_saved_tokenizer, save_for_transformers, vocabulary_sha256
from llmtrain.errors import ConfigError

# A worker's task: documents up to about this much text (large enough that pickling is a small share of the work).
BATCH_CHARS = 1 << 20
BATCH_DOCS = 4096


def _inputs(data_cfg: DataConfig) -> list[list[Any]]:
    """(path, size, mtime) of every input file, so that edited or added files make a different store."""
    if reads_local_files(data_cfg):
        assert data_cfg.path is not None
        paths = local_data_files(data_cfg.path) + (local_data_files(data_cfg.val_path) if data_cfg.val_path else [])
    elif data_cfg.source == "stdlib":  # the one source whose files are the machine's (a row field would serve one)
        paths = stdlib_files()
    else:
        return []  # a hub dataset is named by its config
    return [[p, os.path.getsize(p), os.stat(p).st_mtime_ns] for p in paths]


def _fingerprint(data_cfg: DataConfig) -> tuple[str, dict[str, Any]]:
    described = OmegaConf.to_container(OmegaConf.structured(data_cfg))
    assert isinstance(described, dict)
    for key in ("doc_shuffle_buffer", "window_shuffle_buffer", "cache_dir"):  # training-time keys
        described.pop(key)
    identity = {"data": described, "inputs": _inputs(data_cfg), "version": STORE_VERSION}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest(), cast(dict[str, Any], described)


def _document_batches(data_cfg: DataConfig, split: str) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for example in open_documents(data_cfg, split):
        batch.append(example["text"])
        chars += len(example["text"])
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_worker_tokenizer: Tokenizer | None = None


def _start_worker(directory: str, kind: str, eos_id: int, vocab_size: int) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tokenizer = load_saved_tokenizer(directory, kind, eos_id, vocab_size)


def _tokenize(texts: list[str], tokenizer: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The batch's documents as one array of ids (each followed by end-of-text) and each document's length."""
    tokenizer = tokenizer or _worker_tokenizer
    assert tokenizer is not None, "_start_worker loads the tokenizer"
    encoded = tokenizer.encode_batch(texts)
    lengths = np.array([len(ids) + 1 for ids in encoded], dtype=np.int64)
    tokens = np.empty(int(lengths.sum()), dtype=token_dtype(tokenizer.vocab_size))
    ends = np.cumsum(lengths)
    for ids, end in zip(encoded, ends):
        tokens[end - len(ids) - 1 : end - 1] = ids
        tokens[end - 1] = tokenizer.eos_id
    return tokens, lengths


def _write_split(
    data_cfg: DataConfig, split: str, path: str, tokenizer: Tokenizer, pool, progress: tqdm
) -> dict[str, Any]:
    writer = SplitWriter(path, token_dtype(tokenizer.vocab_size))
    batches = _document_batches(data_cfg, split)
    tokenized = pool.imap(_tokenize, batches) if pool else (_tokenize(b, tokenizer) for b in batches)
    progress.set_description_str(split)
    for tokens, lengths in tokenized:
        writer.append(tokens, len(lengths))
        progress.update(len(tokens))
    return writer.close()


def prepare(data_cfg: DataConfig, prepare_cfg: PrepareConfig) -> dict[str, Any]:
    """Write the token store prepare.out for `data_cfg` (or find it already written) and return its manifest."""
    if not prepare_cfg.out:
        raise ConfigError("prepare.out is not set: name the directory to write, e.g. prepare.out=data/corpus")
    _check_settings(data_cfg, prepare_cfg)
    out = os.path.abspath(os.path.expanduser(prepare_cfg.out))
    fingerprint, described = _fingerprint(data_cfg)
    existing = _prepared_before(out, prepare_cfg.out, fingerprint)
    if existing is not None:
        return existing
    partial = f"{out}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted run left
    os.makedirs(partial)
    started = time.perf_counter()
    tokenizer, splits = _tokenize_splits(data_cfg, prepare_cfg.num_proc, partial)
    seconds = time.perf_counter() - started
    manifest = {
        "version": STORE_VERSION,
        "fingerprint": fingerprint,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "tokenizer": {
            **described["tokenizer"],
            "eos_id": tokenizer.eos_id,
            "size": tokenizer.vocab_size,
            VOCAB_HASH: vocabulary_sha256(tokenizer),
        },
        "splits": splits,
        "data": described,
        "seconds": round(seconds, 2),
        "num_proc": prepare_cfg.num_proc,
    }
    with open(os.path.join(partial, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    if os.path.isdir(out):
        os.rmdir(out)  # empty, checked by _prepared_before
    os.replace(partial, out)
    _print_summary(out, splits, seconds, prepare_cfg.num_proc)
    return manifest


def _check_settings(data_cfg: DataConfig, prepare_cfg: PrepareConfig) -> None:
    """A one-line ConfigError for settings prepare cannot run with."""
    check_domains(prepare_cfg, PrepareConfig, "prepare.")
    validate_data(data_cfg)
    check_data_files(data_cfg)
    if data_source(data_cfg.source).documents is None:
        held = "reads prepared stores" if reads_prepared_stores(data_cfg) else "holds no text documents"
        sources = "|".join(name for name, row in DATA_SOURCES.items() if row.documents is not None)
        raise ConfigError(f"data={data_cfg.source} {held}: choose the source to prepare (data={sources})")


def _prepared_before(out: str, configured_out: str, fingerprint: str) -> dict[str, Any] | None:
    """The manifest of the store at `out` if these inputs wrote it; None where `out` is free to write (absent or an
    empty directory); a ConfigError where something else is there."""
    if os.path.isfile(os.path.join(out, MANIFEST)):
        manifest = read_manifest(out)
        if manifest["fingerprint"] == fingerprint:
            print(f"{out} is already prepared from these inputs: nothing to do", file=sys.stderr)
            return manifest
        raise ConfigError(
            f"prepare.out={configured_out!r} holds a store prepared from other inputs or settings: "
            f"choose a new prepare.out, or delete it to prepare it again"
        )
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"prepare.out={configured_out!r} exists and is not a prepared store: choose a new directory")
    return None


def _tokenize_splits(data_cfg: DataConfig, num_proc: int, partial: str) -> tuple[Tokenizer, dict[str, Any]]:
    """Build (or train) the tokenizer and save it in `partial`, then write each split's tokens there with
    `num_proc` processes: the tokenizer and each split's summary."""
    tokenizer = build_tokenizer(data_cfg, is_main=True, barrier=lambda: None)
    tokenizer_dir = os.path.join(partial, TOKENIZER_DIR)
    save_for_transformers(tokenizer, tokenizer_dir)
    kind = data_cfg.tokenizer.kind
    assert kind is not None, "validate_data checks the tokenizer kind"
    worker_args = (tokenizer_dir, kind, tokenizer.eos_id, tokenizer.vocab_size)
    pool = get_context("spawn").Pool(num_proc, _start_worker, worker_args) if num_proc > 1 else None
    try:
        with tqdm(unit="tok", unit_scale=True, dynamic_ncols=True, mininterval=1.0) as progress:
            return tokenizer, {
                split: _write_split(data_cfg, split, split_file(partial, split), tokenizer, pool, progress)
                for split in (TRAIN, VALIDATION)
            }
    finally:
        if pool:
            pool.terminate()


def _print_summary(out: str, splits: dict[str, Any], seconds: float, num_proc: int) -> None:
    total = sum(s["tokens"] for s in splits.values())
    print(
        f"prepared {out}: {splits[TRAIN]['tokens']:,} training tokens in {splits[TRAIN]['documents']:,} documents, "
        f"{splits[VALIDATION]['tokens']:,} validation tokens in {splits[VALIDATION]['documents']:,}; "
        f"{total / seconds:,.0f} tokens/s with {num_proc} processes ({seconds:.1f} s, tokenizer training included)",
        file=sys.stderr,
    )


register_schemas()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="prepare")
@job
def main(cfg) -> None:
    try:
        prepare(OmegaConf.to_object(cfg.data), OmegaConf.to_object(cfg.prepare))  # type: ignore[arg-type]
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(ConfigError.exit_code)


if __name__ == "__main__":
    run_entry(main, PrepareRootConfig)
