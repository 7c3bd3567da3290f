"""What each rank holds under a layout, measured, next to the ZeRO formulas.

    torchrun --standalone --nproc_per_node=4 -m llmtrain.tools.layout_memory parallel=fsdp [model=gpt2 ...]

Builds the model under the layout, runs one training step on random tokens, and counts the bytes each rank holds
in parameters, gradients and optimizer state (distinct storages, local shards only) after the optimizer step,
plus the parameters held between forward and backward (where ZeRO-2 and ZeRO-3 differ). Rank 0 prints one JSON
line per rank and a table with the expected values: with Ψ the parameter count and N the sharding degree,
    DDP: Ψ, Ψ, 2Ψ    ZeRO-1: Ψ, Ψ, 2Ψ/N    ZeRO-2: Ψ/N, Ψ/N, 2Ψ/N (Ψ during the step)    FSDP: Ψ/N, Ψ/N, 2Ψ/N
in elements of 4 bytes (fp32), exact up to the padding that makes shards equal.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from llmtrain.model import build_model, num_parameters
from llmtrain.parallel import Strategy, get_strategy
from llmtrain.tools import compose_config
from llmtrain.runtime import init_runtime
from llmtrain.train.precision import precision_context


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    storages = {}
    for tensor in tensors:
        local = _local(tensor)
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state (tensors of one or more dimensions: AdamW's moments, not its
    scalar step counters) held by this rank."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    grads += [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0]
    return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(state)}


def expected_elements(strategy: Strategy, n_params: int) -> dict[str, float]:
    """The ZeRO formulas for this layout, in elements (FSDP shards over dp_shard, ZeRO-1 over all of dp)."""
    if strategy.name == "zero1":
        return {"params": n_params, "grads": n_params, "optimizer": 2 * n_params / strategy.dp_size}
    if strategy.name == "fsdp":
        n = strategy.degrees.dp_shard
        return {"params": n_params / n, "grads": n_params / n, "optimizer": 2 * n_params / n}
    return {"params": n_params, "grads": n_params, "optimizer": 2 * n_params}


def measure(cfg) -> dict:
    runtime = init_runtime(cfg.train.device)
    strategy = get_strategy(cfg.parallel.strategy)(cfg, runtime)
    torch.manual_seed(cfg.seed)
    gpt = build_model(cfg.model, cfg.model.vocab_size or 257, cfg.seed)
    n_params = num_parameters(gpt)
    model = strategy.parallelize(gpt.to(runtime.device))
    optimizer = strategy.build_optimizer(model)
    precision = precision_context(cfg.train.precision, runtime.device)
    tokens = torch.randint(0, gpt.cfg.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1),
                           generator=torch.Generator().manual_seed(strategy.dp_rank))
    with torch.no_grad(), precision():
        model(tokens[:, :-1].to(runtime.device))
    held_in_step = tensor_bytes(model.parameters())  # gathered parameters kept between forward and backward
    strategy.forward_backward(model, [(tokens[:, :-1], tokens[:, 1:])], precision)
    strategy.clip_grad_norm(model, cfg.optim.grad_clip)
    optimizer.step()
    measured = state_bytes(model, optimizer)
    expected = {k: 4 * v for k, v in expected_elements(strategy, n_params).items()}
    row = {"rank": runtime.rank, "layout": strategy.describe(), "parameters": n_params, **measured,
           "params_during_step": held_in_step, "expected": expected}
    rows = [None] * runtime.world_size
    if runtime.distributed:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    runtime.shutdown(synchronize=True)
    return {"rank": runtime.rank, "rows": rows}


def _table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [f"{rows[0]['layout']}: {rows[0]['parameters']:,} parameters, fp32",
             f"{'rank':>4} {'params MiB':>18} {'grads MiB':>18} {'optimizer MiB':>18} {'params in step':>14}"]
    for r in rows:
        cells = [f"{r[k] / mib:8.3f} ({r[k] / r['expected'][k]:.3f}x)" for k in ("params", "grads", "optimizer")]
        lines.append(f"{r['rank']:>4} " + " ".join(f"{c:>18}" for c in cells)
                     + f" {r['params_during_step'] / mib:14.3f}")
    lines.append("(n.nnnx) = measured / ZeRO formula")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    result = measure(compose_config(argv))
    if result["rank"] == 0:
        for row in result["rows"]:
            print(json.dumps(row))
        print(_table(result["rows"]), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
