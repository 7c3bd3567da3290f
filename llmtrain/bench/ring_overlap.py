"""Ring attention on this machine: its time per rank against one process attending the whole sequence, and how
much of its transfer hides behind its compute.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 -m llmtrain.bench.ring_overlap --seq-len 4096

Speed: forward + backward of the ring on each rank (median over --repeats) against the fused causal attention
(`F.scaled_dot_product_attention`) of the whole sequence in one process (rank 0, the other ranks idle). A ring
split over cp ranks does 1/cp of the causal work per rank, so the ratio's floor is 1/cp; what it adds above that
is the merging, the fp32 accumulation and the transfers it could not hide.

Overlap: per ring step (one key/value block), rank 0 reports the compute time, the time it still waited for the
transfer after computing (exposed), and the time the same transfer takes alone (nothing to hide behind). hidden =
1 - exposed / alone: 1 when the transfer is fully overlapped, 0 when posting it early bought nothing. Forward and
backward are reported apart (backward sends the keys and values again, plus their fp32 gradients). On a GPU the
times are CUDA events on the compute stream (ring_attention.RingTimes): NCCL does not block the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.parallel import ring_attention as ring
from llmtrain.process.runtime import Runtime, init_runtime


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(work: Callable[[], object], device: torch.device, repeats: int, together: bool = True) -> float:
    """Median wall time of `work` after one warm-up; `together`: every rank starts each repeat at a barrier."""
    work()
    times = []
    for _ in range(repeats):
        if together:
            dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        work()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transfer_alone(kv: torch.Tensor, group: dist.ProcessGroup, repeats: int) -> float:
    """Median seconds of one ring hop of `kv` with nothing else to do."""
    hop = ring.Ring(group)

    def one_hop() -> None:
        _, works = hop.start(kv)
        for work in works:
            work.wait()

    return median_seconds(one_hop, kv.device, repeats)


def speed(runtime: Runtime, args: argparse.Namespace, dtype: torch.dtype, group: dist.ProcessGroup) -> dict:
    """The ring's forward + backward per rank against one process's fused attention of the whole sequence."""
    device, cp = runtime.device, runtime.world_size

    def inputs(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (args.batch, args.heads, length, args.head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        return q, k, v

    q, k, v = inputs(args.seq_len // cp)
    ring_seconds = median_seconds(lambda: ring.ring_attention(q, k, v, group).sum().backward(), device, args.repeats)
    whole_seconds = 0.0
    if runtime.is_main:
        whole_q, whole_k, whole_v = inputs(args.seq_len)
        whole_seconds = median_seconds(
            lambda: F.scaled_dot_product_attention(whole_q, whole_k, whole_v, is_causal=True).sum().backward(),
            device,
            args.repeats,
            together=False,
        )
    dist.barrier()
    return {
        "ring_ms": round(ring_seconds * 1e3, 2),
        "whole_sequence_ms": round(whole_seconds * 1e3, 2),
        "ratio": round(ring_seconds / whole_seconds, 3) if whole_seconds else None,
    }


def overlap(runtime: Runtime, args: argparse.Namespace, dtype: torch.dtype, group: dist.ProcessGroup) -> dict:
    shape = (args.batch, args.heads, args.seq_len // runtime.world_size, args.head_dim)
    q, k, v = (torch.randn(shape, device=runtime.device, dtype=dtype, requires_grad=True) for _ in range(3))
    ring.ring_attention(q, k, v, group).sum().backward()  # warm-up
    results = {}
    for phase in ("forward", "backward"):
        ring.RING_TIMES.clear()
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
        compute = ring.RING_TIMES.seconds("compute")
        exposed = sum(ring.RING_TIMES.seconds("wait")) / max(1, len(compute))
        results[phase] = {
            "compute_ms": round(statistics.median(compute) * 1e3, 3),
            "exposed_ms": round(exposed * 1e3, 3),
            "transfer_alone_ms": round(alone * 1e3, 3),
            "hidden": round(max(0.0, 1 - exposed / alone), 3) if alone > 0 else None,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="the whole sequence, split over the ranks")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    runtime = init_runtime("auto")
    group = dist.group.WORLD
    assert group is not None
    dtype_name = args.dtype or ("bf16" if runtime.device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    cp = runtime.world_size
    results = {"speed": speed(runtime, args, dtype, group), **overlap(runtime, args, dtype, group)}
    if runtime.is_main:
        local = args.seq_len // cp
        print(
            f"ring attention, cp {cp}, {args.seq_len} tokens ({local} per rank), {args.heads} heads x "
            f"{args.head_dim}, {dtype_name}, {torch.get_num_threads()} thread(s) per process"
        )
        s = results["speed"]
        print(
            f"forward + backward per rank {s['ring_ms']:.1f} ms, one process over the whole sequence "
            f"{s['whole_sequence_ms']:.1f} ms: {s['ratio']:.2f}x (floor 1/cp = {1 / cp:.2f})"
        )
        print(f"{'phase':<10}{'compute/step ms':>17}{'exposed ms':>12}{'transfer alone ms':>19}{'hidden':>8}")
        for phase in ("forward", "backward"):
            r = results[phase]
            print(
                f"{phase:<10}{r['compute_ms']:>17.2f}{r['exposed_ms']:>12.2f}{r['transfer_alone_ms']:>19.2f}"
                f"{r['hidden']:>8.2f}"
            )
        print(json.dumps({"cp": cp, "seq_len": args.seq_len, "dtype": dtype_name, **results}))
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
