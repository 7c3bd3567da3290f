"""What llmtrain can be asked for by name, one torch-free table each: the model families and MLP kinds (models.py),
the parallel layouts and pipeline schedules (layouts.py), the optimizers and learning-rate schedules
(optimizers.py), the training objectives (objectives.py), the data sources (data_sources.py), and here the
tokenizers, recomputation and attention modes and the other short lists. The config's choices and --help, and the
code that builds each one, read these tables; nothing else lists the names. A row names the code it runs by an
import string, "module:Name", imported (`imported`) only when a run asks for it, so the tables stay torch-free and a
new row needs no other edit to be built."""

from __future__ import annotations

from llmtrain.catalog.data_sources import DATA_SOURCES, DataSourceSpec, data_source, objectives_fed
from llmtrain.catalog.layouts import (
    AUTO,
    AUTO_DESCRIPTION,
    AUTO_EXAMPLES,
    DATA_PARALLEL,
    LAYOUTS,
    MESH_DIMS,
    RANKS_PER_NODE,
    SCHEDULES,
    WITHIN_NODE_DIMS,
    DataParallelSpec,
    LayoutSpec,
    ScheduleSpec,
    layout_spec,
    schedule_spec,
)
from llmtrain.catalog.models import (
    EXPERT_LORA_TARGETS,
    LORA_TARGETS,
    MLP_KINDS,
    MODEL_FAMILIES,
    MlpKind,
    ModelFamilySpec,
    mlp_kind,
    model_family,
)
from llmtrain.catalog.objectives import (
    AUTO_OBJECTIVE,
    OBJECTIVES,
    REWARDS,
    RL_LOSSES,
    WEIGHT_GATHERS,
    ObjectiveSpec,
    RewardSpec,
    objective_of,
)
from llmtrain.catalog.optimizers import (
    ADAMW_MOMENTS,
    DECAY_SHAPES,
    LR_SCHEDULES,
    MOMENT_BYTES,
    OPTIMIZERS,
    OptimizerSpec,
    zero1_form,
)
from llmtrain.catalog.rows import described, imported

# data.tokenizer.kind (llmtrain/data/tokenizers.py describes each).
TOKENIZER_KINDS = ("byte", "bpe", "hf")
# train.activation_checkpointing, from keeping the most to recomputing the most (llmtrain/model/recompute.py): the
# planner turns it up in this order when a layout does not fit.
RECOMPUTE_MODES = ("none", "selective", "full")
# train.attention (llmtrain/model/documents.py): over the whole packed window, or within each packed document.
ATTENTION_MODES = ("causal", "document")
# train.on_spike (llmtrain/train/loop.py): what a loss spike does beyond its warning and `spike: true` in its
# record: nothing more, its update dropped as a non-finite step's is, or the run rolled back to its last checkpoint
# with the spike's batch left out.
SPIKE_ACTIONS = ("log", "skip", "rollback")
# train.compile_backend: torch.compile's backend (llmtrain/parallel/layout.py): inductor's fused kernels, or the same
# graphs run by eager kernels (dynamo and AOTAutograd, or dynamo alone), to tell a graph's failure from a kernel's.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# train.float8 (llmtrain/parallel/float8.py describes each recipe).
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
# train.float8_layers: which of the blocks' eligible Linear layers float8 converts (llmtrain/parallel/float8.py).
FLOAT8_LAYERS = ("auto", "all")

__all__ = [
    "ADAMW_MOMENTS",
    "ATTENTION_MODES",
    "COMPILE_BACKENDS",
    "AUTO",
    "AUTO_OBJECTIVE",
    "AUTO_DESCRIPTION",
    "AUTO_EXAMPLES",
    "DATA_PARALLEL",
    "DATA_SOURCES",
    "DataSourceSpec",
    "DECAY_SHAPES",
    "EXPERT_LORA_TARGETS",
    "FLOAT8_LAYERS",
    "FLOAT8_RECIPES",
    "LAYOUTS",
    "LORA_TARGETS",
    "LR_SCHEDULES",
    "MESH_DIMS",
    "MLP_KINDS",
    "MODEL_FAMILIES",
    "MOMENT_BYTES",
    "OBJECTIVES",
    "OPTIMIZERS",
    "RANKS_PER_NODE",
    "RECOMPUTE_MODES",
    "REWARDS",
    "RL_LOSSES",
    "SCHEDULES",
    "SPIKE_ACTIONS",
    "TOKENIZER_KINDS",
    "WEIGHT_GATHERS",
    "WITHIN_NODE_DIMS",
    "DataParallelSpec",
    "LayoutSpec",
    "MlpKind",
    "ModelFamilySpec",
    "ObjectiveSpec",
    "OptimizerSpec",
    "RewardSpec",
    "ScheduleSpec",
    "data_source",
    "described",
    "imported",
    "layout_spec",
    "mlp_kind",
    "model_family",
    "objective_of",
    "objectives_fed",
    "schedule_spec",
    "zero1_form",
]
