"""Typed schemas for every config group, registered in Hydra's ConfigStore, and their validation.

Each key is declared once, with its domain and doc beside it (`key(default, domain, doc)`, llmtrain/domains.py), in
the module of its group: model.py, data.py, parallel.py, optim.py, training.py (train, logging, eval, profile,
checkpoint), planning.py (hardware, plan). schema.py joins them into the root each command composes and registers
those; keys.py lists and checks keys by their dotted names (`--help`, an unknown key's one line); validation.py
holds `validate`: every key against its domain, then the rules that span several keys, each refusal a ConfigError
of one line that names the key and the fix; composition.py composes a command's config, a composition error one line
as well (train.py and llmtrain.data.prepare run their @hydra.main functions through it).

The package is torch-free and reads no data files: train.py validates a config before torch loads.
"""

from llmtrain.config.data import DataConfig, TokenizerConfig, reads_local_files, reads_prepared_stores
from llmtrain.config.keys import (
    RENAMED_KEYS,
    check_domains,
    keys_help,
    schema_fields,
    schema_keys,
    unknown_key_line,
)
from llmtrain.config.model import LoRAGroupConfig, ModelConfig, MoEGroupConfig, RopeScalingConfig, mlp_width
from llmtrain.config.optim import OptimConfig
from llmtrain.config.parallel import LAYOUT_CHOICES, PIPELINE_SCHEDULES, ParallelConfig
from llmtrain.config.planning import HardwareConfig, PlanConfig
from llmtrain.config.schema import (
    CONF_DIR,
    DryRunConfig,
    DryRunRootConfig,
    EvaluateRootConfig,
    PrepareConfig,
    PrepareRootConfig,
    RootConfig,
    evaluation_keys,
    register_schemas,
)
from llmtrain.config.training import (
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    ProfileConfig,
    TrainConfig,
    WandbConfig,
)
from llmtrain.config.validation import (
    require_extra,
    validate,
    validate_data,
    validate_lora,
    validate_moe,
    validate_optim,
    validate_rope_scaling,
)

__all__ = [
    "CONF_DIR",
    "LAYOUT_CHOICES",
    "PIPELINE_SCHEDULES",
    "RENAMED_KEYS",
    "CheckpointConfig",
    "DataConfig",
    "DryRunConfig",
    "DryRunRootConfig",
    "EvalConfig",
    "EvaluateRootConfig",
    "HardwareConfig",
    "LoRAGroupConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoEGroupConfig",
    "OptimConfig",
    "ParallelConfig",
    "PlanConfig",
    "PrepareConfig",
    "PrepareRootConfig",
    "ProfileConfig",
    "RootConfig",
    "RopeScalingConfig",
    "TokenizerConfig",
    "TrainConfig",
    "WandbConfig",
    "check_domains",
    "evaluation_keys",
    "keys_help",
    "mlp_width",
    "reads_local_files",
    "reads_prepared_stores",
    "register_schemas",
    "require_extra",
    "schema_fields",
    "schema_keys",
    "unknown_key_line",
    "validate",
    "validate_data",
    "validate_lora",
    "validate_moe",
    "validate_optim",
    "validate_rope_scaling",
]
