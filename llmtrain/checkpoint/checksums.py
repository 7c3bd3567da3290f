"""A checkpoint that proves itself: the SHA-256 and size of every file it holds, in `checksums.json`, written last.

Each rank hashes what it wrote itself (its DCP shards and its generator states) right after writing them, in the
thread that wrote them (an async save's background thread), into `.checksums-<rank>.json`; when every rank is
done, rank 0 hashes its own small files (DCP's `.metadata`, meta.json, the data position, the tokenizer), merges
the ranks' lists into `checksums.json` and renames the checkpoint complete. A checkpoint without `checksums.json`
is incomplete. Before a checkpoint is loaded (a resume, an export, an evaluation, sampling), every file it lists is
hashed again: a flipped byte anywhere is named, where a size check sees only missing or truncated files. A resuming
job's ranks share that reading, each a share of the files dealt out by the sizes recorded at save, so that no rank
reads the metadata of files it does not hash (a million stats at 1,024 ranks on a shared file system). A checkpoint
written before sizes were recorded lists digests alone; its shares are dealt by the files' sizes as they are now.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable

from llmtrain.files import write_json_atomic

CHECKSUMS = "checksums.json"
_RANK_CHECKSUMS = ".checksums-{rank}.json"


_CHUNK = 8 << 20


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _digests(directory: str, names: Iterable[str]) -> dict[str, dict[str, str | int]]:
    """Each file's SHA-256 and size in bytes, as written."""
    return {
        name: {
            "sha256": file_digest(os.path.join(directory, name)),
            "bytes": os.path.getsize(os.path.join(directory, name)),
        }
        for name in sorted(set(names))
    }


def record_rank_files(directory: str, rank: int, names: Iterable[str]) -> None:
    """This rank's files of the checkpoint being written in `directory`, hashed as soon as they are written."""
    write_json_atomic(os.path.join(directory, _RANK_CHECKSUMS.format(rank=rank)), _digests(directory, names))


def seal(directory: str) -> None:
    """Rank 0, once every rank has recorded its files: every other file hashed, the ranks' lists merged into
    `checksums.json`, the last file the checkpoint gets."""
    listed: dict[str, dict[str, str | int]] = {}
    rank_lists = glob.glob(os.path.join(glob.escape(directory), _RANK_CHECKSUMS.format(rank="*")))
    for rank_list in rank_lists:
        with open(rank_list, encoding="utf-8") as f:
            listed.update(json.load(f))
    rest = [name for name in _files(directory) if name not in listed]
    listed.update(_digests(directory, rest))
    write_json_atomic(os.path.join(directory, CHECKSUMS), dict(sorted(listed.items())))
    for rank_list in rank_lists:
        os.remove(rank_list)


def _files(directory: str) -> list[str]:
    """Every file under `directory`, relative to it, but the checksum lists themselves."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            if name == CHECKSUMS or name.startswith(".checksums-"):
                continue
            found.append(os.path.relpath(os.path.join(root, name), directory))
    return found


def listed_files(directory: str) -> dict[str, dict[str, str | int]] | None:
    """The files `checksums.json` lists, each with its digest (`sha256`) and, where the checkpoint recorded it, its
    size (`bytes`); None when it is missing or unreadable."""
    try:
        with open(os.path.join(directory, CHECKSUMS), encoding="utf-8") as f:
            listed = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(listed, dict):
        return None
    return {name: entry if isinstance(entry, dict) else {"sha256": entry} for name, entry in listed.items()}


def damage(directory: str, share: tuple[int, int] = (0, 1)) -> str | None:
    """The first of the checkpoint's files that is not as it was written (missing, or its digest differs), as a
    phrase; None when every listed file matches. `share` (index, count): only that share of the files is read, the
    files dealt out largest first so that the shares read about as much (the ranks of a resuming job each read
    one); a missing checksum list is found by every share."""
    listed = listed_files(directory)
    if listed is None:
        return f"{CHECKSUMS} is missing or unreadable"
    index, count = share
    for name in _largest_first(directory, listed)[index::count]:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if file_digest(path) != listed[name].get("sha256"):
            return f"{name} does not match its checksum"
    return None


def _largest_first(directory: str, listed: dict[str, dict[str, str | int]]) -> list[str]:
    """The listed files, largest first by the sizes recorded at save (a checkpoint from before those: as they are
    now, every file's metadata read)."""

    def size(name: str) -> int:
        recorded = listed[name].get("bytes")
        if isinstance(recorded, int):
            return recorded
        try:
            return os.path.getsize(os.path.join(directory, name))
        except OSError:
            return 0

    return sorted(listed, key=lambda name: (-size(name), name))
