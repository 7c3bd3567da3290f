"""The commands a user runs beside training: plan (the planner's table), gpu_check (the GPU path end to end),
compare_runs, config_doc (docs/config.md from the schema), upgrade_checkpoint. Measurements live in llmtrain/bench/."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from llmtrain.config import CONF_DIR, register_schemas


def compose_config(overrides: list[str]):
    """The training config a `train.py` command line with these overrides would run."""
    register_schemas()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=overrides)
