"""Data mixtures (`data=mix`): one global sample order from weighted prepared stores, the same for any number of
ranks and across a resume at another size, each source within one sample of its share after every sample, a
repetition cap that hands a source's share to the others (or stops the run), per-source metrics, and one-line
errors for sources that cannot be mixed. (A resume through fsdp, tp x dp and one process on a mixture: the chain
of test_muon.py.)"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from test_prepare import _data_cfg, _prepare, write_corpus

from llmtrain.config import DataConfig, validate_data
from llmtrain.data import RankSlice, build_data, build_tokenizer
from llmtrain.data.mixture import MixtureBatches, SourceExhausted, mixture_sources
from llmtrain.data.store import MANIFEST
from llmtrain.data.tokenizers import ByteTokenizer
from llmtrain.errors import ConfigError

SEQ_LEN = 31
WEIGHTS = {"code": 5.0, "docs": 3.0, "tests": 2.0}  # normalised: 0.5, 0.3, 0.2


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


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    return mixture_stores(tmp_path_factory.mktemp("mixture"))


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


def _global_batches(cfg: DataConfig, dp: int, count: int, position=None) -> np.ndarray:
    ranks = [_batches(cfg, dp, rank, position=position) for rank in range(dp)]
    return np.stack([np.concatenate([r.next() for r in ranks]) for _ in range(count)])


def test_each_source_stays_within_one_sample_of_its_share(stores):
    """After every sample (checked at every batch boundary, 100 batches of 16) each source's count is within one
    of weight x samples, so over any N batches its share is its weight within 2 / (16 N)."""
    batches = _batches(_config(stores), 1, 0)
    shares = np.array(list(WEIGHTS.values())) / sum(WEIGHTS.values())
    counts = [np.zeros(3)]
    for _ in range(100):
        batches.next()
        counts.append(np.array([entry["taken"] for entry in batches.state_dict()["sources"].values()]))
    counts = np.array(counts)
    samples = 16 * np.arange(101)[:, None]
    assert np.abs(counts - shares * samples).max() < 1
    for n in (1, 10, 100):
        windowed = (counts[n:] - counts[:-n]) / (16 * n)
        assert np.abs(windowed - shares).max() <= 2 / (16 * n)
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


def test_a_source_at_its_cap_hands_its_share_to_the_others_or_stops_the_run(stores, caplog):
    sources = [{"name": n, "path": str(p), "weight": WEIGHTS[n]} for n, p in stores.items()]
    sources[2]["max_epochs"] = 0.05  # "tests": a 20th of its windows, reached within the first batches
    cfg = _config(stores, sources=sources)
    batches = _batches(cfg, 1, 0)
    cap = batches.caps[2]
    with caplog.at_level(logging.INFO, logger="llmtrain"):
        for _ in range(40):
            batches.next()
    taken = {name: entry["taken"] for name, entry in batches.state_dict()["sources"].items()}
    assert taken["tests"] == cap
    reached = [record.message for record in caplog.records if "max_epochs" in record.message]
    assert len(reached) == 1 and "data.sources[tests] reached max_epochs=0.05" in reached[0], reached
    # the others share what is left 5 : 3, each within one sample of that
    after = 40 * 16 - cap
    assert abs(taken["code"] - taken["docs"] * 5 / 3) < 3 and taken["code"] + taken["docs"] == after
    # resumed after the cap, the source stays out
    resumed = _batches(cfg, 2, 1, position=batches.state_dict())
    assert resumed.state_dict()["sources"]["tests"]["active"] is False
    stopping = _batches(_config(stores, sources=sources, on_exhausted="stop"), 1, 0)
    with pytest.raises(SourceExhausted, match=r"data.sources\[tests\] reached max_epochs=0.05 .* in step \d+"):
        for _ in range(40):
            stopping.next()


def test_a_mixture_builds_with_its_metrics_and_a_validation_set_per_source(stores):
    cfg = _config(stores)
    tokenizer = build_tokenizer(cfg, True, lambda: None)
    assert isinstance(tokenizer, ByteTokenizer)
    data = build_data(cfg, tokenizer, SEQ_LEN, 7, RankSlice(16, 2, 0, 2), RankSlice(32, 2, 0, 2), steps=100)
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
    # a store tokenised otherwise (its manifest says so) is named with both tokenizers
    other = tmp_path / "other"
    shutil.copytree(stores["docs"], other)
    manifest = json.loads((other / MANIFEST).read_text())
    manifest["tokenizer"] = {**manifest["tokenizer"], "kind": "bpe", "size": 4096}
    (other / MANIFEST).write_text(json.dumps(manifest))
    cfg = _config({"code": stores["code"], "docs": other}, weights={"code": 1, "docs": 1})
    with pytest.raises(ConfigError, match=r"data.sources\[docs\].path=.* was tokenised with kind=bpe"):
        build_tokenizer(cfg, True, lambda: None)
