"""Data: sources -> tokenizer -> packed windows in one global order -> this rank's rows of batch k.

Each data.source is a row of llmtrain/catalog/data_sources.py naming its reader (readers.py); build_data runs the
job's. Two paths give the same kind of batches: streamed (stdlib / local / hf, tokenised while training; stream.py)
and prepared (tokenised once by `python -m llmtrain.data.prepare`, read by index; prepared.py)."""

from __future__ import annotations

from collections.abc import Callable

from llmtrain.catalog import data_source, imported
from llmtrain.config import DataConfig, RootConfig, reads_prepared_stores
from llmtrain.data.prefetch import Batches
from llmtrain.data.readers import training_windows
from llmtrain.data.reading import Data, DataReading, SourceBatch, ValidationSet
from llmtrain.data.sources import TRAIN, open_documents
from llmtrain.data.stream import RankSlice
from llmtrain.data.tokenizers import Tokenizer, build_bpe, load_tokenizer

# The BPE is trained on a fixed shuffle of the training documents, so it does not change with the run's seed.
TOKENIZER_TRAINING_SEED = 0


# Above this many data-parallel ranks the streamed path's repeated tokenisation is worth a warning (README, "Data").
STREAMING_DP_LIMIT = 8


def streaming_scale_warning(data_cfg: DataConfig, dp_size: int) -> str | None:
    """The start-up warning for a streamed source read by more than STREAMING_DP_LIMIT data-parallel ranks."""
    if reads_prepared_stores(data_cfg) or dp_size <= STREAMING_DP_LIMIT:
        return None
    return (
        f"warning: data={data_cfg.source} is streamed, so each of the {dp_size} data-parallel ranks tokenises the "
        f"whole stream to keep 1/{dp_size} of it: tokenise once with `python -m llmtrain.data.prepare "
        f"data={data_cfg.source} ... prepare.out=DIR` and train with data=prepared data.path=DIR"
    )


def build_tokenizer(data_cfg, is_main: bool, barrier: Callable[[], None]) -> Tokenizer:
    """Load the configured tokenizer (a prepared store's own); a BPE not yet cached is trained by rank 0 while the
    others wait."""
    stores = data_source(data_cfg.source).stores
    if stores is not None:
        return imported(stores)(data_cfg)
    bpe_path = None
    if data_cfg.tokenizer.kind == "bpe":
        if is_main:
            docs = open_documents(data_cfg, TRAIN).shuffle(
                seed=TOKENIZER_TRAINING_SEED, buffer_size=data_cfg.doc_shuffle_buffer
            )
            bpe_path = build_bpe(data_cfg, (ex["text"] for ex in docs))
        barrier()
    return load_tokenizer(data_cfg, bpe_path)


def build_data(config: RootConfig, tokenizer: Tokenizer, reading: DataReading) -> Data:
    """This rank's training batches and its rows of the validation set(s) of the job `config` describes, as
    `reading` says: data.source's reader."""
    return imported(data_source(config.data.source).reader)(config, tokenizer, reading)


__all__ = [
    "Batches",
    "Data",
    "DataReading",
    "RankSlice",
    "SourceBatch",
    "ValidationSet",
    "build_data",
    "build_tokenizer",
    "streaming_scale_warning",
    "training_windows",
]
