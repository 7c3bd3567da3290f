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

import errno
import functools
import json
import logging
import os
import sys
import sysconfig
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import sleep
from typing import TypeVar

import datasets
from datasets import IterableDataset

from llmtrain.catalog import data_source, imported
from llmtrain.data.files import local_data_files
from llmtrain.errors import ConfigError, DataUnavailable, first_line
from llmtrain.hub import from_hub

log = logging.getLogger("llmtrain")
T = TypeVar("T")

TRAIN, VALIDATION = "train", "validation"
# Documents are held out for validation in pieces of about this many characters (cut at line ends).
HOLDOUT_CHUNK_CHARS = 4096
# A stream that failed with a network error is reopened where it stopped and read again after each of these waits
# (seconds): about a minute in all, under the step watchdog's 300 s floor, so that a source that stays away ends
# the run with its own line rather than as a hang. (A hub stream's reads also retry inside `datasets`, up to
# 100 s each: a hub away for longer is named by the watchdog, its phase "waiting for data".)
RETRY_WAITS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
# OSError numbers of a network, or of a shared file system behind one (NFS's stale handle, an evicted Lustre
# client's EIO).
NETWORK_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ENETRESET,
        errno.ENOTCONN,
        errno.EPIPE,
        errno.ESTALE,
        errno.EIO,
        errno.EREMOTEIO,
    }
)
# HTTP statuses of a server that is busy, restarting or rate-limiting: a later request may be answered.
RETRIED_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# The transport errors (a connection lost, refused or timed out) of the HTTP clients a hub stream reads through, by
# module; those that are not OSErrors with a network errno. A client this process never imported cannot have
# raised, so none is imported to check.
CLIENT_NETWORK_ERRORS = {
    "httpx": ("TransportError",),
    "httpx2": ("TransportError",),  # huggingface_hub's
    "requests.exceptions": ("ConnectionError", "Timeout", "ChunkedEncodingError"),
    "aiohttp": ("ClientConnectionError", "ClientPayloadError"),
}
PREPARED_STORE_ADVICE = (
    "or tokenise it once where it can be read (python -m llmtrain.data.prepare ... prepare.out=DIR) and train with "
    "data=prepared data.path=DIR"
)


def stdlib_files() -> list[str]:
    """The standard library's .py files (site-packages excluded), sorted for a machine-independent order."""
    return list(_walk_stdlib())


@functools.cache  # walked once a process (~0.1 s), not once for each stream opened
def _walk_stdlib() -> tuple[str, ...]:
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
        found.extend(os.path.join(directory, f) for f in files if f.endswith(".py"))
    return tuple(sorted(found))


def _read_text_files(paths: list[str], strict: bool = True, key: str = "data.path") -> Iterator[dict]:
    """One document per file. `strict`: a file that is not UTF-8 is refused, naming the byte (the stdlib corpus,
    which holds a few deliberately Latin-1 test files, passes strict=False and reads them with replacements)."""
    for path in paths:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8", errors="strict" if strict else "replace")
        except UnicodeDecodeError as error:
            line = raw.count(b"\n", 0, error.start) + 1
            raise ConfigError(
                f"{key}: {path} is not UTF-8 text: byte {error.start} (line {line}) is "
                f"0x{raw[error.start]:02x}: re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            ) from None
        yield {"text": text.replace("\r\n", "\n").replace("\r", "\n")}  # as text mode's universal newlines


def _read_jsonl_files(paths: list[str], text_field: str, key: str) -> Iterator[dict]:
    """One document per line: the line's JSON object's `text_field`; a line that is not one names file and line."""
    for path in paths:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield {"text": _jsonl_text(f"{key}: {path}, line {number}", line, text_field)}


def _jsonl_text(where: str, line: bytes, text_field: str) -> str:
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8: re-encode the file as UTF-8") from None
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{where} is not JSON ({error.msg} at column {error.colno}): each line of a .jsonl file must be one "
            f"JSON object; fix or remove that line"
        ) from None
    fields = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}, not an object"
    if not isinstance(record, dict) or text_field not in record:
        raise ConfigError(
            f"{where} has no field {text_field!r} (fields: {fields}): set data.text_field to the field that holds "
            f"the text"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise ConfigError(f"{where}: field {text_field!r} holds {type(text).__name__}, not text: fix that record")
    return text


def _read_parquet_files(paths: list[str], text_field: str, key: str) -> Iterator[dict]:
    """One document per row: its `text_field` column, read one row group at a time."""
    for path in paths:
        parquet = _open_parquet(path, text_field, key)
        for group in range(parquet.num_row_groups):
            try:
                column = parquet.read_row_group(group, columns=[text_field]).column(0)
            except Exception as error:  # pyarrow's ArrowInvalid / OSError for damaged pages
                raise ConfigError(
                    f"{key}: {path}, row group {group} cannot be read ({error}): the file is damaged"
                ) from None
            for row, text in enumerate(column.to_pylist()):
                if not isinstance(text, str):
                    raise ConfigError(
                        f"{key}: {path}, row group {group}, row {row}: column {text_field!r} holds "
                        f"{type(text).__name__}, not text: fix that row"
                    )
                yield {"text": text}


def _open_parquet(path: str, text_field: str, key: str):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid for a file that is not parquet
        raise ConfigError(f"{key}: {path} is not a parquet file ({first_line(error)})") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise ConfigError(
            f"{key}: {path} has no field {text_field!r} (fields: {', '.join(columns)}): set data.text_field to "
            f"the field that holds the text"
        )
    return parquet


def _first_jsonl_text(path: str, text_field: str, key: str) -> None:
    """The first record of `path` checked now, so a wrong data.text_field stops the run before it starts."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                _jsonl_text(f"{key}: {path}, line {number}", line, text_field)
                return


def _from_generator(reader, paths: list[str], **kwargs) -> IterableDataset:
    # `paths` as a gen_kwargs list makes each file a shard, so dataset.shuffle reorders files too.
    return IterableDataset.from_generator(
        reader, gen_kwargs={"paths": paths, **kwargs}, features=datasets.Features({"text": datasets.Value("string")})
    )


def _local_dataset(data_cfg, key: str) -> IterableDataset:
    """The documents of the files `key` (data.path or data.val_path) names."""
    files = getattr(data_cfg, key.removeprefix("data."))
    by_kind: dict[str, list[str]] = defaultdict(list)
    for path in local_data_files(files):
        by_kind[os.path.splitext(path)[1]].append(path)
    parts = []
    if ".txt" in by_kind:
        parts.append(_from_generator(_read_text_files, by_kind[".txt"], key=key))
    if ".jsonl" in by_kind:
        for path in by_kind[".jsonl"]:
            _first_jsonl_text(path, data_cfg.text_field, key)
        parts.append(_from_generator(_read_jsonl_files, by_kind[".jsonl"], text_field=data_cfg.text_field, key=key))
    if ".parquet" in by_kind:
        for path in by_kind[".parquet"]:
            _open_parquet(path, data_cfg.text_field, key)  # footers only: the format and the column, checked now
        parts.append(_from_generator(_read_parquet_files, by_kind[".parquet"], text_field=data_cfg.text_field, key=key))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


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


def _hub_dataset(data_cfg, split: str) -> IterableDataset:
    def load() -> IterableDataset:
        return datasets.load_dataset(data_cfg.name, data_cfg.subset, split=split, streaming=True)

    ds = from_hub("data.name", data_cfg.name, load, repo_type="dataset")
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
    """The document stream of `split` (TRAIN or VALIDATION), unshuffled, as an IterableDataset of {"text"}: the
    source row's documents, held out by data.val_fraction unless a validation split or path names the held-out
    text."""
    opened = imported(_documents_of(data_cfg))(data_cfg, split)
    if isinstance(opened, WholeSplit):
        return opened.documents
    return opened.map(
        _split_side,
        batched=True,
        batch_size=16,
        fn_kwargs={"fraction": data_cfg.val_fraction, "validation": split == VALIDATION},
    )


@dataclass(frozen=True)
class WholeSplit:
    """Documents that are the split asked for as they are (a validation split or path of their own)."""

    documents: IterableDataset


def _documents_of(data_cfg) -> str:
    documents = data_source(data_cfg.source).documents
    if documents is None:
        raise ConfigError(f"data={data_cfg.source} has no text documents to stream: use data=stdlib, local or hf")
    return documents


def stdlib_documents(data_cfg, split: str) -> IterableDataset:
    """data=stdlib: the standard library's source files."""
    return _from_generator(_read_text_files, stdlib_files(), strict=False)


def local_documents(data_cfg, split: str) -> IterableDataset | WholeSplit:
    """data=local: the files under data.path (the held-out ones under data.val_path where it is set)."""
    if data_cfg.val_path is not None:
        return WholeSplit(_local_dataset(data_cfg, "data.path" if split == TRAIN else "data.val_path"))
    return _local_dataset(data_cfg, "data.path")


def hub_documents(data_cfg, split: str) -> IterableDataset | WholeSplit:
    """data=hf: the dataset's split on the hub (data.val_split's where it is set)."""
    if data_cfg.val_split is not None:
        return WholeSplit(_hub_dataset(data_cfg, data_cfg.split if split == TRAIN else data_cfg.val_split))
    return _hub_dataset(data_cfg, data_cfg.split)


def _split_side(batch: dict, fraction: float, validation: bool) -> dict:
    return {"text": _split_for(batch["text"], fraction, validation)}


def source_name(data_cfg) -> str:
    """The training documents' source as a message names it: the key that names them, or the source."""
    needs = data_source(data_cfg.source).needs
    if needs in ("path", "name"):
        return f"data.{needs}={getattr(data_cfg, needs)}"
    return f"data={data_cfg.source}"


def read_with_retries(read: Callable[[], T], reopen: Callable[[], None], source: str) -> T:
    """`read()` from a stream of `source`. After a network error the stream is reopened where it stopped
    (`reopen()`, which may read and fail as well) and read again, after each wait of RETRY_WAITS, each retry one
    warning: a connection lost for a while costs a pause, not the run. Still failing after the last, a
    DataUnavailable (exit 1, requeued) says so in one line. Any other error, which every try would meet again, is
    raised at once."""
    retries = 0
    while True:
        try:
            if retries:
                reopen()
            return read()
        except Exception as error:
            if _offline(error):
                raise ConfigError(
                    f"{source} cannot be streamed with HF_HUB_OFFLINE=1: unset it where the hub is reachable, "
                    f"{PREPARED_STORE_ADVICE}"
                ) from None
            if not is_network_error(error):
                raise
            if retries == len(RETRY_WAITS):
                raise DataUnavailable(_unavailable(source, error)) from error
            wait, retries = RETRY_WAITS[retries], retries + 1
            log.warning(
                f"{source}: {_described(error)}; reading again in {wait:g} s (retry {retries} of {len(RETRY_WAITS)})"
            )
        sleep(wait)


def is_network_error(error: BaseException) -> bool:
    """Whether `error` is a network's (or a shared file system's behind one), which a later try may not meet: a
    connection lost, refused or timed out, an HTTP status a busy or restarting server sends. A missing file, a
    refused token, an unknown dataset or damaged data meet every try alike and are not retried."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status is not None:
        return status in RETRIED_HTTP_STATUSES
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, OSError) and error.errno in NETWORK_ERRNOS:
        return True
    return isinstance(error, _client_network_errors())


def _client_network_errors() -> tuple[type[BaseException], ...]:
    return tuple(
        getattr(sys.modules[module], name)
        for module, names in CLIENT_NETWORK_ERRORS.items()
        if module in sys.modules
        for name in names
    )


def _offline(error: BaseException) -> bool:
    # huggingface_hub's OfflineModeIsEnabled is a ConnectionError, but HF_HUB_OFFLINE=1 meets every try alike.
    return type(error).__name__ == "OfflineModeIsEnabled"


def _unavailable(source: str, error: BaseException) -> str:
    return (
        f"{source} could not be read ({_described(error)}), still after {len(RETRY_WAITS)} retries over "
        f"{sum(RETRY_WAITS):.0f} s: check the network, or the shared file system it is read from, then resume; "
        f"{PREPARED_STORE_ADVICE}"
    )


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error)}"
