"""The data sources (data.source): what each reads, the keys it cannot go without and the rules it sets. The objectives
a source feeds are the objectives' rows' (objectives.py: an objective of a source's own names it, and that source
feeds nothing else; any other source feeds next_token): `objectives_fed`."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.catalog.objectives import OBJECTIVES
from llmtrain.errors import ConfigError


@dataclass(frozen=True)
class DataSourceSpec:
    """Everything llmtrain knows of one data source, its code named by import strings and imported only when a run
    asks for it. Adding a source is this row, a conf/data/<name>.yaml and the modules it names (docs/extending.md)."""

    # "module:function" (config: RootConfig, tokenizer, reading: DataReading) -> Data (llmtrain/data/reading.py):
    # this rank's batches of the job at the reading's position, and its validation rows
    reader: str
    description: str  # one line for data.source's --help and docs/config.md
    needs: str | None = None  # the data key (path, name, sources) it cannot run without, and what that key names
    needs_what: str = ""
    # what its records are where it reads records (conversations, pairs, prompts) from data.path's files or the hub's
    # data.name, one of which it needs
    records: str | None = None
    chat_template: bool = False  # it renders its records with a chat template: a transformers tokenizer's
    local_files: bool = False  # data.path, where set, names files (data.val_path too), which llmtrain.data.files finds
    # it reads token stores llmtrain.data.prepare wrote, whose manifests fix the tokenizer and the split, and this
    # "module:function" (data config) -> Tokenizer loads their tokenizer
    stores: str | None = None
    # "module:function" (data config, split) -> its text documents, unsplit (datasets' IterableDataset of {"text"}):
    # what a BPE is trained on and llmtrain.data.prepare tokenises; None: no text documents (records, stores)
    documents: str | None = None
    # "module:function" (the root config) raising a ConfigError of one line where the source's other keys, or the
    # run's, do not fit it (llmtrain/config/validation.py); None: nothing besides the fields above
    rules: str | None = None


DATA_SOURCES: dict[str, DataSourceSpec] = {
    "stdlib": DataSourceSpec(
        reader="llmtrain.data.readers:read_text",
        description="the Python standard library's source files, streamed (a corpus every machine has)",
        documents="llmtrain.data.sources:stdlib_documents",
    ),
    "local": DataSourceSpec(
        reader="llmtrain.data.readers:read_text",
        description="text files under data.path, streamed",
        needs="path",
        needs_what="<file, folder or glob>",
        local_files=True,
        documents="llmtrain.data.sources:local_documents",
    ),
    "hf": DataSourceSpec(
        reader="llmtrain.data.readers:read_text",
        description="a dataset on the Hugging Face hub, streamed",
        needs="name",
        needs_what="<dataset on the hub>",
        documents="llmtrain.data.sources:hub_documents",
    ),
    "prepared": DataSourceSpec(
        reader="llmtrain.data.readers:read_prepared",
        description="a token store llmtrain.data.prepare wrote, each rank reading its rows",
        needs="path",
        needs_what="<directory written by llmtrain.data.prepare>",
        stores="llmtrain.data.prepared:store_tokenizer",
    ),
    "mix": DataSourceSpec(
        reader="llmtrain.data.readers:read_mixture",
        description="prepared stores mixed by weight (data.sources)",
        needs="sources",
        needs_what="[{name: ..., path: <prepared store>, weight: ...}, ...]",
        stores="llmtrain.data.mixture:mixture_tokenizer",
    ),
    "sft": DataSourceSpec(
        reader="llmtrain.data.readers:read_conversations",
        description="conversations for fine-tuning, trained on the assistant's tokens",
        records="conversations",
        chat_template=True,
        local_files=True,
    ),
    "preference": DataSourceSpec(
        reader="llmtrain.data.readers:read_pairs",
        description="a prompt with a chosen and a rejected answer, for DPO",
        records="preference pairs",
        chat_template=True,
        local_files=True,
        rules="llmtrain.config.validation:preference_rules",
    ),
    "rl": DataSourceSpec(
        reader="llmtrain.data.readers:read_prompts",
        description="prompts to sample completions of and reward, for GRPO",
        records="prompts",
        local_files=True,
        rules="llmtrain.config.validation:rl_rules",
    ),
}


def data_source(name: str) -> DataSourceSpec:
    """The row of data.source=`name` (a config's is checked by its domain)."""
    if name not in DATA_SOURCES:
        raise ConfigError(f"data={name!r} is not a data source here: use one of {', '.join(DATA_SOURCES)}")
    return DATA_SOURCES[name]


def objectives_fed(name: str) -> tuple[str, ...]:
    """The train.objective values data.source=`name` feeds, `auto`'s first."""
    own = tuple(objective for objective, spec in OBJECTIVES.items() if spec.data == name)
    return own or tuple(objective for objective, spec in OBJECTIVES.items() if spec.data is None)
