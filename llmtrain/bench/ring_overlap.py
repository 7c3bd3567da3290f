"""How much of ring attention's transfer hides behind its compute, measured on this machine.

    torchrun --standalone --nproc_per_node=4 -m llmtrain.bench.ring_overlap --seq-len 4096 --heads 8 --head-dim 64

Per ring step (one key/value block), rank 0 reports the compute time, the time it still waited for the transfer
after computing (exposed), and the time the same transfer takes alone (nothing to hide behind). hidden = 1 -
exposed / alone: 1 when the transfer is fully overlapped, 0 when posting it early bought nothing. Forward and
backward are reported apart (backward sends the keys and values again, plus their fp32 gradients).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.parallel import ring_attention as ring
from llmtrain.runtime import init_runtime


def transfer_alone(kv: torch.Tensor, group: dist.ProcessGroup, repeats: int) -> float:
    """Median seconds of one ring hop of `kv` with nothing else to do."""
    hop = ring.Ring(group)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        _, works = hop.start(kv)
        for work in works:
            work.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="the whole sequence, split over the ranks")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runtime = init_runtime("auto")
    group = dist.group.WORLD
    assert group is not None
    cp = runtime.world_size
    local = args.seq_len // cp
    shape = (args.batch, args.heads, local, args.head_dim)
    q, k, v = (torch.randn(shape, device=runtime.device, requires_grad=True) for _ in range(3))
    ring.ring_attention(q, k, v, group).sum().backward()  # warm-up

    results = {}
    for phase in ("forward", "backward"):
        ring.RING_TIMES.compute.clear()
        ring.RING_TIMES.wait.clear()
        for _ in range(args.repeats):
            ring.RING_TIMES.enabled = phase == "forward"
            out = ring.ring_attention(q, k, v, group)
            ring.RING_TIMES.enabled = phase == "backward"
            out.sum().backward()
        ring.RING_TIMES.enabled = False
        # Transfers per step: forward waits once per step (its keys and values); backward twice (keys and values,
        # then the gradient that travels with them).
        moved = torch.stack([k, v]).detach()
        alone = transfer_alone(moved if phase == "forward" else torch.cat([moved, moved.float()]), group, args.repeats)
        compute = statistics.median(ring.RING_TIMES.compute)
        exposed = sum(ring.RING_TIMES.wait) / max(1, len(ring.RING_TIMES.compute))
        results[phase] = {
            "compute_ms": round(compute * 1e3, 3),
            "exposed_ms": round(exposed * 1e3, 3),
            "transfer_alone_ms": round(alone * 1e3, 3),
            "hidden": round(max(0.0, 1 - exposed / alone), 3) if alone > 0 else None,
        }
    if runtime.is_main:
        print(
            f"ring attention, cp {cp}, {args.seq_len} tokens ({local} per rank), {args.heads} heads x {args.head_dim}"
        )
        print(f"{'phase':<10}{'compute/step ms':>17}{'exposed ms':>12}{'transfer alone ms':>19}{'hidden':>8}")
        for phase, r in results.items():
            print(
                f"{phase:<10}{r['compute_ms']:>17.2f}{r['exposed_ms']:>12.2f}{r['transfer_alone_ms']:>19.2f}"
                f"{r['hidden']:>8.2f}"
            )
        print(
            json.dumps({"cp": cp, "seq_len": args.seq_len, "heads": args.heads, "head_dim": args.head_dim, **results})
        )
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
