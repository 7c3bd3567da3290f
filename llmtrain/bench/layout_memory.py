"""What each rank holds and sends under a layout, measured, next to the planner's prediction (llmtrain/planner/).

    torchrun --standalone --nproc_per_node=4 -m llmtrain.bench.layout_memory parallel=fsdp [model=gpt2 ...]
    torchrun ... -m llmtrain.bench.layout_memory --build-only parallel=fsdp model=gpt3-2.7b   # the build alone
    torchrun --standalone --nproc_per_node=8 -m llmtrain.bench.layout_memory --no-comm --bare parallel=fsdp \
        model=gpt2-medium train.micro_batch_size=1 train.seq_len=32 train.batch_size=8        # the step's phases,
                                                                                             # and bare FSDP2's
    torchrun ... -m llmtrain.bench.layout_memory "--layouts=ddp;zero1;tp parallel.sequence_parallel=true;pp"

Builds the model under the layout (measuring the build's peak: llmtrain/train/memory.py) and runs two training
steps on random tokens. It counts the bytes each rank holds in parameters, gradients and optimizer state
(distinct storages, local shards only) after the optimizer step, the parameters held between forward and
backward (where ZeRO-2 and ZeRO-3 differ), and the bytes of every collective and send of the second step by type
(llmtrain/bench/comm_count.py: the first step pays one-off traffic), and each step's high-water mark per phase
(forward, backward, clipping, optimizer: allocated bytes on a GPU, the resident set on a CPU). Rank 0 prints one
JSON line per rank and a table of measured / planned, the plan being the planner's for this rank's pipeline stage
with the sizes llmtrain holds (fp32 weights, gradients and AdamW moments): with Ψ the parameter count and N the
sharding degree,
    DDP: Ψ, Ψ, 2Ψ    ZeRO-1: Ψ, Ψ, 2Ψ/N    ZeRO-2: Ψ/N, Ψ/N, 2Ψ/N (Ψ during the step)    FSDP: Ψ/N, Ψ/N, 2Ψ/N
in elements of 4 bytes, exact up to the padding that makes shards equal.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.bench.comm_count import CommCounter
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.model import meta_model, num_parameters
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel.precision import uses_bf16
from llmtrain.planner.auto import configured_cost
from llmtrain.process.launch_env import ranks_per_node
from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.tools import compose_config
from llmtrain.train.memory import MemoryPeak, held_bytes, peak_since_reset, reset_peak, tensor_bytes


def predicted(cfg, model: ParallelModel, runtime: Runtime, vocab_size: int) -> dict[str, Any]:
    """The planner's numbers for this rank (its pipeline rank's), with the sizes llmtrain holds."""
    bf16 = uses_bf16(cfg.train.precision, runtime.device)
    plan = configured_cost(cfg, runtime.world_size, min(ranks_per_node(), runtime.world_size), vocab_size, bf16)
    pp_rank = model.mesh.device_mesh.get_local_rank("pp") if model.plan.degrees.pp > 1 else 0
    memory = plan.ranks[pp_rank]
    return {
        "params": memory.parameters,
        "grads": memory.gradients,
        "optimizer": memory.optimizer,
        "gathered": memory.gathered,
        "comm": dict(plan.traffic[pp_rank].bytes),
    }


def measure(cfg, runtime: Runtime, build_only: bool = False, count_comm: bool = True) -> list[dict]:
    """Collective: every rank's row for the layout of `cfg`."""
    torch.manual_seed(cfg.seed)
    vocab_size = cfg.model.vocab_size or 257
    whole = meta_model(cfg.model, vocab_size)
    n_params = num_parameters(whole)
    largest = max(p.numel() * p.element_size() for p in whole.parameters())
    with MemoryPeak(runtime.device) as build:
        model = build_parallel_model(cfg, runtime, vocab_size)
    will_hold = held_bytes(model.module, model.optimizer)
    row = {
        "rank": runtime.rank,
        "layout": model.plan.describe(),
        "parameters": n_params,
        "reported": will_hold.__dict__,
        "build_peak": build.bytes,
        "whole_model": 4 * n_params,
        "largest_tensor": largest,
    }
    if not build_only:
        row.update(_two_steps(cfg, model, runtime, vocab_size, count_comm))
        row["predicted"] = predicted(cfg, model, runtime, vocab_size)
    rows: list[Any] = [None] * runtime.world_size
    if runtime.distributed:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    return rows


def _two_steps(cfg, model: ParallelModel, runtime, vocab_size: int, count_comm: bool) -> dict:
    """Two training steps on random tokens, the second one's communication counted unless not `count_comm` (the
    first pays one-off traffic: DDP's bucket rebuild, the pipeline's shape exchange; the counter's profiler holds
    memory of its own); then what the rank holds."""
    module, optimizer = model.module, model.optimizer
    size, count = model.plan.micro_batching()
    generator = torch.Generator().manual_seed(model.mesh.dp_rank)
    held_in_step = None
    if model.plan.degrees.pp == 1:  # a pipeline part's forward takes its stage's input, not tokens
        with torch.no_grad(), model.precision():
            module(torch.randint(0, vocab_size, (size, cfg.train.seq_len), generator=generator).to(runtime.device))
        held_in_step = tensor_bytes(module.parameters())  # gathered parameters kept between forward and backward

    phases = PhasePeaks(runtime.device, module)

    def step(keep_gradients: bool) -> None:
        tokens = torch.randint(0, vocab_size, (size * count, cfg.train.seq_len + 1), generator=generator)
        phases.begin()
        model.forward_backward([(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(size)])
        phases.end("backward")
        model.clip_grad_norm(cfg.optim.grad_clip)
        phases.end("clipping")
        optimizer.step()
        phases.end("optimizer")
        optimizer.zero_grad(set_to_none=not keep_gradients)  # kept (zeroed) to be counted below

    step(keep_gradients=False)
    first_step = phases.take()
    counter = CommCounter() if count_comm else nullcontext()
    with counter:
        step(keep_gradients=True)
    second_step = phases.take()
    phases.close()
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    grads += [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    return {
        "params": tensor_bytes(module.parameters()),
        "grads": tensor_bytes(grads),
        "optimizer": tensor_bytes(state),
        "params_during_step": held_in_step,
        "comm": counter.bytes if isinstance(counter, CommCounter) else {},
        "step_peaks": [first_step, second_step],
    }


def bare_fsdp_peaks(cfg, runtime: Runtime, vocab_size: int) -> dict:
    """Collective: the same two steps' phase peaks under FSDP2 alone, none of llmtrain's layout code: the model from
    the meta device, `fully_shard` on each block and on the root (torch's defaults), normal-initialised shards,
    torch's AdamW and loss. What a layout's peaks hold beyond these is llmtrain's; what both hold, FSDP's, the
    backend's (gloo reduce-scatters through a whole-buffer all-reduce) or the allocator's."""
    from torch.distributed.fsdp import fully_shard

    model = meta_model(cfg.model, vocab_size)
    for block in model.blocks.values():
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=runtime.device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    generator = torch.Generator().manual_seed(runtime.rank)
    size = cfg.train.micro_batch_size
    count = cfg.train.batch_size // (size * runtime.world_size)
    phases = PhasePeaks(runtime.device, model)
    peaks = []
    for _ in range(2):
        tokens = torch.randint(0, vocab_size, (size * count, cfg.train.seq_len + 1), generator=generator)
        phases.begin()
        for chunk in tokens.split(size):
            logits = model(chunk[:, :-1].to(runtime.device))
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), chunk[:, 1:].flatten().to(runtime.device)
            ).backward()
        phases.end("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        phases.end("clipping")
        optimizer.step()
        phases.end("optimizer")
        optimizer.zero_grad(set_to_none=True)
        peaks.append(phases.take())
    phases.close()
    return {"rank": runtime.rank, "step_peaks": peaks}


class PhasePeaks:
    """The high-water mark of each phase of a step (CUDA: allocated bytes; CPU: resident set), the mark reset at
    every boundary: forward (the module's own forward, marked by hooks; a pipeline part's is not split out),
    backward (the loss, backward and the gradient reduction hooked into it), clipping, optimizer. Several
    micro-batches: the largest of each."""

    def __init__(self, device: torch.device, module: torch.nn.Module):
        self.device = device
        self.peaks: dict[str, int] = {}
        self.hooks = [
            module.register_forward_pre_hook(lambda *_: self.end("before forward")),
            module.register_forward_hook(lambda *_: self.end("forward")),
        ]

    def begin(self) -> None:
        reset_peak(self.device)

    def end(self, phase: str) -> None:
        """The phase that just ended: its peak recorded, a new one started."""
        if phase != "before forward":
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak_since_reset(self.device))
        reset_peak(self.device)

    def take(self) -> dict[str, int]:
        taken, self.peaks = self.peaks, {}
        return taken

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def _table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        f"{rows[0]['layout']}: {rows[0]['parameters']:,} parameters, fp32, whole model "
        f"{rows[0]['whole_model'] / mib:.1f} MiB, largest tensor {rows[0]['largest_tensor'] / mib:.1f} MiB",
        f"{'rank':>4} {'params MiB':>18} {'grads MiB':>18} {'optimizer MiB':>18} {'params in step':>14} "
        f"{'build peak':>10}",
    ]
    for r in rows:
        cells = [f"{r[k] / mib:8.3f} ({_ratio(r[k], r['predicted'][k])})" for k in ("params", "grads", "optimizer")]
        peak = "n/a" if r["build_peak"] is None else f"{r['build_peak'] / mib:.1f}"
        in_step = "n/a" if r["params_during_step"] is None else f"{r['params_during_step'] / mib:.3f}"
        lines.append(f"{r['rank']:>4} " + " ".join(f"{c:>18}" for c in cells) + f" {in_step:>14} {peak:>10}")
    ops = sorted({op for r in rows for op in (*r["comm"], *r["predicted"]["comm"])})
    lines.append(f"communicated per step, MiB (measured / planned): {'  '.join(f'{op:>24}' for op in ops)}")
    for r in rows:
        cells = [
            f"{r['comm'].get(op, 0) / mib:.3f} / {r['predicted']['comm'].get(op, 0) / mib:.3f}"
            f" ({_ratio(r['comm'].get(op, 0), r['predicted']['comm'].get(op, 0))})"
            for op in ops
        ]
        lines.append(f"{r['rank']:>4}{'':45}" + "  ".join(f"{c:>24}" for c in cells))
    lines.append("(n.nnnx) = measured / planned (llmtrain/planner/)")
    lines += _phase_lines(rows)
    return "\n".join(lines)


def _phase_lines(rows: list[dict]) -> list[str]:
    mib = 2**20
    phases = list(rows[0]["step_peaks"][1])
    lines = [f"peak per phase of step 1 | step 2, MiB: {'  '.join(f'{p:>20}' for p in phases)}"]
    for r in rows:
        first, second = r["step_peaks"]
        cells = [f"{first.get(p, 0) / mib:,.0f} | {second.get(p, 0) / mib:,.0f}" for p in phases]
        lines.append(f"{r['rank']:>4}{'':34}" + "  ".join(f"{c:>20}" for c in cells))
    return lines


def _ratio(measured: float, planned: float) -> str:
    return f"{measured / planned:.3f}x" if planned else "scalars" if measured < 2**10 else "unplanned"


def _build_table(rows: list[dict]) -> str:
    mib, whole = 2**20, rows[0]["whole_model"]
    lines = [
        f"{rows[0]['layout']}: whole model {whole / mib:,.1f} MiB (fp32), largest tensor "
        f"{rows[0]['largest_tensor'] / mib:,.1f} MiB",
        f"{'rank':>4} {'share MiB':>10} {'build peak MiB':>15} {'peak / whole':>12}",
    ]
    for r in rows:
        peak, share = r["build_peak"] or 0, r["reported"]["params"]
        lines.append(f"{r['rank']:>4} {share / mib:>10,.1f} {peak / mib:>15,.1f} {peak / whole:>12.3f}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Options: --build-only; --no-comm (no collective counted: memory alone); --layouts="a;b x.y=z;c" (several
    layouts, each a parallel= option with its own overrides, measured one after another in one process group and
    named in each row's "parallel" field: the bytes held and sent are exact for each, the build peak only for the
    first, since later builds reuse memory the earlier ones freed); the rest are Hydra overrides for every
    layout."""
    build_only, count_comm, bare = "--build-only" in argv, "--no-comm" not in argv, "--bare" in argv
    layouts = next((arg.split("=", 1)[1].split(";") for arg in argv if arg.startswith("--layouts=")), [None])
    overrides = [arg for arg in argv if not arg.startswith("--")]
    runtime = None
    for layout in layouts:
        name, *extra = layout.split() if layout else [None]
        cfg = compose_config(overrides + ([f"parallel={name}", *extra] if name else []))
        runtime = runtime or init_runtime(cfg.train.device)
        rows = measure(cfg, runtime, build_only, count_comm)
        if runtime.is_main:
            for row in rows:
                print(json.dumps({"parallel": layout, **row}))
            print(_build_table(rows) if build_only else _table(rows), file=sys.stderr)
    if bare and runtime is not None:
        cfg = compose_config(overrides)
        row = bare_fsdp_peaks(cfg, runtime, cfg.model.vocab_size or 257)
        gathered: list[Any] = [None] * runtime.world_size
        dist.all_gather_object(gathered, row)
        if runtime.is_main:
            for bare_row in gathered:
                print(json.dumps({"parallel": "bare fsdp2", **bare_row}))
            print("bare FSDP2 (fully_shard per block and root, torch's AdamW):", file=sys.stderr)
            print("\n".join(_phase_lines(gathered)), file=sys.stderr)
    if runtime is not None:
        runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
