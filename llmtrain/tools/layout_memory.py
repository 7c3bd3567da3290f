"""What each rank holds under a layout, measured, next to the ZeRO formulas.

    torchrun --standalone --nproc_per_node=4 -m llmtrain.tools.layout_memory parallel=fsdp [model=gpt2 ...]
    torchrun ... -m llmtrain.tools.layout_memory --build-only parallel=fsdp model=gpt3-2.7b   # the build alone
    torchrun ... -m llmtrain.tools.layout_memory --layouts=zero1,zero2,fsdp                    # one process group

Builds the model under the layout (measuring the build's peak: llmtrain/train/memory.py), runs one training step
on random tokens, and counts the bytes each rank holds in parameters, gradients and optimizer state (distinct
storages, local shards only) after the optimizer step, plus the parameters held between forward and backward
(where ZeRO-2 and ZeRO-3 differ). Rank 0 prints one JSON
line per rank and a table with the expected values: with Ψ the parameter count and N the sharding degree,
    DDP: Ψ, Ψ, 2Ψ    ZeRO-1: Ψ, Ψ, 2Ψ/N    ZeRO-2: Ψ/N, Ψ/N, 2Ψ/N (Ψ during the step)    FSDP: Ψ/N, Ψ/N, 2Ψ/N
in elements of 4 bytes (fp32), exact up to the padding that makes shards equal.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.model import meta_model, num_parameters
from llmtrain.parallel import Strategy
from llmtrain.runtime import Runtime, init_runtime
from llmtrain.tools import build_layout, compose_config
from llmtrain.train.memory import BuildPeak, held_bytes, tensor_bytes


def expected_elements(strategy: Strategy, n_params: int) -> dict[str, float]:
    """The ZeRO formulas for this layout, in elements (FSDP shards over dp_shard, ZeRO-1 over all of dp)."""
    if strategy.name == "zero1":
        return {"params": n_params, "grads": n_params, "optimizer": 2 * n_params / strategy.dp_size}
    if strategy.name == "fsdp":
        n = strategy.degrees.dp_shard
        return {"params": n_params / n, "grads": n_params / n, "optimizer": 2 * n_params / n}
    return {"params": n_params, "grads": n_params, "optimizer": 2 * n_params}


def measure(cfg, runtime: Runtime, build_only: bool = False) -> list[dict]:
    """Collective: every rank's row for the layout of `cfg`."""
    torch.manual_seed(cfg.seed)
    vocab_size = cfg.model.vocab_size or 257
    whole = meta_model(cfg.model, vocab_size)
    n_params = num_parameters(whole)
    largest = max(p.numel() * p.element_size() for p in whole.parameters())
    with BuildPeak(runtime.device) as build:
        strategy, model = build_layout(cfg, runtime, vocab_size)
        optimizer = strategy.build_optimizer(model, cfg.optim)
    will_hold = held_bytes(model, optimizer)
    row = {
        "rank": runtime.rank,
        "layout": strategy.describe(),
        "parameters": n_params,
        "reported": will_hold.__dict__,
        "build_peak": build.bytes,
        "whole_model": 4 * n_params,
        "largest_tensor": largest,
    }
    if not build_only:
        row.update(_one_step(cfg, strategy, model, optimizer, runtime, vocab_size, n_params))
    rows: list[Any] = [None] * runtime.world_size
    if runtime.distributed:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    return rows


def _one_step(cfg, strategy: Strategy, model, optimizer, runtime, vocab_size: int, n_params: int) -> dict:
    """One training step on random tokens, then what the rank holds, next to the ZeRO formulas."""
    precision, _ = strategy.precision()
    size, count = strategy.micro_batching()
    tokens = torch.randint(
        0, vocab_size, (size * count, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(strategy.dp_rank)
    )
    micro_batches = [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(size)]
    held_in_step = None
    if strategy.degrees.pp == 1:  # a pipeline part's forward takes its stage's input, not tokens
        with torch.no_grad(), precision():
            model(micro_batches[0][0].to(runtime.device))
        held_in_step = tensor_bytes(model.parameters())  # gathered parameters kept between forward and backward
    strategy.forward_backward(model, micro_batches, precision)
    strategy.clip_grad_norm(model, cfg.optim.grad_clip)
    optimizer.step()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grads += [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    measured = {
        "params": tensor_bytes(model.parameters()),
        "grads": tensor_bytes(grads),
        "optimizer": tensor_bytes(state),
    }
    expected = {k: 4 * v for k, v in expected_elements(strategy, n_params).items()}
    return {**measured, "params_during_step": held_in_step, "expected": expected}


def _table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        f"{rows[0]['layout']}: {rows[0]['parameters']:,} parameters, fp32, whole model "
        f"{rows[0]['whole_model'] / mib:.1f} MiB, largest tensor {rows[0]['largest_tensor'] / mib:.1f} MiB",
        f"{'rank':>4} {'params MiB':>18} {'grads MiB':>18} {'optimizer MiB':>18} {'params in step':>14} "
        f"{'build peak':>10}",
    ]
    for r in rows:
        cells = [f"{r[k] / mib:8.3f} ({r[k] / r['expected'][k]:.3f}x)" for k in ("params", "grads", "optimizer")]
        peak = "n/a" if r["build_peak"] is None else f"{r['build_peak'] / mib:.1f}"
        in_step = "n/a" if r["params_during_step"] is None else f"{r['params_during_step'] / mib:.3f}"
        lines.append(f"{r['rank']:>4} " + " ".join(f"{c:>18}" for c in cells) + f" {in_step:>14} {peak:>10}")
    lines.append("(n.nnnx) = measured / ZeRO formula")
    return "\n".join(lines)


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
    """Options: --build-only; --layouts=a,b,c (several parallel= options measured one after another in one process
    group, each in a row's "parallel" field: the bytes held are exact for each, the build peak only for the first,
    since later builds reuse memory the earlier ones freed); the rest are Hydra overrides."""
    build_only = "--build-only" in argv
    layouts = next((arg.split("=", 1)[1].split(",") for arg in argv if arg.startswith("--layouts=")), [None])
    overrides = [arg for arg in argv if not arg.startswith("--")]
    runtime = None
    for layout in layouts:
        cfg = compose_config(overrides + ([f"parallel={layout}"] if layout else []))
        runtime = runtime or init_runtime(cfg.train.device)
        rows = measure(cfg, runtime, build_only)
        if runtime.is_main:
            for row in rows:
                print(json.dumps({"parallel": layout, **row}))
            print(_build_table(rows) if build_only else _table(rows), file=sys.stderr)
    if runtime is not None:
        runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1:])
