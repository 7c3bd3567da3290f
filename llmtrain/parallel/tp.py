"""Tensor parallelism the Megatron way, with DTensor: `parallel=tp`, and the TP half of 2-D layouts.

Within a block, the first matmul of each pair is column-parallel (q, k, v split by heads; the MLP's up-projection
split by hidden units) and the second row-parallel (attention output, MLP down-projection), so a block needs one
all-reduce in forward (Megatron's g) and one in backward (f) per pair: 4 per layer, 8·b·s·h·(t−1)/t bytes.

With sequence parallelism the activations between the pairs (LayerNorms, residual adds, dropout) stay sharded
along the sequence: each all-reduce becomes an all-gather into the pair and a reduce-scatter out of it, the same
bytes on the wire, while LayerNorm inputs and residuals shrink t times.

The token embedding is split by vocabulary rows and the tied LM head by the same rows, so with loss parallelism
the cross-entropy runs on vocabulary shards and no rank ever holds full-vocabulary logits.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from llmtrain.config import ConfigError
from llmtrain.model.dropout import Split
from llmtrain.parallel.registry import register
from llmtrain.parallel.strategy import Strategy


def block_plan(sequence_parallel: bool) -> dict:
    """Module name (inside a Block) -> parallel style."""
    if not sequence_parallel:
        # q, k and v read one shared DTensor, so backward sums their input gradients before a single all-reduce
        # (Megatron's f), as a fused qkv projection would; three plain inputs would cost three.
        share_input = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                         use_local_output=False)
        return {"attn": share_input,
                "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
                "attn.out_proj": RowwiseParallel(),
                "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"attn_norm": SequenceParallel(),
            "attn": gather_sequence,
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": gather_sequence,
            "mlp.fc_in": ColwiseParallel(),
            "mlp.fc_out": RowwiseParallel(output_layouts=Shard(1))}


def outer_plan(model: nn.Module, sequence_parallel: bool, loss_parallel_on: bool) -> dict:
    """The embedding, final norm and LM head around the blocks (those this model part holds)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=residual,
                                          output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
                                          use_local_output=not loss_parallel_on)
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
    return plan


def _shard_positions(module: nn.Module, mesh: DeviceMesh) -> None:
    """Under sequence parallelism the position embedding keeps replicated weights (a DTensor, so the partial
    gradients of the ranks' sequence chunks are summed) and each rank looks up its own chunk of positions."""
    def positions_chunk(_module, inputs, device_mesh):
        positions = DTensor.from_local(inputs[0], device_mesh, [Replicate()], run_check=False)
        return (positions.redistribute(device_mesh, [Shard(0)]),)

    distribute_module(module, mesh, input_fn=positions_chunk,
                      output_fn=lambda _module, output, _mesh: output.to_local())


def _mark_dropout_splits(model: nn.Module, split: Split, sequence_parallel: bool) -> None:
    """Tell each dropout which of its inputs are shards (dim 1 is the heads of attention weights and the sequence
    of residual activations), so its mask is the matching part of the unsplit tensor's."""
    for block in model.blocks.values():
        block.attn.attn_dropout.split = split
        if sequence_parallel:
            block.attn.resid_dropout.split = split
            block.mlp.dropout.split = split
    if sequence_parallel and model.emb_dropout is not None:
        model.emb_dropout.split = split


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          loss_parallel_on: bool) -> None:
    # Each rank then computes its own heads: the attention reshape derives the head count from the local width.
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    parallelize_module(model, tp_mesh, outer_plan(model, sequence_parallel, loss_parallel_on))
    if sequence_parallel and model.pos_emb is not None:
        _shard_positions(model.pos_emb, tp_mesh)
    _mark_dropout_splits(model, Split(dim=1, rank=tp_mesh.get_local_rank(), parts=tp_mesh.size()),
                         sequence_parallel)
    if model.tok_emb is not None and model.lm_head is not None:
        # parallelize_module gave the embedding and the head separate DTensor parameters; both are sharded by
        # vocabulary rows, so the tie is restored on the same placement.
        model.lm_head.weight = model.tok_emb.weight


def validate_tensor_parallel(cfg, tp: int) -> None:
    m, t = cfg.model, cfg.train
    if m.n_head % tp:
        raise ConfigError(f"model.n_head={m.n_head} is not divisible by parallel.tp={tp}: tensor parallelism splits "
                          f"heads across ranks; choose a tp that divides {m.n_head}")
    if m.d_model % tp or (m.d_ff or 4 * m.d_model) % tp:
        raise ConfigError(f"model.d_model={m.d_model} (and the MLP width) must be divisible by parallel.tp={tp}")
    if cfg.parallel.sequence_parallel and t.seq_len % tp:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by parallel.tp={tp}, which sequence "
                          f"parallelism needs: set train.seq_len to a multiple of {tp} or "
                          f"parallel.sequence_parallel=false")
    if m.vocab_multiple % tp:
        raise ConfigError(f"model.vocab_multiple={m.vocab_multiple} is not divisible by parallel.tp={tp}: the padded "
                          f"vocabulary is split across tp ranks; use a multiple of {tp} (e.g. {64 * tp})")


@register("tp")
class TensorParallel(Strategy):
    supported_dims = ("tp",)

    def validate(self) -> None:
        super().validate()
        if self.degrees.tp > 1:
            validate_tensor_parallel(self.cfg, self.degrees.tp)

    def describe(self) -> str:
        extras = [name for name, on in (("sequence parallel", self.cfg.parallel.sequence_parallel),
                                         ("loss parallel", self.cfg.parallel.loss_parallel)) if on]
        return f"{self.name} ({self.degrees.describe()}{', ' if extras else ''}{', '.join(extras)})"

    def apply_tensor_parallel(self, model: nn.Module) -> None:
        if self.degrees.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"], self.cfg.parallel.sequence_parallel,
                                  self.cfg.parallel.loss_parallel)

    def loss_context(self) -> AbstractContextManager:
        return loss_parallel() if self.cfg.parallel.loss_parallel and self.degrees.tp > 1 else nullcontext()
