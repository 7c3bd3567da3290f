"""Sharded, atomic checkpoints with torch Distributed Checkpoint (DCP).

A checkpoint is a directory `<checkpoint.dir>/step-<8 digits>/` holding
  DCP's shard files and `.metadata`   model and optimizer state: each rank writes only the shards it holds, under
                                      the unsplit model's names, so any layout can load what any other saved;
  meta.json                           step, model config, layout, LR schedule, the run that wrote it (rank 0);
  data.pt                             the training stream's position after the last step (rank 0), read back
                                      with `weights_only=True`: loading a checkpoint never runs code it holds;
  rng-<rank>.pt                       each rank's random generator states (dropout);
  tokenizer/                          the run's tokenizer as transformers loads it (rank 0), for export and sampling;
  checksums.json                      the SHA-256 and size of every file above, written last (checksums.py).
It is written as `step-<n>.tmp/` and renamed when every rank has finished, so a directory without `.tmp` is
complete; one whose files are missing or truncated anyway (a disk that lost a shard) is skipped with a warning
naming it, and the previous one is used. Before one is loaded, every file is checked against its checksum
(`verify`): resuming with checkpoint.resume=auto sets a damaged latest one aside (`step-<n>.damaged`), names it and
resumes from the one before; a checkpoint named explicitly, an export or an evaluation ends in one line naming the
damaged file. The `keep` newest complete checkpoints stay; older ones are deleted, and
one saved on the clock alone (checkpoint.every_minutes, `by_clock` in its meta.json) goes as soon as a newer one is
complete.

With `checkpoint.async_save`, DCP's async_save stages the state in host memory, returns, and writes in a background
thread on a dedicated gloo group while training continues. The staging buffers are allocated at the first save and
reused by every later one (pinned on GPUs, so the copy runs at full PCIe speed): the training pause is the copy,
not an allocation of the whole state; the rename happens at the first step end after every
rank's write has finished (or at the next save, or the end of the run), so a crash mid-write leaves the previous
checkpoint as the latest.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from llmtrain import faults
from llmtrain.checkpoint import checksums, safe_load
from llmtrain.checkpoint.safe_load import (
    DATA_POSITION,
    PICKLED_DATA_POSITION,
    UnsafeCheckpointFile,
    write_data_position,
)
from llmtrain.errors import CheckpointWriteError, ConfigError, first_line
from llmtrain.process.runtime import Runtime
from llmtrain.releases import stager_outlives_a_save

log = logging.getLogger("llmtrain")
# DCP warns on each call without a process group that it assumes one process, which is what a single-process run
# asks for (no_dist=True). An async save warns from its writing thread, after any `catch_warnings` around the call
# has ended (the user then saw it beside the one-line error of a failed save), so the filter holds for the process.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

_STEP_DIR = re.compile(r"^step-(\d{8})$")
_DAMAGED = re.compile(r"^step-\d{8}\.damaged(-\d+)?$")


def _failure_reason(error: BaseException) -> str:
    """What failed, in the operating system's words where there are some ("No space left on device"), looked for
    in DCP's per-rank failures too."""
    found: list[BaseException] = [error]
    if isinstance(error, CheckpointException):
        found += [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
    for candidate in found:
        cause: BaseException | None = candidate
        while cause is not None:
            if isinstance(cause, OSError) and cause.strerror:
                return cause.strerror
            cause = cause.__cause__ or cause.__context__
    own = found[-1]  # the failing rank's own exception when DCP wrapped it
    return first_line(own)


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def is_checkpoint_name(path: str) -> bool:
    """Whether `path` names one checkpoint (step-<n>) rather than a directory of them."""
    return bool(_STEP_DIR.match(os.path.basename(os.path.normpath(path))))


def incomplete_reason(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None when it is complete: every file DCP's metadata
    names exists and is long enough, and our own files are there."""
    missing = _missing_file(path)
    if missing:
        return missing
    try:
        metadata = safe_load.read_dcp_metadata(path)
    except UnsafeCheckpointFile as error:
        return str(error)
    except Exception as error:  # a truncated .metadata fails to unpickle in many ways
        return f".metadata is unreadable ({type(error).__name__})"
    try:
        if not isinstance(read_meta(path), dict):
            return "meta.json is not a JSON object"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"meta.json is unreadable ({type(error).__name__})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"shard {name} is missing"
        if os.path.getsize(file) < size:
            return f"shard {name} is truncated ({os.path.getsize(file)} of {size} bytes)"
    return None


def _missing_file(path: str) -> str | None:
    """Which of the files every checkpoint has is missing, as a phrase (None: none is)."""
    for name in (".metadata", "meta.json"):
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    if not os.path.isfile(os.path.join(path, checksums.CHECKSUMS)):
        return (
            f"{checksums.CHECKSUMS} is missing (its write did not finish; one written before checkpoints carried "
            f"checksums gets them from `python -m llmtrain.tools.upgrade_checkpoint {path}`, if you trust it)"
        )
    if not any(os.path.isfile(os.path.join(path, name)) for name in (DATA_POSITION, PICKLED_DATA_POSITION)):
        return f"{DATA_POSITION} is missing"
    return None


def complete_checkpoints(directory: str, warn: bool = True) -> list[str]:
    """Complete checkpoints in `directory`, oldest first; incomplete ones are left out (and reported: `warn`)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        if _STEP_DIR.match(name):
            path = os.path.join(directory, name)
            reason = incomplete_reason(path)
            if reason is None:
                found.append(path)
            elif warn:
                log.warning(f"skipping checkpoint {path}: {reason}")
    return found


class IncompleteCheckpoint(ValueError):
    """A path that names one checkpoint (step-<n>) which cannot be loaded; the message is the reason."""


class DamagedCheckpoint(ValueError):
    """A complete checkpoint one of whose files is not as it was written; the message names the file."""


def verify(path: str, share: tuple[int, int] = (0, 1)) -> None:
    """Every file of the checkpoint at `path` hashed against its checksum (the whole checkpoint is read; with
    `share`, that share of its files: checksums.damage). Raises DamagedCheckpoint naming the first that differs or
    is missing."""
    found = checksums.damage(path, share)
    if found:
        raise DamagedCheckpoint(found)


def set_aside_in(directory: str) -> list[str]:
    """The checkpoints in `directory` that resuming set aside as damaged."""
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, name) for name in os.listdir(directory) if _DAMAGED.match(name))


def set_aside(path: str) -> str:
    """Move the checkpoint at `path` out of the run's way (its step-* name is what resuming looks for), kept for
    whoever wants to look at it: `step-<n>.damaged`, numbered if that exists."""
    aside, number = f"{path}.damaged", 1
    while os.path.exists(aside):
        number += 1
        aside = f"{path}.damaged-{number}"
    os.replace(path, aside)
    return aside


def latest_checkpoint(path: str, warn: bool = True) -> str | None:
    """The checkpoint `path` stands for: itself when it names one (step-<n>), else the latest complete one in the
    directory `path`, None when it holds none. The one lookup behind resuming, export and sampling; each caller
    words its own error. Raises IncompleteCheckpoint when `path` names one checkpoint that is incomplete."""
    if is_checkpoint_name(path):
        reason = incomplete_reason(path)
        if reason:
            raise IncompleteCheckpoint(reason)
        return path
    found = complete_checkpoints(path, warn)
    return found[-1] if found else None


def read_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def read_data_position(path: str) -> dict:
    """The training stream's position saved with the checkpoint at `path`, read without running code."""
    if not os.path.isfile(os.path.join(path, DATA_POSITION)) and os.path.isfile(
        os.path.join(path, PICKLED_DATA_POSITION)
    ):
        raise ConfigError(
            f"checkpoint {path} keeps its data position in {PICKLED_DATA_POSITION}, a pickle that could run code "
            f"when read, so it is not loaded: if you trust where it came from, convert it with `python -m "
            f"llmtrain.tools.upgrade_checkpoint {path}`, or start afresh (checkpoint.resume=none)"
        )
    try:
        return safe_load.read_data_position(path)
    except UnsafeCheckpointFile as error:
        raise ConfigError(
            f"checkpoint {path}: {DATA_POSITION} holds more than data and was not loaded ({error}): resume from a "
            f"checkpoint you wrote (checkpoint.resume=<its step-* directory>) or start afresh (checkpoint.resume=none)"
        ) from None
    except (OSError, EOFError, RuntimeError) as error:
        raise damaged(path, DATA_POSITION, error) from None


def damaged(path: str, what: str, error: BaseException) -> ConfigError:
    """The one-line error for a checkpoint whose `what` does not read back (the previous ones may)."""
    return ConfigError(
        f"checkpoint {path} is damaged: {what} cannot be read ({_failure_reason(error)}): resume from an earlier "
        f"checkpoint (checkpoint.resume=<its step-* directory>) or start afresh (checkpoint.resume=none)"
    )


def rng_states() -> dict[str, Any]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(path: str, rank: int) -> bool:
    """This rank's generators as saved, when the checkpoint has a file for this rank (same world size)."""
    file = os.path.join(path, f"rng-{rank}.pt")
    if not os.path.isfile(file):
        return False
    try:
        states = torch.load(file, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ConfigError(
            f"checkpoint {path}: rng-{rank}.pt holds more than generator states ({safe_load.what_it_asked(error)}) "
            f"and was not loaded: resume from a checkpoint you wrote (checkpoint.resume=<its step-* directory>) or "
            f"start afresh (checkpoint.resume=none)"
        ) from None
    except (OSError, EOFError, RuntimeError) as error:
        raise damaged(path, f"rng-{rank}.pt", error) from None
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    return True


def staging_options(device: torch.device) -> StagingOptions:
    """Async saves copy into host buffers that persist between saves (DCP's stager keeps them by storage), pinned
    when the state lives on a GPU; the copy itself stays on the training thread, where DCP expects it."""
    on_gpu = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
    )


class _Writer(FileSystemWriter):
    """DCP's file writer, with the fault points of checkpoint `step`'s write (llmtrain/faults.py), hashing what
    `rank` wrote (its shards and `also`, written before) as soon as it is written: in an async save, off the
    training thread."""

    def __init__(self, path: str, step: int, rank: int, also: tuple[str, ...]):
        super().__init__(path)
        self.step, self.rank, self.also = step, rank, also
        self.directory = path

    def write_data(self, plan, planner):
        written = faults.checkpoint_write(self.step, lambda: super(_Writer, self).write_data(plan, planner))
        shards = {result.storage_data.relative_path for result in written.wait()}
        checksums.record_rank_files(self.directory, self.rank, [*shards, *self.also])
        return written


class CheckpointManager:
    """Writes the checkpoints of one directory (every rank calls `save`), completing async ones."""

    def __init__(self, directory: str, keep: int, use_async: bool, runtime: Runtime):
        self.directory = directory
        self.keep = keep
        self.use_async = use_async
        self.runtime = runtime
        self._pending: tuple[Future, str, str] | None = None  # (write, tmp dir, final dir)
        # The background writes of async_save run collectives; they get their own gloo group so that they never
        # interleave with the training step's collectives on the default group.
        self._group = dist.new_group(backend="gloo") if use_async and runtime.distributed else None
        self._stager = DefaultStager(staging_options(runtime.device)) if use_async else None
        self._stager_outlives_a_save = stager_outlives_a_save()

    def save(
        self,
        step: int,
        state: dict[str, Any],
        meta: dict[str, Any],
        data_position: dict,
        write_main_files: Callable[[str], None] | None = None,
    ) -> None:
        """Collective. Write checkpoint `step`: `state` (DCP: model and optimizer), `meta`, `data_position` and
        whatever `write_main_files(directory)` writes (rank 0), and every rank's generator states."""
        self.wait()
        final = checkpoint_path(self.directory, step)
        tmp = f"{final}.tmp"
        with self._write_failure(tmp):
            if self.runtime.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            self.runtime.barrier()
            generators = f"rng-{self.runtime.rank}.pt"
            torch.save(rng_states(), os.path.join(tmp, generators))
            if self.runtime.is_main:
                with open(os.path.join(tmp, "meta.json"), "w") as f:
                    json.dump(meta, f)
                write_data_position(tmp, data_position)
                if write_main_files is not None:
                    write_main_files(tmp)
            if self.use_async:
                future = dcp.async_save(
                    state,
                    storage_writer=_Writer(tmp, step, self.runtime.rank, (generators,)),
                    process_group=self._group,
                    async_stager=self._stager_for_this_save(),
                    no_dist=not self.runtime.distributed,
                )
                self._pending = (cast(Future, future), tmp, final)
                return
            writer = _Writer(tmp, step, self.runtime.rank, (generators,))
            dcp.save(state, storage_writer=writer, no_dist=not self.runtime.distributed)
        self._finish(tmp, final)

    def _stager_for_this_save(self) -> DefaultStager:
        """The stager kept between saves, or a new one where a stager serves one save only (releases.py)."""
        if not self._stager_outlives_a_save:
            self._stager = DefaultStager(staging_options(self.runtime.device))
        return cast(DefaultStager, self._stager)

    @contextmanager
    def _write_failure(self, tmp: str) -> Iterator[None]:
        """A failed write (a full disk, a directory that cannot be written) leaves the previous checkpoint the
        latest: the partial one is deleted and CheckpointWriteError says so in one line. DCP reports a rank's
        failure to every rank (CheckpointException), so all of them raise; one rank's own file write fails alone
        (its peers then fail at the next collective)."""
        try:
            yield
        except (OSError, CheckpointException) as error:
            if self.runtime.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = complete_checkpoints(self.directory, warn=False)
            kept = (
                f"{os.path.basename(previous[-1])} is intact and a rerun resumes from it"
                if previous
                else ("no earlier checkpoint exists")
            )
            raise CheckpointWriteError(
                f"checkpoint {os.path.basename(tmp[: -len('.tmp')])} could not be written to {self.directory} "
                f"({_failure_reason(error)}); {kept}: free space on that disk (older step-* directories can go), "
                f"lower checkpoint.keep, or set checkpoint.dir to another disk"
            ) from error

    def poll(self) -> None:
        """Collective, once a step: complete an async save as soon as every rank's write has finished, so a
        crash later in the run finds it complete."""
        if self._pending is None:
            return
        # A host tensor, reduced by the training group's gloo backend (a GPU job's group has one for host tensors):
        # no device synchronisation. Not on the write's own group: that one is busy in the write's thread.
        done = torch.tensor([int(self._pending[0].done())], dtype=torch.int32)
        if self.runtime.distributed:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            self.wait()

    def wait(self) -> None:
        """Complete an async save still in flight (collective)."""
        if self._pending is not None:
            future, tmp, final = self._pending
            self._pending = None
            with self._write_failure(tmp):
                future.result()
            self._finish(tmp, final)

    def _finish(self, tmp: str, final: str) -> None:
        """After every rank's shards are written: rank 0 renames the checkpoint complete and prunes old ones."""
        self.runtime.barrier()
        if self.runtime.is_main:
            with self._write_failure(tmp):
                checksums.seal(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            faults.checkpoint_complete(final)
            for old in complete_checkpoints(self.directory)[:-1]:
                if read_meta(old).get("by_clock"):  # a newer one is complete: it has done its job
                    shutil.rmtree(old, ignore_errors=True)
            for old in complete_checkpoints(self.directory)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.runtime.barrier()


def load_checkpoint(path: str, state: dict[str, Any], distributed: bool) -> None:
    """Load `path` into `state` in place (collective); each rank reads the parts its layout holds. Nothing it
    holds is run: an entry that would run code is refused with a one-line ConfigError."""
    try:
        safe_load.load_dcp(state, path, distributed)
    except UnsafeCheckpointFile as error:
        raise ConfigError(
            f"checkpoint {path} holds more than data in its model and optimizer shards and was not loaded "
            f"({error}): use a checkpoint you wrote (its step-* directory) or start afresh (checkpoint.resume=none)"
        ) from None
    except CheckpointException as error:  # raised on every rank: a shard that does not unpickle or is short
        raise damaged(path, "its model and optimizer shards", error) from None
