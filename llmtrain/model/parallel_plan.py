"""The GPT's tensor-parallel plan: module name -> DTensor parallel style, the Megatron way.

Within a block, the first matmul of each pair is column-parallel (q, k, v split by heads, grouped-query attention's
key/value heads with their query heads; the MLP's up-projection and SwiGLU gate split by hidden units) and the
second row-parallel (attention output, MLP down-projection), so a block needs one all-reduce in forward
(Megatron's g) and one in backward (f) per pair: 4 per layer, 8·b·s·h·(t−1)/t bytes.

With sequence parallelism the activations between the pairs (LayerNorms, residual adds, dropout) stay sharded
along the sequence: each all-reduce becomes an all-gather into the pair and a reduce-scatter out of it, the same
bytes on the wire, while LayerNorm inputs and residuals shrink t times.

The token embedding is split by vocabulary rows and the tied LM head by the same rows, so with loss parallelism
the cross-entropy runs on vocabulary shards and no rank ever holds full-vocabulary logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from llmtrain.config import ConfigError
from llmtrain.model.dropout import Dropout, Split

if TYPE_CHECKING:
    from llmtrain.model.gpt import GPT


class SplitDropout(ParallelStyle):
    """Tells a Dropout that its input is this rank's chunk along `dim` (heads of attention weights, the sequence
    of residual activations), so its mask is the matching part of the unsplit tensor's (model/dropout.py)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        cast(Dropout, module).split = Split(dim=self.dim, rank=device_mesh.get_local_rank(), parts=device_mesh.size())
        return module


class ChunkPositions(ParallelStyle):
    """Under sequence parallelism the position embedding keeps replicated weights (a DTensor, so the partial
    gradients of the ranks' sequence chunks are summed) and each rank looks up its own chunk of positions."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def positions_chunk(_module, inputs, mesh):
            positions = DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False)
            return (positions.redistribute(mesh, [Shard(0)]),)

        return distribute_module(
            module, device_mesh, input_fn=positions_chunk, output_fn=lambda _module, output, _mesh: output.to_local()
        )


def _block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Module name (inside a Block) -> parallel style."""
    if not sequence_parallel:
        # q, k and v read one shared DTensor, so backward sums their input gradients before a single all-reduce
        # (Megatron's f), as a fused qkv projection would; three plain inputs would cost three.
        share_input = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        return {
            "attn": share_input,
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.out_proj": RowwiseParallel(),
            "attn.attn_dropout": SplitDropout(dim=1),
            "mlp.fc_in": ColwiseParallel(),
            "mlp.fc_gate": ColwiseParallel(),
            "mlp.fc_out": RowwiseParallel(),
        }
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "attn_norm": SequenceParallel(),
        "attn": gather_sequence,
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        "attn.attn_dropout": SplitDropout(dim=1),
        "attn.resid_dropout": SplitDropout(dim=1),
        "mlp_norm": SequenceParallel(),
        "mlp": gather_sequence,
        "mlp.fc_in": ColwiseParallel(),
        "mlp.fc_gate": ColwiseParallel(),
        "mlp.fc_out": RowwiseParallel(output_layouts=Shard(1)),
        "mlp.dropout": SplitDropout(dim=1),
    }


def gpt_tensor_parallel_plan(model: GPT, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan for the blocks and the embeddings / final norm / head this model (or pipeline part) holds. Each
    rank then computes its own heads: the attention reshape derives the head count from the local width."""
    plan = {
        f"blocks.{i}.{name}": style
        for i, block in model.blocks.items()
        for name, style in _block_plan(sequence_parallel).items()
        if _holds(block, name)  # the gate only in a SwiGLU MLP
    }
    residual = Shard(1) if sequence_parallel else Replicate()
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
        if sequence_parallel:
            if model.pos_emb is not None:  # rotary positions have no weights
                plan["pos_emb"] = ChunkPositions()
            plan["emb_dropout"] = SplitDropout(dim=1)
    if model.lm_head is not None:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def _holds(block: nn.Module, name: str) -> bool:
    try:
        return block.get_submodule(name) is not None
    except AttributeError:
        return False


def check_tensor_parallel(model_cfg, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """A one-line ConfigError when the model's shapes do not split over `tp` ranks."""
    m = model_cfg
    if m.moe.num_experts:
        raise ConfigError(
            f"model.moe.num_experts={m.moe.num_experts} with parallel.tp={tp}: the experts have no tensor-parallel "
            f"plan yet; use parallel.tp=1 (fsdp, ddp, zero1 or pp layouts)"
        )
    if m.n_head % tp:
        raise ConfigError(
            f"model.n_head={m.n_head} is not divisible by parallel.tp={tp}: tensor parallelism splits "
            f"heads across ranks; choose a tp that divides {m.n_head}"
        )
    if m.n_kv_head and m.n_kv_head % tp:
        raise ConfigError(
            f"model.n_kv_head={m.n_kv_head} is not divisible by parallel.tp={tp}: tensor parallelism splits the "
            f"key/value heads across ranks with their query heads; choose a tp that divides {m.n_kv_head}"
        )
    if m.d_model % tp or (m.d_ff or 4 * m.d_model) % tp:
        raise ConfigError(f"model.d_model={m.d_model} (and the MLP width) must be divisible by parallel.tp={tp}")
    if sequence_parallel and seq_len % tp:
        raise ConfigError(
            f"train.seq_len={seq_len} is not divisible by parallel.tp={tp}, which sequence "
            f"parallelism needs: set train.seq_len to a multiple of {tp} or "
            f"parallel.sequence_parallel=false"
        )
    if m.vocab_multiple % tp:
        raise ConfigError(
            f"model.vocab_multiple={m.vocab_multiple} is not divisible by parallel.tp={tp}: the padded "
            f"vocabulary is split across tp ranks; use a multiple of {tp} (e.g. {64 * tp})"
        )
