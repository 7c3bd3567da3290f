"""A checkpoint's model laid out over this process group as training lays it out, its weights loaded: what a
command that runs a trained model on the ranks that launched it (llmtrain.evaluate, llmtrain.chat) starts from."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from llmtrain.config import RootConfig
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.process.runtime import Runtime


def laid_out_checkpoint(checkpoint: str, config: RootConfig, runtime: Runtime) -> tuple[ParallelModel, Any]:
    """Collective: (the model of `checkpoint` laid out by `config` on this rank, its weights loaded and in eval
    mode; the transformers tokenizer it was trained with). Its shape comes from the checkpoint, a low-rank
    adapters' base from where the checkpoint names it (checked against the fingerprint it recorded)."""
    from transformers import AutoTokenizer

    from llmtrain.checkpoint.manager import load_checkpoint, read_meta
    from llmtrain.checkpoint.state import load_model_weights_state, model_weights_state
    from llmtrain.checkpoint.training import check_base_matches, check_model_matches
    from llmtrain.model import GPTConfig, base_of, model_group_of
    from llmtrain.model.scoring import TokenMarks
    from llmtrain.run.build import build_parallel_model

    meta = read_meta(checkpoint)
    gpt_cfg, base = GPTConfig.from_dict(meta["model"]), meta.get("base")
    t = config.train
    # The plan's checks read train.seq_len (a row is at most the model's length) and a batch every layout divides.
    train = dataclasses.replace(t, seq_len=gpt_cfg.max_seq_len, batch_size=t.micro_batch_size * runtime.world_size)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint, "tokenizer"))
    model_group, seed = model_group_of(gpt_cfg, config.model), config.seed
    if base is not None:  # low-rank adapters: the checkpoint holds them alone, the base comes from where it names
        model_group, seed = dataclasses.replace(model_group, init_from=base["init_from"]), base.get("seed", seed)
        check_base_matches(checkpoint, base_of(model_group, seed))
    model = build_parallel_model(
        dataclasses.replace(config, model=model_group, train=train, seed=seed),
        runtime,
        gpt_cfg.vocab_size,
        marks=TokenMarks(tokenizer.eos_token_id),
    )
    check_model_matches(checkpoint, gpt_cfg)  # the shape went through the model group and back unchanged
    state = model_weights_state(model, adapters_only=base is not None)
    load_checkpoint(checkpoint, state.values, runtime.distributed)
    load_model_weights_state(model, state)
    model.module.eval()
    return model, tokenizer
