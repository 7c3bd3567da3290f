"""Every bad input is one line naming the key: the schema walk (every key, values from its declared domain and
of the wrong type, checked in-process as the entry point checks them), the command line itself (exit 2, one
`error:` line, no traceback, no run directory), and external inputs that are not what they claim to be."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from harness.paths import REPO
from harness.processes import python
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException

from llmtrain.config import (
    LAYOUT_CHOICES,
    PIPELINE_SCHEDULES,
    PrepareRootConfig,
    RootConfig,
    check_domains,
    register_schemas,
    schema_keys,
    validate,
)
from llmtrain.config.composition import composition_error_line
from llmtrain.errors import CLOSED_PIPE_EXIT, ConfigError

register_schemas()


def _leaf_types(schema: type, prefix: str = "") -> dict[str, tuple[type, bool]]:
    """key -> (its Python type, whether it may be null), read from the dataclass annotations."""
    import dataclasses

    found: dict[str, tuple[type, bool]] = {}
    hints = typing.get_type_hints(schema)
    for item in dataclasses.fields(schema):
        args = typing.get_args(hints[item.name])
        inner = next((a for a in args if a is not type(None)), hints[item.name])
        if dataclasses.is_dataclass(inner):
            found.update(_leaf_types(inner, f"{prefix}{item.name}."))  # type: ignore[arg-type]
        else:
            found[f"{prefix}{item.name}"] = (inner, type(None) in args)
    return found


WRONG_TYPE = {
    int: ["many", "1.5"],
    float: ["fast"],
    bool: ["maybe"],
    str: ["[1,2]"],
    list[int]: ["3", "[one,two]"],
    list[float]: ["3", "[one,two]"],
    list[str]: ["3"],
    list[typing.Any]: ["3"],
    typing.Any: ["3"],  # one item or a list of them (data.reward): a number is neither
}


def _literal(value) -> str:
    """`value` as Hydra's override grammar reads it back (strings quoted, so '' and spaces survive)."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, list):
        return "[" + ",".join(map(_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{_literal(item)}" for key, item in value.items()) + "}"
    return repr(value)


def invalid_overrides(schema: type) -> list[tuple[str, str]]:
    """(key, override) for every key: values just outside its domain, values of the wrong type, null where the
    key may not be null, and ??? (unset)."""
    types = _leaf_types(schema)
    cases = []
    for key, domain in schema_keys(schema):
        kind, nullable = types[key]
        assert domain is not None, key
        values = [f"{key}={_literal(v)}" for v in domain.outside()]
        values += [f"{key}={v}" for v in WRONG_TYPE[kind]]
        values += [] if nullable else [f"{key}=null"]
        values.append(f"{key}=???")
        cases += [(key, v) for v in values]
    return cases


def _composed():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=["train.device=cpu"])


def error_line(base, override: str, schema: type = RootConfig) -> str | None:
    """The one-line error train.py would print for `override` on top of `base` (None: accepted): Hydra's own
    override application, then the same validation the entry point runs."""
    cfg = pickle.loads(pickle.dumps(base))  # a fresh copy in half a deepcopy's time (500 cases)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides([override]), cfg)
    except ConfigCompositionException as error:
        return composition_error_line(error, schema)
    try:
        validate(cfg)
    except ConfigError as error:
        return str(error)
    return None


def test_every_key_declares_a_domain():
    for schema in (RootConfig, PrepareRootConfig):
        undeclared = [key for key, domain in schema_keys(schema) if domain is None]
        assert not undeclared, f"keys without a domain (llmtrain/domains.py key(...)): {undeclared}"


def test_every_name_in_the_catalog_builds_what_it_names():
    """llmtrain/catalog/ is the one list of layouts, schedules, model families, MLP kinds and optimizers: each layout
    loads its data-parallel mechanism, each schedule is a class torch has (or the reference), each family names a
    model class, its layout, its planner shapes and its Hugging Face formats (or none), each MLP kind an activation,
    and each optimizer names a builder and (where it has one) a ZeRO-1 form."""
    from llmtrain.catalog import LAYOUTS, MLP_KINDS, MODEL_FAMILIES, OPTIMIZERS, SCHEDULES, imported
    from llmtrain.model import LayeredModel
    from llmtrain.model.hf import HFFormats
    from llmtrain.parallel.data_parallel import DataParallel
    from llmtrain.parallel.family import FamilyLayout
    from llmtrain.parallel.parallel_model import data_parallel_class
    from llmtrain.parallel.pipeline.schedules import torch_schedule
    from llmtrain.parallel.zero import ZeroOneShards
    from llmtrain.planner.shapes import FamilyShapes

    for name in LAYOUTS:
        assert issubclass(data_parallel_class(name), DataParallel)
    for family in MODEL_FAMILIES.values():
        assert issubclass(imported(family.model), LayeredModel)
        assert isinstance(imported(family.layout), FamilyLayout) and isinstance(imported(family.shapes), FamilyShapes)
        assert family.hf is None or isinstance(imported(family.hf), HFFormats)
    for kind in MLP_KINDS.values():
        assert callable(imported(kind.activation))
    for optimizer in OPTIMIZERS.values():
        assert callable(imported(optimizer.builder))
        assert optimizer.zero1 is None or issubclass(imported(optimizer.zero1), ZeroOneShards)
    for spec in SCHEDULES.values():
        assert spec.torch_class is None or isinstance(torch_schedule(spec), type)
    assert list(PIPELINE_SCHEDULES) == list(SCHEDULES) and LAYOUT_CHOICES == (*LAYOUTS, "auto")


@pytest.mark.slow  # seconds: every key walked / the whole plan table; the fast tier keeps under a minute
def test_the_schema_walk_refuses_every_invalid_value_with_one_line_naming_its_key():
    base = _composed()
    validate(base)  # the defaults themselves are inside every domain
    cases = invalid_overrides(RootConfig)
    keys = {key for key, _ in cases}
    assert len(keys) == len(list(schema_keys(RootConfig))) > 100
    accepted, badly_worded = [], []
    for key, override in cases:
        line = error_line(base, override)
        if line is None:
            accepted.append(override)
        elif key not in line or "\n" in line or "Traceback" in line:
            badly_worded.append((override, line))
    assert not accepted, accepted
    assert not badly_worded, badly_worded
    print(f"schema walk: {len(keys)} keys, {len(cases)} invalid values, each refused in one line naming its key")


def test_the_prepare_keys_are_walked_too(tmp_path):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        base = compose("prepare", overrides=[f"prepare.out={tmp_path / 'store'}"])
    check_domains(base, PrepareRootConfig)
    cases = [(key, o) for key, o in invalid_overrides(PrepareRootConfig) if key.startswith("prepare.")]
    for key, override in cases:
        cfg = copy.deepcopy(base)
        with pytest.raises((ConfigCompositionException, ConfigError)) as error:
            ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides([override]), cfg)
            check_domains(cfg, PrepareRootConfig)
        line = str(error.value) if error.type is ConfigError else composition_error_line(error.value, PrepareRootConfig)
        assert key in line and "\n" not in line, (override, line)
    assert len(cases) >= 8


def test_an_unknown_key_names_the_nearest_one():
    base = _composed()
    assert error_line(base, "train.stpes=5") == (
        "train.stpes is not a key: did you mean train.steps? (the keys of train: activation_checkpointing, "
        "attention, batch_size, compile, compile_backend, device, eval_batches, eval_every, float8, float8_layers, "
        "hang_timeout, max_bad_steps, micro_batch_size, objective, on_spike, precision, save_model, score_after_eos, "
        "seq_len, spike_factor, spike_window, steps)"
    )
    assert error_line(base, "+train.stpes=5").startswith("train.stpes is not a key: did you mean train.steps?")
    assert error_line(base, "+foo=1").startswith("foo is not a key (the keys of the config: checkpoint, data,")
    # a key an earlier version had: its new name
    assert (
        error_line(base, "parallel.strategy=fsdp")
        == "parallel.strategy is now parallel.layout: set parallel.layout instead"
    )
    assert error_line(base, "optim.schedule=wsd").startswith("optim.schedule is now optim.lr_schedule")


def _corpus(tmp: Path) -> dict[str, Path]:
    """Files that are not what their extension says, and model / tokenizer directories llmtrain cannot use."""
    import pandas as pd

    files = {
        "bad_json": tmp / "bad.jsonl",
        "bad_utf8": tmp / "latin1.txt",
        "not_parquet": tmp / "fake.parquet",
        "null_text": tmp / "nulls.parquet",
        "bert": tmp / "bert",
        "no_weights": tmp / "gpt2-no-weights",
        "empty_tokenizer": tmp / "tokenizer",
    }
    files["bad_json"].write_text('{"text": "fine"}\n{"text": "cut off\n')
    files["bad_utf8"].write_bytes("café\nnaïve".encode("latin-1"))
    files["not_parquet"].write_text("not parquet")
    pd.DataFrame({"text": ["a document", None]}).to_parquet(files["null_text"])
    files["bert"].mkdir()
    (files["bert"] / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["X"]}))
    files["no_weights"].mkdir()  # the shape of GPT2 below, without its weights file
    shape = {"n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 32, "vocab_size": 320, "n_inner": 64}
    (files["no_weights"] / "config.json").write_text(json.dumps({"model_type": "gpt2", **shape}))
    files["empty_tokenizer"].mkdir()
    return files


def test_data_files_that_are_not_their_format_name_the_file_and_place(tmp_path):
    from llmtrain.data.sources import TRAIN, open_documents

    files = _corpus(tmp_path)
    expected = {
        "bad_json": f"data.path: {files['bad_json']}, line 2 is not JSON",
        "bad_utf8": f"data.path: {files['bad_utf8']} is not UTF-8 text: byte 3 (line 1) is 0xe9",
        "not_parquet": f"data.path: {files['not_parquet']} is not a parquet file",
        "null_text": f"data.path: {files['null_text']}, row group 0, row 1: column 'text' holds NoneType",
    }
    for name, start in expected.items():
        data = _composed().data
        data.source, data.path, data.tokenizer.kind = "local", str(files[name]), "byte"
        with pytest.raises(ConfigError) as error:
            list(open_documents(data, TRAIN))  # the parquet footer is read when the stream opens, the rest as read
        assert str(error.value).startswith(start), str(error.value)
        assert "\n" not in str(error.value)


def test_model_directories_llmtrain_cannot_import_say_why(tmp_path):
    from llmtrain.model import GPTConfig
    from llmtrain.model.hf import hf_weights

    files = _corpus(tmp_path)
    gpt2 = GPTConfig(vocab_size=320, n_layer=1, n_head=2, d_model=16, max_seq_len=32, d_ff=64)
    with pytest.raises(ConfigError, match=r"holds a 'bert' model \(X\), which llmtrain does not import"):
        hf_weights(str(files["bert"]), gpt2)
    llama = GPTConfig(
        vocab_size=320, n_layer=1, n_head=2, d_model=16, max_seq_len=32, norm="rmsnorm", position="rope",
        mlp="swiglu", bias=False,
    )  # fmt: skip
    with pytest.raises(
        ConfigError,
        match="holds a gpt2 model but the model config is a llama: leave model= out .* or choose a gpt2 preset",
    ):
        hf_weights(str(files["no_weights"]), llama)
    with pytest.raises(
        ConfigError, match="holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    ):
        hf_weights(str(files["no_weights"]), gpt2)


def test_a_damaged_checkpoint_is_named_not_loaded(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from llmtrain.checkpoint.manager import (
        checkpoint_path,
        incomplete_reason,
        load_checkpoint,
        read_data_position,
    )

    path = Path(checkpoint_path(str(tmp_path), 3))
    dcp.save({"weights": torch.randn(8, 8)}, checkpoint_id=str(path), no_dist=True)
    (path / "meta.json").write_text('{"step": 3')
    (path / "checksums.json").write_text("{}")  # present: what is read is the files themselves
    torch.save({"epoch": 0}, path / "data.pt")
    (path / "data.pt").write_bytes((path / "data.pt").read_bytes()[:50])
    assert incomplete_reason(str(path)) == "meta.json is unreadable (JSONDecodeError)"
    with pytest.raises(ConfigError, match=rf"^checkpoint {path} is damaged: data.pt cannot be read"):
        read_data_position(str(path))
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)  # the right size, the wrong bytes
    with pytest.raises(ConfigError, match=rf"^checkpoint {path} is damaged: its model and optimizer shards"):
        load_checkpoint(str(path), {"weights": torch.empty(8, 8)}, distributed=False)


# Each case: (arguments after train.py, environment, the text the one line must hold). The config's own cases are
# answered before torch is imported (about a second each); the external inputs' need the run to start.
CONFIG_CASES = [
    (["train.steps=many"], {}, "train.steps=many is not a whole number: set train.steps to a whole number >= 1"),
    (["train.stpes=5"], {}, "train.stpes is not a key: did you mean train.steps?"),
    (["model=gpt5"], {}, "model=gpt5 is not an option of model: choose one of gemma3-1b, gemma3-4b, gemma3-tiny, "),
    (["train.steps=[1,2"], {}, "cannot read the override 'train.steps=[1,2'"),
    (["+foo=1"], {}, "foo is not a key"),
    (["optim.lr=-1"], {}, "optim.lr=-1.0 is out of range: set optim.lr to a number > 0"),
    (["train.batch_size=30"], {}, "train.batch_size=30 is not divisible by train.micro_batch_size=8"),
    (["data=local"], {}, "data.path is not set: data=local needs data.path="),
    ([f"hydra.run.dir={REPO / 'train.py'}/run"], {}, "the run directory"),
]


def _external_cases(tmp: Path) -> list[tuple[list[str], dict[str, str], str]]:
    files = _corpus(tmp)
    offline = {"HF_HUB_OFFLINE": "1"}
    return [
        (["model.init_from=gpt2"], offline, "model.init_from='gpt2' is not a local directory and the Hugging Face"),
        (["data.tokenizer.kind=hf", "data.tokenizer.name=org/tok"], offline, "data.tokenizer.name='org/tok' is not"),
        (["data=hf", "data.name=org/corpus"], offline, "data.name='org/corpus' is not a local directory and the"),
        ([f"data.tokenizer.name={files['empty_tokenizer']}", "data.tokenizer.kind=hf"], {}, "is a directory without"),
        (["data=local", f"data.path={files['bad_json']}"], {}, f"{files['bad_json']}, line 2 is not JSON"),
        (["model=gpt2", f"model.init_from={files['bert']}"], {}, "holds a 'bert' model"),
        (["parallel=fsdp", "parallel.cpu_offload=true"], {}, "but this run is on cpu, where they are in host memory"),
    ]


@pytest.mark.slow  # processes of their own: the schema walk above checks the same lines in-process
def test_the_command_line_answers_a_bad_config_with_one_line_and_exit_2(tmp_path):
    _assert_one_line_errors(tmp_path, CONFIG_CASES)


@pytest.mark.slow
def test_the_command_line_answers_bad_external_inputs_with_one_line_and_exit_2(tmp_path):
    _assert_one_line_errors(tmp_path, _external_cases(tmp_path))


def _assert_one_line_errors(tmp_path: Path, cases: list[tuple[list[str], dict[str, str], str]]) -> None:
    """Real runs of train.py, started together: exit 2, exactly one line on stderr starting `error:`, no
    traceback, no run directory left behind."""
    started = []
    for i, (args, env, _) in enumerate(cases):
        run_dir = tmp_path / f"run{i}"
        has_dir = any(a.startswith("hydra.run.dir=") for a in args)
        command = [python(), str(REPO / "train.py"), *([] if has_dir else [f"hydra.run.dir={run_dir}"]), *args]
        environment = {**os.environ, "WANDB_MODE": "disabled", **env}
        process = subprocess.Popen(
            command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        started.append((process, run_dir))
    for (process, run_dir), (args, _, expected) in zip(started, cases):
        stdout, stderr = (stream.decode() for stream in process.communicate(timeout=300))
        lines = [line for line in stderr.splitlines() if line.strip() and "huggingface_hub" not in line]
        assert process.returncode == 2, (args, process.returncode, stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (args, stderr[-2000:])
        assert "Traceback" not in stderr + stdout, args
        assert not run_dir.exists(), args


@pytest.mark.parametrize("override", ["train.stpes=3", "optim.lr=-1"])
def test_the_planner_answers_a_bad_override_as_train_py_does(override, capsys):
    from llmtrain.tools.plan import main as plan

    with pytest.raises(SystemExit) as exit_code:
        plan([override, "plan.out=/nonexistent-dir/plan.json"])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {error_line(_composed(), override)}"


@pytest.mark.slow  # a process of its own
@pytest.mark.parametrize(
    "command",
    [[str(REPO / "train.py"), "--help"], ["-m", "llmtrain.tools.plan", "--help"]],
    ids=["train.py", "plan"],
)
def test_help_into_a_pipe_closed_early_ends_quietly(command, tmp_path):
    """`--help | head`: the reader goes away before the text is written; the process ends as a Unix tool killed by
    SIGPIPE does (status 141), with nothing on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    done = subprocess.run([sys.executable, *command], stdout=write_end, stderr=subprocess.PIPE, cwd=tmp_path)
    os.close(write_end)
    assert done.returncode == CLOSED_PIPE_EXIT and done.stderr.decode() == ""


@pytest.mark.parametrize(
    "faults, message",
    [
        ("hang_at_stpe=3", "hang_at_stpe is not a fault point: the points are hang_at_step, "),
        ("oom_at_step=three", "oom_at_step=three is not a value it takes"),
        ("step_seconds", "step_seconds is not point=value"),
    ],
)
def test_a_fault_point_that_arms_nothing_is_one_line_and_an_armed_one_is_said(faults, message, monkeypatch):
    """A test's misspelt LLMTRAIN_FAULTS would otherwise let the run pass without the fault it was meant to meet."""
    from llmtrain import faults as fault_points

    monkeypatch.setenv(fault_points.ENVIRONMENT, faults)
    fault_points.armed.cache_clear()
    with pytest.raises(ConfigError, match=f"^LLMTRAIN_FAULTS: {message}") as error:
        fault_points.check_armed()
    assert "\n" not in str(error.value)
    monkeypatch.setenv(fault_points.ENVIRONMENT, "hang_at_step=9 hang_on_rank=1")
    fault_points.armed.cache_clear()
    assert fault_points.check_armed() == (
        "fault points armed (LLMTRAIN_FAULTS=hang_at_step=9 hang_on_rank=1): a test's run, made to fail or slow "
        "where they say"
    )
    monkeypatch.delenv(fault_points.ENVIRONMENT)
    fault_points.armed.cache_clear()
    assert fault_points.check_armed() is None


@pytest.mark.slow  # processes of their own
def test_a_log_file_that_cannot_be_opened_is_one_line_on_the_main_rank_and_silence_on_another(tmp_path):
    """The race a worker rank can lose: the main rank removes the run directory of a refused config while another
    rank's Hydra opens its log file in it. logging's configuration wraps that OSError in a ValueError; the main rank
    says in one line which file cannot be written, and another rank says nothing (the main rank reports the run's
    end) and exits 2 when its launcher stops it. Made here by a log file's path that is a directory."""
    import signal

    run_dir = tmp_path / "run"
    (run_dir / "train.log").mkdir(parents=True)
    command = [python(), str(REPO / "train.py"), f"hydra.run.dir={run_dir}"]
    environment = {**os.environ, "WANDB_MODE": "disabled"}
    main = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    lines = [line for line in main.stderr.splitlines() if line.strip()]
    assert main.returncode == 2 and len(lines) == 1, main.stderr[-2000:]
    assert lines[0].startswith(f"error: the run directory cannot be written ({run_dir / 'train.log'}: Is a directory)")
    worker = subprocess.Popen(
        command, cwd=tmp_path, env={**environment, "RANK": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    time.sleep(3)  # past its start: it waits for the main rank's line, as a launcher's worker would
    worker.send_signal(signal.SIGTERM)
    stdout, stderr = (stream.decode() for stream in worker.communicate(timeout=60))
    assert worker.returncode == 2 and not stderr.strip() and "error" not in stdout, stderr[-2000:]
