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
import importlib.util
import os
import textwrap
import typing
from collections.abc import Collection, Iterator
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
    ListOf,
    MeshDegree,
    MixtureSources,
    Number,
    OneOf,
    StepSpan,
    Text,
    WritableDirectory,
    at_least,
    describe,
    fraction,
    key,
    positive,
)
from llmtrain.errors import ConfigError
from llmtrain.launch_env import register_resolvers

# The option files (train.yaml, prepare.yaml, one folder per group): conf/ at the top of a checkout, which
# llmtrain/conf links to, so that a wheel carries them inside the package and the tools find them from anywhere.
CONF_DIR = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf"))

# What parallel.layout accepts: the catalog's layouts, and `auto` (the planner picks one of them).
LAYOUT_CHOICES = (*catalog.LAYOUTS, catalog.AUTO)
PIPELINE_SCHEDULES = tuple(catalog.SCHEDULES)


@dataclass
class RopeScalingConfig:
    """Llama 3's stretching of the slow rotary frequencies (llmtrain/model/rope.py); the numbers are Llama 3.1's."""

    type: str = key(
        "none",
        OneOf(("none", "llama3")),
        "`none` (plain RoPE) or `llama3`: Llama 3's stretch of the slow rotary frequencies (transformers' `rope_type: "
        "llama3`). Rotations with more than `high_freq_factor` turns over the original context keep their frequency, "
        "those with fewer than `low_freq_factor` slow by `factor`, the band between blends the two. `llama3.2-1b` "
        "sets Meta's (32, 1, 4, 8192), so its weights load with `model.init_from`",
    )
    factor: float = key(8.0, Number(low=1), "`llama3`: the stretched context is `factor` × `original_max_seq_len`")
    low_freq_factor: float = key(
        1.0,
        positive(),
        "`llama3`: rotations with fewer turns than this over the original context slow by `factor`",
    )
    high_freq_factor: float = key(4.0, positive(), "`llama3`: rotations with more turns than this keep their frequency")
    original_max_seq_len: int = key(8192, at_least(1), "`llama3`: the context the model was pretrained on")


@dataclass
class MoEGroupConfig:
    """Mixture-of-experts blocks (llmtrain/model/moe.py); num_experts 0 keeps every MLP dense."""

    num_experts: int = key(
        0,
        at_least(0),
        "routed experts per mixture-of-experts block; 0 keeps every MLP dense. `moe-tiny` (8, GPT-2 family) and "
        "`mixtral-tiny` (8, Llama family) set it",
    )
    top_k: int = key(
        2,
        at_least(1),
        "experts each token goes to; their router probabilities, renormalised to sum to 1, weight the outputs "
        "(Mixtral's rule). Dropless: no capacity limit, no token dropped",
    )
    every: int = key(
        1,
        at_least(1),
        "block i is a mixture when (i + 1) % every == 0 (1: every block; 2: every second, as `moe-tiny`)",
    )
    shared_experts: int = key(
        0,
        at_least(0),
        "always-on experts beside the routed ones (DeepSeek-style), run as one MLP of shared_experts × the expert "
        "width",
    )
    d_ff: Optional[int] = key(
        None,
        at_least(1),
        "one expert's hidden width; null = the dense MLP's (`model.d_ff`, or its default)",
    )
    aux_loss_coef: float = key(
        0.01,
        Number(low=0),
        "Switch / GShard load-balancing loss, coef · E · Σ_e (share of routed slots_e · mean router probability_e), "
        "per micro-batch",
    )
    z_loss_coef: float = key(0.0, Number(low=0), "ST-MoE router z-loss, coef · mean(logsumexp(router logits)²)")


@dataclass
class LoRAGroupConfig:
    """Low-rank adapters (llmtrain/model/lora.py): rank 0 trains every parameter."""

    rank: int = key(
        0,
        at_least(0),
        "low-rank adapters of this rank beside each targeted projection, the rest of the model frozen (no gradients, "
        "no optimizer state; bf16 where FSDP gathers bf16); 0 trains every parameter. 8 to 64 is usual",
    )
    alpha: float = key(16.0, positive(), "the adapters' update is scaled by alpha / rank (PEFT's `lora_alpha`)")
    dropout: float = key(0.0, fraction(), "dropout on each adapter's input (PEFT's `lora_dropout`)")
    targets: list[str] = key(
        list(catalog.LORA_TARGETS),
        ListOf(OneOf(tuple(catalog.LORA_TARGETS))),
        "the projections adapted: `q_proj k_proj v_proj out_proj` (attention), `fc_gate fc_in fc_out` (the MLP; "
        "Hugging Face's Llama calls them `o_proj gate_proj up_proj down_proj`); all of them by default",
    )


def mlp_width(d_model: int, d_ff: int | None, mlp: str) -> int:
    """The MLP's hidden width: `d_ff`, else 4·d_model (GELU) or 8/3·d_model rounded up to 64 (SwiGLU: the same
    parameter count). The one rule the model, the plan's checks and the planner read."""
    if d_ff:
        return d_ff
    return 4 * d_model if mlp == "gelu" else -(-8 * d_model // 3 // 64) * 64


@dataclass
class ModelConfig:
    name: str = key(MISSING, Text(), "the preset's name, shown in summaries")
    n_layer: int = key(MISSING, at_least(1), "transformer blocks; each preset sets its own")
    n_head: int = key(MISSING, at_least(1), "attention heads (`d_model` divisible by it); each preset sets its own")
    d_model: int = key(MISSING, at_least(1), "the residual stream's width; each preset sets its own")
    d_ff: Optional[int] = key(
        None,
        at_least(1),
        "MLP hidden width; null = 4 × d_model (`mlp=gelu`) or 8/3 × d_model rounded up to 64 (`mlp=swiglu`)",
    )
    max_seq_len: int = key(
        1024,
        at_least(1),
        "learned position embeddings; 1024 in the GPT-2 presets, 2048 in `gpt3-2.7b`",
    )
    vocab_size: Optional[int] = key(
        None,
        at_least(1),
        "null = the tokenizer's vocabulary size; must be at least the tokenizer's. The GPT-2 presets and `gpt3-2.7b` "
        "set GPT-2's 50257, `smollm2-135m` 49152 and `llama3.2-1b` 128256 (their tokenizers'); the tiny ones null",
    )
    dropout: float = key(
        0.0,
        fraction(),
        "on embeddings and residual branches. Each element's mask bit is a hash of the seed and its index in the "
        "unsplit tensor, so tensor/sequence parallel and recomputed blocks drop exactly what one process drops, no "
        "rank draws more than its own elements, and under `train.compile` the mask is fused into the block's kernel "
        "(data-parallel ranks draw independent masks; a compiled run draws its seeds through the compiler's "
        "random-number path, so its masks differ from an eager run's but are as reproducible)",
    )
    attention_dropout: float = key(
        0.0,
        fraction(),
        "on the attention weights, with the same split-invariant masks; > 0 materialises the (batch, heads, t, t) "
        "weights instead of the fused attention kernel: memory grows with t², so keep it for short contexts",
    )
    bias: bool = key(True, Flag(), "biases in Linear and LayerNorm, as GPT-2")
    vocab_multiple: int = key(
        64,
        at_least(1),
        "pad the vocabulary (embedding rows, head outputs) to a multiple of this; the padded logits are masked to "
        "-inf, so the loss is the unpadded model's; tensor parallelism needs it divisible by tp. The printed "
        "parameter count leaves the padding out",
    )
    # A model in Hugging Face format (GPT-2, Llama, Mixtral) to start from: a local directory or a hub id.
    init_from: Optional[str] = key(
        None,
        DirectoryOrHub(("config.json",)),
        "start from GPT-2, Llama or Mixtral weights in Hugging Face format (a local directory, or a hub name where the "
        "hub is reachable), read one tensor at a time into each rank's shards; its shape must match the preset (a "
        "mismatch names the keys). Use its tokenizer: `data.tokenizer.kind=hf data.tokenizer.name=<same>`",
    )
    # The Llama family's choices (GPT-2's are the defaults): conf/model/llama-tiny.yaml and the presets set them.
    norm: str = key("layernorm", OneOf(("layernorm", "rmsnorm")), "`layernorm` (GPT-2) or `rmsnorm` (Llama)")
    position: str = key(
        "learned",
        OneOf(("learned", "rope")),
        "`learned` (a position embedding, GPT-2) or `rope` (rotary on queries and keys, transformers' half-split "
        "convention)",
    )
    rope_theta: float = key(10000.0, positive(), "base of the rotary frequencies (SmolLM2 1e5, Llama 3 5e5)")
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # rope: type=llama3 stretches it
    mlp: str = key(
        "gelu",
        OneOf(("gelu", "swiglu")),
        "`gelu` (GPT-2's fc_in, GELU, fc_out) or `swiglu` (fc_out(silu(fc_gate(x)) · fc_in(x)); `model.d_ff` is its "
        "hidden width, null = 8/3·d_model rounded up to 64)",
    )
    n_kv_head: Optional[int] = key(
        None,
        at_least(1),
        "key/value heads: grouped-query attention when below `n_head` (must divide it; 1 = multi-query); null = "
        "`n_head`. Tensor parallelism splits them with their query heads, so tp must divide it",
    )
    tie_embeddings: bool = key(True, Flag(), "the LM head shares the token embedding's weights")
    norm_eps: float = key(1e-5, positive(), "epsilon of the norms")
    sliding_window: Optional[list[int]] = key(
        None,
        ListOf(at_least(0)),
        "attention windows, one per block in turn and repeated over the blocks: a block attends to each query's "
        "last N keys (0: all of them), e.g. `[1024,1024,1024,0]` (three local blocks, one global); within "
        "`train.attention=document`'s documents too; null: every block global (`model/documents.py`)",
    )
    moe: MoEGroupConfig = field(default_factory=MoEGroupConfig)
    lora: LoRAGroupConfig = field(default_factory=LoRAGroupConfig)


@dataclass
class TokenizerConfig:
    # data=prepared leaves these null: the store's manifest names its tokenizer, and a key set here must agree.
    kind: Optional[str] = key(
        "bpe",
        OneOf(catalog.TOKENIZER_KINDS),
        "`byte` (256 bytes + end-of-text, no files), `bpe` (byte-level BPE trained on the training stream and "
        "cached), `hf` (a transformers tokenizer)",
    )
    vocab_size: Optional[int] = key(
        4096,
        at_least(1),
        "`bpe`: the vocabulary to train; 8192 for `local`, 16384 for `hf`",
    )
    train_chars: Optional[int] = key(
        4_000_000,
        at_least(1),
        "`bpe`: characters of the training stream it is trained on; 10,000,000 for `local`, 20,000,000 for `hf`",
    )
    name: Optional[str] = key(None, DirectoryOrHub(TOKENIZER_FILES), "`hf`: a hub name (`gpt2`) or a local directory")


@dataclass
class DataConfig:
    source: str = key(
        MISSING,
        OneOf(catalog.DATA_SOURCES),
        "`stdlib`, `local`, `hf`, `prepared`, `mix` or `sft` (conversations for fine-tuning, `data/sft.py`): set by "
        "the `data` option",
    )
    path: Optional[str] = key(
        None,
        ExistingPath("glob"),
        "`local`: a file, a folder (searched recursively) or a glob of `.txt`, `.jsonl`, `.parquet`; `prepared`: the "
        "directory `llmtrain.data.prepare` wrote; `sft`: `.jsonl` / `.parquet` conversations (`messages` or "
        "`prompt` + `response`)",
    )
    name: Optional[str] = key(
        None, Text(), "`hf` (and `sft` without a `path`): the dataset's name on the hub (`HuggingFaceFW/fineweb-edu`)"
    )
    subset: Optional[str] = key(None, Text(), "`hf`: the dataset's configuration on the hub (e.g. `sample-10BT`)")
    split: str = key("train", Text(), "`hf`: the split to train on")
    val_split: Optional[str] = key(
        None,
        Text(),
        "`hf`: a validation split to use; null holds out `val_fraction` of the text",
    )
    val_path: Optional[str] = key(
        None,
        ExistingPath("glob"),
        "`local` and `sft`: validation files (a file, a folder or a glob); null holds out `val_fraction` of the text "
        "(of the conversations, for `sft`)",
    )
    val_fraction: float = key(
        0.02,
        Number(low=0, high=0.5, low_open=True, high_open=True),
        "share of the text held out for validation, in ~4 KB chunks (a long document gives that share of its chunks, "
        "spread through it; a short one is held out whole by a hash of its text): disjoint from training, the same on "
        "every run; 0.05 for `local` (a one-file corpus of ~1 MB validates with the defaults), 0.005 for `hf`",
    )
    text_field: str = key("text", Text(), "the jsonl / parquet / hub column holding the text")
    doc_shuffle_buffer: int = key(
        1000,
        at_least(0),
        "documents shuffled in a seeded buffer (and the file order, for local files); 10000 for `hf`",
    )
    window_shuffle_buffer: int = key(
        4096,
        at_least(0),
        "packed windows shuffled in a seeded buffer; 256 for `local`, 1024 for `hf`",
    )
    sources: Optional[list[Any]] = key(
        None,
        MixtureSources(),
        "`mix`: the prepared stores mixed, e.g. `[{name: web, path: data/web, weight: 3}, {name: code, path: "
        "data/code, weight: 1, max_epochs: 2}]`: each sample of the global order from the source furthest behind its "
        "share (weights are normalised), each source's windows in a seeded order per epoch; max_epochs caps repeats",
    )
    on_exhausted: str = key(
        "redistribute",
        OneOf(("redistribute", "stop")),
        "`mix`: when a source reaches its max_epochs, `redistribute` its share among the others in proportion to "
        "their weights (logged with the step), or `stop` the run there",
    )
    cache_dir: str = key("~/.cache/llmtrain", WritableDirectory(), "where trained BPE tokenizers are cached")
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)


def _degree(what: str) -> str:
    """A mesh degree's doc: what it splits, then the rule all five share."""
    return (
        f"{what}. A mesh degree (outer to inner: pp, dp_replicate, dp_shard, cp, tp): their product is the world "
        f"size, -1 on one of them = the remaining ranks; each layout sets its own"
    )


@dataclass
class ParallelConfig:
    layout: str = key(
        "single",
        OneOf(LAYOUT_CHOICES),
        f"the layout `parallel=<layout>` picked (a row of `llmtrain/catalog.py`'s LAYOUTS, [parallelism.md]"
        f"(parallelism.md)), or `{catalog.AUTO}` (the planner chooses one for the world it runs in, "
        f"[planner.md](planner.md))",
    )
    # Degrees of the mesh (outer to inner); -1 on one of them means "the remaining ranks"; 0 is refused.
    pp: int = key(1, MeshDegree(), _degree("pipeline parallelism: the blocks cut into stages, one per rank group"))
    dp_replicate: int = key(
        1,
        MeshDegree(),
        _degree(
            "data-parallel replicas, each holding the whole (or its dp_shard group's) state: DDP's and ZeRO-1's "
            "ranks, HSDP's replica groups across nodes"
        ),
    )
    dp_shard: int = key(
        1,
        MeshDegree(),
        _degree("data-parallel ranks that shard parameters, gradients and optimizer state (FSDP, ZeRO-2)"),
    )
    cp: int = key(
        1,
        MeshDegree(),
        _degree(
            "context parallelism: every sequence split over this many ranks, attention around a ring "
            "([moe-cp.md](moe-cp.md)); the FSDP layouts (`fsdp`, `zero2`, `hsdp`, `fsdp_tp`, `ddp_tp`) and the "
            "pipeline ones take it"
        ),
    )
    tp: int = key(
        1,
        MeshDegree(),
        _degree("tensor parallelism: each block's matrices split over this many ranks (+ sequence parallelism)"),
    )
    ep: int = key(
        1,
        at_least(1),
        "expert parallelism for mixture-of-experts models: each mixture's experts split over `ep` of the dp_shard × "
        "cp ranks (not a sixth degree: it regroups FSDP's ranks); must divide dp_shard × cp and "
        "`model.moe.num_experts`; the FSDP and pipeline layouts take it ([moe-cp.md](moe-cp.md))",
    )
    nproc: int = key(
        1,
        at_least(1),
        "workers `train.py` starts itself when not launched by torchrun or srun (ignored under them)",
    )
    max_restarts: int = key(
        0,
        at_least(0),
        "times `train.py` starts its workers again (all of them, resuming from the last complete checkpoint into the "
        "same run directory) after one crashed, was killed, hung or lost a peer; a stop signal, bad input or a "
        "diverged run ends the job at once. With `parallel.nproc=1` too: one worker. Under torchrun: "
        "`--max-restarts` ([slurm.md](slurm.md))",
    )
    reshard_after_forward: bool = key(
        True,
        Flag(),
        "FSDP: free gathered parameters after each block's forward (ZeRO-3) or keep them for backward (ZeRO-2, what "
        "`zero2` sets)",
    )
    cpu_offload: bool = key(
        False,
        Flag(),
        "FSDP: keep sharded parameters, gradients and optimizer state in host memory",
    )
    reduce_once_per_step: bool = key(
        False,
        Flag(),
        "FSDP with several micro-batches per step: accumulate each micro-batch's gradients unsharded (in fp32) and "
        "reduce-scatter once per step, a 1/micro-batches share of the gradient traffic for a full fp32 gradient of "
        "memory per rank (for slow links: PCIe without peer-to-peer); false: reduce-scatter every micro-batch. "
        "DDP, ZeRO-1 and pipelines already reduce once",
    )
    sequence_parallel: bool = key(
        False,
        Flag(),
        "tensor parallel: keep LayerNorm, residual and dropout activations sharded along the sequence "
        "(`train.seq_len` divisible by tp); `fsdp_tp`, `ddp_tp`, `pp_tp` and `3d` set true",
    )
    loss_parallel: bool = key(
        True,
        Flag(),
        "tensor parallel: cross-entropy on vocabulary shards; no rank holds full-vocabulary logits",
    )
    pp_schedule: str = key(
        "1f1b",
        OneOf(PIPELINE_SCHEDULES),
        "pipeline: `gpipe`, `1f1b`, `1f1b_reference` (written here), `interleaved_1f1b`, `zero_bubble`, `zbv`, "
        "`dualpipev`",
    )
    pp_stages_per_rank: int = key(
        1,
        at_least(1),
        "pipeline: virtual stages per rank; ≥ 2 for `interleaved_1f1b` / `zero_bubble`, exactly 2 for `zbv` / "
        "`dualpipev` (`model.n_layer` must split into pp × this many stages)",
    )
    microbatches: Optional[int] = key(
        None,
        at_least(1),
        "pipeline: micro-batches m per step; null = batch_size / (data-parallel × micro_batch_size). 1F1B-family "
        "schedules need m ≥ pp, V schedules m ≥ 2·pp, interleaved ones m a multiple of pp",
    )
    pp_edge_blocks: int = key(
        0,
        at_least(0),
        "pipeline: the first and last stage each get this many fewer blocks (the embedding and the head cost about a "
        "block each)",
    )


@dataclass
class OptimConfig:
    name: str = key(
        "adamw",
        OneOf(tuple(catalog.OPTIMIZERS)),
        "the `optim` option: `adamw` (every parameter) or `muon` (Muon on the blocks' weight matrices, each expert's "
        "separately; AdamW on embeddings, head, norms and biases)",
    )
    lr: float = key(1e-3, positive(), "peak learning rate (under `muon`, of the AdamW parameters)")
    lr_schedule: str = key(
        "cosine",
        OneOf(catalog.LR_SCHEDULES),
        "after the linear warmup: `cosine` (decay to lr × min_lr_ratio at the last step), `wsd` (the peak held, then "
        "a decay over the last `decay_fraction` of the steps: a run resumed from a stable-phase checkpoint with a "
        "larger `train.steps` continues as if planned that long) or `constant`",
    )
    min_lr_ratio: float = key(0.1, fraction(high_open=False), "`cosine` and `wsd` decay to lr × min_lr_ratio")
    decay_fraction: float = key(
        0.2,
        Number(low=0, high=1, low_open=True),
        "`wsd`: the share of `train.steps` the decay takes, at the end",
    )
    decay_shape: str = key(
        "1-sqrt",
        OneOf(tuple(catalog.DECAY_SHAPES)),
        "`wsd`: `linear`, `cosine` or `1-sqrt` (1 - sqrt(progress): Hägele et al. 2024's best)",
    )
    weight_decay: float = key(
        0.1,
        Number(low=0),
        "decoupled, on Linear weights and embeddings (and Muon's matrices); never on biases and norms",
    )
    beta1: float = key(0.9, fraction(), "AdamW's decay of the gradient's running mean (Muon's AdamW groups too)")
    beta2: float = key(0.95, fraction(), "AdamW's decay of the squared gradient's running mean")
    eps: float = key(1e-8, positive(), "AdamW's epsilon, added to the root of the second moment")
    warmup_steps: int = key(20, at_least(0), "linear warmup steps")
    grad_clip: float = key(1.0, Number(low=0), "clip the global gradient norm; 0 disables")
    state_bits: int = key(
        32,
        OneOf((32, 8)),
        "bits per element of AdamW's two moments: `32`, or `8` (torchao's 8-bit AdamW, the `fp8` extra: 2 bytes a "
        "parameter instead of 8; checkpoints keep them in fp32 and reshard across layouts; a checkpoint of one setting "
        "refuses the other). Not with `optim=muon` or `parallel=zero1`",
    )
    offload: bool = key(
        False,
        Flag(),
        "AdamW's moments, an fp32 copy of the weights and the update in host memory (`optim/offload.py`): 8 bytes a "
        "parameter less on the device, 12 more on the host, gradients down and weights up the host link each step. "
        "Not with `optim=muon`, `optim.state_bits=8` or `parallel.cpu_offload` (which offloads the state already)",
    )
    muon_lr: Optional[float] = key(
        None,
        positive(),
        "`muon`: peak learning rate of the matrices; null = `lr` (their updates are scaled to AdamW's RMS, so "
        "AdamW's rate carries over)",
    )
    momentum: float = key(0.95, fraction(), "`muon`: momentum of the matrices' gradients")
    nesterov: bool = key(True, Flag(), "`muon`: orthogonalise the Nesterov look-ahead rather than the momentum")
    ns_steps: int = key(5, at_least(1), "`muon`: Newton-Schulz iterations (in bf16 where the run computes in bf16)")
    update_rms: float = key(
        0.2,
        positive(),
        "`muon`: the RMS of each matrix's update per unit of learning rate (lr × update_rms × sqrt(max(rows, "
        "cols)) times the orthogonalised matrix); 0.2 matches AdamW's, Moonlight's rule",
    )
    whole_matrices: str = key(
        "spread",
        OneOf(("spread", "gather")),
        "`muon` under sharding: `spread` sends each split matrix whole to one of the ranks sharing it (all-to-all), "
        "orthogonalises it there and sends the pieces back; `gather` has every rank gather and orthogonalise every "
        "matrix it holds a piece of. A matrix split two ways (FSDP × tensor parallel) is always gathered",
    )


@dataclass
class WandbConfig:
    mode: str = key(
        "auto",
        OneOf(("auto", "online", "offline", "disabled")),
        "`auto`: online when a W&B key is configured (`WANDB_API_KEY` or `wandb login`), offline otherwise; `online`; "
        "`offline`; `disabled`",
    )
    project: str = key("llmtrain", Text(), "W&B project")
    entity: Optional[str] = key(None, Text(), "W&B user or team; null = the key's default")
    name: Optional[str] = key(
        None,
        Text(),
        "run name; null = the run directory (a sweep job: sweep directory + its overrides)",
    )
    group: Optional[str] = key(None, Text(), "run group; null = the sweep directory for `-m` sweeps, none otherwise")


@dataclass
class LoggingConfig:
    log_every: int = key(10, at_least(1), "steps between console lines when there is no progress bar")
    progress: str = key(
        "auto",
        OneOf(("auto", "bar", "lines")),
        "`auto`: a progress bar on a terminal, log lines otherwise; `bar`; `lines`",
    )
    straggler_threshold: float = key(
        0.2,
        Number(low=0),
        "on logging steps (every `log_every`) the ranks compare their busy time (the step less the waits in "
        "collectives): `slowest_rank` and `straggler_lag` in the metrics, and a warning for a rank its peers waited "
        "for longer than this fraction of a step 3 times in a row; 0 = no check",
    )
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainConfig:
    steps: int = key(300, at_least(1), "optimizer steps")
    batch_size: int = key(32, at_least(1), "global batch: sequences per optimizer step, over all data-parallel ranks")
    micro_batch_size: int = key(
        8,
        at_least(1),
        "sequences per rank per forward/backward; gradient accumulation = batch_size / (micro_batch_size × "
        "data-parallel ranks)",
    )
    seq_len: int = key(128, at_least(1), "tokens per sequence, at most `model.max_seq_len`")
    attention: str = key(
        "causal",
        OneOf(catalog.ATTENTION_MODES),
        "`causal`: every token attends to all before it in its packed window, across documents; `document`: only "
        "to those of its own document (a document ends at the tokenizer's end-of-text token), with positions "
        "restarting at each document: FlexAttention on CUDA, SDPA with a mask on CPU, the ring under context "
        "parallelism (`model/documents.py`)",
    )
    score_after_eos: bool = key(
        True,
        Flag(),
        "score the prediction made at each end-of-text token (the next packed document's first token); `false`: "
        "leave it out of the loss, whose mean is then over the scored targets of the whole global batch. Under "
        "`train.attention=document` nothing that position sees is of the document it would predict",
    )
    eval_every: int = key(50, at_least(0), "validate every N steps and at the last step; 0 disables")
    eval_batches: int = key(
        2,
        at_least(1),
        "global batches of held-out windows in one validation: the same windows every time and for every layout",
    )
    precision: str = key(
        "auto",
        OneOf(("auto", "bf16", "fp32")),
        "`auto`: bf16 on CUDA, fp32 on CPU; `bf16`; `fp32`. bf16 is one policy (`parallel/precision.py`, "
        "torchtitan's): where FSDP applies, its mixed precision alone (bf16 copies of the fp32 weights for compute, "
        "gradients reduced in fp32), elsewhere autocast over fp32 weights; losses in fp32. Layouts agree to 1e-5 in "
        "fp32 (CPU tests); in bf16 `gpu_check` holds each layout to 3% of one GPU's per-step loss (a stated bound, "
        "not yet measured on a GPU); fp32 matmuls use TF32 on GPUs",
    )
    device: str = key("auto", OneOf(("auto", "cpu", "cuda")), "`auto`: CUDA when visible, else CPU; `cpu`; `cuda`")
    save_model: bool = key(
        True,
        Flag(),
        "write the final weights as one full state dict, `model.pt`, in the run directory",
    )
    activation_checkpointing: str = key(
        "none",
        OneOf(catalog.RECOMPUTE_MODES),
        "`full`: recompute each block in backward (keeps only block inputs); `selective`: keep matmul, attention "
        "and communication outputs, recompute the cheap ops between them",
    )
    compile: bool = key(
        False,
        Flag(),
        "`torch.compile` each transformer block (on GPU; compiling on CPU is slow to start); the end summary and "
        "`summary.json` (`compiled_graphs`) count the graphs compiled",
    )
    float8: str = key(
        "none",
        OneOf(catalog.FLOAT8_RECIPES),
        "`tensorwise` or `rowwise`: the blocks' Linear layers compute in float8 (torchao, the `fp8` extra; FP8 "
        "tensor cores: sm_89+, emulated on CPU). `tensorwise` also all-gathers FSDP weights and tensor-parallel "
        "activations in float8 (`parallel/float8.py`); `none`: the compute dtype",
    )
    max_bad_steps: int = key(3, at_least(1), "consecutive non-finite steps before the run stops")
    hang_timeout: Optional[float] = key(
        None,
        Number(low=0),
        "seconds a rank may make no progress before every rank writes its stacks and collectives to "
        "`<run dir>/hang/` and the job exits 76 (requeued by launch/slurm.sbatch); validation, `eval.tasks` and "
        "checkpoints get 10x; 0 = off; null = on GPUs 20x the median of the first steps (at least 300 s), off on CPUs",
    )


@dataclass
class EvalConfig:
    """Downstream tasks scored in the training loop (llmtrain/data/tasks.py, llmtrain/train/downstream.py)."""

    tasks: Optional[list[str]] = key(
        None,
        ListOf(ExistingPath("file")),
        "multiple-choice task files (jsonl: context, choices, label; HellaSwag's ctx, endings, label too), each scored "
        "every `eval.every` steps and at the end: `eval/<task>/acc` (the choice of greatest log-likelihood) and "
        "`eval/<task>/acc_norm` (greatest log-likelihood per character of the choice), as lm-eval defines them; the "
        "examples split over the data-parallel ranks",
    )
    every: Optional[int] = key(None, at_least(1), "steps between task evaluations; null = `train.eval_every`")
    limit: Optional[int] = key(None, at_least(1), "examples scored per task (the file's first); null = all")


@dataclass
class ProfileConfig:
    steps: Optional[list[int]] = key(
        None,
        StepSpan(),
        "`[first, last]`: record those training steps with torch.profiler: a Chrome trace per rank in `<run "
        "dir>/profile/` (open in chrome://tracing or ui.perfetto.dev; a W&B artifact when logging online) and the "
        "busiest operators in the end summary; null: no profiling",
    )
    memory: bool = key(
        False,
        Flag(),
        "record the CUDA allocator's history and write `<run dir>/profile/memory-rank<r>.pickle` (drag into "
        "pytorch.org/memory_viz) on an out-of-memory error or at the end; nothing on CPU",
    )


@dataclass
class CheckpointConfig:
    every: int = key(0, at_least(0), "also save every N steps (0: only at the end and on preemption)")
    every_minutes: float = key(
        15,
        Number(low=0),
        "also save when this many minutes have passed since the last save (rank 0's clock, agreed at the step's "
        "read), so a crash loses at most that much; only the newest of these is kept beside `every`'s; 0 = off. "
        "15: an async save of GPT-2 124M blocks this 2-core CPU 3.4 s (a written one 7 s), under 1% of 15 minutes",
    )
    dir: Optional[str] = key(
        None,
        WritableDirectory(),
        "null = `<run dir>/checkpoints`; a run given a directory with checkpoints resumes from it",
    )
    keep: int = key(2, at_least(1), "complete checkpoints kept, newest first")
    async_save: bool = key(False, Flag(), "DCP async save: training continues while shards are written")
    resume: str = key(
        "auto",
        CheckpointSource(),
        "`auto`: the latest complete checkpoint in `checkpoint.dir`, if any; `none`; or a checkpoint path",
    )


@dataclass
class HardwareConfig:
    """The machines a run is planned for (conf/hardware/): what the planner's memory and time estimates use."""

    name: str = key(MISSING, Text(), "the machine description (`conf/hardware/<name>.yaml`)")
    nodes: int = key(1, at_least(1), "nodes")
    gpus_per_node: int = key(1, at_least(1), "devices (ranks) per node")
    device_memory_gib: Optional[float] = key(
        None,
        positive(),
        "memory of one device in GiB; null (cpu): the host's memory shared out over the ranks of the node",
    )
    intra_node_gbps: float = key(
        MISSING,
        positive(),
        "GB/s per device, one direction, to the other devices of its node (cpu: gloo's all-reduce bus bandwidth "
        "measured by `comm_bench` on a 2-core machine)",
    )
    inter_node_gbps: float = key(
        MISSING,
        positive(),
        "GB/s per device, one direction, across nodes (cpu: 1 Gbit/s Ethernet)",
    )
    peak_tflops: Optional[float] = key(
        None,
        positive(),
        "dense bf16 TFLOP/s (fp32 accumulate) per device; null: unknown (CPUs)",
    )
    mfu: float = key(
        0.4,
        Number(low=0, high=1, low_open=True),
        "fraction of `peak_tflops` a transformer's training compute reaches here, recomputation included (the "
        "planner's predicted step times); a100x8's and h100x8's are the median of published runs "
        "([planner.md](planner.md#held-to-published-runs))",
    )
    peer_to_peer: bool = key(
        True,
        Flag(),
        "devices reach each other directly (NVLink, PCIe P2P) rather than through host memory",
    )
    device_name: Optional[str] = key(
        None,
        Text(),
        "part of the name torch gives the device this describes (`torch.cuda.get_device_name()`, e.g. `H200`): a "
        "run on such a GPU plans with this config whatever `hardware` says; null: no GPU (cpu)",
    )


@dataclass
class PlanConfig:
    """The planner's knobs (llmtrain.tools.plan; parallel=auto reads `measured`, `mfu` and `reserved_gib`)."""

    world_size: Optional[int] = key(
        None,
        at_least(1),
        "ranks the planner plans for; null: `hardware.nodes` × `hardware.gpus_per_node` (`parallel=auto`: the real "
        "world)",
    )
    # A float, so that 7.5e9 is accepted as the whole number it is (an int key refuses any float).
    parameters: Optional[float] = key(
        None,
        at_least(1),
        'plan model states for this many parameters instead of the model\'s ("what if"), e.g. 7.5e9',
    )
    param_bytes: float = key(2, positive(), "bytes per parameter of the weights (bf16; llmtrain itself keeps fp32: 4)")
    grad_bytes: float = key(2, positive(), "bytes per parameter of the gradients (bf16; llmtrain: 4)")
    optimizer_bytes: float = key(
        12,
        positive(),
        "bytes per parameter of the optimizer state (fp32 master copy + 2 AdamW moments; llmtrain: 8); under "
        "`optim=muon` the blocks' weight matrices keep one fp32 moment fewer (4 bytes less)",
    )
    layouts: str = key(
        "dp",
        OneOf(("dp", "all")),
        "`dp`: the data-parallel layouts; `all`: also tensor, pipeline and 3-D layouts",
    )
    measured: Optional[str] = key(
        None,
        ExistingPath("file"),
        "a `comm_bench.csv` whose measured bus bandwidths replace the hardware's link numbers; null: the planner "
        "tool uses the hardware's, and `parallel=auto` on more than one rank times the machine's collectives at start "
        "(a few seconds, cached in `data.cache_dir/links/` per host, world size and device)",
    )
    reserved_gib: float = key(
        1.0,
        Number(low=0),
        "per device, kept out of the plan: CUDA context, NCCL buffers, allocator fragmentation",
    )
    out: str = key("plan.json", Text(), "where `llmtrain.tools.plan` writes its JSON")


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
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = key(
        1337,
        Number(low=0, high=2**32 - 1, whole=True),
        "seeds the weights, the data order and dropout: same seed + same global batch = same run",
    )


@dataclass
class PrepareConfig:
    out: Optional[str] = key(
        None,
        WritableDirectory(),
        "required: the store's directory. Written to `<out>.partial` and renamed when complete, so an interrupted run "
        "leaves nothing that looks complete; a second run on the same inputs (config, file sizes and times) does "
        "nothing; a store of other inputs is never overwritten",
    )
    num_proc: int = key(
        1,
        at_least(1),
        "tokenising processes; the store is the same for any number. With 1, a fast (Rust) tokenizer already spreads "
        "each batch over every core: on 2 cores the stdlib corpus prepared at 492k tokens/s with the trained BPE "
        "(390k with 2 processes), 407k with a transformers tokenizer (398k). More processes pay off for a tokenizer "
        "without a fast version, or on many cores where the one reading process becomes the limit",
    )


@dataclass
class PrepareRootConfig:
    data: DataConfig = MISSING
    prepare: PrepareConfig = field(default_factory=PrepareConfig)


@dataclass
class EvaluateRootConfig(RootConfig):
    """`python -m llmtrain.evaluate`: training's keys (the layout, precision, hardware; the model comes from the
    checkpoint) and lm-evaluation-harness's."""

    tasks: Optional[list[str]] = key(
        None,
        ListOf(Text()),
        "required: lm-eval tasks, by name (`hellaswag`, from the hub) or as a task yaml file (local and offline: its "
        "`task:` is the name, its directory is searched for the tasks it names)",
    )
    limit: Optional[int] = key(None, at_least(1), "documents evaluated per task (the first); null = all")
    num_fewshot: Optional[int] = key(None, at_least(0), "examples shown before each question; null = the task's own")
    bootstrap_iters: int = key(100000, at_least(0), "resamples for the metrics' standard errors (0: none)")
    output: Optional[str] = key(
        None, Text(), "write lm-eval's results (every metric, the task configs) as JSON to this file; null = print only"
    )


@dataclass
class DryRunConfig:
    world_size: int = key(8, at_least(1), "the job's ranks, e.g. 1024: one process stands in for one of them")
    rank: Optional[int] = key(
        None,
        at_least(0),
        "which rank to be (its pipeline stage, its place in the mesh), below world_size; null: the first rank of "
        "each pipeline stage, one after another (one rank when the layout does not pipeline)",
    )
    steps: int = key(
        2, at_least(2), "training steps to run; the last is measured (the first also allocates optimizer state)"
    )
    output: Optional[str] = key(None, Text(), "also write what was measured and planned as JSON to this file")


@dataclass
class DryRunRootConfig(RootConfig):
    """`python -m llmtrain.tools.dry_run`: training's keys and the job the one process stands in for."""

    dry_run: DryRunConfig = field(default_factory=DryRunConfig)


def evaluation_keys() -> set[str]:
    """The keys `python -m llmtrain.evaluate` adds to training's."""
    return {f.name for f in dataclasses.fields(EvaluateRootConfig)} - {f.name for f in dataclasses.fields(RootConfig)}


def register_schemas() -> None:
    ConfigStore.instance().store(name="train_schema", node=RootConfig)
    ConfigStore.instance().store(name="evaluate_schema", node=EvaluateRootConfig)
    ConfigStore.instance().store(name="prepare_schema", node=PrepareRootConfig)
    ConfigStore.instance().store(name="dry_run_schema", node=DryRunRootConfig)
    register_resolvers()
    if not OmegaConf.has_resolver("llmtrain_keys"):  # `--help`: ${llmtrain_keys:train} in conf/hydra/help/
        OmegaConf.register_new_resolver("llmtrain_keys", _keys_help)


def _keys_help(which: str, _root_: DictConfig) -> str:
    schema = RootConfig if which == "train" else PrepareRootConfig
    return keys_help(_root_, schema)


def keys_help(cfg: DictConfig, schema: type, only: Collection[str] | None = None) -> str:
    """Per key (of `only` where given) its composed value and what it accepts, then what it does on a line below."""
    rows = []
    sections = {f.name: _plain(cfg[f.name]) if isinstance(cfg[f.name], DictConfig) else cfg[f.name]
                for f in dataclasses.fields(schema)}  # fmt: skip
    for dotted, item, nullable in schema_fields(schema):
        if only is not None and dotted not in only:
            continue
        missing, value = _lookup(sections, dotted)
        shown = "???" if missing else OmegaConf.to_yaml({"v": value})[3:].strip()  # null, true, 0.001 as typed
        accepts = item.metadata["domain"].accepts() + (", or null" if nullable else "")
        rows.append((f"{dotted}={shown}", accepts, item.metadata["doc"]))
    width = max(len(setting) for setting, _, _ in rows) + 3
    wrap = functools.partial(textwrap.fill, width=116, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(f"  {setting:<{width}} {accepts}\n{wrap(doc)}" for setting, accepts, doc in rows)


def schema_fields(schema: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, bool]]:
    """(dotted key, its field, whether it may be null) for every leaf of a schema dataclass."""
    hints = typing.get_type_hints(schema)
    for item in dataclasses.fields(schema):
        kind = hints[item.name]
        args = typing.get_args(kind)
        inner = next((a for a in args if a is not type(None)), kind)  # Optional[X] -> X
        if dataclasses.is_dataclass(inner):
            yield from schema_fields(inner, f"{prefix}{item.name}.")  # type: ignore[arg-type]
        else:
            yield f"{prefix}{item.name}", item, type(None) in args


@functools.cache
def schema_keys(schema: type) -> tuple[tuple[str, Domain | None], ...]:
    """Every leaf key of a schema dataclass, dotted, with its declared domain (None: none declared)."""
    return tuple((dotted, item.metadata.get("domain")) for dotted, item, _ in schema_fields(schema))


# Keys an earlier version had -> their names now: a config that still sets one is told the new name.
RENAMED_KEYS = {
    "parallel.strategy": "parallel.layout",
    "optim.schedule": "optim.lr_schedule",
    "plan.mfu": "hardware.mfu",
}


def unknown_key_line(name: str, keys: list[str]) -> str:
    """`name` is not among `keys` (dotted leaf keys): its new name if it was renamed, else the closest key of the
    same section, and the section's keys."""
    if name in RENAMED_KEYS:
        return f"{name} is now {RENAMED_KEYS[name]}: set {RENAMED_KEYS[name]} instead"
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
    validate_optim(cfg.optim)
    layout = catalog.LAYOUTS.get(cfg.parallel.layout)
    if layout and layout.mechanism.flat_optimizer and (cfg.optim.offload or cfg.optim.state_bits != 32):
        setting = "optim.offload=true" if cfg.optim.offload else f"optim.state_bits={cfg.optim.state_bits}"
        raise ConfigError(
            f"{setting} is not available with parallel={cfg.parallel.layout}, whose optimizer updates flat fp32 "
            f"slices of its own: use parallel=zero2 or fsdp (sharded per parameter)"
        )
    if cfg.optim.offload and cfg.parallel.cpu_offload:
        raise ConfigError(
            "optim.offload=true and parallel.cpu_offload=true: FSDP's CPU offload keeps the optimizer state on the "
            "host already; set optim.offload=false"
        )
    if t.float8 != "none":
        require_extra("torchao", f"train.float8={t.float8}", "fp8")
    validate_lora(cfg)
    if cfg.profile.steps is not None and cfg.profile.steps[1] > t.steps:
        raise ConfigError(
            f"profile.steps={list(cfg.profile.steps)} ends after the run's train.steps={t.steps}: profile steps "
            f"within 1..{t.steps}"
        )
    validate_data(cfg.data)


def validate_lora(cfg) -> None:
    """Low-rank adapters against the settings that would undo them."""
    rank, float8 = cfg.model.lora.rank, cfg.train.float8
    if rank and float8 != "none":
        raise ConfigError(
            f"train.float8={float8} with model.lora.rank={rank}: float8 layers would replace the adapted ones; set "
            f"train.float8=none to train adapters"
        )


def validate_optim(optim) -> None:
    if optim.offload and (optim.name != "adamw" or optim.state_bits != 32):
        other = f"optim={optim.name}" if optim.name != "adamw" else f"optim.state_bits={optim.state_bits}"
        raise ConfigError(f"optim.offload=true runs AdamW's fp32 update on the host, not {other}: set one of them off")
    if optim.state_bits != 32:
        if optim.name != "adamw":
            raise ConfigError(
                f"optim.state_bits={optim.state_bits} quantises AdamW's moments, but optim={optim.name} keeps its "
                f"own: set optim.state_bits=32 or optim=adamw"
            )
        require_extra("torchao", f"optim.state_bits={optim.state_bits}", "fp8")


def require_extra(module: str, setting: str, extra: str) -> None:
    """A one-line error naming the extra to install when `setting` needs `module` and it is absent."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{setting} needs {module}, which is not installed: pip install -e '.[{extra}]'")


def reads_prepared_stores(data_cfg) -> bool:
    """data=prepared and data=mix: token stores llmtrain.data.prepare wrote, of which each rank reads its rows (the
    other sources are streamed and tokenised while training)."""
    return data_cfg.source in ("prepared", "mix")


def validate_data(d) -> None:
    """The data keys' domains and the rules between them (also what llmtrain.data.prepare checks)."""
    check_domains(d, DataConfig, "data.")
    if d.source in ("local", "prepared") and not d.path:
        what = "<file, folder or glob>" if d.source == "local" else "<directory written by llmtrain.data.prepare>"
        raise ConfigError(f"data.path is not set: data={d.source} needs data.path={what}")
    if d.source in ("local", "sft") and d.path:
        _check_local_files("data.path", d.path)
        if d.val_path is not None:
            _check_local_files("data.val_path", d.val_path)
    elif d.val_path is not None:
        raise ConfigError(
            f"data.val_path is for data=local (data={d.source}): use data.val_split for data=hf, "
            f"or unset data.val_path to hold out data.val_fraction"
        )
    if d.source == "mix" and not d.sources:
        raise ConfigError(
            "data.sources is not set: data=mix needs data.sources=[{name: ..., path: <prepared store>, weight: ...}, "
            "...]"
        )
    if d.source != "mix" and d.sources:
        raise ConfigError(f"data.sources is for data=mix (data={d.source}): choose data=mix or unset data.sources")
    if d.source == "hf" and not d.name:
        raise ConfigError("data.name is not set: data=hf needs data.name=<dataset on the hub>")
    _validate_conversations(d)
    if reads_prepared_stores(d):
        return  # the stores' manifests fix the tokenizer and the split: llmtrain/data/prepared.py checks them
    if d.tokenizer.kind is None:
        raise ConfigError(f"data.tokenizer.kind is not set: set it to one of {', '.join(catalog.TOKENIZER_KINDS)}")
    if d.tokenizer.kind == "hf" and not d.tokenizer.name:
        raise ConfigError("data.tokenizer.name is not set: data.tokenizer.kind=hf needs a tokenizer name or path")
    if d.tokenizer.kind == "bpe" and (d.tokenizer.vocab_size or 0) < 512:
        raise ConfigError(
            f"data.tokenizer.vocab_size={d.tokenizer.vocab_size} is too small for a byte-level BPE: use at least 512"
        )


def _validate_conversations(d) -> None:
    """data=sft: conversations from files or the hub, rendered by a transformers tokenizer's chat template."""
    if d.source != "sft":
        return
    if not d.path and not d.name:
        raise ConfigError(
            "data=sft needs conversations: data.path=<.jsonl or .parquet files> or data.name=<dataset on the hub>"
        )
    if d.tokenizer.kind != "hf":
        raise ConfigError(
            f"data.tokenizer.kind={d.tokenizer.kind}: data=sft renders conversations with a chat template, which only "
            f"a transformers tokenizer has: set data.tokenizer.kind=hf data.tokenizer.name=<the model's directory>"
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
