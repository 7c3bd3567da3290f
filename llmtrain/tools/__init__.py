"""Command-line tools beside training (benchmarks, planners, export, generation)."""

from __future__ import annotations

import os
from typing import cast

from hydra import compose, initialize_config_dir

from llmtrain.config import RootConfig, register_schemas

CONF_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "conf"))


def compose_config(overrides: list[str]):
    """The training config a `train.py` command line with these overrides would run (byte tokenizer by default:
    the tools feed random tokens)."""
    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=["data.tokenizer.kind=byte", *overrides])


def build_layout(cfg, runtime, vocab_size: int):
    """(strategy, model): the model of `cfg` laid out and materialised as training does (llmtrain/job.py), for
    tools that run steps on random tokens."""
    from omegaconf import OmegaConf

    from llmtrain.model import initial_weights, meta_model
    from llmtrain.parallel import get_strategy

    config = cast(RootConfig, OmegaConf.to_object(cfg))
    strategy = get_strategy(config.parallel.strategy)(config.parallel, config.train, config.model, runtime)
    model = meta_model(config.model, vocab_size)
    return strategy, strategy.parallelize(model, initial_weights(config.model, model, config.seed))
