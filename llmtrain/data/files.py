"""The data files a path names, for the sources that read files (data=local, data=sft, and llmtrain.data.prepare of
them): a file, a folder searched recursively, or a glob; of what it matches, the non-empty .txt, .jsonl and .parquet
files.

`check_data_files` refuses a path that names none, in one line. The config's validation (llmtrain/config/) has
already said whether the path exists; this runs after it and before any training work: train.py once the config's
checks pass, llmtrain.data.prepare before it reads.
"""

from __future__ import annotations

import glob
import os

from llmtrain.config import reads_local_files
from llmtrain.errors import ConfigError

DATA_EXTENSIONS = (".txt", ".jsonl", ".parquet")


def local_data_files(path: str) -> list[str]:
    """Non-empty data files named by a file, a folder (searched recursively) or a glob, sorted."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        candidates = glob.glob(os.path.join(path, "**", "*"), recursive=True)
    else:
        candidates = glob.glob(path, recursive=True)
    return sorted(p for p in candidates if os.path.isfile(p) and p.endswith(DATA_EXTENSIONS) and os.path.getsize(p) > 0)


def check_data_files(data_cfg) -> None:
    """A one-line ConfigError when data.path or data.val_path, of a source that reads files, names no data file."""
    if not reads_local_files(data_cfg):
        return
    kinds = f"{', '.join(DATA_EXTENSIONS[:-1])} or {DATA_EXTENSIONS[-1]}"
    for key, path in (("data.path", data_cfg.path), ("data.val_path", data_cfg.val_path)):
        if path is not None and not local_data_files(path):
            raise ConfigError(
                f"{key}={path!r} matches no {kinds} file: point {key} at a file, a folder or a glob of such files"
            )
