"""How a layout is applied to a model on the meta device: one linear sequence of plain steps, each in its own
module (tp.py, fsdp.py, ddp.py; compilation is here). Activation checkpointing is not a step: the blocks
are built recomputing as train.activation_checkpointing says (llmtrain/model/recompute.py), inside their forward.

The ordering rule, stated once: context parallelism first (it only tells the model which positions it holds and
hands its attention the ring), expert parallelism next (it shards the experts and hands each mixture its
all-to-all), then float8 (it swaps Linear layers for torchao's Float8Linear, which torchao's float8 tensor-parallel
styles expect to find), then tensor parallelism (every later step sees the sharded layers), then compilation, of
each block or of the whole model (so it captures the sharded computation, recomputation included), then FSDP (it
hooks the module tree as it will run). Only then is memory allocated, each rank only what it keeps
(llmtrain/model/materialize.py); wrappers that need real weights (DDP, which broadcasts them; ZeRO-1's flat
buffers, built with the optimizer) come after that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from llmtrain.errors import ConfigError
from llmtrain.model.base import LayeredModel
from llmtrain.model.moe import MoE
from llmtrain.parallel.context import apply_context_parallel
from llmtrain.parallel.expert import apply_expert_parallel
from llmtrain.parallel.family import family_layout
from llmtrain.parallel.float8 import Float8, apply_float8, float8_on, round_compiled_casts_as_eager
from llmtrain.parallel.fsdp import apply_fsdp, expert_fsdp_mesh, fsdp_mesh
from llmtrain.parallel.mesh import RankMesh
from llmtrain.parallel.precision import uses_bf16
from llmtrain.parallel.tp import apply_tensor_parallel
from llmtrain.parallel_plan import ParallelPlan


@dataclass(frozen=True)
class LayoutSteps:
    """What `apply_layout` does to one model (or pipeline stage): `layout_steps` reads it off a checked plan."""

    cp_mesh: DeviceMesh | None = None  # None: no context parallelism
    ep_mesh: DeviceMesh | None = None  # the experts' (ep) or (ep, tp) mesh; None: every rank holds all experts
    float8: Float8 | None = None  # None: the blocks' matmuls in the compute dtype
    tp_mesh: DeviceMesh | None = None  # None: no tensor parallelism
    sequence_parallel: bool = False
    loss_parallel: bool = False
    compile: str = "none"  # none | blocks | model: what torch.compile makes one graph of (apply_compile)
    compile_backend: str = "inductor"  # train.compile_backend
    fsdp_mesh: DeviceMesh | None = None  # None: parameters are not sharded over data-parallel ranks
    expert_fsdp_mesh: DeviceMesh | None = None  # with ep_mesh: the ranks FSDP shards the experts over
    data_parallel_size: int = 1  # the ranks whose gradients are averaged (dp_replicate x dp_shard x cp)
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None  # FSDP's gathered parameters (bf16 compute), gradients reduced in fp32
    cpu_offload: bool = False


def layout_steps(plan: ParallelPlan, mesh: RankMesh, device: torch.device) -> LayoutSteps:
    """The steps `plan`'s layout takes on this rank's model, from its row's fields: tensor parallelism over the tp
    dimension when it has one, context and expert parallelism when their degrees are above 1, compilation as
    train.compile asks, and FSDP where the data-parallel mechanism shards parameters (inside a pipeline only over
    more than one rank, keeping the gathered parameters for the whole step: resharding after forward would
    re-gather them for every micro-batch)."""
    d, p, t, spec = plan.degrees, plan.parallel, plan.train, plan.spec
    if p.cpu_offload and device.type != "cuda":
        raise ConfigError(
            f"parallel.cpu_offload=true moves FSDP's shards from a GPU into host memory, but this run is on "
            f"{device.type}, where they are in host memory already: set parallel.cpu_offload=false"
        )
    sharded = spec.fsdp_shards(d.dp * d.cp)
    fsdp: dict = {}
    if sharded:
        fsdp.update(
            fsdp_mesh=fsdp_mesh(mesh.device_mesh, d),
            reshard_after_forward=p.reshard_after_forward and not spec.pipeline,
        )
    if mesh.expert_mesh is not None:  # the plan allows ep only where FSDP shards (so `fsdp` is set)
        fsdp.update(
            ep_mesh=mesh.expert_mesh["ep", "tp"] if d.tp > 1 else mesh.expert_mesh["ep"],
            expert_fsdp_mesh=expert_fsdp_mesh(mesh.expert_mesh, d),
            data_parallel_size=d.dp * d.cp,
        )
    tp = d.tp > 1
    return LayoutSteps(
        cp_mesh=mesh.cp_mesh,
        # Over one rank FSDP gathers nothing: a float8 all-gather would only add its casts and scale precompute.
        float8=float8_on(
            t.float8,
            t.float8_layers,
            device,
            sharded=sharded and d.dp_shard_cp > 1,
            tensor_parallel=tp,
            sequence_parallel=tp and p.sequence_parallel,
        ),
        tp_mesh=mesh.tp_mesh,
        sequence_parallel=tp and p.sequence_parallel,
        loss_parallel=tp and p.loss_parallel,
        compile=compile_scope(plan, sharded),
        compile_backend=t.compile_backend,
        param_dtype=torch.bfloat16 if uses_bf16(t.precision, device) else None,
        cpu_offload=p.cpu_offload,
        **fsdp,
    )


def compile_scope(plan: ParallelPlan, sharded: bool) -> str:
    """What train.compile makes one graph of under `plan`: `model` where nothing splits the rank's model (no FSDP,
    tensor, context or expert parallelism, no pipeline) and attention is causal; `blocks` elsewhere; `none` without
    train.compile. apply_compile narrows `model` to `blocks` for models it cannot take whole."""
    if not plan.train.compile:
        return "none"
    d = plan.degrees
    splits = sharded or d.tp > 1 or d.cp > 1 or d.ep > 1 or plan.spec.pipeline
    return "blocks" if splits or plan.train.attention != "causal" else "model"


def compiles_whole(model: LayeredModel) -> bool:
    """Whether `model` compiles as one graph: dense blocks (a mixture block may break, below) without sliding
    windows (whose block masks are built between the blocks)."""
    blocks = list(model.blocks.values())
    dense = not any(isinstance(getattr(block, "mlp", None), MoE) for block in blocks)
    windows = any(getattr(getattr(block, "attn", None), "window", None) is not None for block in blocks)
    return dense and not windows


# How the start summary says what train.compile made one graph of, by compile_unit.
COMPILED_AS = {"model": "as one graph", "blocks": "block by block"}


def compile_unit(scope: str, model: LayeredModel) -> str:
    """What `scope` (compile_scope's) makes one graph of in `model`: `model` narrowed to `blocks` where the model
    cannot compile whole."""
    return "blocks" if scope == "model" and not compiles_whole(model) else scope


# The graphs one code object may make under train.compile (apply_compile): 16 structural variants, with room.
RECOMPILE_LIMIT = 32


def apply_compile(model: LayeredModel, scope: str, backend: str = "inductor") -> None:
    """torch.compile `model` with `backend` as `scope` (compile_unit's) says.

    `model`: the whole model with nothing split, one graph from the embeddings to the head: the step's operators
    fuse across the blocks' edges (a residual add with the next norm) and nothing runs eagerly between graphs (a
    bare loop compiled so ran 10% faster than per-block graphs on a CPU: llmtrain.bench.overhead). The graph
    grows with the depth, and so does the first compile.

    `blocks`: each block a graph of its own, one reused by every layer (same shapes), a short compile; what FSDP's
    units, pipeline stages and parallel styles need. Dense and context-parallel blocks compile whole (fullgraph:
    a break would quietly run part of a block eagerly; tests/model/test_model.py checks each kind). Mixture blocks
    may break: in fp32 the grouped GEMM has no compiled form (their experts run one by one, the counts read on the
    host), and under activation checkpointing their load count is a side effect the recomputed region cannot hold.

    Either way the loss is a graph of its own where the logits are whole (parallel/step_setup.py).

    A graph is specialised to the grad mode, whether its input needs a gradient, adapters on or off, and (per block)
    the attention's window: DPO and GRPO score without gradients with adapters off (their reference), and a block
    whose input comes from an adapted block needs one, so a model of two window kinds makes up to 16 graphs of one
    code object, past dynamo's default limit of 8 (meant for code that recompiles with every new shape)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if compile_unit(scope, model) == "model":
        model.compile(fullgraph=True, backend=backend)
        return
    for block in model.blocks.values():
        block.compile(fullgraph=not isinstance(getattr(block, "mlp", None), MoE), backend=backend)


def apply_layout(model: LayeredModel, layout: LayoutSteps) -> None:
    """The steps of `layout`, in the order above, on a model that is still on the meta device."""
    if layout.cp_mesh is not None:
        apply_context_parallel(model, layout.cp_mesh)
    if layout.ep_mesh is not None:
        apply_expert_parallel(model, layout.ep_mesh)
    if layout.float8 is not None:
        apply_float8(model, layout.float8)
    if layout.tp_mesh is not None:
        float8_styles = layout.float8 is not None and layout.float8.tensor_parallel_styles
        plan = family_layout(model).tensor_parallel_plan(model, layout.sequence_parallel, layout.loss_parallel)
        apply_tensor_parallel(model, plan, layout.tp_mesh, float8_styles)
    if layout.compile != "none":
        if layout.float8 is not None and layout.float8.recipe == "rowwise":
            round_compiled_casts_as_eager()
        apply_compile(model, layout.compile, layout.compile_backend)
    if layout.fsdp_mesh is not None:
        apply_fsdp(
            model,
            layout.fsdp_mesh,
            layout.reshard_after_forward,
            layout.param_dtype,
            layout.cpu_offload,
            experts=(layout.expert_fsdp_mesh, layout.data_parallel_size) if layout.expert_fsdp_mesh else None,
        )
