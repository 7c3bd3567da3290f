"""Typed schemas for every config group, registered in Hydra's ConfigStore.

`conf/train.yaml` lists `train_schema` first in its defaults, so every yaml and every command-line override is
merged into these dataclasses: a misspelt key or a wrong type fails before any work starts. Each key declares
its domain beside it (`key(default, domain)`, llmtrain/domains.py); `validate` checks every key against its domain,
then the rules that span several keys (divisibility, lengths, paths), and raises `ConfigError` with one line that
names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import glob
import os
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from llmtrain import catalog
from llmtrain.domains import (
    TOKENIZER_FILES,
    CheckpointSource,
    DirectoryOrHub,
    Domain,
    ExistingPath,
    Flag,
    MeshDegree,
    Number,
    OneOf,
    Text,
    WritableDirectory,
    at_least,
    describe,
    fraction,
    key,
    positive,
)
from llmtrain.errors import ConfigError
from llmtrain.resolvers import register_resolvers

TOKENIZER_KINDS = ("byte", "bpe", "hf")
STRATEGIES = (*catalog.STRATEGIES, catalog.AUTO)
PIPELINE_SCHEDULES = tuple(catalog.SCHEDULES)


@dataclass
class RopeScalingConfig:
    """Llama 3's stretching of the slow rotary frequencies (llmtrain/model/rope.py); the numbers are Llama 3.1's."""

    type: str = key("none", OneOf(("none", "llama3")))  # none (plain RoPE) | llama3 (transformers' "llama3")
    factor: float = key(8.0, Number(low=1))  # how much longer than original_max_seq_len the stretched context is
    low_freq_factor: float = key(1.0, positive())  # rotations with fewer turns than this slow by factor
    high_freq_factor: float = key(4.0, positive())  # rotations with more turns than this keep their frequency
    original_max_seq_len: int = key(8192, at_least(1))  # the context the model was pretrained on before the stretch


@dataclass
class MoEGroupConfig:
    """Mixture-of-experts blocks (llmtrain/model/moe.py); num_experts 0 keeps every MLP dense."""

    num_experts: int = key(0, at_least(0))  # routed experts per mixture block
    top_k: int = key(2, at_least(1))  # experts each token is sent to (at most num_experts)
    every: int = key(1, at_least(1))  # block i is a mixture when (i + 1) % every == 0
    shared_experts: int = key(0, at_least(0))  # always-on experts beside the routed ones
    d_ff: Optional[int] = key(None, at_least(1))  # one expert's hidden width; None: model.d_ff (the dense MLP's)
    aux_loss_coef: float = key(0.01, Number(low=0))  # Switch / GShard load-balancing loss
    z_loss_coef: float = key(0.0, Number(low=0))  # ST-MoE router z-loss


@dataclass
class ModelConfig:
    name: str = key(MISSING, Text())
    n_layer: int = key(MISSING, at_least(1))
    n_head: int = key(MISSING, at_least(1))
    d_model: int = key(MISSING, at_least(1))
    d_ff: Optional[int] = key(None, at_least(1))  # None: 4 * d_model
    max_seq_len: int = key(1024, at_least(1))
    vocab_size: Optional[int] = key(None, at_least(1))  # None: the tokenizer's vocabulary size
    dropout: float = key(0.0, fraction())  # embeddings and residual branches
    attention_dropout: float = key(0.0, fraction())  # attention weights: materialises them (no fused kernel)
    bias: bool = key(True, Flag())
    vocab_multiple: int = key(64, at_least(1))  # pad the vocabulary (embedding rows, head outputs) to a multiple
    # A model in Hugging Face format (GPT-2, Llama, Mixtral) to start from: a local directory or a hub id.
    init_from: Optional[str] = key(None, DirectoryOrHub(("config.json",)))
    # The Llama family's choices (GPT-2's are the defaults): conf/model/llama-tiny.yaml and the presets set them.
    norm: str = key("layernorm", OneOf(("layernorm", "rmsnorm")))
    position: str = key("learned", OneOf(("learned", "rope")))
    rope_theta: float = key(10000.0, positive())  # rope: the base of the rotation frequencies
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # rope: type=llama3 stretches it
    mlp: str = key("gelu", OneOf(("gelu", "swiglu")))  # swiglu: d_ff is then the gated hidden width
    n_kv_head: Optional[int] = key(None, at_least(1))  # key/value heads (grouped-query attention); None: n_head
    tie_embeddings: bool = key(True, Flag())  # the LM head shares the token embedding's weights
    norm_eps: float = key(1e-5, positive())
    moe: MoEGroupConfig = field(default_factory=MoEGroupConfig)


@dataclass
class TokenizerConfig:
    # data=prepared leaves these null: the store's manifest names its tokenizer, and a key set here must agree.
    kind: Optional[str] = key("bpe", OneOf(TOKENIZER_KINDS))  # byte | bpe | hf
    vocab_size: Optional[int] = key(4096, at_least(1))  # bpe: size of the vocabulary to train (at least 512)
    train_chars: Optional[int] = key(4_000_000, at_least(1))  # bpe: characters of the training stream it reads
    name: Optional[str] = key(None, DirectoryOrHub(TOKENIZER_FILES))  # hf: a tokenizer's hub id or local directory


@dataclass
class DataConfig:
    source: str = key(MISSING, OneOf(("stdlib", "local", "hf", "prepared")))
    path: Optional[str] = key(None, ExistingPath("glob"))  # local: a file, folder or glob; prepared: the store
    name: Optional[str] = key(None, Text())  # hf: dataset name on the hub
    subset: Optional[str] = key(None, Text())  # hf: configuration / subset
    split: str = key("train", Text())
    val_split: Optional[str] = key(None, Text())  # hf: the validation split; None: hold out val_fraction
    val_path: Optional[str] = key(None, ExistingPath("glob"))  # local: validation files; None: hold out val_fraction
    val_fraction: float = key(0.02, Number(low=0, high=0.5, low_open=True, high_open=True))
    text_field: str = key("text", Text())  # jsonl / parquet / hf column holding the text
    doc_shuffle_buffer: int = key(1000, at_least(0))  # documents (0 or 1: no shuffling)
    window_shuffle_buffer: int = key(4096, at_least(0))  # packed windows (0 or 1: no shuffling)
    cache_dir: str = key("~/.cache/llmtrain", WritableDirectory())  # trained tokenizers
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass
class ParallelConfig:
    strategy: str = key("single", OneOf(STRATEGIES))  # a layout of llmtrain/catalog.py, or auto
    # Degrees of the mesh (outer to inner); -1 on one of them means "the remaining ranks"; 0 is refused.
    pp: int = key(1, MeshDegree())
    dp_replicate: int = key(1, MeshDegree())
    dp_shard: int = key(1, MeshDegree())
    cp: int = key(1, MeshDegree())  # context parallel: each sequence split over cp ranks, attention around a ring
    tp: int = key(1, MeshDegree())
    ep: int = key(1, at_least(1))  # expert parallel: each mixture's experts split over ep of the dp_shard x cp ranks
    nproc: int = key(1, at_least(1))  # workers to start on this machine when not launched by torchrun or srun
    reshard_after_forward: bool = key(True, Flag())  # fsdp: free gathered parameters after forward (ZeRO-3)
    cpu_offload: bool = key(False, Flag())  # fsdp: keep sharded parameters, gradients, optimizer state on the host
    sequence_parallel: bool = key(False, Flag())  # tp: shard LayerNorm / residual / dropout along the sequence
    loss_parallel: bool = key(True, Flag())  # tp: cross-entropy on vocabulary shards, never gathering full logits
    pp_schedule: str = key("1f1b", OneOf(PIPELINE_SCHEDULES))  # pp: the schedule (README: Pipeline schedules)
    pp_stages_per_rank: int = key(1, at_least(1))  # pp: virtual stages per rank (interleaved: >= 2; V: 2)
    microbatches: Optional[int] = key(None, at_least(1))  # pp: None = batch / (data-parallel x micro batch)
    pp_edge_blocks: int = key(0, at_least(0))  # pp: the first and last stage each get this many fewer blocks


@dataclass
class OptimConfig:
    name: str = key("adamw", OneOf(("adamw",)))
    lr: float = key(1e-3, positive())
    min_lr_ratio: float = key(0.1, fraction(high_open=False))  # cosine decays to lr * min_lr_ratio
    weight_decay: float = key(0.1, Number(low=0))
    beta1: float = key(0.9, fraction())
    beta2: float = key(0.95, fraction())
    eps: float = key(1e-8, positive())
    warmup_steps: int = key(20, at_least(0))
    grad_clip: float = key(1.0, Number(low=0))  # 0 disables clipping


@dataclass
class WandbConfig:
    mode: str = key("auto", OneOf(("auto", "online", "offline", "disabled")))
    project: str = key("llmtrain", Text())
    entity: Optional[str] = key(None, Text())
    name: Optional[str] = key(None, Text())  # None: the run directory
    group: Optional[str] = key(None, Text())  # None: the sweep directory of a -m sweep, no group for a single run


@dataclass
class LoggingConfig:
    log_every: int = key(10, at_least(1))  # steps between console lines when no progress bar is shown
    progress: str = key("auto", OneOf(("auto", "bar", "lines")))  # auto: a bar when attached to a terminal
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainConfig:
    steps: int = key(300, at_least(1))
    batch_size: int = key(32, at_least(1))  # global sequences per optimizer step
    micro_batch_size: int = key(8, at_least(1))  # sequences per rank per forward/backward
    seq_len: int = key(128, at_least(1))
    eval_every: int = key(50, at_least(0))  # 0 disables periodic validation
    eval_batches: int = key(2, at_least(1))  # global batches (of batch_size sequences) per validation
    precision: str = key("auto", OneOf(("auto", "bf16", "fp32")))  # auto: bf16 autocast on CUDA, fp32 on CPU
    device: str = key("auto", OneOf(("auto", "cpu", "cuda")))
    save_model: bool = key(True, Flag())  # write the final weights (full state dict) to model.pt in the run dir
    activation_checkpointing: str = key("none", OneOf(("none", "full", "selective")))
    compile: bool = key(False, Flag())  # torch.compile each transformer block
    max_bad_steps: int = key(3, at_least(1))  # stop after this many consecutive steps with a non-finite loss or norm


@dataclass
class CheckpointConfig:
    every: int = key(0, at_least(0))  # also save every N optimizer steps; 0: only at the end and on preemption
    dir: Optional[str] = key(None, WritableDirectory())  # None: <run dir>/checkpoints
    keep: int = key(2, at_least(1))  # complete checkpoints kept, newest first
    async_save: bool = key(False, Flag())  # write in the background (DCP async_save) while training continues
    resume: str = key("auto", CheckpointSource())  # auto: the latest complete one in dir, if any | none | <path>


@dataclass
class HardwareConfig:
    """The machines a run is planned for (conf/hardware/): what the planner's memory and time estimates use."""

    name: str = key(MISSING, Text())
    nodes: int = key(1, at_least(1))
    gpus_per_node: int = key(1, at_least(1))  # devices (ranks) per node
    device_memory_gib: Optional[float] = key(None, positive())  # one device's; None: host memory / ranks per node
    intra_node_gbps: float = key(MISSING, positive())  # GB/s per device, one direction, to the others of its node
    inter_node_gbps: float = key(MISSING, positive())  # GB/s per device, one direction, across nodes
    peak_tflops: Optional[float] = key(None, positive())  # dense bf16 (fp32 accumulate) per device; None: unknown
    peer_to_peer: bool = key(True, Flag())  # devices of a node reach each other directly (NVLink, PCIe P2P)


@dataclass
class PlanConfig:
    """The planner's knobs (llmtrain.tools.plan; parallel=auto reads `measured`, `mfu` and `reserved_gib`)."""

    world_size: Optional[int] = key(None, at_least(1))  # None: hardware.nodes x hardware.gpus_per_node
    parameters: Optional[int] = key(None, at_least(1))  # plan model states for this many parameters ("what if")
    param_bytes: float = key(2, positive())  # bytes per parameter of the weights (bf16)
    grad_bytes: float = key(2, positive())  # ... of the gradients (bf16)
    optimizer_bytes: float = key(12, positive())  # ... of the optimizer state (fp32 master + two AdamW moments)
    layouts: str = key("dp", OneOf(("dp", "all")))  # dp: data-parallel layouts | all: also tensor, pipeline, 3-D
    measured: Optional[str] = key(None, ExistingPath("file"))  # a comm_bench.csv replacing the hardware's links
    mfu: float = key(0.4, Number(low=0, high=1, low_open=True))  # fraction of peak FLOP/s the compute reaches
    reserved_gib: float = key(1.0, Number(low=0))  # per device: CUDA context, comm buffers, fragmentation
    out: str = key("plan.json", Text())  # where llmtrain.tools.plan writes its JSON


@dataclass
class RootConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    parallel: ParallelConfig = MISSING
    optim: OptimConfig = MISSING
    logging: LoggingConfig = MISSING
    hardware: HardwareConfig = MISSING
    plan: PlanConfig = field(default_factory=PlanConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = key(1337, Number(low=0, high=2**32 - 1, whole=True))


@dataclass
class PrepareConfig:
    out: Optional[str] = key(None, WritableDirectory())  # required: the directory the token store is written to
    num_proc: int = key(1, at_least(1))  # tokenising processes (1: this one, whose fast tokenizer uses every core)


@dataclass
class PrepareRootConfig:
    data: DataConfig = MISSING
    prepare: PrepareConfig = field(default_factory=PrepareConfig)


def register_schemas() -> None:
    ConfigStore.instance().store(name="train_schema", node=RootConfig)
    ConfigStore.instance().store(name="prepare_schema", node=PrepareRootConfig)
    register_resolvers()
    if not OmegaConf.has_resolver("llmtrain_keys"):  # `--help`: ${llmtrain_keys:train} in conf/hydra/help/
        OmegaConf.register_new_resolver("llmtrain_keys", _keys_help)


def _keys_help(which: str, _root_: DictConfig) -> str:
    schema = RootConfig if which == "train" else PrepareRootConfig
    return keys_help(_root_, schema)


def keys_help(cfg: DictConfig, schema: type) -> str:
    """One line per key: its composed value and what it accepts (the README says what each one does)."""
    rows = []
    sections = {f.name: _plain(cfg[f.name]) if isinstance(cfg[f.name], DictConfig) else cfg[f.name]
                for f in dataclasses.fields(schema)}  # fmt: skip
    for dotted, item, nullable in _schema_leaves(schema):
        missing, value = _lookup(sections, dotted)
        shown = "???" if missing else OmegaConf.to_yaml({"v": value})[3:].strip()  # null, true, 0.001 as typed
        domain = item.metadata.get("domain")
        rows.append((dotted, shown, (domain.accepts() if domain else "") + (", or null" if nullable else "")))
    width = max(len(k) + len(v) for k, v, _ in rows) + 3
    return "\n".join(f"  {f'{k}={v}':<{width}} {a}" for k, v, a in rows)


def _schema_leaves(schema: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, bool]]:
    """(dotted key, its field, whether it may be null) for every leaf of a schema dataclass."""
    hints = typing.get_type_hints(schema)
    for item in dataclasses.fields(schema):
        kind = hints[item.name]
        args = typing.get_args(kind)
        inner = next((a for a in args if a is not type(None)), kind)  # Optional[X] -> X
        if dataclasses.is_dataclass(inner):
            yield from _schema_leaves(inner, f"{prefix}{item.name}.")  # type: ignore[arg-type]
        else:
            yield f"{prefix}{item.name}", item, type(None) in args


@functools.cache
def schema_keys(schema: type) -> tuple[tuple[str, Domain | None], ...]:
    """Every leaf key of a schema dataclass, dotted, with its declared domain (None: none declared)."""
    return tuple((dotted, item.metadata.get("domain")) for dotted, item, _ in _schema_leaves(schema))


def unknown_key_line(name: str, keys: list[str]) -> str:
    """`name` is not among `keys` (dotted leaf keys): the closest key of the same section, and the section's keys."""
    parent = name.rpartition(".")[0]
    prefix = f"{parent}." if parent else ""
    siblings = sorted({k[len(prefix) :].split(".")[0] for k in keys if k.startswith(prefix)})
    near = difflib.get_close_matches(name.rpartition(".")[2], siblings, n=1)
    hint = f": did you mean {prefix}{near[0]}?" if near else ""
    return f"{name} is not a key{hint} (the keys of {parent or 'the config'}: {', '.join(siblings)})"


def check_domains(cfg, schema: type, prefix: str = "") -> None:
    """Each key of `cfg` (composed from `schema`, its keys under `prefix`) against its domain; ConfigError on the
    first key that is unset or outside."""
    values = _plain(cfg)
    keys = dict(schema_keys(schema))
    for dotted in _leaf_keys(values):
        if dotted not in keys:  # added with +key=value, which Hydra lets through a structured config
            raise ConfigError(unknown_key_line(prefix + dotted, [prefix + k for k in keys]))
    for dotted, domain in keys.items():
        name = prefix + dotted
        missing, value = _lookup(values, dotted)
        if missing:
            accepts = domain.accepts() if domain else "a value"
            raise ConfigError(f"{name} is not set: set {name} to {accepts} (in its conf/ group or on the command line)")
        if value is not None and domain is not None and (line := describe(name, value, domain)):
            raise ConfigError(line)


def _plain(cfg) -> dict:
    """`cfg` (a DictConfig or a schema dataclass) as nested dicts: read key by key, an OmegaConf node costs 100x."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return cast(dict, OmegaConf.to_container(node, resolve=True, throw_on_missing=False))


def _lookup(values: dict, dotted: str) -> tuple[bool, Any]:
    """(whether the key is unset: ??? or deleted with ~key, its value)."""
    *parents, last = dotted.split(".")
    for part in parents:
        values = values.get(part)  # type: ignore[assignment]
        if not isinstance(values, dict):
            return True, None
    if last not in values or values[last] == MISSING:
        return True, None
    return False, values[last]


def _leaf_keys(values: dict, prefix: str = "") -> Iterator[str]:
    for name, value in values.items():
        if isinstance(value, dict):
            yield from _leaf_keys(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def validate_rope_scaling(scaling) -> None:
    if not scaling.low_freq_factor < scaling.high_freq_factor:
        raise ConfigError(
            f"model.rope_scaling.low_freq_factor={scaling.low_freq_factor} must be below model.rope_scaling."
            f"high_freq_factor={scaling.high_freq_factor}: the band between them blends the two frequencies"
        )


def validate_moe(moe, n_layer: int) -> None:
    if moe.top_k > moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}: set "
            f"model.moe.top_k to at most the number of experts"
        )
    if moe.every > n_layer:
        raise ConfigError(f"model.moe.every={moe.every} must be between 1 and model.n_layer={n_layer}")


def validate(cfg) -> None:
    """Every key against its domain, then the rules that span several keys or read the file system; raises
    ConfigError on the first problem. Cheap and torch-free: it runs before any process group, model or data."""
    check_domains(cfg, RootConfig)
    t, m = cfg.train, cfg.model
    if t.batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.micro_batch_size="
            f"{t.micro_batch_size}: set train.batch_size to a multiple of {t.micro_batch_size}"
        )
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len} of model="
            f"{m.name}: set train.seq_len<={m.max_seq_len} or raise model.max_seq_len"
        )
    if m.d_model % m.n_head:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}: "
            f"choose a d_model that is a multiple of n_head"
        )
    if m.n_kv_head is not None and (m.n_kv_head < 1 or m.n_head % m.n_kv_head):
        raise ConfigError(
            f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head}: each key/value head serves a whole "
            f"group of query heads (n_kv_head=n_head: multi-head, 1: multi-query)"
        )
    if m.position == "rope" and (m.d_model // m.n_head) % 2:
        raise ConfigError(
            f"model.position=rope rotates pairs of dimensions but the head size d_model / n_head = "
            f"{m.d_model // m.n_head} is odd: choose d_model and n_head with an even quotient"
        )
    if m.rope_scaling.type == "llama3":
        validate_rope_scaling(m.rope_scaling)
    if m.moe.num_experts:
        validate_moe(m.moe, m.n_layer)
    validate_data(cfg.data)


def validate_data(d) -> None:
    """The data keys' domains and the rules between them (also what llmtrain.data.prepare checks)."""
    check_domains(d, DataConfig, "data.")
    if d.source in ("local", "prepared") and not d.path:
        what = "<file, folder or glob>" if d.source == "local" else "<directory written by llmtrain.data.prepare>"
        raise ConfigError(f"data.path is not set: data={d.source} needs data.path={what}")
    if d.source == "local":
        _check_local_files("data.path", d.path)
        if d.val_path is not None:
            _check_local_files("data.val_path", d.val_path)
    elif d.val_path is not None:
        raise ConfigError(
            f"data.val_path is for data=local (data={d.source}): use data.val_split for data=hf, "
            f"or unset data.val_path to hold out data.val_fraction"
        )
    if d.source == "hf" and not d.name:
        raise ConfigError("data.name is not set: data=hf needs data.name=<dataset on the hub>")
    if d.source == "prepared":
        return  # the store's manifest fixes the tokenizer and the split: llmtrain/data/prepared.py checks them
    if d.tokenizer.kind is None:
        raise ConfigError(f"data.tokenizer.kind is not set: set it to one of {', '.join(TOKENIZER_KINDS)}")
    if d.tokenizer.kind == "hf" and not d.tokenizer.name:
        raise ConfigError("data.tokenizer.name is not set: data.tokenizer.kind=hf needs a tokenizer name or path")
    if d.tokenizer.kind == "bpe" and (d.tokenizer.vocab_size or 0) < 512:
        raise ConfigError(
            f"data.tokenizer.vocab_size={d.tokenizer.vocab_size} is too small for a byte-level BPE: use at least 512"
        )


def _check_local_files(key: str, path: str) -> None:
    if not local_data_files(path):
        raise ConfigError(
            f"{key}={path!r} matches no .txt, .jsonl or .parquet file: "
            f"point {key} at a file, a folder or a glob of such files"
        )


DATA_EXTENSIONS = (".txt", ".jsonl", ".parquet")


def local_data_files(path: str) -> list[str]:
    """Non-empty data files named by a file, a folder (searched recursively) or a glob, sorted."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        candidates = glob.glob(os.path.join(path, "**", "*"), recursive=True)
    else:
        candidates = glob.glob(path, recursive=True)
    return sorted(p for p in candidates if os.path.isfile(p) and p.endswith(DATA_EXTENSIONS) and os.path.getsize(p) > 0)
