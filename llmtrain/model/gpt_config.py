"""The shape of a model of any family: the widths, counts and kinds its config names (model.*), resolved (the
vocabulary the tokenizer's), and what follows from them (head widths, MLP width, attention windows, padding). A
checkpoint's meta.json holds one, so it rebuilds its own model."""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.catalog import MlpKind, mlp_kind
from llmtrain.config import mlp_width
from llmtrain.model.lora import LoRAConfig
from llmtrain.model.moe import MoEConfig
from llmtrain.model.rope import RopeScaling


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    max_seq_len: int
    # model.family: the family this config is built as (llmtrain/catalog/models.py MODEL_FAMILIES), so a checkpoint's
    # config rebuilds its own model; a checkpoint from before the key is the GPT's
    family: str = "gpt"
    d_ff: int | None = None
    dropout: float = 0.0
    attention_dropout: float = 0.0
    bias: bool = True
    vocab_multiple: int = 1  # pad the embedding and head to a multiple of this (GPUs and tensor parallelism)
    # The Llama family's choices (GPT-2's are the defaults):
    norm: str = "layernorm"  # layernorm | rmsnorm | offset_rmsnorm (Gemma's x̂ · (1 + w))
    position: str = "learned"  # learned (an embedding per position) | rope (rotary, on queries and keys)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # Llama 3's stretched low frequencies (llmtrain/model/rope.py)
    mlp: str = "gelu"  # a row of llmtrain/catalog/models.py MLP_KINDS: gelu | swiglu | geglu | relu2
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    head_dim: int | None = None  # one head's width; None: d_model // n_head (Qwen3 sets its own)
    qk_norm: bool = False  # an RMSNorm over each query and key head before the rotation (Qwen3, Gemma 3)
    qk_norm_scope: str = "head"  # head: over each head's width (Qwen3) | projection: over all heads (OLMo 2)
    qkv_bias: bool = False  # biases on the query, key and value projections alone (Qwen2)
    # A norm on each branch's input (GPT-2, Llama); false: only sandwich_norm's on its output (OLMo 2)
    pre_norm: bool = True
    # Which blocks rotate their queries and keys, one per block in turn, the pattern repeated (1: rotates, 0: no
    # positions at all, NoPE; SmolLM3's every fourth); (): every block rotates
    rope_layers: tuple[int, ...] = ()
    # Gemma's choices: norms on the attention's and MLP's outputs too, embeddings times sqrt(d_model), and the
    # sliding-window blocks' own rotary base (without rope_scaling; None: every block rotates alike)
    sandwich_norm: bool = False
    embedding_scale: bool = False
    rope_local_theta: float | None = None
    tie_embeddings: bool = True  # the LM head is the token embedding
    norm_eps: float = 1e-5
    moe: MoEConfig = MoEConfig()  # mixture-of-experts blocks (llmtrain/model/moe.py); none by default
    # Attention windows, one per block in turn, the pattern repeated over the blocks (0: the whole context; ():
    # every block global). model/documents.py masks each block's attention to its query's last `window` keys.
    sliding_window: tuple[int, ...] = ()
    lora: LoRAConfig = LoRAConfig()  # low-rank adapters on the projections it targets, the rest frozen (model/lora.py)
    quantize_base: str = "none"  # none | nf4: the frozen base's block weights in 4-bit NormalFloat (model/quantize.py)

    @classmethod
    def from_dict(cls, fields: dict) -> GPTConfig:
        """The config a checkpoint's meta.json holds (dataclasses.asdict of one)."""
        scaling, moe, lora = fields.get("rope_scaling"), fields.get("moe"), fields.get("lora") or {}
        return cls(
            **{
                **fields,
                "rope_scaling": RopeScaling(**scaling) if scaling else None,
                "moe": MoEConfig(**(moe or {})),
                "sliding_window": tuple(fields.get("sliding_window", ())),
                "rope_layers": tuple(fields.get("rope_layers", ())),
                "lora": LoRAConfig(**{**lora, "targets": tuple(lora.get("targets", ()))}),
            }
        )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every block's attention window, in order (None: the whole context)."""
        return tuple(self.window_of(layer) for layer in range(self.n_layer))

    def window_of(self, layer: int) -> int | None:
        """Block `layer`'s attention window in keys; None: the whole context."""
        if not self.sliding_window:
            return None
        return self.sliding_window[layer % len(self.sliding_window)] or None

    def rotates(self, layer: int) -> bool:
        """Whether block `layer` rotates its queries and keys (a model of rotary positions; rope_layers)."""
        if self.position != "rope":
            return False
        return not self.rope_layers or bool(self.rope_layers[layer % len(self.rope_layers)])

    @property
    def layer_rotations(self) -> tuple[bool, ...]:
        """Whether each block rotates, in order."""
        return tuple(self.rotates(layer) for layer in range(self.n_layer))

    @property
    def mlp_kind(self) -> MlpKind:
        """What the MLPs compute and how many matrices they hold (catalog MLP_KINDS)."""
        return mlp_kind(self.mlp)

    def rope_of(self, layer: int) -> tuple[float, RopeScaling | None]:
        """Block `layer`'s rotary base and scaling: a sliding-window block's own base where the model has one."""
        if self.rope_local_theta is not None and self.window_of(layer) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def hidden(self) -> int:
        """The MLP's hidden width (llmtrain.config.mlp_width)."""
        return mlp_width(self.d_model, self.d_ff, self.mlp)

    @property
    def expert_shape(self) -> tuple[int, int, int, int, int, bool] | None:
        """(experts, top_k, every, shared experts, expert width, renormalised) of a mixture-of-experts model; None
        if dense."""
        m = self.moe
        if not m.num_experts:
            return None
        return m.num_experts, m.top_k, m.every, m.shared_experts, m.d_ff or self.hidden, m.renormalize

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        """One attention head's width."""
        return self.head_dim or self.d_model // self.n_head

    @property
    def attention_width(self) -> int:
        """The queries' width, all heads: what the attention's output projection reads."""
        return self.n_head * self.head_size

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def padding_parameters(self) -> int:
        """Embedding and head rows that only pad the vocabulary (trainable, but never looked up nor predicted): the
        embedding's, and an untied head's as many again."""
        return (self.padded_vocab_size - self.vocab_size) * self.d_model * (1 if self.tie_embeddings else 2)
