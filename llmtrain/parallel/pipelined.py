"""`parallel=pp | pp_fsdp | pp_tp | 3d`: the model cut by depth into stages on the `pp` mesh dimension, micro-batches
run through a pipeline schedule, and within each stage the usual tensor (tp) and sharded data (dp_shard) parallelism.

Per step each rank runs only its stages' blocks; neighbours exchange one (micro-batch, seq, d_model) activation per
micro-batch forward and its gradient backward, the only traffic across the pp dimension, which is why pp goes
across nodes and tp inside them. Within a stage FSDP keeps its gathered parameters for the whole step
(reshard_after_forward off): resharding would re-gather them for every micro-batch.

The tied embedding and LM head live on different stages (the first and the last), as two copies kept equal:
after backward their gradients are summed between the two ranks (Megatron's embedding group), and both get the
same update. Gradient clipping takes the norm over all stages, counting that matrix once; the logged loss is the
mean over the global batch, as in every layout.

A Pipeline is one of ParallelModel's two executors (llmtrain/parallel/executor.py), the other accumulation.py's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from llmtrain.catalog import schedule_spec
from llmtrain.errors import ConfigError
from llmtrain.model import LayeredModel
from llmtrain.parallel.executor import Combine
from llmtrain.parallel.family import family_layout
from llmtrain.parallel.layout import LayoutSteps, apply_layout
from llmtrain.parallel.pipeline.p2p import exchange, recv_header, send_header
from llmtrain.parallel.pipeline.reference import Reference1F1B
from llmtrain.parallel.pipeline.schedules import torch_schedule
from llmtrain.parallel.pipeline.split import rank_stages, stage_rank
from llmtrain.parallel.pipeline.timeline import TimedStage, Timeline, bubble_fraction, plot_gantt
from llmtrain.parallel.step_setup import StepSetup
from llmtrain.parallel.tensors import MicroBatches, Statistic, full_tensor, grads_by_layout, local_tensor, squared_norm
from llmtrain.parallel_plan import stage_layers


class Pipeline:
    """This rank's stages of the model cut by depth (`stages`, one per entry of `stage_indices`; `module` holds them
    all, for the optimizer), each laid out by `steps` and allocated and initialised by `allocate`, and the schedule
    that runs them: all made at construction."""

    def __init__(
        self,
        setup: StepSetup,
        model: LayeredModel,
        steps: LayoutSteps,
        allocate: Callable[[nn.Module], None],
    ):
        self.setup = setup
        self.plan, self.mesh, self.runtime = setup.plan, setup.mesh, setup.runtime
        pp, per_rank = self.plan.degrees.pp, self.plan.parallel.pp_stages_per_rank
        self.spec = schedule_spec(self.plan.parallel.pp_schedule)
        self.group = self.mesh.device_mesh["pp"].get_group()
        self.pp_rank = self.mesh.device_mesh.get_local_rank("pp")
        self.n_stages = pp * per_rank
        self.stage_indices = rank_stages(self.pp_rank, pp, per_rank, self.spec.style)
        # What the stages send each other (the residual stream): bf16 where FSDP gathers bf16 weights; autocast's
        # residual adds keep fp32.
        fsdp_mixed_precision = steps.fsdp_mesh is not None and steps.param_dtype is not None
        self.residual_dtype = torch.bfloat16 if fsdp_mixed_precision else torch.float32
        self.timeline = Timeline(self.runtime.device)
        # The factor of this step's summed micro-batch losses (StepSetup.loss_scale), set by forward_backward: the
        # schedule calls the loss with what torch passes it alone.
        self._loss_scale: float | torch.Tensor = 1.0
        # Before the stages are allocated: a dry run's materializer turns every tensor made after it fake, and the
        # groups are read from the mesh's values.
        self.tied_group = self._tied_embedding_group()
        self.module, self.stages = self._cut(model, steps, allocate)
        self.tied_parameters = self.module.tied_parameters
        self.schedule = self._build_schedule()

    # -- construction ---------------------------------------------------------------------------------------
    def _cut(
        self, model: LayeredModel, steps: LayoutSteps, allocate: Callable[[nn.Module], None]
    ) -> tuple[LayeredModel, list[LayeredModel]]:
        """This rank's part of `model` (on the meta device), then each of its stages laid out (tensor / data
        parallelism) and allocated."""
        layers = stage_layers(len(model.blocks), self.n_stages, self.plan.parallel.pp_edge_blocks)
        last = self.n_stages - 1
        family = family_layout(model)
        part = family.pipeline_part(
            model,
            [i for stage in self.stage_indices for i in layers[stage]],
            0 in self.stage_indices,
            last in self.stage_indices,
        )
        stages = []
        for stage in self.stage_indices:
            view = family.stage_view(part, layers[stage], stage == 0, stage == last)
            apply_layout(view, steps)
            # Per stage: each view is an FSDP root whose parameters FSDP must re-register once allocated.
            allocate(view)
            stages.append(view)
        return part, stages

    def _build_schedule(self):
        m, device = self.plan.microbatches, self.runtime.device
        schedule_class = torch_schedule(self.spec)
        if schedule_class is None:
            return Reference1F1B(
                self.stages[0], self.pp_rank, self.n_stages, self.group, m, self._loss, device, self.timeline
            )
        stages = [
            TimedStage(module, stage, self.n_stages, device, group=self.group, timeline=self.timeline)
            for stage, module in zip(self.stage_indices, self.stages)
        ]
        try:
            if self.spec.stages_per_rank == "one":
                return schedule_class(stages[0], m, loss_fn=self._loss)
            return schedule_class(stages, m, loss_fn=self._loss)
        except ValueError as error:  # torch's own conditions beyond those validate_schedule checks
            raise ConfigError(
                f"parallel.pp_schedule={self.plan.parallel.pp_schedule} with parallel.microbatches={m}: {error}"
            ) from None

    def _tied_embedding_group(self) -> dist.ProcessGroup | None:
        """The two ranks (same data and tensor-parallel coordinates) holding the embedding and the LM head; None
        when one rank holds both (V schedules)."""
        if stage_rank(self.n_stages - 1, self.plan.degrees.pp, self.spec.style) == 0:
            return None
        mine = None
        ends = self.mesh.device_mesh.mesh[[0, -1]].reshape(2, -1)
        for pair in ends.T.tolist():  # every rank creates every group, in the same order
            group = dist.new_group(pair)
            if self.runtime.rank in pair:
                mine = group
        return mine

    # -- one step -------------------------------------------------------------------------------------------
    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.setup.loss(logits, targets) * self._loss_scale

    def forward_backward(self, micro_batches: MicroBatches) -> torch.Tensor:
        """One step's micro-batches through the schedule, which cuts their concatenation again: the mean micro-batch
        loss, computed on the last stage's rank and shared with the whole pipeline."""
        setup, device = self.setup, self.runtime.device
        whole = torch.cat([x for x, _ in micro_batches])
        inputs = setup.context_shard(whole).to(device)
        targets = setup.context_shard(torch.cat([y for _, y in micro_batches])).to(device)
        self._loss_scale = setup.loss_scale(micro_batches, self.plan.microbatches)
        with setup.loss_context(), setup.precision():
            return self._step(inputs, targets, setup.documents(whole))

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor, documents: dict[str, torch.Tensor]) -> torch.Tensor:
        """The schedule's step over the whole step's `inputs` and `targets` (this rank's part of each sequence, on
        the device); the tied copies' gradients summed; the mean loss shared. `documents`: the stages' `documents`
        keyword for the whole step (split into micro-batches as the inputs are; every stage gets its own), or
        none."""
        losses: list[torch.Tensor] = []
        self.timeline.begin_step()
        # torch's schedules would otherwise keep every micro-batch's logits on the last stage to return them
        outputs = {} if isinstance(self.schedule, Reference1F1B) else {"return_outputs": False}
        if 0 in self.stage_indices:
            self.schedule.step(inputs, target=targets, losses=losses, **outputs, **documents)
        else:
            self.schedule.step(target=targets, losses=losses, **outputs, **documents)
        self._sum_tied_gradients()
        mean = torch.stack([full_tensor(loss) for loss in losses]).mean() if losses else None
        return self._share(mean if mean is not None else torch.zeros((), device=self.runtime.device))

    def _share(self, value: torch.Tensor) -> torch.Tensor:
        """A value the last stage's rank computed (zeros on the others), on every rank of the pipeline."""
        dist.all_reduce(value, group=self.group)
        return value

    def _sum_tied_gradients(self) -> None:
        held = {name for name, _ in self.module.named_parameters()}
        for tied, source in self.tied_parameters.items():
            copies = [self.module.get_parameter(name) for name in (source, tied) if name in held]
            if not all(copy.requires_grad for copy in copies):  # frozen beside low-rank adapters: no gradients
                continue
            grads = [_local_grad(copy) for copy in copies]
            if len(grads) == 2:
                total = grads[0] + grads[1]
                for grad in grads:
                    grad.copy_(total)
            elif grads:
                dist.all_reduce(grads[0], group=self.tied_group)

    def forward_only(self, micro_batches: MicroBatches, statistic: Statistic, combine: Combine) -> torch.Tensor:
        """`combine` of the micro-batches' statistics, computed on the last stage's rank (`combine([])` on the
        others) and shared with the whole pipeline."""
        with self.setup.precision(), self.setup.loss_context():
            results = self._on_last_stage(micro_batches, statistic)
        return self._share(combine(results))

    def _on_last_stage(self, micro_batches: MicroBatches, statistic: Statistic) -> list[torch.Tensor]:
        """`statistic` of each micro-batch on the last stage's rank ([] elsewhere), by forward-only pipelining,
        micro-batch by micro-batch: each rank runs, for micro-batch 0, 1, ..., its stages in increasing order,
        receiving each input from the previous stage's rank and sending each output on. Every rank goes through
        (micro-batch, stage) in the same order, so the k-th message between two ranks is the k-th on both sides and
        each waits only on work that comes earlier in that order: no cycle, even where a send blocks until received
        (NCCL; a rank with several stages sends both ways). With one stage per rank the ranks still overlap: rank 0
        computes micro-batch i + 1 while rank 1 computes i.
        The first output of each stage travels with a header (its trailing shape and dtype, a host read on the
        receiver); the others' shapes follow from the micro-batch sizes every pipeline rank already holds."""
        setup, device, last = self.setup, self.runtime.device, self.n_stages - 1
        results: list[torch.Tensor] = []
        stages = sorted(zip(self.stage_indices, self.stages), key=lambda pair: pair[0])
        received: dict[int, tuple[list[int], torch.dtype]] = {}  # stage -> its input's trailing shape and dtype
        for i, (whole_inputs, whole_targets) in enumerate(micro_batches):
            inputs, targets = setup.context_shard(whole_inputs), setup.context_shard(whole_targets)
            documents = setup.documents(whole_inputs)
            carried: torch.Tensor | None = None  # the output of the previous stage when this rank holds it
            for stage, module in stages:
                if stage == 0:
                    x = inputs.to(device)
                elif carried is not None:
                    x = carried
                else:
                    previous = self._global_rank(stage - 1)
                    if stage not in received:
                        received[stage] = recv_header(previous, self.group, device)
                    shape, dtype = received[stage]
                    x = torch.empty([len(inputs), *shape[1:]], dtype=dtype, device=device)
                    exchange([dist.P2POp(dist.irecv, x, previous, self.group)])
                output, carried = module(x, **documents), None
                if stage == last:
                    results.append(full_tensor(statistic(output, targets.to(device))))
                elif stage + 1 in self.stage_indices:
                    carried = output
                else:
                    following = self._global_rank(stage + 1)
                    if i == 0:
                        send_header(output, following, self.group)
                    exchange([dist.P2POp(dist.isend, output.contiguous(), following, self.group)])
        return results

    def _global_rank(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage_rank(stage, self.plan.degrees.pp, self.spec.style))

    def grad_norm(self) -> torch.Tensor:
        """The global gradient norm over every stage; a tied parameter's copy (the LM head's embedding matrix) is one
        parameter of the model, counted once."""
        tied = self.tied_parameters
        counted = [param for name, param in self.module.named_parameters() if name not in tied]
        squared = squared_norm(grads_by_layout(counted))
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()

    # -- results --------------------------------------------------------------------------------------------
    def _gather_to_main(self, payload: object) -> list | None:
        """The pipeline's payloads by pp rank, on rank 0 (the pipeline that holds rank 0 takes part)."""
        if 0 not in dist.get_process_group_ranks(self.group):
            return None
        gathered = [None] * self.plan.degrees.pp if self.runtime.is_main else None
        dist.gather_object(payload, gathered, dst=0, group=self.group)
        return gathered

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model on rank 0's host, assembled tensor by tensor. Every rank walks the same list
        of (pipeline rank, parameter); the ranks of the stage holding one gather it (FSDP / TP shards), and the
        first of them sends it to rank 0 unless rank 0 holds it itself. No rank holds more than one whole tensor
        it does not keep; a tied copy (the head's embedding matrix) is not sent twice."""
        tied = self.tied_parameters
        params = dict(self.module.named_parameters())
        listing = [(name, tuple(param.shape), param.dtype) for name, param in params.items() if name not in tied]
        held: list = [None] * self.plan.degrees.pp
        dist.all_gather_object(held, listing, group=self.group)
        state: dict[str, torch.Tensor] = {}
        device = self.runtime.device
        for holder, names in enumerate(held):
            first_rank = int(self.mesh.device_mesh.mesh[holder].flatten()[0])
            for name, shape, dtype in names:
                if holder == self.pp_rank:
                    whole = full_tensor(params[name].detach())
                    if self.runtime.is_main:
                        state[name] = whole.cpu()
                    elif self.runtime.rank == first_rank and holder != 0:
                        dist.send(whole.contiguous(), dst=0)
                elif self.runtime.is_main:
                    whole = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(whole, src=first_rank)
                    state[name] = whole.cpu()
        if not self.runtime.is_main:
            return None
        state.update({name: state[source] for name, source in tied.items() if source in state})
        return state

    def report(self, run_dir: str) -> dict:
        gathered = self._gather_to_main((self.timeline.events, self.timeline.peak_in_flight))
        if not gathered:
            return {}
        p, v, m = self.plan.degrees.pp, self.plan.parallel.pp_stages_per_rank, self.plan.microbatches
        events = [rank_events for rank_events, _ in gathered]
        measured, theory = bubble_fraction(events), (p - 1) / (v * m)
        schedule = self.plan.parallel.pp_schedule
        plot_gantt(
            events,
            os.path.join(run_dir, "pipeline.png"),
            stages_per_rank=v,
            title=f"{schedule}: pp={p}, {m} micro-batches{f', {v} stages/rank' if v > 1 else ''} — "
            f"bubble (idle / compute) measured {measured:.2f}, (p-1)/(v·m) = {theory:.2f}",
        )
        result = {
            "schedule": schedule,
            "pp": p,
            "stages_per_rank": v,
            "microbatches": m,
            "bubble_measured": measured,
            "bubble_theory": theory,
            "peak_in_flight": [peak for _, peak in gathered],
        }
        with open(os.path.join(run_dir, "pipeline.json"), "w") as f:
            json.dump({**result, "events": [[e.__dict__ for e in rank_events] for rank_events in events]}, f)
        return {"pipeline": result}


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of the gradient, laid out as the parameter is (a tensor-parallel embedding's gradient
    can come back replicated; the head's is sharded like the weight), so the two copies' parts line up."""
    grad = param.grad
    assert grad is not None, "called after backward"
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return local_tensor(grad)
