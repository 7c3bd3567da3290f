"""Typed schemas for every config group, registered in Hydra's ConfigStore.

`conf/train.yaml` lists `train_schema` first in its defaults, so every yaml and every command-line override is
merged into these dataclasses: a misspelt key or a wrong type fails before any work starts. Checks that span
several keys (divisibility, lengths, paths) live in `validate`, which raises `ConfigError` with one line that
names the key and the fix.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from llmtrain.resolvers import register_resolvers


class ConfigError(ValueError):
    """A user-fixable configuration problem; its message is one line naming the key and the fix."""


@dataclass
class RopeScalingConfig:
    """Llama 3's stretching of the slow rotary frequencies (llmtrain/model/rope.py); the numbers are Llama 3.1's."""

    type: str = "none"  # none (plain RoPE) | llama3 (transformers' rope_type "llama3")
    factor: float = 8.0  # how much longer than original_max_seq_len the stretched context is
    low_freq_factor: float = 1.0  # rotations with fewer turns than this over the original context slow by factor
    high_freq_factor: float = 4.0  # rotations with more turns than this keep their frequency; between: a blend
    original_max_seq_len: int = 8192  # the context the model was pretrained on before the stretch


@dataclass
class MoEGroupConfig:
    """Mixture-of-experts blocks (llmtrain/model/moe.py); num_experts 0 keeps every MLP dense."""

    num_experts: int = 0  # routed experts per mixture block
    top_k: int = 2  # experts each token is sent to
    every: int = 1  # block i is a mixture when (i + 1) % every == 0
    shared_experts: int = 0  # always-on experts beside the routed ones
    d_ff: Optional[int] = None  # one expert's hidden width; None: model.d_ff (the dense MLP's)
    aux_loss_coef: float = 0.01  # Switch / GShard load-balancing loss
    z_loss_coef: float = 0.0  # ST-MoE router z-loss


@dataclass
class ModelConfig:
    name: str = MISSING
    n_layer: int = MISSING
    n_head: int = MISSING
    d_model: int = MISSING
    d_ff: Optional[int] = None  # None: 4 * d_model
    max_seq_len: int = 1024
    vocab_size: Optional[int] = None  # None: the tokenizer's vocabulary size
    dropout: float = 0.0  # embeddings and residual branches
    attention_dropout: float = 0.0  # attention weights: materialises them (no fused attention kernel)
    bias: bool = True
    vocab_multiple: int = 64  # pad the vocabulary (embedding rows, head outputs) to a multiple of this
    init_from: Optional[str] = None  # a GPT-2 in Hugging Face format (directory or hub name) to start from
    # The Llama family's choices (GPT-2's are the defaults): conf/model/llama-tiny.yaml and the presets set them.
    norm: str = "layernorm"  # layernorm | rmsnorm
    position: str = "learned"  # learned | rope
    rope_theta: float = 10000.0  # rope: the base of the rotation frequencies
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # rope: type=llama3 stretches it
    mlp: str = "gelu"  # gelu | swiglu (d_ff is then the gated hidden width)
    n_kv_head: Optional[int] = None  # key/value heads (grouped-query attention); None: n_head
    tie_embeddings: bool = True  # the LM head shares the token embedding's weights
    norm_eps: float = 1e-5
    moe: MoEGroupConfig = field(default_factory=MoEGroupConfig)


@dataclass
class TokenizerConfig:
    # data=prepared leaves these null: the store's manifest names its tokenizer, and a key set here must agree.
    kind: Optional[str] = "bpe"  # byte | bpe | hf
    vocab_size: Optional[int] = 4096  # bpe: size of the vocabulary to train
    train_chars: Optional[int] = 4_000_000  # bpe: characters of the training stream used to train it
    name: Optional[str] = None  # hf: a transformers tokenizer name or local directory


@dataclass
class DataConfig:
    source: str = MISSING  # stdlib | local | hf | prepared
    path: Optional[str] = None  # local: a file, a folder or a glob; prepared: the directory prepare wrote
    name: Optional[str] = None  # hf: dataset name on the hub
    subset: Optional[str] = None  # hf: configuration / subset
    split: str = "train"
    val_split: Optional[str] = None  # hf: the validation split; None: hold out val_fraction of the text
    val_path: Optional[str] = None  # local: validation files (file, folder or glob); None: hold out val_fraction
    val_fraction: float = 0.02
    text_field: str = "text"  # jsonl / parquet / hf column holding the text
    doc_shuffle_buffer: int = 1000  # documents
    window_shuffle_buffer: int = 4096  # packed windows
    cache_dir: str = "~/.cache/llmtrain"  # trained tokenizers
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


@dataclass
class ParallelConfig:
    strategy: str = "single"  # a registered strategy (llmtrain/parallel/registry.py)
    # Degrees of the mesh (outer to inner); -1 on one of them means "the remaining ranks".
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks, attention around a ring
    tp: int = 1
    ep: int = 1  # expert parallel: each mixture's experts split over ep of the dp_shard x cp ranks (not a 6th degree)
    nproc: int = 1  # workers to start on this machine when not launched by torchrun or srun
    reshard_after_forward: bool = True  # fsdp: free gathered parameters after forward (ZeRO-3) or keep (ZeRO-2)
    cpu_offload: bool = False  # fsdp: keep sharded parameters, gradients and optimizer state in host memory
    sequence_parallel: bool = False  # tp: shard LayerNorm / residual / dropout activations along the sequence
    loss_parallel: bool = True  # tp: cross-entropy on vocabulary shards, never gathering full logits
    pp_schedule: str = "1f1b"  # pp: gpipe | 1f1b | 1f1b_reference | interleaved_1f1b | zero_bubble | zbv | dualpipev
    pp_stages_per_rank: int = 1  # pp: virtual stages per rank (interleaved_1f1b, zero_bubble: >= 2; V schedules: 2)
    microbatches: Optional[int] = None  # pp: micro-batches per step; None = batch / (data-parallel x micro batch)
    pp_edge_blocks: int = 0  # pp: the first and last stage each get this many fewer blocks (embedding / head cost)


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto | online | offline | disabled
    project: str = "llmtrain"
    entity: Optional[str] = None
    name: Optional[str] = None  # None: the run directory
    group: Optional[str] = None  # None: the sweep directory of a -m sweep, no group for a single run


@dataclass
class LoggingConfig:
    log_every: int = 10  # steps between console lines when no progress bar is shown
    progress: str = "auto"  # auto (bar when attached to a terminal) | bar | lines
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 32  # global sequences per optimizer step
    micro_batch_size: int = 8  # sequences per rank per forward/backward
    seq_len: int = 128
    eval_every: int = 50  # 0 disables periodic validation
    eval_batches: int = 2  # global batches (of batch_size sequences) per validation
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    device: str = "auto"  # auto | cpu | cuda
    save_model: bool = True  # write the final weights (full state dict) to model.pt in the run directory
    activation_checkpointing: str = "none"  # none | full | selective
    compile: bool = False  # torch.compile each transformer block
    max_bad_steps: int = 3  # stop after this many consecutive steps with a non-finite loss or gradient norm


@dataclass
class CheckpointConfig:
    every: int = 0  # also save every N optimizer steps; 0: only at the end of the run and on preemption
    dir: Optional[str] = None  # None: <run dir>/checkpoints
    keep: int = 2  # complete checkpoints kept, newest first
    async_save: bool = False  # write in the background (DCP async_save) while training continues
    resume: str = "auto"  # auto: the latest complete checkpoint in dir, if any | none | <checkpoint path>


@dataclass
class HardwareConfig:
    """The machines a run is planned for (conf/hardware/): what the planner's memory and time estimates use."""

    name: str = MISSING
    nodes: int = 1
    gpus_per_node: int = 1  # devices (ranks) per node
    device_memory_gib: Optional[float] = None  # memory of one device; None: host memory / ranks per node (CPU)
    intra_node_gbps: float = MISSING  # GB/s per device, one direction, to the other devices of its node
    inter_node_gbps: float = MISSING  # GB/s per device, one direction, across nodes
    peak_tflops: Optional[float] = None  # dense bf16 (fp32 accumulate) per device; None: unknown (CPU)
    peer_to_peer: bool = True  # devices of a node reach each other directly (NVLink, PCIe P2P), not via host memory


@dataclass
class PlanConfig:
    """The planner's knobs (llmtrain.tools.plan; parallel=auto reads `measured`, `mfu` and `reserved_gib`)."""

    world_size: Optional[int] = None  # None: hardware.nodes x hardware.gpus_per_node
    parameters: Optional[int] = None  # plan model states for this many parameters instead of the model's ("what if")
    param_bytes: float = 2  # bytes per parameter of the weights (bf16)
    grad_bytes: float = 2  # ... of the gradients (bf16)
    optimizer_bytes: float = 12  # ... of the optimizer state (fp32 master copy + two AdamW moments)
    layouts: str = "dp"  # dp: the data-parallel layouts | all: also tensor, pipeline and 3-D layouts
    measured: Optional[str] = None  # a comm_bench.csv whose bus bandwidths replace the hardware's link numbers
    mfu: float = 0.4  # fraction of peak FLOP/s the compute is assumed to reach
    reserved_gib: float = 1.0  # per device: CUDA context, communication buffers, allocator fragmentation
    out: str = "plan.json"  # where llmtrain.tools.plan writes its JSON


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
    seed: int = 1337


@dataclass
class PrepareConfig:
    out: Optional[str] = None  # required: the directory the token store is written to
    num_proc: int = 1  # tokenising processes (1: this one, whose fast tokenizer uses every core by itself)


@dataclass
class PrepareRootConfig:
    data: DataConfig = MISSING
    prepare: PrepareConfig = field(default_factory=PrepareConfig)


def register_schemas() -> None:
    ConfigStore.instance().store(name="train_schema", node=RootConfig)
    ConfigStore.instance().store(name="prepare_schema", node=PrepareRootConfig)
    register_resolvers()


_CHOICES = {
    "data.source": ("stdlib", "local", "hf", "prepared"),
    "optim.name": ("adamw",),
    "logging.wandb.mode": ("auto", "online", "offline", "disabled"),
    "logging.progress": ("auto", "bar", "lines"),
    "train.precision": ("auto", "bf16", "fp32"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.activation_checkpointing": ("none", "full", "selective"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.position": ("learned", "rope"),
    "model.mlp": ("gelu", "swiglu"),
    "model.rope_scaling.type": ("none", "llama3"),
}


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate_rope_scaling(scaling) -> None:
    if not (0 < scaling.low_freq_factor < scaling.high_freq_factor) or scaling.factor < 1:
        raise ConfigError(
            f"model.rope_scaling needs 0 < low_freq_factor < high_freq_factor and factor >= 1 (got "
            f"{scaling.low_freq_factor}, {scaling.high_freq_factor}, {scaling.factor}): fix those keys"
        )
    if scaling.original_max_seq_len <= 0:
        raise ConfigError(f"model.rope_scaling.original_max_seq_len={scaling.original_max_seq_len} must be positive")


def validate_moe(moe, n_layer: int) -> None:
    if moe.num_experts < 0 or not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}: set "
            f"model.moe.top_k to at most the number of experts"
        )
    if not 1 <= moe.every <= n_layer:
        raise ConfigError(f"model.moe.every={moe.every} must be between 1 and model.n_layer={n_layer}")
    if moe.shared_experts < 0 or (moe.d_ff is not None and moe.d_ff <= 0):
        raise ConfigError("model.moe.shared_experts must be >= 0 and model.moe.d_ff positive (or null)")
    if moe.aux_loss_coef < 0 or moe.z_loss_coef < 0:
        raise ConfigError("model.moe.aux_loss_coef and model.moe.z_loss_coef must be >= 0 (0 turns a term off)")


def validate(cfg) -> None:
    """Checks that need more than one key or the file system; raises ConfigError on the first problem."""
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}: set {key} to one of them")

    positive = (
        "train.steps",
        "train.batch_size",
        "train.micro_batch_size",
        "train.seq_len",
        "train.eval_batches",
        "model.n_layer",
        "model.n_head",
        "model.d_model",
        "model.max_seq_len",
        "model.vocab_multiple",
        "train.max_bad_steps",
        "logging.log_every",
    )
    for key in positive:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}={_get(cfg, key)} must be positive: set {key} to a value above 0")
    if cfg.parallel.nproc < 1:
        raise ConfigError(f"parallel.nproc={cfg.parallel.nproc} must be at least 1")
    if cfg.parallel.microbatches is not None and cfg.parallel.microbatches < 1:
        raise ConfigError(
            f"parallel.microbatches={cfg.parallel.microbatches} must be at least 1 (or null: "
            f"train.batch_size / (data-parallel size x train.micro_batch_size))"
        )
    if cfg.parallel.pp_stages_per_rank < 1 or cfg.parallel.pp_edge_blocks < 0:
        raise ConfigError("parallel.pp_stages_per_rank must be >= 1 and parallel.pp_edge_blocks >= 0")
    if cfg.train.eval_every < 0:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} must be >= 0: use 0 to disable validation")

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
    if m.rope_theta <= 0 or m.norm_eps <= 0:
        raise ConfigError(f"model.rope_theta={m.rope_theta} and model.norm_eps={m.norm_eps} must be positive")
    if m.rope_scaling.type == "llama3":
        validate_rope_scaling(m.rope_scaling)
    if m.moe.num_experts:
        validate_moe(m.moe, m.n_layer)
    for key in ("dropout", "attention_dropout"):
        if not 0.0 <= m[key] < 1.0:
            raise ConfigError(f"model.{key}={m[key]} must be in [0, 1): the fraction of elements dropped")
    for key in ("nodes", "gpus_per_node", "device_memory_gib", "intra_node_gbps", "inter_node_gbps", "peak_tflops"):
        value = cfg.hardware[key]
        if value is not None and value <= 0:
            raise ConfigError(
                f"hardware.{key}={value} must be positive: fix it in conf/hardware/{cfg.hardware.name}.yaml or on the "
                f"command line"
            )
    _validate_plan(cfg.plan)
    if cfg.optim.warmup_steps < 0 or cfg.optim.grad_clip < 0:
        raise ConfigError("optim.warmup_steps and optim.grad_clip must be >= 0 (grad_clip=0 disables clipping)")
    validate_data(cfg.data)
    _validate_checkpoint(cfg.checkpoint)


def _validate_plan(p) -> None:
    for key in ("world_size", "parameters", "param_bytes", "grad_bytes", "optimizer_bytes"):
        if p[key] is not None and p[key] <= 0:
            raise ConfigError(f"plan.{key}={p[key]} must be positive: set plan.{key} to a value above 0")
    if not 0 < p.mfu <= 1 or p.reserved_gib < 0:
        raise ConfigError(
            f"plan.mfu={p.mfu} must be in (0, 1] and plan.reserved_gib={p.reserved_gib} >= 0: e.g. plan.mfu=0.4"
        )
    if p.layouts not in ("dp", "all"):
        raise ConfigError(f"plan.layouts={p.layouts!r} is not one of dp, all: set plan.layouts=dp or plan.layouts=all")


def _validate_checkpoint(c) -> None:
    if c.every < 0 or c.keep < 1:
        raise ConfigError(
            f"checkpoint.every={c.every} must be >= 0 (0: only at the end) and checkpoint.keep={c.keep} >= 1"
        )


def validate_data(d) -> None:
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
    if d.tokenizer.kind not in TOKENIZER_KINDS:
        raise ConfigError(
            f"data.tokenizer.kind={d.tokenizer.kind!r} is not one of {', '.join(TOKENIZER_KINDS)}: "
            f"set data.tokenizer.kind to one of them"
        )
    if d.tokenizer.kind == "hf" and not d.tokenizer.name:
        raise ConfigError("data.tokenizer.name is not set: data.tokenizer.kind=hf needs a tokenizer name or path")
    if d.tokenizer.kind == "bpe" and (d.tokenizer.vocab_size or 0) < 512:
        raise ConfigError(
            f"data.tokenizer.vocab_size={d.tokenizer.vocab_size} is too small for a byte-level BPE: use at least 512"
        )
    if d.val_split is None and d.val_path is None and not 0.0 < d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 0.5) when data.val_split is unset")


def _check_local_files(key: str, path: str) -> None:
    if not local_data_files(path):
        raise ConfigError(
            f"{key}={path!r} matches no .txt, .jsonl or .parquet file: "
            f"point {key} at a file, a folder or a glob of such files"
        )


TOKENIZER_KINDS = ("byte", "bpe", "hf")
DATA_EXTENSIONS = (".txt", ".jsonl", ".parquet")


def local_data_files(path: str) -> list[str]:
    """Non-empty data files named by a file, a folder (searched recursively) or a glob, sorted."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        candidates = glob.glob(os.path.join(path, "**", "*"), recursive=True)
    else:
        candidates = glob.glob(path, recursive=True)
    return sorted(p for p in candidates if os.path.isfile(p) and p.endswith(DATA_EXTENSIONS) and os.path.getsize(p) > 0)
