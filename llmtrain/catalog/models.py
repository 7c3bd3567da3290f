"""The model families (model.family), the MLP kinds (model.mlp) and the projections low-rank adapters can target."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.errors import ConfigError


@dataclass(frozen=True)
class ModelFamilySpec:
    """Everything llmtrain knows of one model family, each part named by an import string and imported only when a
    run asks for it. Adding a family is this row and the modules it names: nothing else lists families."""

    # "module:Class" of the model: GPT's constructor arguments (a GPTConfig; for a pipeline rank's part, the blocks
    # and ends it holds) make it whole, and it is a LayeredModel (llmtrain/model/base.py)
    model: str
    # "module:Name" of its FamilyLayout (llmtrain/parallel/family.py): its tensor-parallel plan, how a pipeline cuts
    # it, how context parallelism hands it a shard of every sequence
    layout: str
    # "module:Name" of its FamilyShapes (llmtrain/planner/shapes.py): the tensors of its blocks, embeddings and head
    # as the planner sizes them from the config alone
    shapes: str
    description: str  # one line: what sets it apart, for model.family's --help and docs/config.md
    # "module:Name" of its HFFormats (llmtrain/model/hf.py): the transformers classes it converts to and from; None:
    # its modules compute what no transformers class does, so export and model.init_from refuse it in one line
    hf: str | None = None


# model.family -> what it is. Llama, Qwen3, Gemma 3, Mixtral and the other presets are the GPT under other keys
# (norm, position, mlp, moe: conf/model/*.yaml); a family of its own is a model whose modules differ.
MODEL_FAMILIES: dict[str, ModelFamilySpec] = {
    "gpt": ModelFamilySpec(
        model="llmtrain.model.gpt:GPT",
        layout="llmtrain.parallel.family:GPT_LAYOUT",
        shapes="llmtrain.planner.shapes:GPT_SHAPES",
        hf="llmtrain.model.hf:GPT_FORMATS",
        description="the decoder of every preset, GPT-2, Llama, Qwen3, Gemma 3 or Mixtral by the norm, position, mlp "
        "and moe keys",
    ),
}


def model_family(name: str) -> ModelFamilySpec:
    """The row of model.family=`name`: a config's is checked by its domain, a checkpoint's (written where another
    row was installed) here."""
    if name not in MODEL_FAMILIES:
        raise ConfigError(f"model.family={name!r} is not a model family here: use one of {', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[name]


@dataclass(frozen=True)
class MlpKind:
    """One MLP a block can compute: fc_out(act(fc_in(x))), or gated fc_out(act(fc_gate(x)) · fc_in(x)). The model
    builds it, the FLOP count, the planner's memory and traffic count its matrices, all from this row."""

    activation: str  # "module:function" applied elementwise (to the gate's output where the MLP is gated)
    gated: bool  # a third matrix, the gate
    description: str  # one line for model.mlp's --help and docs/config.md
    # the hidden width where model.d_ff is null: d_model · width_ratio, rounded up to a multiple of width_multiple
    # (a gated MLP's 8/3 keeps the two-matrix MLP's 4·d_model parameter count)
    width_ratio: tuple[int, int] = (4, 1)
    width_multiple: int = 1

    @property
    def matrices(self) -> int:
        """Weight matrices: the input projections and the output one."""
        return self.input_projections + 1

    @property
    def input_projections(self) -> int:
        """Projections of the block's input to the hidden width: the up projection, and the gate's."""
        return 2 if self.gated else 1

    @property
    def saved_hidden(self) -> int:
        """Hidden-width tensors kept for backward: the activation's input and output (a squared ReLU keeps the
        ReLU's output and its square), and a gated MLP's up projection and product besides."""
        return 2 * self.input_projections

    def width(self, d_model: int) -> int:
        numerator, denominator = self.width_ratio
        return -(-(numerator * d_model // denominator) // self.width_multiple) * self.width_multiple


# model.mlp -> the MLP every dense block (and every routed expert) computes.
MLP_KINDS: dict[str, MlpKind] = {
    "gelu": MlpKind(
        activation="llmtrain.model.activations:gelu_tanh",
        gated=False,
        description="GPT-2's fc_out(gelu_tanh(fc_in(x))), hidden 4·d_model",
    ),
    "swiglu": MlpKind(
        activation="torch.nn.functional:silu",
        gated=True,
        description="Llama's fc_out(silu(fc_gate(x)) · fc_in(x)), hidden 8/3·d_model rounded up to 64",
        width_ratio=(8, 3),
        width_multiple=64,
    ),
    "geglu": MlpKind(
        activation="llmtrain.model.activations:gelu_tanh",
        gated=True,
        description="Gemma's fc_out(gelu_tanh(fc_gate(x)) · fc_in(x)), hidden 8/3·d_model rounded up to 64",
        width_ratio=(8, 3),
        width_multiple=64,
    ),
    "relu2": MlpKind(
        activation="llmtrain.model.activations:squared_relu",
        gated=False,
        description="Primer's squared ReLU (So et al. 2021), fc_out(relu(fc_in(x))²), hidden 4·d_model",
    ),
}


def mlp_kind(name: str) -> MlpKind:
    if name not in MLP_KINDS:
        raise ConfigError(f"model.mlp={name!r} is not an MLP kind: use one of {', '.join(MLP_KINDS)}")
    return MLP_KINDS[name]


# model.lora.targets: the projections low-rank adapters can sit beside (llmtrain/model/lora.py), by their attribute
# names, with the names Hugging Face's Llama and Qwen3 and PEFT give them (either names a target in a config).
LORA_TARGETS = {
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "out_proj": "o_proj",
    "fc_gate": "gate_proj",
    "fc_in": "up_proj",
    "fc_out": "down_proj",
}
# The mixtures' routed experts, adapted per expert only when named (every expert of every block: many adapters), by
# our names and by the parameters of transformers' fused experts that PEFT's target_parameters names.
EXPERT_LORA_TARGETS = {
    "experts_in": "experts.gate_up_proj",
    "experts_out": "experts.down_proj",
}
