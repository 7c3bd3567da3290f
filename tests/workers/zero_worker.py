"""Run by tests/checkpoint/test_checkpoint.py under torchrun on 2 ranks: a ZeRO-1 checkpoint saved and loaded by the
real
checkpoint code (llmtrain/checkpoint/state.py and manager.py), its cost and what it restores.

    torchrun --nproc_per_node=2 tests/workers/zero_worker.py OUT_DIR "<model overrides>"

After two steps on random tokens, each rank measures the peak memory its save takes above what it held
(checkpoint_state + CheckpointManager: no gathered moments may appear), then saves again in the background
(checkpoint.async_save's staging); a fresh ZeRO-1 model (other weights, no optimizer state) loads the background
save, its peak measured too, and rank 0's unsplit model (built before the group forms, as `single` would resume)
loads the first without a process group. Rank 0 writes OUT_DIR/results.json: the peaks, the bytes of the whole
model and of its largest tensor, and how far each restored state is from the saved one.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llmtrain.checkpoint.manager import CheckpointManager, checkpoint_path, load_checkpoint
from llmtrain.checkpoint.state import checkpoint_state, load_checkpoint_state
from llmtrain.differences import largest, tensor_difference
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.parallel.zero import ZeroOneAdamW
from llmtrain.process.runtime import Runtime, all_gather_single, init_runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.tools import compose_config
from llmtrain.train.memory import MemoryPeak

VOCAB = 257
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def layout(overrides: list[str], runtime: Runtime, seed: int) -> ParallelModel:
    config = OmegaConf.to_object(compose_config([*overrides, f"seed={seed}", "train.device=cpu"]))
    return build_parallel_model(config, runtime, VOCAB)


def take_steps(model: ParallelModel, number: int) -> None:
    size, count = model.plan.micro_batching()
    generator = torch.Generator().manual_seed(model.mesh.dp_rank)
    for _ in range(number):
        tokens = torch.randint(0, VOCAB, (size * count, 33), generator=generator)
        model.forward_backward([(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(size)])
        model.clip_grad_norm(1.0)
        model.optimizer.step()
        model.optimizer.zero_grad()


def full_moments(optimizer: ZeroOneAdamW, names: dict) -> dict[str, torch.Tensor]:
    """Every parameter's whole AdamW moments, gathered from the slices (verification only)."""
    moments = {}
    for bucket in optimizer.buckets:
        state = optimizer.state[bucket.shard]
        for key in ("exp_avg", "exp_avg_sq"):
            full = torch.empty_like(bucket.flat_params)
            all_gather_single(full, state[key].contiguous())
            offset = 0
            for param in bucket.params:
                moments[f"{names[param]}.{key}"] = full[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
    return moments


def main(out_dir: str, model_overrides: str) -> None:
    # Every allocation of a megabyte or more its own mapping, returned when freed: the resident set then follows
    # the tensors (glibc's default raises this threshold as large blocks are freed, so the heap keeps holes whose
    # reuse hides, or whose growth adds, tens of megabytes).
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 2**20)
    overrides = [*model_overrides.split(), "parallel=zero1"]
    alone = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    unsplit = layout([*overrides[:-1], "parallel=single"], alone, seed=7) if os.environ["RANK"] == "0" else None
    runtime = init_runtime("cpu")
    saved = layout(overrides, runtime, seed=0)
    take_steps(saved, 2)
    with MemoryPeak(runtime.device) as save_peak:
        state = checkpoint_state(saved)
        CheckpointManager(os.path.join(out_dir, "sync"), 1, False, runtime).save(2, state.values, {}, {})
        del state
    in_background = CheckpointManager(os.path.join(out_dir, "async"), 1, True, runtime)
    in_background.save(2, checkpoint_state(saved).values, {}, {})
    in_background.wait()
    sync, in_background_path = (checkpoint_path(os.path.join(out_dir, kind), 2) for kind in ("sync", "async"))

    fresh = layout(overrides, runtime, seed=1)
    take_steps(fresh, 1)  # holding its optimizer state, as a rank does when it loads
    with MemoryPeak(runtime.device) as load_peak:
        state = checkpoint_state(fresh)
        load_checkpoint(in_background_path, state.values, distributed=True)
        load_checkpoint_state(fresh, state)
        del state
    same_slices = all(
        torch.equal(fresh.optimizer.state[mine.shard][key], saved.optimizer.state[theirs.shard][key])
        for mine, theirs in zip(fresh.optimizer.buckets, saved.optimizer.buckets)
        for key in ("exp_avg", "exp_avg_sq", "step")
    ) and all(torch.equal(a, b) for a, b in zip(fresh.module.parameters(), saved.module.parameters()))

    names = {param: name for name, param in saved.module.named_parameters()}
    moments = full_moments(saved.optimizer, names)
    peaks = [None, None]
    dist.all_gather_object(peaks, (save_peak.bytes, load_peak.bytes))
    slices = [None, None]
    dist.all_gather_object(slices, same_slices)
    if unsplit is not None:
        state = checkpoint_state(unsplit)
        load_checkpoint(sync, state.values, distributed=False)
        load_checkpoint_state(unsplit, state)
        worst = largest(
            tensor_difference(unsplit.optimizer.state[param][key], moments[f"{name}.{key}"])
            for name, param in unsplit.module.named_parameters()
            if param.requires_grad  # the head's frozen padding mask has no optimizer state
            for key in ("exp_avg", "exp_avg_sq")
        )
        steps = {float(s["step"]) for s in unsplit.optimizer.state.values()}
        sizes = [p.numel() * p.element_size() for p in unsplit.module.parameters()]
        results = {
            "save_peaks": [p[0] for p in peaks],
            "load_peaks": [p[1] for p in peaks],
            "whole_model": sum(sizes),
            "largest_tensor": max(sizes),
            "zero1_restored_exactly": slices,
            "single_moment_difference": worst,
            "single_steps": sorted(steps),
        }
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
