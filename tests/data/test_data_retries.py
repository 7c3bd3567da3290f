"""A streamed source that fails with network errors (faults: data_errors, data_stall_seconds), in this process: a few
failures cost retries and no window, one that outlasts the retries ends the run in one line naming the source, a
stream that stalls past the watchdog's limit is named as the data's wait. The waits between tries are recorded, not
slept."""

from __future__ import annotations

import errno
import itertools
import logging
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from harness.corpora import DOCUMENT_CORPUS
from omegaconf import OmegaConf

from llmtrain import faults
from llmtrain.config import DataConfig
from llmtrain.data import RankSlice, sources, training_windows
from llmtrain.data.prefetch import Prefetched
from llmtrain.data.stream import StreamedBatches, TrainingWindows
from llmtrain.data.tokenizers import ByteTokenizer
from llmtrain.errors import HUNG_EXIT, ConfigError, DataUnavailable
from llmtrain.process.runtime import Runtime
from llmtrain.train.watchdog import Position, StepWatchdog, describe_hang

WINDOWS = 300  # windows of 33 bytes: about 200 of the corpus's short documents


def _data_cfg() -> DataConfig:
    cfg = OmegaConf.structured(DataConfig(source="local"))
    cfg.path, cfg.tokenizer.kind = str(DOCUMENT_CORPUS), "byte"
    cfg.doc_shuffle_buffer, cfg.window_shuffle_buffer = 50, 16
    return cfg


def _stream() -> TrainingWindows:
    return training_windows(_data_cfg(), ByteTokenizer(), seq_len=32, seed=5)


@pytest.fixture
def arm_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """Arms fault points in this process (`arm_faults(data_errors=2, ...)`), the reads counted from the next one;
    returns the waits the retries took instead of sleeping them. Disarmed after the test."""
    waits: list[float] = []
    monkeypatch.setattr(sources, "sleep", waits.append)

    def arm(**points: object) -> list[float]:
        monkeypatch.setenv(faults.ENVIRONMENT, faults.arm(**points)[faults.ENVIRONMENT])
        monkeypatch.setattr(faults, "_document_reads", itertools.count(1))
        faults.armed.cache_clear()
        return waits

    yield arm
    faults.armed.cache_clear()  # read again, unarmed, once monkeypatch has restored the environment


def _same_windows(got: list[np.ndarray], expected: list[np.ndarray]) -> bool:
    return len(got) == len(expected) > 0 and all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_a_source_that_fails_a_few_times_gives_the_windows_it_would_have(arm_faults, caplog):
    """Three failed reads in a row at the stream's 100th document (its position last copied at the 64th): three
    retries, each a warning naming the source, after 1, 2 and 4 s, and the windows are exactly the unfailed
    stream's."""
    expected = list(itertools.islice(_stream(), WINDOWS))
    waits = arm_faults(data_errors=3, data_fault_at_read=100)
    with caplog.at_level(logging.WARNING, logger="llmtrain"):
        got = list(itertools.islice(_stream(), WINDOWS))
    assert _same_windows(got, expected)
    assert waits == [1.0, 2.0, 4.0]
    retries = [record.message for record in caplog.records if "reading again" in record.message]
    assert len(retries) == 3 and all(f"data.path={DOCUMENT_CORPUS}: ConnectionError" in line for line in retries)
    assert "(retry 3 of 6)" in retries[-1]


def test_a_reader_broken_mid_file_is_reopened_after_the_last_document_read(monkeypatch):
    """A connection lost inside the source's reader: the file's generator ends with the error at its 150th line, in
    the middle of a batch the source maps (16 lines, read ahead of those yielded); then again at its 140th, while
    the reopened source reads again up to where it was. Reopened after the last document yielded, the stream gives
    the windows it would have."""
    expected = list(itertools.islice(_stream(), WINDOWS))
    read, breaks = sources._read_jsonl_files, [150, 140]

    def breaking(paths: list[str], text_field: str, key: str) -> Iterator[dict]:
        for line, document in enumerate(read(paths, text_field, key), 1):
            if breaks and line == breaks[0]:
                breaks.pop(0)
                raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
            yield document

    monkeypatch.setattr(sources, "_read_jsonl_files", breaking)
    monkeypatch.setattr(sources, "sleep", lambda seconds: None)
    assert _same_windows(list(itertools.islice(_stream(), WINDOWS)), expected)
    assert breaks == []


def test_a_resumed_source_that_fails_at_once_continues_where_it_stopped(arm_faults):
    """The first read after a restore fails: the source reopens at the restored position, not where the stream had
    read to before it was restored."""
    stream = _stream()
    list(itertools.islice(stream, 100))
    position = stream.state_dict()
    expected = list(itertools.islice(stream, WINDOWS))
    arm_faults(data_errors=2)
    stream.load_state_dict(position)
    assert _same_windows(list(itertools.islice(stream, WINDOWS)), expected)


def test_a_source_that_stays_away_ends_the_run_in_one_line_naming_it(arm_faults):
    """More failures than retries: after the six waits (63 s in all), one line on the training thread (from the
    prefetching thread that met it) naming the source, the error and what to do; exit 1, which is requeued."""
    waits = arm_faults(data_errors=len(sources.RETRY_WAITS) + 1, data_fault_at_read=10)
    batches = Prefetched(StreamedBatches(_stream(), RankSlice(8, 8, 0, 1)))
    try:
        with pytest.raises(DataUnavailable) as raised:
            batches.next()
    finally:
        batches.close()
    message = str(raised.value)
    assert "\n" not in message and DataUnavailable.exit_code == 1
    assert message.startswith(f"data.path={DOCUMENT_CORPUS} could not be read (ConnectionError: ")
    assert "after 6 retries over 63 s" in message and "python -m llmtrain.data.prepare" in message
    assert waits == list(sources.RETRY_WAITS)


class _Response:
    def __init__(self, status_code: int):
        self.status_code = status_code


class _HTTPError(OSError):
    def __init__(self, status_code: int):
        super().__init__(f"{status_code} from the server")
        self.response = _Response(status_code)


@pytest.mark.parametrize(
    "error, retried",
    [
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (OSError(116, "Stale file handle"), True),  # ESTALE: an NFS server that restarted
        (_HTTPError(503), True),
        (_HTTPError(429), True),
        (_HTTPError(404), False),  # a file the hub does not have: every try alike
        (FileNotFoundError(2, "No such file or directory"), False),
        (ConfigError("data.path: not UTF-8"), False),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), False),
    ],
)
def test_only_network_errors_are_retried(error, retried):
    assert sources.is_network_error(error) is retried


def test_the_http_clients_lost_connections_are_retried():
    """Those of the clients a hub stream reads through that are no OSError with a network errno."""
    import httpx
    import requests

    assert sources.is_network_error(httpx.ConnectError("connection refused"))
    assert sources.is_network_error(requests.exceptions.ConnectionError("connection aborted"))
    assert sources.is_network_error(requests.exceptions.ChunkedEncodingError("connection broken"))


def test_a_hub_in_offline_mode_is_said_at_once_not_retried(monkeypatch):
    """HF_HUB_OFFLINE=1 raises a ConnectionError that every try meets: a ConfigError (exit 2), no wait."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    waits: list[float] = []
    monkeypatch.setattr(sources, "sleep", waits.append)

    def read() -> None:
        raise OfflineModeIsEnabled("Cannot reach https://huggingface.co: offline mode is enabled")

    with pytest.raises(ConfigError, match="data.name=web cannot be streamed with HF_HUB_OFFLINE=1"):
        sources.read_with_retries(read, lambda: None, "data.name=web")
    assert waits == []


def test_a_stream_stalled_past_the_watchdogs_limit_is_named_as_the_datas(arm_faults, tmp_path, caplog):
    """The first read stalls (data_stall_seconds) while the training thread waits for its batch: the watchdog, armed
    by five steps at 0.05 s, fires in the phase "waiting for data", and the hang line says so."""
    fired, codes = threading.Event(), []

    def recorded_exit(code: int) -> None:
        codes.append(code)
        fired.set()

    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    watchdog = StepWatchdog(None, runtime, str(tmp_path), auto_floor=0.05, end_process=recorded_exit)
    try:
        for step in range(1, 6):
            watchdog.phase_begins(step, "starting the step")
            watchdog.step_ends(step, 0.001)
        arm_faults(data_stall_seconds=0.3)
        batches = Prefetched(StreamedBatches(_stream(), RankSlice(8, 8, 0, 1)))
        with caplog.at_level(logging.ERROR, logger="llmtrain"):
            watchdog.phase_begins(6, "waiting for data")
            batches.next()
            batches.close()
            # Its deadline passed while the batch was awaited; on a loaded machine its thread may look only now.
            assert fired.wait(5.0) and codes == [HUNG_EXIT]
    finally:
        watchdog.close()
    assert "in step 6, waiting for data" in (tmp_path / "hang" / "rank-0.txt").read_text()
    assert "rank 0 in step 6 (waiting for data)" in caplog.text


def test_a_rank_waiting_for_data_is_the_one_behind():
    """Its peers went on to the step's forward/backward (and wait in its collectives): the data's rank is named."""
    waiting = Position(1, 5, "waiting for data", "next (llmtrain/data/prefetch.py:56)")
    computing = Position(0, 5, "forward/backward", "backward (torch/autograd/graph.py:8)")
    line = describe_hang({0: computing, 1: waiting}, 2, 300, "hang/")
    assert "behind: rank 1 in step 5 (waiting for data)" in line
