"""The `data` group's keys (conf/data/): where the text comes from, how it is split and shuffled, and the
tokenizer that reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from llmtrain import catalog
from llmtrain.domains import (
    TOKENIZER_FILES,
    DirectoryOrHub,
    ExistingPath,
    ListOf,
    MixtureSources,
    Number,
    OneOf,
    OneOrListOf,
    Text,
    WritableDirectory,
    at_least,
    key,
    positive,
)


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
        f"set by the `data` option: {catalog.described(catalog.DATA_SOURCES)}",
    )
    path: Optional[str] = key(
        None,
        ExistingPath("glob"),
        "`local`: a file, a folder (searched recursively) or a glob of `.txt`, `.jsonl`, `.parquet`; `prepared`: the "
        "directory `llmtrain.data.prepare` wrote; `sft`: `.jsonl` / `.parquet` conversations (`messages` or "
        "`prompt` + `response`); `preference`: `.jsonl` / `.parquet` pairs (`prompt`, `chosen`, `rejected`); `rl`: "
        "`.jsonl` / `.parquet` prompts (`prompt`, and the columns the reward reads)",
    )
    name: Optional[str] = key(
        None,
        Text(),
        "`hf` (and `sft`, `preference`, `rl` without a `path`): the dataset's name on the hub "
        "(`HuggingFaceFW/fineweb-edu`)",
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
        "`local`, `sft`, `preference` and `rl`: validation files (a file, a folder or a glob); null holds out "
        "`val_fraction` of the text (of the conversations or pairs, for `sft` and `preference`)",
    )
    val_fraction: float = key(
        0.02,
        Number(low=0, high=0.5, low_open=True, high_open=True),
        "share of the text held out for validation, in ~4 KB chunks (a long document gives that share of its chunks, "
        "spread through it; a short one is held out whole by a hash of its text): disjoint from training, the same on "
        "every run; 0.05 for `local` (a one-file corpus of ~1 MB validates with the defaults), 0.005 for `hf`",
    )
    text_field: str = key("text", Text(), "the jsonl / parquet / hub column holding the text")
    beta: float = key(
        0.1,
        positive(),
        "`preference`: DPO's β, how far the policy may move from the reference (the base, adapters off) for a "
        "margin: the loss is -log σ(β (chosen log-ratio - rejected log-ratio)); 0.1 as TRL's DPOConfig",
    )
    reward: Optional[Any] = key(
        None,
        OneOrListOf(Text()),
        "`rl`: what scores a completion, one name or a list (weighted by `reward_weights`): built-ins "
        + ", ".join(f"`{name}` ({spec.description})" for name, spec in catalog.REWARDS.items())
        + ", or `module:function` (TRL's convention: prompts, completions and the record's other columns as "
        "keywords, returning a float or None per completion), imported from the working directory or PYTHONPATH",
    )
    reward_weights: Optional[list[float]] = key(
        None, ListOf(Number()), "`rl`: each reward's weight in a completion's reward, in data.reward's order; null: 1"
    )
    reward_pattern: Optional[str] = key(None, Text(), "`rl` with the `regex` reward: the pattern a completion matches")
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


def reads_prepared_stores(data_cfg) -> bool:
    """data=prepared and data=mix: token stores llmtrain.data.prepare wrote, of which each rank reads its rows (the
    other sources are streamed and tokenised while training)."""
    return catalog.data_source(data_cfg.source).stores is not None


def reads_local_files(data_cfg) -> bool:
    """data=local, and data=sft, preference or rl given a path: files named by data.path (and data.val_path), which
    llmtrain.data.files finds."""
    return catalog.data_source(data_cfg.source).local_files and bool(data_cfg.path)


def reward_names(data_cfg) -> list[str]:
    """data.reward as a list: the one name, or the names, it gives (none where it is unset)."""
    reward = data_cfg.reward
    if reward is None:
        return []
    return [reward] if isinstance(reward, str) else list(reward)
