"""Data: packing, local sources, tokenizers, the held-out split and the global batch order (streamed path)."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
from collections import Counter

import numpy as np
import pandas as pd
import pytest
from harness.corpora import job_reading
from omegaconf import OmegaConf

from llmtrain.config import DataConfig, validate_data
from llmtrain.data import DataReading, RankSlice, build_data, build_tokenizer, streaming_scale_warning
from llmtrain.data.packing import WindowPacker, pack_windows, tokenize_documents
from llmtrain.data.prefetch import Prefetched
from llmtrain.data.sources import TRAIN, VALIDATION, open_documents, stdlib_files
from llmtrain.data.stream import StreamedBatches, TrainingWindows
from llmtrain.data.tokenizers import ByteTokenizer, bpe_cache_path
from llmtrain.errors import ConfigError

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(300)]


def _data_cfg(**overrides) -> DataConfig:
    cfg = OmegaConf.structured(DataConfig(source="local"))
    cfg.tokenizer.kind = "byte"
    cfg.doc_shuffle_buffer = 50
    cfg.window_shuffle_buffer = 16
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.fixture
def corpus(tmp_path):
    """The same 300 documents as .txt files, one .jsonl and one .parquet."""
    for i, doc in enumerate(DOCS):
        (tmp_path / "txt").mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(doc)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    pd.DataFrame({"content": DOCS, "id": range(len(DOCS))}).to_parquet(tmp_path / "docs.parquet")
    return tmp_path


def _texts(cfg, split=TRAIN) -> list[str]:
    return [ex["text"] for ex in open_documents(cfg, split)]


def assert_same_windows(got: list, expected: list) -> None:
    """The same non-empty sequence of arrays (zip alone would pass on a short or empty stream)."""
    assert len(got) == len(expected) > 0, (len(got), len(expected))
    assert all(np.array_equal(x, y) for x, y in zip(got, expected))


def test_packing_round_trips_the_token_stream():
    tokenizer = ByteTokenizer()
    stream = np.concatenate(list(tokenize_documents(DOCS, tokenizer)))
    windows = list(pack_windows(tokenize_documents(DOCS, tokenizer), 33))
    assert all(len(w) == 33 for w in windows)
    assert len(windows) == len(stream) // 33
    np.testing.assert_array_equal(np.concatenate(windows), stream[: len(windows) * 33])
    decoded = tokenizer.decode(stream)
    assert decoded == "".join(DOCS)  # the end-of-text ids separate documents and decode to nothing


def test_a_packer_restored_from_its_state_continues_the_same_windows():
    chunks = list(tokenize_documents(DOCS, ByteTokenizer()))
    expected = list(pack_windows(chunks, 33))
    packer = WindowPacker(33)
    for chunk in chunks[:100]:
        packer.add(chunk)
    taken = [packer.take()]  # more windows are cut than taken, and tokens are left over
    restored = WindowPacker(33)
    restored.load_state_dict(pickle.loads(pickle.dumps(packer.state_dict())))
    for chunk in chunks[100:]:
        restored.add(chunk)
    taken += list(restored.windows())
    assert_same_windows(taken, expected)


def test_window_shuffle_is_a_seeded_permutation_of_the_packed_stream(corpus):
    cfg = _data_cfg(path=str(corpus / "txt"))
    packed = list(itertools.islice(_windows(cfg, seed=3, window_shuffle_buffer=1), 210))
    shuffled = _windows(cfg, seed=3, window_shuffle_buffer=10)
    a = list(itertools.islice(shuffled, 200))
    b = list(itertools.islice(_windows(cfg, seed=3, window_shuffle_buffer=10), 200))
    c = list(itertools.islice(_windows(cfg, seed=4, window_shuffle_buffer=10), 200))
    assert_same_windows(a, b)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    # A permutation: the 200 windows served and the 10 still in the buffer are exactly the first 210 packed ones, as
    # multisets (a window served twice, lost or made up would fail).
    served = Counter(w.tobytes() for w in a) + Counter(w.tobytes() for w in shuffled.state_dict()["window_buffer"])
    assert sum(served.values()) == 210 and served == Counter(w.tobytes() for w in packed)


def _windows(cfg, seed: int, seq_len: int = 16, window_shuffle_buffer: int | None = None) -> TrainingWindows:
    return TrainingWindows(
        open_documents(cfg, TRAIN),
        ByteTokenizer(),
        seq_len,
        seed,
        cfg.doc_shuffle_buffer,
        cfg.window_shuffle_buffer if window_shuffle_buffer is None else window_shuffle_buffer,
    )


@pytest.mark.parametrize("taken", [5, 123, 400])  # the last one is past the end of the first epoch
def test_a_restored_stream_continues_exactly_where_it_stopped(corpus, taken):
    cfg = _data_cfg(path=str(corpus / "txt"))
    stream = _windows(cfg, seed=7)
    list(itertools.islice(stream, taken))
    position = stream.state_dict()
    expected = list(itertools.islice(stream, 300))
    resumed = _windows(cfg, seed=7)
    resumed.load_state_dict(position)
    assert_same_windows(list(itertools.islice(resumed, 300)), expected)


def test_batch_position_is_the_taken_batches_not_the_prefetched_ones(corpus):
    cfg = _data_cfg(path=str(corpus / "txt"))
    batches = Prefetched(StreamedBatches(_windows(cfg, seed=1), RankSlice(8, 8, 0, 1)))
    taken = [batches.next() for _ in range(3)]
    position = batches.state_dict()
    following = [batches.next() for _ in range(2)]
    resumed_windows = _windows(cfg, seed=1)
    resumed_windows.load_state_dict(position)
    resumed = Prefetched(StreamedBatches(resumed_windows, RankSlice(8, 8, 0, 1)))
    resumed_batches = [resumed.next() for _ in following]
    for prefetching in (batches, resumed):  # their threads would read on, into other tests' fault points
        prefetching.close()
    assert_same_windows(resumed_batches, following)
    assert not np.array_equal(taken[-1], following[0])


@pytest.mark.parametrize(
    "path, field", [("txt", "text"), ("docs.jsonl", "body"), ("docs.parquet", "content"), ("*.jsonl", "body")]
)
def test_local_sources_load_every_document(corpus, path, field):
    cfg = _data_cfg(path=str(corpus / path), text_field=field)
    texts = _texts(cfg, TRAIN) + _texts(cfg, VALIDATION)
    assert sorted(texts) == sorted(DOCS)


def test_jsonl_without_the_text_field_names_the_key(corpus):
    with pytest.raises(ConfigError, match="data.text_field"):
        open_documents(_data_cfg(path=str(corpus / "docs.jsonl")), TRAIN)


def test_validation_documents_are_disjoint_from_training(corpus):
    cfg = _data_cfg(path=str(corpus / "docs.jsonl"), text_field="body", val_fraction=0.1)
    train, val = set(_texts(cfg, TRAIN)), set(_texts(cfg, VALIDATION))
    assert val and train and not (train & val)
    assert 10 <= len(val) <= 60  # ~10% of 300


def test_stdlib_corpus_is_real_text_present_offline():
    files = stdlib_files()
    assert len(files) > 500 and all(f.endswith(".py") for f in files)
    cfg = _data_cfg(source="stdlib")
    first = next(iter(open_documents(cfg, TRAIN)))["text"]
    assert len(first) > 0


def _first_batches(cfg, tokenizer, seed, n=3, batch_size=8, seq_len=16):
    windows = TrainingWindows(
        open_documents(cfg, TRAIN), tokenizer, seq_len, seed, cfg.doc_shuffle_buffer, cfg.window_shuffle_buffer
    )
    batches = StreamedBatches(windows, RankSlice(batch_size, batch_size, 0, 1))
    return [batches.next() for _ in range(n)]


def test_same_seed_same_batches_other_seed_other_batches(corpus):
    cfg = _data_cfg(path=str(corpus / "txt"))
    tokenizer = ByteTokenizer()
    a, b = _first_batches(cfg, tokenizer, seed=1), _first_batches(cfg, tokenizer, seed=1)
    c = _first_batches(cfg, tokenizer, seed=2)
    assert_same_windows(a, b)
    assert len(c) == len(a) and not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_the_stream_is_endless_and_reshuffles_each_epoch(corpus):
    cfg = _data_cfg(path=str(corpus / "txt"), window_shuffle_buffer=1)
    tokenizer = ByteTokenizer()
    train_tokens = sum(len(t.encode()) + 1 for t in _texts(cfg, TRAIN))
    per_epoch = train_tokens // 17
    windows = list(
        itertools.islice(TrainingWindows(open_documents(cfg, TRAIN), tokenizer, 16, 0, 50, 1), 2 * per_epoch + 5)
    )
    assert len(windows) == 2 * per_epoch + 5
    epoch1 = np.concatenate(windows[: per_epoch // 2])
    epoch2 = np.concatenate(windows[per_epoch + 2 : per_epoch + 2 + per_epoch // 2])
    assert not np.array_equal(epoch1[: len(epoch2)], epoch2[: len(epoch1)])


@pytest.mark.parametrize("dp_size, micro", [(1, 8), (2, 4), (4, 1), (8, 1)])
def test_rank_slices_partition_the_global_batch(dp_size, micro):
    global_batch = np.arange(8 * 5).reshape(8, 5)
    rows = []
    for rank in range(dp_size):
        rank_slice = RankSlice(8, micro, rank, dp_size)
        micro_batches = rank_slice.micro_batches(rank_slice.rows(global_batch))
        assert len(micro_batches) == rank_slice.accumulation == 8 // dp_size // micro
        for inputs, targets in micro_batches:
            assert inputs.shape == targets.shape == (micro, 4)
            np.testing.assert_array_equal(inputs[:, 1:].numpy(), targets[:, :-1].numpy())
            rows.extend(np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1))
    np.testing.assert_array_equal(np.stack(rows), global_batch)


def test_bpe_is_trained_once_cached_and_round_trips(corpus, tmp_path):
    cfg = _data_cfg(path=str(corpus / "txt"), cache_dir=str(tmp_path / "cache"))
    cfg.tokenizer.kind = "bpe"
    cfg.tokenizer.vocab_size = 600
    calls = []
    tokenizer = build_tokenizer(cfg, is_main=True, barrier=lambda: calls.append(1))
    assert calls == [1]
    path = bpe_cache_path(cfg)
    mtime = os.path.getmtime(path)
    again = build_tokenizer(cfg, is_main=True, barrier=lambda: None)
    assert os.path.getmtime(path) == mtime
    text = DOCS[5] + " ünïcödé ✓"
    ids = again.encode_batch([text])[0]
    assert again.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # it learned merges
    assert 256 < tokenizer.vocab_size <= 600 and tokenizer.eos_id < tokenizer.vocab_size


def test_a_transformers_tokenizer_loads_from_a_local_directory(tmp_path, corpus):
    from transformers import PreTrainedTokenizerFast

    from llmtrain.data.tokenizers import EOS_TOKEN, train_bpe

    backend = train_bpe(DOCS, 400)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN).save_pretrained(tmp_path / "tok")
    cfg = _data_cfg(path=str(corpus / "txt"))
    cfg.tokenizer.kind = "hf"
    cfg.tokenizer.name = str(tmp_path / "tok")
    tokenizer = build_tokenizer(cfg, is_main=True, barrier=lambda: None)
    assert tokenizer.eos_id == backend.token_to_id(EOS_TOKEN)
    assert tokenizer.decode(tokenizer.encode_batch([DOCS[3]])[0]) == DOCS[3]


def _one_long_document(tmp_path, chars: int = 400_000):
    from test_prepare import write_corpus

    return write_corpus(tmp_path / "one", chars) / "part-00.txt"


def test_a_long_document_is_held_out_by_chunk(tmp_path):
    one_file = _one_long_document(tmp_path)
    text = one_file.read_text()
    cfg = _data_cfg(path=str(one_file), val_fraction=0.05)
    train, val = _texts(cfg, TRAIN), _texts(cfg, VALIDATION)
    assert 0.04 < sum(map(len, val)) / len(text) < 0.06
    assert sum(map(len, train)) + sum(map(len, val)) == len(text)  # every character on exactly one side
    assert all(piece in text for piece in train + val)
    assert not any(piece in t for piece in val for t in train)
    assert _texts(cfg, VALIDATION) == val  # stable


def test_a_restored_stream_of_split_documents_continues_exactly(tmp_path):
    """The holdout splits one document into many training pieces; a resume lands between two of them."""
    cfg = _data_cfg(path=str(_one_long_document(tmp_path, 200_000)), doc_shuffle_buffer=4)
    stream = _windows(cfg, seed=2, seq_len=64)
    list(itertools.islice(stream, 700))
    position = pickle.loads(pickle.dumps(stream.state_dict()))
    expected = list(itertools.islice(stream, 300))
    resumed = _windows(cfg, seed=2, seq_len=64)
    resumed.load_state_dict(position)
    assert_same_windows(list(itertools.islice(resumed, 300)), expected)


def test_val_path_names_the_validation_files(corpus, tmp_path):
    (tmp_path / "val.txt").write_text("held-out text " * 50)
    cfg = _data_cfg(path=str(corpus / "txt"), val_path=str(tmp_path / "val.txt"))
    assert _texts(cfg, VALIDATION) == ["held-out text " * 50]
    assert sorted(_texts(cfg, TRAIN)) == sorted(DOCS)  # nothing held out of training
    validate_data(cfg)
    with pytest.raises(ConfigError, match=r"^data.val_path='.*missing.txt' does not exist"):
        validate_data(_data_cfg(path=str(corpus / "txt"), val_path=str(tmp_path / "missing.txt")))


def test_a_too_small_validation_set_names_a_fix_that_works(tmp_path):
    cfg = _data_cfg(path=str(_one_long_document(tmp_path, 200_000)), val_fraction=0.01)
    reading = DataReading(train=RankSlice(16, 16, 0, 1), validation=RankSlice(128, 16, 0, 1))
    with pytest.raises(ConfigError, match=r"raise data.val_fraction to (\S+)") as error:
        build_data(job_reading(cfg, 63, 0), ByteTokenizer(), reading)
    assert "\n" not in str(error.value)
    cfg.val_fraction = float(re.search(r"val_fraction to (\S+)", str(error.value)).group(1))
    data = build_data(job_reading(cfg, 63, 0), ByteTokenizer(), reading)
    data.close()  # its stream's reading thread would read on in the background, into other tests' fault points
    assert data.validation[0].rows.shape == (128, 64)


def test_a_streamed_source_on_many_data_parallel_ranks_points_at_prepare(corpus):
    streamed = _data_cfg(path=str(corpus / "txt"))
    assert streaming_scale_warning(streamed, 8) is None
    warning = streaming_scale_warning(streamed, 16)
    assert warning is not None and "\n" not in warning
    assert "each of the 16 data-parallel ranks" in warning and "python -m llmtrain.data.prepare data=local" in warning
    assert streaming_scale_warning(_data_cfg(source="prepared", path=str(corpus)), 64) is None
