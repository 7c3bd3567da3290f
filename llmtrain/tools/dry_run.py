"""`python -m llmtrain.tools.dry_run <training overrides> dry_run.world_size=N [dry_run.rank=r]`: check a cluster
layout on one CPU before the queue does. Examples:

    python -m llmtrain.tools.dry_run parallel=fsdp model=gpt2 dry_run.world_size=64
    python -m llmtrain.tools.dry_run parallel=3d parallel.pp=8 parallel.tp=8 model=llama3.2-1b model.n_layer=80 \\
        model.d_model=8192 model.n_head=64 model.n_kv_head=8 model.d_ff=28672 model.tie_embeddings=false \\
        train.seq_len=4096 train.batch_size=1024 train.micro_batch_size=1 dry_run.world_size=1024 dry_run.rank=517

One process stands in for rank r of an N-rank job (without dry_run.rank, for the first rank of each pipeline
stage in turn: the ranks whose memory and traffic differ). It joins a fake process group of N ranks (torch's `fake`
backend: every collective returns at once), lays the model out with training's own code (ParallelModel: the
mesh, FSDP2, DTensor tensor parallelism, the optimizer), allocates its parameters as fake tensors (shapes, dtypes
and devices, no memory) and runs `dry_run.steps` training steps: forward, backward, clipping, optimizer. The last
step is measured: the rank's peak memory by kind (LiveMemory below) and every collective it issues, beside
what the planner predicts for the same layout. A layout that would crash (a shape that does not split, a dtype
mix) ends in one line naming the module and the error, exit 2.

A fake group carries no values, so where a layout reads one that another rank sent, the dry run answers as the
plan implies: pipelines run their schedule as rank r's stages would, every message to or from another rank a
collective of the fake group, their stages given the message shapes torch's would agree on at the first step;
expert parallelism's all-to-alls split the tokens as an even router would (what its balancing loss aims at).

What it does not do yet, and why: the tensors are fake CPU tensors under the CUDA run's precision policy
(`train.precision=auto` becomes bf16), not fake CUDA ones: on a CPU-only build of torch, Python's tensor indexing
asks for a CUDA device guard that does not exist. DDP's reducer (parallel=ddp) is C++ that makes and reads tensors
of its own: that layout is refused (dry-run zero1, or ddp_tp with tp 1: DDP's semantics on FSDP2), as are 8-bit
optimizer state (its scales are values), the hand-written 1f1b_reference schedule (its shape headers are values)
and FSDP's CPU offload (host and device are one here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import weakref
from collections import Counter
from typing import Any, cast

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmtrain.config import (
    DryRunConfig,
    DryRunRootConfig,
    RootConfig,
    check_domains,
    keys_help,
    validate,
)
from llmtrain.config.composition import compose_or_refuse
from llmtrain.errors import ConfigError, closed_pipe_is_quiet, exits_on_run_error, first_line
from llmtrain.files import write_json_atomic
from llmtrain.model import GPT, ParameterInit
from llmtrain.model.hf_adopted import with_init_from_model
from llmtrain.model.materialize import allocate
from llmtrain.model.moe import MoE
from llmtrain.model.scoring import TokenMarks
from llmtrain.parallel.expert import AllToAllDispatch
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel_plan import ParallelPlan, check_layout
from llmtrain.planner.auto import configured_cost
from llmtrain.process.runtime import Runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.train.memory import storage_tensors

MIB, GIB = 2**20, 2**30
# What a model that takes its vocabulary from the tokenizer (model.vocab_size=null) is sized for here: GPT-2's
# tokenizer's 50,257, which the model pads to 50,304; a dry run reads no tokenizer.
GPT2_VOCABULARY = 50257


def dry_run_config(overrides: list[str]) -> DryRunRootConfig:
    """The config as train.py would run it on dry_run.world_size ranks, with the CUDA run's precision."""
    cfg = with_init_from_model(compose_or_refuse("dry_run", overrides, DryRunRootConfig), overrides)
    check_domains(cfg, DryRunRootConfig)
    validate(OmegaConf.masked_copy(cfg, [f.name for f in dataclasses.fields(RootConfig)]))  # training's rules
    config = cast(DryRunRootConfig, OmegaConf.to_object(cfg))
    world, rank = config.dry_run.world_size, config.dry_run.rank
    if rank is not None and rank >= world:
        raise ConfigError(f"dry_run.rank={rank} is not a rank of dry_run.world_size={world}: set it below {world}")
    check_layout(config, [o for o in overrides if not o.startswith("dry_run.")], world)
    if config.train.precision == "auto":  # what `auto` is on CUDA, the run this one stands in for
        config.train.precision = "bf16"
    return config


def _refuse_what_fake_tensors_cannot_run(plan: ParallelPlan, config: DryRunRootConfig) -> None:
    if plan.spec.data_parallel == "ddp":
        raise ConfigError(
            f"parallel={plan.name} cannot be dry-run: DistributedDataParallel's C++ reducer makes and reads tensors "
            f"of its own, which are fake here and hold no values; dry-run parallel=zero1 (the same traffic and "
            f"gradients, the optimizer state sharded) or parallel=ddp_tp parallel.tp=1 (DDP's semantics on FSDP2)"
        )
    if plan.pipelined and plan.parallel.pp_schedule == "1f1b_reference":
        raise ConfigError(
            "parallel.pp_schedule=1f1b_reference cannot be dry-run: its messages' shapes travel as values, which "
            "fake tensors do not have; dry-run parallel.pp_schedule=1f1b (torch's, the same messages and memory)"
        )
    if config.optim.state_bits != 32:
        raise ConfigError(
            f"optim.state_bits={config.optim.state_bits} cannot be dry-run yet: its block scales are computed "
            f"from values, which fake tensors do not have; dry-run optim.state_bits=32 (8-bit moments take a "
            f"quarter of its optimizer state, plus one fp32 scale per block)"
        )
    if config.parallel.cpu_offload:
        raise ConfigError(
            "parallel.cpu_offload=true cannot be dry-run: the dry run's fake tensors are host tensors, so it cannot "
            "tell host memory from the device's; dry-run parallel.cpu_offload=false (the device then holds what "
            "it reports as parameters, gradients and optimizer state on top of the rest)"
        )


class CollectiveTally(TorchDispatchMode):
    """Every collective this rank issues, by op: calls and bytes as nccl-tests counts them (all_gather the gathered
    output, reduce_scatter the unreduced input, all_reduce and broadcast the tensor, all_to_all the send buffer),
    read from the op's tensor arguments: the largest one, times the group for a functional all-gather, whose output
    is not an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func._schema.name.partition("::")
        if namespace in ("c10d", "_c10d_functional") and name not in ("wait_tensor", "barrier", "monitored_barrier"):
            op = _op_name(name)
            sizes = [t.numel() * t.element_size() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            nbytes = max(sizes, default=0)
            if namespace == "_c10d_functional" and op == "all_gather":
                nbytes *= args[1]  # (input, group_size, group_name)
            self.calls[op] += 1
            self.bytes[op] += nbytes
        return func(*args, **(kwargs or {}))


def _op_name(name: str) -> str:
    """A c10d op's name as the planner's traffic names it (allgather_, _allgather_base_, all_gather_into_tensor ->
    all_gather)."""
    bare = name.strip("_").replace("_coalesced", "").replace("_base", "").replace("_into_tensor", "")
    bare = bare.replace("_tensor", "").replace("_single", "")
    return {"allgather": "all_gather", "allreduce": "all_reduce", "alltoall": "all_to_all"}.get(bare, bare)


class _ModuleTrail:
    """The module each forward is in (forward pre- and post-hooks on every submodule), for naming where a layout
    failed."""

    def __init__(self, module: nn.Module):
        self.stack: list[str] = []
        for name, sub in module.named_modules():
            sub.register_forward_pre_hook(lambda *_, name=name: self._enter(name))
            sub.register_forward_hook(lambda *_: self._leave())

    def _enter(self, name: str) -> None:
        self.stack.append(name)

    def _leave(self) -> None:
        if self.stack:
            self.stack.pop()

    def where(self) -> str:
        return self.stack[-1] if self.stack and self.stack[-1] else "the model's top level"


class FakeFromAllocation:
    """Fake tensors from the moment the model is allocated to the end of the run: a materializer that enters
    `mode` (once) and allocates the laid-out model without values (a dry run's steps read none), so that what the
    build makes from the parameters afterwards (ZeRO-1's flat buffers, the optimizer) is fake too. The layout
    itself runs before, with real tensors: the device meshes it derives are built from their values."""

    def __init__(self, mode: FakeTensorMode, stack: contextlib.ExitStack):
        self.mode, self.stack, self.entered = mode, stack, False

    def __call__(self, model: nn.Module, device: torch.device, init: ParameterInit) -> None:
        self.enter()
        allocate(model, device)

    def enter(self) -> None:
        if not self.entered:
            self.stack.enter_context(self.mode)
            self.entered = True


def ranks_to_run(config: DryRunRootConfig) -> list[int]:
    """dry_run.rank, or the first rank of each pipeline stage (the outermost mesh dimension): the ranks whose
    memory and traffic differ. Within a stage, tensor, expert and data-parallel positions hold equal shares."""
    if config.dry_run.rank is not None:
        return [config.dry_run.rank]
    world = config.dry_run.world_size
    pp = ParallelPlan.of(config.parallel, config.train, config.model, world).degrees.pp
    return [stage * (world // pp) for stage in range(pp)]


def dry_run(config: DryRunRootConfig, rank: int) -> dict[str, Any]:
    """Build the layout as `rank` of dry_run.world_size and run its steps; what the last one held and sent, and
    the planner's prediction."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = config.dry_run.world_size
    plan = ParallelPlan.of(config.parallel, config.train, config.model, world)
    _refuse_what_fake_tensors_cannot_run(plan, config)
    started = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        runtime = Runtime(rank, world, rank % config.hardware.gpus_per_node, torch.device("cpu"), "dry-run")
        vocab_size = config.model.vocab_size or GPT2_VOCABULARY
        with contextlib.ExitStack() as stack:
            fake = FakeFromAllocation(FakeTensorMode(allow_non_fake_inputs=True), stack)
            # the last id ends documents (train.attention=document): the steps' tokens are made up anyway
            try:
                model = build_parallel_model(
                    config, runtime, vocab_size, materializer=fake, marks=TokenMarks(vocab_size - 1)
                )
            except ConfigError:
                raise
            except Exception as error:  # what training would crash on at start-up, in one line
                raise ConfigError(f"the layout fails to build on rank {rank}: {first_line(error)}") from error
            fake.enter()  # a model without parameters to allocate
            _answer_the_pipeline_vote(model, config)
            _route_evenly(model.module)
            measured = _steps(model, plan, config, rank)
    finally:
        dist.destroy_process_group()
        # DTensor caches the layouts of its ops by mesh shape, naming the groups of the mesh that made them: a
        # later dry run in this process has meshes of the same shapes over new groups.
        _clear_sharding_prop_cache()
    measured["rank"], measured["seconds"] = rank, time.perf_counter() - started
    pp_rank = model.executor.pp_rank
    measured["planned"] = planned_for(config, vocab_size, pp_rank)
    measured["pp_rank"] = pp_rank
    measured["layout"] = model.plan.describe()
    measured["precision"] = model.precision_description
    return measured


class EvenAllToAll(AllToAllDispatch):
    """Expert parallelism's exchange with the split sizes of an even routing: every rank sends each rank an equal
    share of its slots, and receives as much (a fake group carries no counts to read them from). An even router
    is what the load-balancing loss aims at; a skewed one makes the receiving ranks' buffers larger."""

    def split_sizes(
        self, rows: torch.Tensor, to_rank: torch.Tensor, from_rank: torch.Tensor
    ) -> tuple[list[int], list[int]]:
        share, left = divmod(len(rows), self.size)
        sizes = [share + (rank < left) for rank in range(self.size)]
        return sizes, sizes


def _route_evenly(module: nn.Module) -> None:
    for block in module.modules():
        if isinstance(block, MoE) and isinstance(block.dispatch, AllToAllDispatch):
            block.dispatch = EvenAllToAll(block.dispatch.group)


def _answer_the_pipeline_vote(model: ParallelModel, config: DryRunRootConfig) -> None:
    """On its first step, torch's pipelining votes over the pp group whether every stage knows the shapes of its
    messages (a vote read with `.item()`) and, where one does not, sends them over (pickled): values, which a fake
    process group does not carry. The dry run gives each of this rank's stages its shapes, as the plan fixes them
    (a micro-batch of tokens into the first stage; the residual stream, cut by context and sequence parallelism,
    between stages; logits out of the last), and answers the vote for every stage: known."""
    if not model.plan.pipelined:
        return
    from torch.distributed.pipelining._utils import InferenceMode, extract_tensor_metas

    from llmtrain.parallel.pipelined import Pipeline

    pipeline = model.executor
    assert isinstance(pipeline, Pipeline), "a pipelined plan's executor"
    plan, schedule = model.plan, pipeline.schedule
    size, _ = plan.micro_batching()
    sequence = config.train.seq_len // plan.degrees.cp
    residual_sequence = sequence // plan.degrees.tp if plan.parallel.sequence_parallel else sequence
    tokens = torch.empty((size, sequence), dtype=torch.long, device="meta")
    width, dtype = config.model.d_model, pipeline.residual_dtype
    residual = torch.empty((size, residual_sequence, width), dtype=dtype, device="meta", requires_grad=True)
    logits = torch.empty((size, sequence, cast(GPT, pipeline.module).cfg.padded_vocab_size), dtype=dtype, device="meta")
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        stage._user_meta.inputs = extract_tensor_metas((tokens if stage.is_first else residual,))
        stage._user_meta.outputs = extract_tensor_metas((logits if stage.is_last else residual,))

    def static(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static


class LiveMemory(TorchDispatchMode):
    """The bytes of the tensors alive on this rank and their high-water mark, by kind: every op's outputs counted
    once per storage until it is freed, storages resized in place (FSDP2 frees and refills its gathered
    parameters that way) followed through `UntypedStorage.resize_`. At the peak, each live storage is a
    parameter (this rank's shard), a gradient or optimizer state when the model and optimizer hold it, else an
    activation or temporary (gathered parameters, saved activations, communication buffers). The peak's kinds are
    read again whenever it has grown by `regrain` since they were last read."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, regrain: float = 0.005):
        super().__init__()
        self.regrain = regrain
        # This rank's shards, taken before a step: FSDP2 puts gathered parameters in their place while it runs.
        self.parameters = list(module.parameters())
        state = [t for values in optimizer.state.values() for t in values.values() if isinstance(t, torch.Tensor)]
        self.live: dict[int, int] = {}
        self.total = self.peak = 0
        self.peak_kinds: dict[str, int] = {}
        self._kinds_at = 0
        self._resize = torch.UntypedStorage.resize_
        self._parameter_keys = {storage._cdata for p in self.parameters for storage in _storages(p)}
        self._state_keys = {storage._cdata for t in state for storage in _storages(t)} - self._parameter_keys
        for tensor in [*self.parameters, *module.buffers(), *state]:
            for storage in _storages(tensor):
                self._add(storage)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.live:
            return
        self.live[key] = 0
        weakref.finalize(storage, self._free, key)
        self._resized(key, storage.nbytes())

    def _free(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)

    def _resized(self, key: int, nbytes: int) -> None:
        self.total += nbytes - self.live[key]
        self.live[key] = nbytes
        if self.total > self.peak:
            self.peak = self.total
            if self.peak > self._kinds_at * (1 + self.regrain):
                self._read_kinds()

    def _read_kinds(self) -> None:
        self._kinds_at = self.peak
        live = self.live.keys()
        grads = {s._cdata for p in self.parameters if p.grad is not None for s in _storages(p.grad)}
        grads -= self._parameter_keys
        kinds = {
            "parameters": self._parameter_keys & live,
            "gradients": grads & live,
            "optimizer state": self._state_keys - grads & live,
        }
        self.peak_kinds = {kind: sum(self.live[key] for key in keys) for kind, keys in kinds.items()}
        self.peak_kinds["activations and temporaries"] = self.total - sum(self.peak_kinds.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            # A DTensor's own storage stands for its global shape; its local tensor, made by a local op that runs
            # while this mode is set aside (inside the DTensor op), is what it holds. Meta tensors are DTensor's
            # shape arithmetic.
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                for storage in _storages(tensor):
                    self._add(storage)
        return out

    def __enter__(self):
        memory = self

        def resize(storage: torch.UntypedStorage, size: int):
            result = memory._resize(storage, size)
            memory._add(storage)  # one allocated before the step (FSDP2's gathered parameters): counted from now
            memory._resized(storage._cdata, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages of a tensor, or of a DTensor's local part (read without dispatching an op); of the plain
    tensors inside a wrapper subclass (an NF4 weight's codes and scales), not the wrapper's nominal one."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return [inner.untyped_storage() for inner in storage_tensors(local)]


def _steps(model: ParallelModel, plan: ParallelPlan, config: DryRunRootConfig, rank: int) -> dict[str, Any]:
    """The training steps, in the fake mode the build entered."""
    size, count = plan.micro_batching()
    trail = _ModuleTrail(model.module)
    tally = CollectiveTally()
    tokens = torch.zeros((size * count, config.train.seq_len + 1), dtype=torch.long)
    micro_batches = [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(size)]
    for step in range(config.dry_run.steps):
        last = step == config.dry_run.steps - 1  # optimizer state exists from the first step on
        memory = LiveMemory(model.module, model.optimizer) if last else contextlib.nullcontext()
        with memory, tally if last else contextlib.nullcontext():
            try:
                model.forward_backward(micro_batches)
                model.clip_grad_norm(config.optim.grad_clip)
                model.optimizer.step()
                model.optimizer.zero_grad(set_to_none=True)
            except Exception as error:
                raise ConfigError(f"the layout fails on rank {rank} in {trail.where()}: {first_line(error)}") from error
    assert isinstance(memory, LiveMemory)
    return {"peak": memory.peak, "kinds": memory.peak_kinds, "calls": dict(tally.calls), "bytes": dict(tally.bytes)}


def planned_for(config: DryRunRootConfig, vocab_size: int, pp_rank: int) -> dict[str, Any]:
    """The planner's numbers for a rank at pipeline position `pp_rank`, with the sizes llmtrain holds (as
    llmtrain.bench.layout_memory), on nodes of hardware.gpus_per_node ranks."""
    world = config.dry_run.world_size
    cost = configured_cost(config, world, min(config.hardware.gpus_per_node, world), vocab_size, bf16=True)
    memory, traffic = cost.ranks[pp_rank], cost.traffic[pp_rank]
    return {
        "parameters": memory.parameters,
        "gradients": memory.gradients,
        "optimizer state": memory.optimizer,
        "activations and temporaries": memory.activations + memory.gathered,
        "peak": memory.total,
        "bytes": dict(traffic.bytes),
        "calls": dict(traffic.calls),
        "unmodelled": cost.unmodelled,
    }


def report(results: list[dict[str, Any]], config: DryRunRootConfig) -> str:
    """One row per rank: its memory at the step's peak by kind, then its collectives, as measured / planned."""
    d, first = config.dry_run, results[0]
    unit, scale = ("GiB", GIB) if max(r["peak"] for r in results) >= GIB else ("MiB", MIB)
    ranks = f"rank {first['rank']}" if len(results) == 1 else f"{len(results)} ranks (the first of each pipeline stage)"
    lines = [
        f"dry run   {ranks} of {d.world_size}: {first['layout']}; {first['precision']}; {d.steps} steps each, in "
        f"{sum(r['seconds'] for r in results):.1f} s (fake tensors, fake process group)",
        "",
        f"memory at the step peak ({unit}), measured / planned",
        f"{'rank':>6}{'stage':>6}" + "".join(f"{_SHORT.get(kind, kind):>18}" for kind in [*first["kinds"], "peak"]),
    ]
    for r in results:
        planned = r["planned"]
        pairs = [(r["kinds"][kind], planned[kind]) for kind in first["kinds"]]
        pairs.append((r["peak"], planned["peak"]))
        lines.append(f"{r['rank']:6d}{r['pp_rank']:6d}" + "".join(_cell(m, p, scale, 2) for m, p in pairs))
    if first["planned"]["unmodelled"]:
        reason = first["planned"]["unmodelled"]
        lines.append(f"the planner's memory is not trusted here ({reason}): parallel=auto never picks it")
    ops = sorted({op for r in results for op in [*r["calls"], *r["planned"]["bytes"]]})
    lines += ["", f"collectives in the step ({unit}), measured / planned, and the calls measured"]
    lines.append(f"{'rank':>6}{'stage':>6}" + "".join(f"{op:>27}" for op in ops))
    for r in results:
        cells = "".join(
            _cell(r["bytes"].get(op, 0), r["planned"]["bytes"].get(op, 0), scale, 3, r["calls"].get(op, 0))
            for op in ops
        )
        lines.append(f"{r['rank']:6d}{r['pp_rank']:6d}{cells}")
    return "\n".join(lines)


_SHORT = {"optimizer state": "optimizer", "activations and temporaries": "activations+temp"}


def _cell(measured: float, planned: float, scale: int, digits: int, calls: int | None = None) -> str:
    text = f"{measured / scale:.{digits}f} / {planned / scale:.{digits}f}"
    return f"{text} ({calls})".rjust(27) if calls is not None else text.rjust(18)


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Keys (key=default and what it accepts; below it, what it does):")
        own = {f"dry_run.{f.name}" for f in dataclasses.fields(DryRunConfig)}
        print(keys_help(compose_or_refuse("dry_run", [], DryRunRootConfig), DryRunRootConfig, only=own))
        print("Training's keys: python train.py --help")
        return
    with exits_on_run_error():
        config = dry_run_config(argv)
        ranks = ranks_to_run(config)
        results: list[dict[str, Any]] = []
        for rank in ranks:
            if len(ranks) > 1:
                print(f"dry-running rank {rank} ({len(results) + 1} of {len(ranks)})", file=sys.stderr, flush=True)
            results.append(dry_run(config, rank))
    print(report(results, config))
    if config.dry_run.output:
        write_json_atomic(config.dry_run.output, {"ranks": results})
        print(f"results: {config.dry_run.output}")


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
