"""Run by test_pipeline.py under torchrun: every pipeline schedule over all ranks (pp = world size), each trained a
few steps on the same batches as the unsplit model, which every rank also trains by itself (`single`, in-process).
One process group serves all schedules, so the suite pays for process start-up once.

    torchrun --nproc_per_node=P tests/workers/pipeline_worker.py OUT_DIR MICROBATCHES

Rank 0 writes OUT_DIR/results.json: per schedule the per-step losses and gradient norms of both runs, the largest
weight difference, the peak micro-batches alive per rank, and the step's bubble; each schedule's Gantt chart lands
in OUT_DIR/<schedule>/pipeline.png.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from llmtrain.catalog import SCHEDULES as ALL_SCHEDULES
from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.tools import compose_config
from llmtrain.tools.compare_runs import max_weight_difference

STEPS = 2
VOCAB = 257
# name -> virtual stages per rank
SCHEDULES = {name: spec.fewest_stages_per_rank for name, spec in ALL_SCHEDULES.items()}


def config(layout: list[str], microbatches: int):
    return compose_config(
        [
            "model=tiny",
            "model.n_layer=8",
            "train.seq_len=32",
            "train.batch_size=16",
            f"train.micro_batch_size={16 // microbatches}",
            "optim.warmup_steps=1",
            *layout,
        ]
    )


def batches(cfg) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """STEPS global batches of random tokens, as micro-batches of train.micro_batch_size (the same on every rank)."""
    generator = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=generator)
        steps.append([(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(cfg.train.micro_batch_size)])
    return steps


def validation_loss(model) -> float:
    """The trained model's loss on micro-batches of 3, 5 and 2 sequences: the receiving stages learn only the first
    one's shape from a header, the others' from their own micro-batch sizes."""
    tokens = torch.randint(0, VOCAB, (10, 33), generator=torch.Generator().manual_seed(1))
    micro_batches = [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split([3, 5, 2])]
    model.module.eval()
    loss = model.reduce_mean(model.evaluate(micro_batches)).item()
    model.module.train()
    return loss


def train(cfg, runtime: Runtime):
    """The trainer's step (llmtrain/train/loop.py) on fixed batches: losses, gradient norms, the parallel model."""
    torch.manual_seed(cfg.seed)
    model = build_parallel_model(cfg, runtime, VOCAB)
    losses, norms = [], []
    for micro_batches in batches(cfg):
        losses.append(model.reduce_mean(model.forward_backward(micro_batches)).item())
        norms.append(model.clip_grad_norm(cfg.optim.grad_clip).item())
        model.optimizer.step()
        model.optimizer.zero_grad(set_to_none=True)
    return losses, norms, model


class PostedGroups:
    """Records, without changing it, every group of point-to-point operations this rank posts together through
    `dist.batch_isend_irecv`: a list of [("send" | "recv", peer rank), ...] per group."""

    def __init__(self):
        self.groups: list[list[tuple[str, int]]] = []
        self._post = torch.distributed.batch_isend_irecv

    def __enter__(self) -> PostedGroups:
        def post(ops):
            self.groups.append([("send" if op.op is torch.distributed.isend else "recv", op.peer) for op in ops])
            return self._post(ops)

        torch.distributed.batch_isend_irecv = post
        return self

    def __exit__(self, *exc) -> None:
        torch.distributed.batch_isend_irecv = self._post


def main(out_dir: str, microbatches: int) -> None:
    runtime = init_runtime("cpu")
    local = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    ref_losses, ref_norms, ref_model = train(config(["parallel=single"], microbatches), local)
    reference = ref_model.full_state_dict()
    ref_validation = validation_loss(ref_model)
    results = {}
    for schedule, stages_per_rank in SCHEDULES.items():
        cfg = config(
            [
                "parallel=pp",
                f"parallel.pp_schedule={schedule}",
                f"parallel.pp_stages_per_rank={stages_per_rank}",
                f"parallel.microbatches={microbatches}",
            ],
            microbatches,
        )
        with PostedGroups() as posted:
            losses, norms, model = train(cfg, runtime)
        validation = validation_loss(model)
        groups = [None] * runtime.world_size
        torch.distributed.all_gather_object(groups, posted.groups)
        weights = model.full_state_dict()
        run_dir = os.path.join(out_dir, schedule)
        os.makedirs(run_dir, exist_ok=True)
        report = model.report(run_dir)
        if runtime.is_main:
            results[schedule] = {
                "losses": losses,
                "reference_losses": ref_losses,
                "norms": norms,
                "reference_norms": ref_norms,
                "validation": validation,
                "reference_validation": ref_validation,
                "same_names": sorted(weights) == sorted(reference),
                "weight_difference": max_weight_difference(weights, reference),
                "state": weights,
                "posted_groups": groups,  # per rank, its batch_isend_irecv groups in order (hand-written only)
                **report["pipeline"],
            }
    if runtime.is_main:
        # The hand-written 1F1B against torch's, step for step: same losses, norms and final weights, bit for bit.
        ours, theirs = results["1f1b_reference"].pop("state"), results["1f1b"]["state"]
        results["1f1b_reference"]["weights_equal_1f1b"] = all(torch.equal(ours[k], theirs[k]) for k in theirs)
        for result in results.values():
            result.pop("state", None)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
