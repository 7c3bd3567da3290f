"""The prepared token store: `llmtrain.data.prepare` writes it once, `data=prepared` reads each rank's rows."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from harness.paths import REPO
from harness.processes import python
from harness.runs import PARITY, PIPELINE, assert_parity, assert_resumed_exactly, killed_mid_run, run_train
from omegaconf import OmegaConf

import llmtrain.data.prepare as prepare_module
from llmtrain.config import DataConfig, PrepareConfig
from llmtrain.data import RankSlice, build_tokenizer
from llmtrain.data.prepare import prepare
from llmtrain.data.prepared import PreparedBatches
from llmtrain.data.sources import TRAIN, VALIDATION, open_documents, stdlib_files
from llmtrain.data.store import MANIFEST, STORE_VERSION, SplitWriter, split_file
from llmtrain.data.tokenizers import ByteTokenizer
from llmtrain.errors import ConfigError


def write_corpus(directory: Path, chars: int, files: int = 1, skip: int = 0) -> Path:
    """`chars` characters of real text (the standard library's source, from its `skip`-th file on) split over
    `files` .txt files."""
    directory.mkdir(parents=True, exist_ok=True)
    text, paths = "", iter(stdlib_files()[skip:])
    while len(text) < chars:
        with open(next(paths), encoding="utf-8", errors="replace") as f:
            text += f.read()
    per_file = chars // files
    for i in range(files):
        (directory / f"part-{i:02d}.txt").write_text(text[i * per_file : (i + 1) * per_file])
    return directory


def _data_cfg(path: Path, **overrides) -> DataConfig:
    cfg = OmegaConf.structured(DataConfig(source="local", path=str(path)))
    cfg.tokenizer.kind = "byte"
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _prepare(data_cfg: DataConfig, out: Path, num_proc: int = 1) -> dict:
    return prepare(data_cfg, PrepareConfig(out=str(out), num_proc=num_proc))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), 300_000, files=6)


@pytest.fixture(scope="module")
def store(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stores") / "corpus"
    _prepare(_data_cfg(corpus), out)
    return out


def test_the_store_holds_the_documents_training_would_stream(corpus, store):
    cfg = _data_cfg(corpus)
    for split in (TRAIN, VALIDATION):
        texts = [example["text"] for example in open_documents(cfg, split)]
        expected = np.concatenate([np.append(ids, ByteTokenizer.eos_id) for ids in ByteTokenizer().encode_batch(texts)])
        np.testing.assert_array_equal(np.fromfile(split_file(str(store), split), dtype=np.uint16), expected)
    manifest = json.loads((store / MANIFEST).read_text())
    assert manifest["splits"][TRAIN]["documents"] > manifest["splits"][VALIDATION]["documents"] > 0
    assert manifest["tokenizer"]["kind"] == "byte" and manifest["data"]["path"] == str(corpus)


@pytest.mark.slow  # starts two worker processes
def test_any_number_of_workers_writes_the_same_store_and_a_rerun_does_nothing(corpus, store, tmp_path):
    parallel = tmp_path / "parallel"
    _prepare(_data_cfg(corpus), parallel, num_proc=2)
    for name in ("train.bin", "validation.bin"):
        assert (parallel / name).read_bytes() == (store / name).read_bytes()
    written = os.path.getmtime(parallel / MANIFEST)
    _prepare(_data_cfg(corpus), parallel, num_proc=2)
    assert os.path.getmtime(parallel / MANIFEST) == written


def test_an_interrupted_prepare_leaves_nothing_that_looks_complete(corpus, tmp_path, monkeypatch):
    write_split = prepare_module._write_split

    def interrupted_at_validation(data_cfg, split, *args):
        if split == VALIDATION:
            raise KeyboardInterrupt
        return write_split(data_cfg, split, *args)

    monkeypatch.setattr(prepare_module, "_write_split", interrupted_at_validation)
    with pytest.raises(KeyboardInterrupt):
        _prepare(_data_cfg(corpus), tmp_path / "store")
    assert not (tmp_path / "store").exists() and not list(tmp_path.rglob(MANIFEST))
    with pytest.raises(ConfigError, match="not a prepared store"):
        PreparedBatches(str(tmp_path / "store.partial"), 32, 0, RankSlice(8, 8, 0, 1), None)
    monkeypatch.undo()
    _prepare(_data_cfg(corpus), tmp_path / "store")
    assert (tmp_path / "store" / MANIFEST).is_file() and not (tmp_path / "store.partial").exists()


def test_a_store_prepared_from_other_inputs_is_not_overwritten(corpus, tmp_path):
    inputs = write_corpus(tmp_path / "inputs", 20_000)
    _prepare(_data_cfg(inputs), tmp_path / "store")
    (inputs / "part-00.txt").write_text("changed")
    with pytest.raises(ConfigError, match="prepare.out=.* prepared from other inputs"):
        _prepare(_data_cfg(inputs), tmp_path / "store")


def _batches(store: Path, dp: int, rank: int, position: dict | None = None, seed: int = 3) -> PreparedBatches:
    return PreparedBatches(str(store), 31, seed, RankSlice(8, 8 // dp, rank, dp), position)


def test_global_batches_are_the_same_for_any_number_of_ranks_and_across_a_resume(store):
    single = _batches(store, 1, 0)
    expected = [single.next() for _ in range(6)]
    for dp in (2, 4, 8):
        ranks = [_batches(store, dp, r) for r in range(dp)]
        for batch in expected[:3]:
            np.testing.assert_array_equal(np.concatenate([r.next() for r in ranks]), batch)
        # resumed after step 3 under another number of ranks
        resumed = [_batches(store, 8 // dp, r, ranks[0].state_dict()) for r in range(8 // dp)]
        for batch in expected[3:]:
            np.testing.assert_array_equal(np.concatenate([r.next() for r in resumed]), batch)
    other_seed = _batches(store, 1, 0, seed=4)
    assert not np.array_equal(other_seed.next(), expected[0])


def test_each_epoch_is_a_new_permutation_of_every_window(store):
    batches = _batches(store, 1, 0)
    count = batches.windows.count
    rows = np.concatenate([batches.next() for _ in range(2 * count // 8 + 1)])
    tokens = np.fromfile(split_file(str(store), TRAIN), dtype=np.uint16).astype(np.int64)
    every_window = tokens[: count * 32].reshape(count, 32)
    for epoch in (rows[:count], rows[count : 2 * count]):
        assert sorted(map(bytes, epoch)) == sorted(map(bytes, every_window))
    assert not np.array_equal(rows[:count], rows[count : 2 * count])


def test_a_resume_on_another_store_or_from_a_streamed_checkpoint_is_one_line(store):
    with pytest.raises(ConfigError, match="data.path and train.seq_len"):
        _batches(store, 1, 0, {"next_sample": 8, "windows": 5, "window": 32})
    with pytest.raises(ConfigError, match="streamed source"):
        _batches(store, 1, 0, {"epoch": 0, "docs_in_epoch": 3})


def test_the_tokenizer_comes_from_the_store_and_an_override_must_agree(store):
    cfg = OmegaConf.structured(DataConfig(source="prepared", path=str(store)))
    cfg.tokenizer.merge_with({"kind": None, "vocab_size": None, "train_chars": None})
    assert isinstance(build_tokenizer(cfg, True, lambda: None), ByteTokenizer)
    cfg.tokenizer.kind = "bpe"
    with pytest.raises(ConfigError, match="data.tokenizer.kind='bpe' disagrees with the store"):
        build_tokenizer(cfg, True, lambda: None)


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_training_holds_the_rows_it_reads_not_the_store(tmp_path):
    """A 128 MiB store, 20 batches read from it (160 windows, 40 KiB): the process grows by what it read plus the
    epoch's order (8 bytes per window, 4 MiB), not by the store (a memory map of a 256 MiB one grew by ~176 MiB on
    kernel 6.18)."""
    tokens = 64 * 2**20
    writer = SplitWriter(split_file(str(tmp_path), TRAIN), np.dtype(np.uint16))
    chunk = np.random.default_rng(0).integers(0, 257, size=2**22, dtype=np.uint16)
    for _ in range(tokens // len(chunk)):
        writer.append(chunk, 1)
    manifest = {
        "version": STORE_VERSION,
        "dtype": "uint16",
        "tokenizer": {"kind": "byte", "eos_id": 256, "size": 257},
        "splits": {TRAIN: writer.close()},
    }
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    store_bytes = os.path.getsize(split_file(str(tmp_path), TRAIN))
    before = _resident_bytes()
    batches = PreparedBatches(str(tmp_path), 128, 0, RankSlice(8, 8, 0, 1), None)
    rows = [batches.next() for _ in range(20)]
    grown = _resident_bytes() - before
    assert len(rows) == 20 and store_bytes == 128 * 2**20
    assert grown < store_bytes / 10, f"reading 20 batches grew the process by {grown / 2**20:.1f} MiB"


# -- end to end: the real entry points, several ranks ------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared_store(tmp_path_factory) -> Path:
    """A one-file corpus prepared by the command line, as a user would."""
    corpus = write_corpus(tmp_path_factory.mktemp("one-file"), 600_000)
    out = tmp_path_factory.mktemp("prepared") / "store"
    done = subprocess.run(
        [python(), "-m", "llmtrain.data.prepare", "data=local", f"data.path={corpus / 'part-00.txt'}"]
        + ["data.tokenizer.kind=byte", f"prepare.out={out}", "prepare.num_proc=2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prepared" in done.stderr and (out / MANIFEST).is_file()
    return out


@pytest.fixture(scope="module")
def prepared(prepared_store) -> tuple[str, ...]:
    return ("data=prepared", f"data.path={prepared_store}")


@pytest.fixture(scope="module")
def prepared_single(prepared, tmp_path_factory, cache_dir):
    run = run_train(tmp_path_factory.mktemp("prepared-single"), cache_dir, *PARITY, *prepared, name="single")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data      prepared" in run.stderr + run.stdout
    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout, nproc", [(("parallel=fsdp", "checkpoint.every=5"), 2), (PIPELINE, 2)])
def test_prepared_data_trains_the_same_under_every_layout(layout, nproc, prepared, prepared_single, layout_run):
    assert_parity(layout_run(*prepared, *layout, nproc=nproc), prepared_single)


@pytest.mark.slow
def test_a_killed_run_on_prepared_data_resumes_bit_identically(prepared, prepared_single, tmp_path, cache_dir):
    checkpoints = killed_mid_run(tmp_path, cache_dir, prepared, 0)
    resumed = run_train(tmp_path, cache_dir, *PARITY, *prepared, f"checkpoint.dir={checkpoints}", name="resumed")
    assert_resumed_exactly(resumed, prepared_single)


@pytest.mark.slow
def test_a_resume_with_fewer_data_parallel_ranks_continues_the_same_global_batches(
    prepared, prepared_single, layout_run, tmp_path, cache_dir
):
    """Saved by fsdp on 2 ranks at step 5, continued by one process: it now reads the rows of both."""
    fsdp = layout_run(*prepared, "parallel=fsdp", "checkpoint.every=5", nproc=2)
    step_5 = fsdp.run_dir / "checkpoints" / "step-00000005"
    resumed = run_train(tmp_path, cache_dir, *PARITY, *prepared, f"checkpoint.resume={step_5}")
    assert_parity(resumed, prepared_single)


@pytest.mark.slow
def test_a_one_file_corpus_trains_and_validates_with_every_default(train, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", 1_100_000)
    run = train(
        "data=local",
        f"data.path={corpus / 'part-00.txt'}",
        "train.steps=2",
        "logging.wandb.mode=disabled",
        "train.device=cpu",
        fast=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert [m["step"] for m in run.metrics if "val_loss" in m] == [2]
