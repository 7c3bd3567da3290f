"""Config composition, schema checks and the one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.paths import REPO
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from llmtrain.config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    RootConfig,
    TrainConfig,
    register_schemas,
    validate,
)
from llmtrain.data.files import check_data_files
from llmtrain.errors import ConfigError

CONF = REPO / "conf"
GROUPS = {
    group: sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    for group in ("model", "data", "parallel", "optim", "logging", "hardware")
}
# Options that need a key the user must supply before they validate.
REQUIRED = {
    "data=local": ["data.path={tmp}/corpus.txt"],
    "data=hf": ["data.name=roneneldan/TinyStories"],
    "data=prepared": ["data.path={tmp}"],
    "data=mix": ["data.sources=[{{name:web,path:{tmp},weight:1}}]"],
    "data=sft": ["data.path={tmp}/corpus.jsonl", "data.tokenizer.name=gpt2"],
    "data=preference": ["data.path={tmp}/corpus.jsonl", "data.tokenizer.name=gpt2", "model.lora.rank=16"],
    "data=rl": ["data.path={tmp}/corpus.jsonl", "data.tokenizer.name=gpt2", "rl.max_new_tokens=64"],
}

register_schemas()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("override", [f"{g}={o}" for g, options in GROUPS.items() for o in options])
def test_every_option_composes_and_validates(override, tmp_path):
    (tmp_path / "corpus.txt").write_text("some text")
    (tmp_path / "corpus.jsonl").write_text('{"prompt": "Hi", "response": "Hello"}\n')
    (tmp_path / "manifest.json").write_text("{}")  # what marks a prepared store before it is read
    extra = [o.format(tmp=tmp_path) for o in REQUIRED.get(override, [])]
    if override.startswith("model=") and override != "model=tiny":
        extra = ["train.seq_len=128"]
    cfg = _compose(override, *extra)
    validate(cfg)
    group, option = override.split("=")
    assert cfg[group] is not None and (group != "model" or cfg.model.name == option)


def test_model_presets_meet_the_layout_contract():
    for option in GROUPS["model"]:
        m = _compose(f"model={option}").model
        assert m.head_dim is not None or m.d_model % m.n_head == 0, option
    tiny = _compose("model=tiny").model
    assert tiny.n_layer % 4 == 0 and tiny.n_head % 4 == 0


def test_unknown_option_lists_the_available_ones():
    with pytest.raises(ConfigCompositionException) as error:
        _compose("model=gpt5")
    assert "gpt2-medium" in str(error.value) and "tiny" in str(error.value)


@pytest.mark.parametrize(
    "override", ["train.stpes=5", "model.n_heads=4", "optim.learning_rate=1", "checkpoint.async=true"]
)
def test_misspelt_key_is_rejected(override):
    with pytest.raises(ConfigCompositionException) as error:
        _compose(override)
    assert override.split("=")[0] in str(error.value)


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigCompositionException) as error:
        _compose("train.steps=many")
    assert isinstance(error.value.__cause__, (ValidationError, ConfigKeyError))


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["train.batch_size=30"], "train.batch_size"),
        (["train.seq_len=512"], "train.seq_len"),
        (["data=local"], "data.path"),
        (["data=local", "data.path=/nonexistent/corpus"], "data.path"),
        (["data=hf"], "data.name"),
        (["logging.wandb.mode=sometimes"], "logging.wandb.mode"),
        (["model.d_model=130"], "model.d_model"),
        (["train.micro_batch_size=0"], "train.micro_batch_size"),
        (["checkpoint.keep=0"], "checkpoint.keep"),
        (["model.attention_dropout=1.0"], "model.attention_dropout"),
        (["model=llama-tiny", "model.rope_scaling.type=yarn"], "model.rope_scaling.type"),
        (["model=llama-tiny", "model.rope_scaling.type=llama3", "model.rope_scaling.factor=0.5"], "model.rope_scaling"),
        (["hardware=rtx4080x4", "hardware.device_memory_gib=0"], "hardware.device_memory_gib"),
        (["hardware.nodes=0"], "hardware.nodes"),
    ],
)
def test_validate_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        validate(_compose(*overrides))
    message = str(error.value)
    assert key in message and "\n" not in message


def test_empty_file_counts_as_missing_data(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cfg = _compose("data=local", f"data.path={empty}")
    validate(cfg)  # the path exists; which files it holds is the data side's check
    with pytest.raises(ConfigError, match="data.path"):
        check_data_files(cfg.data)


def _leaves(node, prefix: str = "") -> dict:
    """Every leaf key of a config, dotted, with its value ("???" where it is MISSING)."""
    leaves = {}
    for key in node:
        value = "???" if OmegaConf.is_missing(node, key) else node[key]
        if OmegaConf.is_dict(value):
            leaves.update(_leaves(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def test_the_config_page_is_the_one_the_schema_generates():
    """docs/config.md is written by llmtrain.tools.config_doc from each key's one declaration (default, domain, doc)
    and the option files: a key, an option or a default changed without regenerating it fails here."""
    from llmtrain.tools.config_doc import PAGE, render

    assert Path(PAGE).read_text() == render(), "run: python -m llmtrain.tools.config_doc --write"


def test_the_layout_files_are_the_ones_their_rows_make():
    """conf/parallel/*.yaml and the layout tables of README.md and docs/parallelism.md are written from the rows of
    llmtrain/catalog/layouts.py's LAYOUTS: a row changed without regenerating them, or a yaml no row makes, fails
    here."""
    from llmtrain.tools.layout_doc import stale

    assert stale() == [], "run: python -m llmtrain.tools.layout_doc --write"


def test_every_key_says_what_it_alone_does():
    """No doc pasted onto several keys: each says what its own key does (five mesh degrees once shared one)."""
    from collections import Counter

    from llmtrain.config import schema_fields

    docs = Counter(item.metadata["doc"] for _, item, _ in schema_fields(RootConfig))
    assert [doc for doc, keys in docs.items() if keys > 1] == []


def test_schema_defaults_are_the_default_options_values():
    """A key the schema gives a default means what conf/ says, so a yaml that leaves it out changes nothing. The
    model schema is generic (each preset sets its own shape), so its defaults are left out."""
    composed = _leaves(_compose())
    schemas = {
        "data": DataConfig,
        "parallel": ParallelConfig,
        "optim": OptimConfig,
        "logging": LoggingConfig,
        "train": TrainConfig,
        "checkpoint": CheckpointConfig,
    }
    defaults = {"seed": RootConfig.seed}
    for group, schema in schemas.items():
        defaults.update(_leaves(OmegaConf.structured(schema), f"{group}."))
    differing = {key: (value, composed[key]) for key, value in defaults.items() if value not in ("???", composed[key])}
    assert differing == {}, "schema default vs conf/"
