"""`validate`: every key against its domain, then the rules that span several keys (divisibility, lengths, the
extras a setting needs), each refusal a ConfigError of one line that names the key and the fix.

Cheap and torch-free, so train.py runs it before torch loads. Which files data.path holds is the data side's check
(llmtrain/data/files.py), run after it where files are read."""

from __future__ import annotations

import importlib.util

from llmtrain import catalog
from llmtrain.config.data import DataConfig, reads_local_files, reads_prepared_stores, reward_names
from llmtrain.config.keys import check_domains
from llmtrain.config.schema import RootConfig
from llmtrain.errors import ConfigError


def validate(cfg) -> None:
    """Every key against its domain, then the rules that span several keys; raises ConfigError on the first
    problem. Cheap and torch-free: it runs before any process group, model or data. Which files data.path and
    data.val_path hold is llmtrain.data.files.check_data_files's to say, run after this where files are read."""
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
    if m.head_dim is None and m.d_model % m.n_head:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}: "
            f"choose a d_model that is a multiple of n_head, or set model.head_dim"
        )
    if m.n_kv_head is not None and (m.n_kv_head < 1 or m.n_head % m.n_kv_head):
        raise ConfigError(
            f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head}: each key/value head serves a whole "
            f"group of query heads (n_kv_head=n_head: multi-head, 1: multi-query)"
        )
    head_size = m.head_dim or m.d_model // m.n_head
    if m.position == "rope" and head_size % 2:
        size = f"model.head_dim={head_size}" if m.head_dim else f"the head size d_model / n_head = {head_size}"
        raise ConfigError(
            f"model.position=rope rotates pairs of dimensions but {size} is odd: choose an even head size"
        )
    if m.rope_scaling.type == "llama3":
        validate_rope_scaling(m.rope_scaling)
    if m.moe.num_experts:
        validate_moe(m.moe, m.n_layer)
    validate_optim(cfg.optim)
    validate_flat_slices(cfg.optim, cfg.parallel.layout)
    if cfg.optim.offload and cfg.parallel.cpu_offload:
        raise ConfigError(
            "optim.offload=true and parallel.cpu_offload=true: FSDP's CPU offload keeps the optimizer state on the "
            "host already; set optim.offload=false"
        )
    if t.float8 != "none":
        require_extra("torchao", f"train.float8={t.float8}", "fp8")
    validate_lora(cfg)
    validate_objective(cfg)
    if cfg.profile.steps is not None and cfg.profile.steps[1] > t.steps:
        raise ConfigError(
            f"profile.steps={list(cfg.profile.steps)} ends after the run's train.steps={t.steps}: profile steps "
            f"within 1..{t.steps}"
        )
    validate_data(cfg.data)


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


def validate_lora(cfg) -> None:
    """Low-rank adapters against the settings that would undo them."""
    rank, float8 = cfg.model.lora.rank, cfg.train.float8
    experts = [t for t in cfg.model.lora.targets if t in catalog.EXPERT_LORA_TARGETS or t in
               catalog.EXPERT_LORA_TARGETS.values()]  # fmt: skip
    if rank and experts and cfg.parallel.tp != 1:
        raise ConfigError(
            f"model.lora.targets={experts} adapts the routed experts, which tensor parallelism splits by hidden "
            f"units (parallel.tp={cfg.parallel.tp}) and their adapters not yet: use parallel=fsdp with parallel.ep, "
            f"or leave the experts out of model.lora.targets"
        )
    if rank and float8 != "none":
        raise ConfigError(
            f"train.float8={float8} with model.lora.rank={rank}: float8 layers would replace the adapted ones; set "
            f"train.float8=none to train adapters"
        )
    if cfg.model.quantize_base != "none":
        if not rank:
            raise ConfigError(
                f"model.quantize_base={cfg.model.quantize_base} freezes the base in 4 bits, which cannot train: set "
                f"model.lora.rank (16, say) to train adapters beside it, or model.quantize_base=none"
            )
        require_extra("torchao", f"model.quantize_base={cfg.model.quantize_base}", "fp8")


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


def validate_flat_slices(optim, layout_name: str) -> None:
    """A layout whose optimizer updates flat fp32 slices of its own (ZeRO-1's) runs an optimizer with a form over
    them, in fp32 on the device."""
    layout = catalog.LAYOUTS.get(layout_name)
    if not (layout and layout.mechanism.flat_optimizer):
        return
    catalog.zero1_form(optim.name)  # a ConfigError where the optimizer has no such form
    if optim.offload or optim.state_bits != 32:
        setting = "optim.offload=true" if optim.offload else f"optim.state_bits={optim.state_bits}"
        raise ConfigError(
            f"{setting} is not available with parallel={layout_name}, whose optimizer updates flat fp32 "
            f"slices of its own: use parallel=zero2 or fsdp (sharded per parameter)"
        )


def require_extra(module: str, setting: str, extra: str) -> None:
    """A one-line error naming the extra to install when `setting` needs `module` and it is absent."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{setting} needs {module}, which is not installed: pip install -e '.[{extra}]'")


def validate_data(d) -> None:
    """The data keys' domains and the rules between them (also what llmtrain.data.prepare checks); the files the
    paths name are llmtrain.data.files.check_data_files's."""
    check_domains(d, DataConfig, "data.")
    source = catalog.data_source(d.source)
    if source.needs is not None and not getattr(d, source.needs):
        needed = f"data.{source.needs}"
        raise ConfigError(f"{needed} is not set: data={d.source} needs {needed}={source.needs_what}")
    if d.val_path is not None and not reads_local_files(d):
        raise ConfigError(
            f"data.val_path is for data=local (data={d.source}): use data.val_split for data=hf, "
            f"or unset data.val_path to hold out data.val_fraction"
        )
    if source.needs != "sources" and d.sources:
        raise ConfigError(f"data.sources is for data=mix (data={d.source}): choose data=mix or unset data.sources")
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
    """A source of records (conversations, preference pairs, prompts) from files or the hub; rendered by a chat
    template where the source says so, which only a transformers tokenizer has."""
    source = catalog.data_source(d.source)
    if source.records is None:
        return
    if not d.path and not d.name:
        raise ConfigError(
            f"data={d.source} needs {source.records}: data.path=<.jsonl or .parquet files> or data.name=<dataset on "
            f"the hub>"
        )
    if source.chat_template and d.tokenizer.kind != "hf":
        raise ConfigError(
            f"data.tokenizer.kind={d.tokenizer.kind}: data={d.source} renders {source.records} with a chat template, "
            f"which only a transformers tokenizer has: set data.tokenizer.kind=hf data.tokenizer.name=<the model's "
            f"directory>"
        )


def validate_objective(cfg) -> None:
    """train.objective against the data: an objective of its own source (DPO's pairs, GRPO's prompts) exactly on
    that source, and what that objective needs besides."""
    objective = catalog.objective_of(cfg.train.objective, cfg.data.source)
    needed = catalog.OBJECTIVES[objective].data
    if objective not in catalog.objectives_fed(cfg.data.source):
        wanted = f"data={needed}" if needed else f"an objective of data={cfg.data.source}"
        raise ConfigError(
            f"train.objective={objective} with data={cfg.data.source}: it needs {wanted}; use train.objective=auto "
            f"(dpo on data=preference, grpo on data=rl, next_token on any other data)"
        )
    if not catalog.OBJECTIVES[objective].loss_is_progress and cfg.train.on_spike != "log":
        raise ConfigError(
            f"train.on_spike={cfg.train.on_spike}: train.objective={objective}'s loss is not a measure of progress "
            f"(signed, centred on 0), so no loss of it is a spike and none is judged: use train.on_spike=log "
            f"(non-finite steps are still skipped)"
        )
    if (rules := catalog.data_source(cfg.data.source).rules) is not None:
        catalog.imported(rules)(cfg)


def preference_rules(cfg) -> None:
    """Pairs that no split parts, and a reference to compare with (the base, adapters off)."""
    if cfg.train.micro_batch_size % 2:
        raise ConfigError(
            f"train.micro_batch_size={cfg.train.micro_batch_size}: data=preference trains pairs (a chosen and a "
            f"rejected answer, a row each) that must share a micro-batch: set an even train.micro_batch_size"
        )
    if not cfg.model.lora.rank:
        raise ConfigError(
            "data=preference compares the model with its reference, the base with the adapters switched off: set "
            "model.lora.rank (16, say); a full fine-tune's frozen reference copy is not built"
        )


def rl_rules(cfg) -> None:
    """Whole groups of completions, room for them after a prompt, rewards that can score, a reference where the
    KL term asks for one, and the training rows read as the sampler read them."""
    rl, t, d = cfg.rl, cfg.train, cfg.data
    if t.attention == "document":
        raise ConfigError(
            "train.attention=document: data=rl trains on the log-probabilities the completions were drawn with, "
            "over the whole prompt, and document masking would cut a prompt at every end-of-text or end-of-turn "
            "token a chat template puts in it (off-policy): use train.attention=causal"
        )
    if t.batch_size % rl.group_size:
        fits = t.batch_size // rl.group_size * rl.group_size or rl.group_size
        raise ConfigError(
            f"train.batch_size={t.batch_size} completions do not hold whole groups of rl.group_size={rl.group_size}: "
            f"set train.batch_size to a multiple of {rl.group_size} ({fits}, say) or change rl.group_size"
        )
    if rl.max_new_tokens >= t.seq_len:
        raise ConfigError(
            f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in train.seq_len={t.seq_len} tokens "
            f"(a prompt and its completion share a row): raise train.seq_len or lower rl.max_new_tokens"
        )
    rewards = reward_names(d)
    if not rewards:
        raise ConfigError(
            f"data=rl scores completions with data.reward, which is not set: e.g. data.reward=exact_number (built-"
            f"ins: {', '.join(catalog.REWARDS)}), data.reward=my_module:my_reward or a list of them"
        )
    if d.reward_weights is not None and len(d.reward_weights) != len(rewards):
        raise ConfigError(
            f"data.reward_weights holds {len(d.reward_weights)} weights for {len(rewards)} rewards "
            f"(data.reward={rewards}): give one weight per reward, or null for 1 each"
        )
    for name in rewards:
        needs = catalog.REWARDS[name].needs if name in catalog.REWARDS else None
        if needs is not None:
            module, extra = needs
            require_extra(module, f"data.reward={name}", extra)
    if d.tokenizer.kind == "bpe":
        raise ConfigError(
            "data.tokenizer.kind=bpe trains a tokenizer on a text stream, which data=rl's prompts are not: use the "
            "model's tokenizer (data.tokenizer.kind=hf data.tokenizer.name=<model dir>) or kind=byte"
        )
    if rl.beta and not cfg.model.lora.rank:
        raise ConfigError(
            f"rl.beta={rl.beta} penalises the distance to the reference, the base with the adapters switched off: set "
            f"model.lora.rank (16, say), or rl.beta=0; a full fine-tune's frozen reference copy is not built"
        )
