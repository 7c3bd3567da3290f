"""Data mixtures (`data=mix`): one global sample order from weighted prepared stores, the same for any number of
ranks and across a resume at another size, each source within one sample of its share after every sample, a
repetition cap that hands a source's share to the others (or stops the run), per-source metrics, and one-line
errors for sources that cannot be mixed. (A resume through fsdp, tp x dp and one process on a mixture: the chain
of test_muon.py.)"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from harness.corpora import job_reading
from omegaconf import OmegaConf
from test_prepare import _data_cfg, _prepare, write_corpus

from llmtrain.config import CONF_DIR, DataConfig, validate_data
from llmtrain.data import DataReading, RankSlice, build_data, build_tokenizer, streaming_scale_warning
from llmtrain.data.mixture import MixtureBatches, SourceExhausted, mixture_sources
from llmtrain.data.sources import TRAIN
from llmtrain.data.store import MANIFEST, STORE_VERSION, VOCAB_HASH, SplitWriter, split_file
from llmtrain.data.tokenizers import ByteTokenizer
from llmtrain.errors import ConfigError

SEQ_LEN = 31
WEIGHTS = {"code": 5.0, "docs": 3.0, "tests": 2.0}
SHARES = np.array(list(WEIGHTS.values())) / sum(WEIGHTS.values())  # 0.5, 0.3, 0.2
LABEL = 1000  # every token of window w of the s-th labelled store is LABEL * s + w
LABELLED = {"code": 400, "docs": 300, "tests": 200}  # the labelled stores' windows
CAP = 100  # "tests" capped at max_epochs=0.5 (_capped)


def mixture_stores(directory: Path) -> dict[str, Path]:
    """Three byte-token stores of different text (slices of the standard library), 60-120k characters each."""
    stores = {}
    for i, (name, chars) in enumerate((("code", 120_000), ("docs", 90_000), ("tests", 60_000))):
        corpus = write_corpus(directory / f"{name}-text", chars, skip=40 * i)
        _prepare(_data_cfg(corpus), directory / name)
        stores[name] = directory / name
    return stores


def mixture_override(stores: dict[str, Path], weights: dict[str, float], **max_epochs: float) -> str:
    """`data.sources=[...]` as a command line gives it (no spaces: one token)."""
    entries = []
    for name, path in stores.items():
        cap = f",max_epochs:{max_epochs[name]}" if name in max_epochs else ""
        entries.append(f"{{name:{name},path:{path},weight:{weights[name]}{cap}}}")
    return f"data.sources=[{','.join(entries)}]"


def labelled_stores(directory: Path) -> dict[str, Path]:
    """Stores whose every row names its source and window (LABEL), so shares are counted from what next() returns."""
    stores = {}
    for s, (name, windows) in enumerate(LABELLED.items()):
        store = directory / name
        store.mkdir()
        writer = SplitWriter(split_file(str(store), TRAIN), np.dtype(np.uint16))
        writer.append(np.repeat(LABEL * s + np.arange(windows), SEQ_LEN + 1), windows)
        manifest = {"version": STORE_VERSION, "dtype": "uint16", "splits": {TRAIN: writer.close()}}
        (store / MANIFEST).write_text(json.dumps(manifest))
        stores[name] = store
    return stores


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    return mixture_stores(tmp_path_factory.mktemp("mixture"))


@pytest.fixture(scope="module")
def labelled(tmp_path_factory) -> dict[str, Path]:
    return labelled_stores(tmp_path_factory.mktemp("labelled"))


def _config(stores: dict[str, Path], weights=WEIGHTS, **changes) -> DataConfig:
    sources = [{"name": n, "path": str(p), "weight": weights[n]} for n, p in stores.items()]
    cfg = OmegaConf.structured(DataConfig(source="mix", sources=sources))
    for key in ("kind", "vocab_size", "train_chars"):  # as conf/data/mix.yaml leaves them: the stores' own
        cfg.tokenizer[key] = None
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    validate_data(cfg)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _batches(cfg: DataConfig, dp: int, rank: int, batch: int = 16, position=None) -> MixtureBatches:
    stop = cfg.on_exhausted == "stop"
    return MixtureBatches(mixture_sources(cfg.sources), SEQ_LEN, 7, RankSlice(batch, 2, rank, dp), stop, position)


def _read(ranks: list[MixtureBatches], count: int) -> np.ndarray:
    """(count, 16, SEQ_LEN + 1): the next `count` global batches, each the ranks' rows in rank order."""
    return np.stack([np.concatenate([r.next() for r in ranks]) for _ in range(count)])


def _global_batches(cfg: DataConfig, dp: int, count: int, position=None) -> np.ndarray:
    return _read([_batches(cfg, dp, rank, position=position) for rank in range(dp)], count)


def _counts(batches: np.ndarray) -> np.ndarray:
    """(batches + 1, 3): each labelled source's rows in the first k global batches, read off the rows."""
    assert (batches == batches[..., :1]).all(), "every row is one whole labelled window"
    sources = batches[..., 0] // LABEL
    per_batch = (sources[..., None] == np.arange(len(LABELLED))).sum(axis=1)
    return np.concatenate([np.zeros((1, len(LABELLED)), dtype=np.int64), per_batch.cumsum(axis=0)])


def _largest_gap(counts: np.ndarray, shares) -> float:
    """How far, in samples, a source's count strays from its share of the samples since counts[0], at any batch
    boundary."""
    counts = counts - counts[0]
    return float(np.abs(counts - counts.sum(axis=1, keepdims=True) * np.asarray(shares)).max())


def _capped(stores: dict[str, Path], **changes) -> DataConfig:
    """The labelled mixture with "tests" capped at half an epoch: CAP samples, its share's worth of about 32
    batches of 16."""
    sources = [{"name": n, "path": str(p), "weight": WEIGHTS[n]} for n, p in stores.items()]
    sources[2]["max_epochs"] = 0.5
    return _config(stores, sources=sources, **changes)


def _assert_capped_shares(batches: np.ndarray) -> None:
    """Counted from the rows: "tests" returns exactly its cap, no window twice; until the batch that reaches it
    each source is within one sample of its share; after it "code" and "docs" share its place 5 : 3, each within
    two samples (one at either end)."""
    counts = _counts(batches)
    tests = batches[..., 0][batches[..., 0] // LABEL == 2]
    assert counts[-1, 2] == CAP and len(np.unique(tests)) == CAP
    reached = int(np.argmax(counts[:, 2] == CAP))  # the boundary after the batch that reached it
    assert 25 <= reached < len(batches) - 10, reached  # both sides of the cap are measured
    assert _largest_gap(counts[:reached], SHARES) < 1
    assert _largest_gap(counts[reached:], SHARES * [1, 1, 0] / SHARES[:2].sum()) < 2


def test_each_source_keeps_its_share_of_the_rows_returned(labelled):
    """Counted from the rows next() returns, 100 global batches of 16 read by 2 ranks: at every batch boundary each
    source's count is within one sample of weight x samples, so over any N batches its share is its weight within
    2 / (16 N); and a source's rows are its windows in turn, each once per epoch."""
    batches = _global_batches(_config(labelled), 2, 100)
    counts = _counts(batches)
    assert _largest_gap(counts, SHARES) < 1
    for n in (1, 10, 100):
        windowed = (counts[n:] - counts[:-n]) / (16 * n)
        assert np.abs(windowed - SHARES).max() <= 2 / (16 * n)
    labels = batches[..., 0]
    for s, windows in enumerate(LABELLED.values()):
        seen = np.bincount(labels[labels // LABEL == s] - LABEL * s, minlength=windows)
        assert len(seen) == windows and seen.min() >= 1 and seen.max() - seen.min() <= 1
    print("shares over 100 batches:", dict(zip(WEIGHTS, (counts[-1] / counts[-1].sum()).round(4))))


def test_the_global_batches_are_the_same_for_any_number_of_ranks_and_across_a_resume(stores):
    cfg = _config(stores)
    alone = _global_batches(cfg, 1, 12)
    assert np.array_equal(_global_batches(cfg, 2, 12), alone)
    assert np.array_equal(_global_batches(cfg, 4, 12), alone)
    # 5 batches on 2 ranks, then resumed from that position on 4 ranks (and from its JSON, as checkpoints hold it)
    first = _batches(cfg, 2, 0)
    for _ in range(5):
        first.next()
    position = json.loads(json.dumps(first.state_dict()))
    assert np.array_equal(_global_batches(cfg, 4, 7, position), alone[5:])
    # every row is a window of its source: the sources' text differs, and batches hold all three
    assert len({bytes(row[:8].astype(np.uint8)) for row in alone.reshape(-1, SEQ_LEN + 1)}) > 150


def test_a_source_at_its_cap_returns_no_more_rows_and_the_others_take_its_share(labelled, caplog):
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        batches = _global_batches(_capped(labelled), 1, 60)
    _assert_capped_shares(batches)
    reached = [record.message for record in caplog.records if "max_epochs" in record.message]
    assert len(reached) == 1 and "data.sources[tests] reached max_epochs=0.5 (100 samples)" in reached[0], reached
    with pytest.raises(SourceExhausted, match=r"data.sources\[tests\] reached max_epochs=0.5 .* in step \d+"):
        _global_batches(_capped(labelled, on_exhausted="stop"), 1, 60)


def test_a_resume_returns_the_rows_the_uninterrupted_mixture_would_at_the_same_shares(labelled):
    """Saved on 2 ranks after 20 batches (before "tests" reaches its cap) and after 40 (after it), through JSON as a
    checkpoint holds it, resumed on 4: the rows from there on are the uninterrupted mixture's, and the shares
    counted over the whole resumed run hold."""
    cfg = _capped(labelled)
    uninterrupted = _global_batches(cfg, 1, 60)
    for saved_at in (20, 40):
        ranks = [_batches(cfg, 2, rank) for rank in range(2)]
        before = _read(ranks, saved_at)
        position = json.loads(json.dumps(ranks[0].state_dict()))
        after = _global_batches(cfg, 4, 60 - saved_at, position)
        assert np.array_equal(after, uninterrupted[saved_at:]), f"resumed after {saved_at} batches"
        _assert_capped_shares(np.concatenate([before, after]))


def test_a_mixture_builds_with_its_metrics_and_a_validation_set_per_source(stores):
    cfg = _config(stores)
    tokenizer = build_tokenizer(cfg, True, lambda: None)
    assert isinstance(tokenizer, ByteTokenizer)
    reading = DataReading(train=RankSlice(16, 2, 0, 2), validation=RankSlice(32, 2, 0, 2))
    data = build_data(job_reading(cfg, SEQ_LEN, 7, steps=100), tokenizer, reading)
    try:
        # a validation set for each source whose split holds 32 windows (eval_batches x batch_size; here the
        # smaller sources hold out too little text and are left out), its rows on this rank
        validated = [
            name
            for name, path in stores.items()
            if json.loads((path / MANIFEST).read_text())["splits"]["validation"]["tokens"] // (SEQ_LEN + 1) >= 32
        ]
        assert [(v.name, v.weight, v.rows.shape) for v in data.validation] == [
            (name, WEIGHTS[name], (16, SEQ_LEN + 1)) for name in validated
        ]
        assert "mixture of 3 prepared stores" in data.description and "code 0.5 (" in data.description
        data.train.next()
        assert data.source_tokens(SEQ_LEN) == {"tokens/code": 8 * SEQ_LEN, "tokens/docs": 5 * SEQ_LEN,
                                                "tokens/tests": 3 * SEQ_LEN}  # fmt: skip
    finally:
        data.close()


def test_sources_that_cannot_be_mixed_are_one_line_naming_the_source(stores, tmp_path):
    def refused(sources) -> str:
        cfg = OmegaConf.structured(DataConfig(source="mix", sources=sources))
        with pytest.raises(ConfigError) as error:
            validate_data(cfg)
        assert "\n" not in str(error.value)
        return str(error.value)

    code = {"name": "code", "path": str(stores["code"]), "weight": 1}
    assert "(source docs): weight=0 is not a number > 0" in refused([code, {**code, "name": "docs", "weight": 0}])
    assert "name 'code' is given twice" in refused([code, code])
    missing = refused([code, {"name": "web", "path": str(tmp_path), "weight": 1}])
    assert "(source web): path=" in missing and "is not a prepared store" in missing
    assert "data.sources is not set" in refused(None)


def _group_cfg(corpus: Path, group: str, cache_dir: Path, **tokenizer) -> DataConfig:
    """data=local on `corpus` with the tokenizer keys data=<group> sets (conf/data/<group>.yaml), then `tokenizer`."""
    cfg = OmegaConf.structured(DataConfig(source="local", path=str(corpus), cache_dir=str(cache_dir)))
    cfg.tokenizer.merge_with(OmegaConf.load(Path(CONF_DIR) / "data" / f"{group}.yaml").tokenizer)
    cfg.tokenizer.merge_with(tokenizer)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _without_hash(store: Path, out: Path) -> Path:
    """A copy of `store` as it was prepared before manifests recorded the vocabulary's hash."""
    shutil.copytree(store, out)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["tokenizer"][VOCAB_HASH]
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="module")
def group_stores(tmp_path_factory) -> dict[str, Path]:
    """Two byte stores prepared under data=local's and data=hf's tokenizer keys (whose BPE knobs differ) and two
    BPEs of one size trained on different text, from small corpora."""
    directory = tmp_path_factory.mktemp("groups")
    corpora = [write_corpus(directory / f"text-{i}", 40_000, skip=100 + 50 * i) for i in range(2)]
    configs = {
        "local-byte": _group_cfg(corpora[0], "local", directory, kind="byte"),
        "hf-byte": _group_cfg(corpora[1], "hf", directory, kind="byte"),
        "bpe-0": _group_cfg(corpora[0], "local", directory, kind="bpe", vocab_size=512, train_chars=30_000),
        "bpe-1": _group_cfg(corpora[1], "local", directory, kind="bpe", vocab_size=512, train_chars=30_000),
    }
    for name, cfg in configs.items():
        _prepare(cfg, directory / name)
    return {name: directory / name for name in configs}


def _mixed(*paths: Path) -> str | None:
    """The one-line error mixing `paths` gives, None when they mix (and the mixture's tokenizer loads)."""
    cfg = _config({f"s{i}": path for i, path in enumerate(paths)}, weights={f"s{i}": 1 for i in range(len(paths))})
    try:
        build_tokenizer(cfg, True, lambda: None)
    except ConfigError as error:
        assert "\n" not in str(error)
        return str(error)
    return None


def test_stores_prepared_with_one_tokenizer_mix_whatever_their_data_group(group_stores, tmp_path):
    """The stores' manifests record the BPE knobs of their groups (data=local: 8192 / 10M, data=hf: 16384 / 20M),
    which the byte tokenizer ignores; an old store without the vocabulary's hash mixes with a new one."""
    knobs = [json.loads((group_stores[n] / MANIFEST).read_text())["tokenizer"] for n in ("local-byte", "hf-byte")]
    assert (knobs[0]["vocab_size"], knobs[1]["vocab_size"]) == (8192, 16384)
    assert _mixed(group_stores["local-byte"], group_stores["hf-byte"]) is None
    assert _mixed(group_stores["local-byte"], _without_hash(group_stores["hf-byte"], tmp_path / "old")) is None
    assert _mixed(group_stores["bpe-0"], _without_hash(group_stores["bpe-0"], tmp_path / "old-bpe")) is None


def test_stores_tokenised_otherwise_are_refused_in_one_line(group_stores, tmp_path):
    """Two BPEs of one size (the same kind, size and end-of-text id) trained on different text differ in their
    vocabularies, also when the older store's manifest lacks the hash; byte and BPE differ in kind."""
    sizes = [json.loads((group_stores[f"bpe-{i}"] / MANIFEST).read_text())["tokenizer"]["size"] for i in range(2)]
    assert sizes == [512, 512]
    other_bpe = r"data.sources\[s1\].path=.* was tokenised with kind=bpe, size=512, eos_id=0, vocab_sha256=\w{12}, "
    assert re.match(other_bpe, _mixed(group_stores["bpe-0"], group_stores["bpe-1"]) or "")
    old = _without_hash(group_stores["bpe-1"], tmp_path / "old")
    assert re.match(other_bpe, _mixed(group_stores["bpe-0"], old) or "")
    refused = _mixed(group_stores["local-byte"], group_stores["bpe-0"]) or ""
    assert re.match(r"data.sources\[s1\].path=.* was tokenised with kind=bpe, .* with kind=byte, size=257", refused)
    assert refused.endswith(": prepare every source of a mixture with one tokenizer")


def test_a_mixture_counts_as_prepared_data(stores, tmp_path):
    """data=mix reads prepared stores: on many data-parallel ranks it is not warned about as streamed (a streamed
    source is), and llmtrain.data.prepare refuses it in one line."""
    cfg = _config(stores)
    assert streaming_scale_warning(cfg, 64) is None
    assert streaming_scale_warning(_data_cfg(stores["code"]), 64) is not None
    with pytest.raises(ConfigError, match=r"^data=mix reads prepared stores: choose the source to prepare"):
        _prepare(cfg, tmp_path / "out")
