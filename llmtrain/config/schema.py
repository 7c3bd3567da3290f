"""The roots each command composes (training, llmtrain.data.prepare, llmtrain.evaluate, llmtrain.tools.dry_run),
registered in Hydra's ConfigStore.

conf/train.yaml lists `train_schema` first in its defaults, so every yaml and every command-line override is merged
into these dataclasses: a misspelt key or a wrong type fails before any work starts.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from llmtrain.config.data import DataConfig
from llmtrain.config.keys import keys_help
from llmtrain.config.model import ModelConfig
from llmtrain.config.optim import OptimConfig
from llmtrain.config.parallel import ParallelConfig
from llmtrain.config.planning import HardwareConfig, PlanConfig
from llmtrain.config.rl import RLConfig
from llmtrain.config.training import CheckpointConfig, EvalConfig, LoggingConfig, ProfileConfig, TrainConfig
from llmtrain.domains import ListOf, Number, Text, WritableDirectory, at_least, key
from llmtrain.process.launch_env import register_resolvers

# The option files (train.yaml, prepare.yaml, one folder per group): conf/ at the top of a checkout, which
# llmtrain/conf (beside this package) links to, so that a wheel carries them inside llmtrain and the tools find them
# from anywhere.
CONF_DIR = os.path.realpath(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf"))


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
    rl: RLConfig = field(default_factory=RLConfig)
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
        "each batch over every core (docs/benchmarks.md, the data path); more processes pay off for a tokenizer "
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
    """The four roots in Hydra's ConfigStore (conf/train.yaml and the others name them first in their defaults), the
    launch environment's resolvers, and `--help`'s listing of the keys."""
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
