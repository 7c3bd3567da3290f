"""Run by tests under torchrun: several layouts, each trained a few steps by the real trainer (the components
llmtrain/run/job.py builds for train.py) in one process group, on the same global batches as the unsplit model, which
rank 0 trains by itself first (`single`, before the group forms). The process group and the imports are paid for
once, however many layouts.

    torchrun --nproc_per_node=N tests/workers/layout_worker.py OUT_DIR "<overrides for all>" "<layout 1>" ...

Each layout is a space-separated list of overrides ("parallel=tp parallel.sequence_parallel=true"); the overrides
before its first `parallel` one choose what it trains (`model=moe-tiny optim=muon parallel=fsdp`) and it is
compared with the unsplit run of those (`single model=moe-tiny optim=muon`). Rank 0 writes
OUT_DIR/results.json: per layout its per-step losses and gradient norms, its validation loss, and its largest
weight difference to the unsplit model after the last step; what it holds (`holdings`: float8 layers, the kind,
size and place of the optimizer's moments, over all ranks), which the losses alone cannot show (an emulated
float8 rounds by less than the layouts' tolerance, an offloaded AdamW on a CPU is AdamW to the bit); with
eval.tasks, its task scores and the lm-eval adapter's answers.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import time

import torch
from omegaconf import OmegaConf

from llmtrain.model.scoring import SUMMED_LOSSES, UNSCORED
from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_training
from llmtrain.tools import compose_config
from llmtrain.tools.compare_runs import max_weight_difference
from llmtrain.train.flight_recorder import flight_entries
from llmtrain.train.loop import Trainer

STEPS = 2
# The tiny models in byte tokens (on the embedded corpus unless the overrides name another), validated after the last
# step over one global batch (whose rows every layout splits as it splits the training batch). train.steps is one more
# than the steps taken, so no end-of-run checkpoint is written (checkpoints have tests of their own); each layout
# gets its own run directory under OUT_DIR, and never resumes.
RUN = [
    f"train.steps={STEPS + 1}",
    f"train.eval_every={STEPS}",
    "train.eval_batches=1",
    "logging.wandb.mode=disabled",
    "train.device=cpu",
    "checkpoint.resume=none",
    "data.tokenizer.kind=byte",
]


def train(overrides: list[str], runtime: Runtime, run_dir: str) -> tuple[dict, dict | None]:
    """The trainer's records of `overrides` (losses, gradient norms, validation loss), and rank 0's full weights."""
    parts = build_training(OmegaConf.to_object(compose_config([*RUN, *overrides])), runtime, run_dir)
    records: list[dict] = []
    # What the steps computed in: the dtype of the output head's logits (on the pipeline's last stage), outside the
    # compiled blocks; the blocks compute in the same precision (parallel/precision.py).
    computed_in: set[str] = set()
    for name, module in parts.model.module.named_modules():
        if name.endswith("lm_head"):
            module.register_forward_hook(lambda _module, _inputs, output: computed_in.add(str(output.dtype)))
    try:
        trainer = Trainer(parts, records.append)
        parts.model.module.train()
        for _ in range(STEPS):
            last_step_began = time.time_ns()  # on the flight recorder's clock
            trainer.advance()
    finally:
        parts.data.close()
        adapter = adapter_answers(parts) if parts.config.eval.tasks else None
    gap = boundary_gap(parts) if parts.config.train.attention == "document" else None
    curves = {
        "holdings": holdings(parts, runtime, computed_in, last_step_began),
        "precision": parts.model.precision_description,
        "adapter": adapter,
        "losses": [r["loss"] for r in records],
        "norms": [r["grad_norm"] for r in records],
        "val_losses": [r["val_loss"] for r in records if "val_loss" in r],
        "rewards": [r["reward"] for r in records if "reward" in r],  # reinforcement learning's (data=rl)
        "val_rewards": [r["val_reward"] for r in records if "val_reward" in r],
        "tasks": {key: value for key, value in records[-1].items() if key.count("/") == 2},  # eval.tasks' scores
        "val_bpb": records[-1].get("val_bpb"),
        "boundary_gap": gap,
    }
    return curves, parts.model.full_state_dict()


def boundary_gap(parts) -> float:
    """Under train.attention=document, the property itself as this layout computes it: a document read after another
    one in a window and the same document read alone at a window's start, their summed losses over the same
    (context, target) pairs of that document (the other targets unscored; llmtrain/model/scoring.py); the relative
    difference of the two (0 up to the kernels' rounding; causal attention would make them differ)."""
    seq_len, eos = parts.config.train.seq_len, parts.data.document_separator
    generator = torch.Generator().manual_seed(0)

    def text(n: int) -> torch.Tensor:  # tokens other than end-of-text
        drawn = torch.randint(0, parts.data.tokenizer.vocab_size - 1, (n,), generator=generator)
        return drawn + (drawn >= eos)

    before = seq_len // 3
    first, second = text(before - 1), text(seq_len + 1 - before)
    after_another = torch.cat([first, torch.tensor([eos]), second])
    alone = torch.cat([second, text(before)])
    rows = torch.stack([after_another, alone])
    inputs, targets = rows[:, :-1], torch.full((2, seq_len), UNSCORED)
    scored = len(second) - 1  # each position of `second` but its last predicts the next token of `second`
    targets[0, before : before + scored] = second[1:]
    targets[1, :scored] = second[1:]
    parts.model.module.eval()
    sums = parts.model.row_sums([(inputs, targets)], SUMMED_LOSSES)[:, 0]
    return float((sums[0] - sums[1]).abs() / sums[1])


def holdings(parts, runtime: Runtime, computed_in: set[str], last_step_began: int) -> dict:
    """What the layout holds after its steps, summed over the ranks: the names (the unsplit model's) of the Linear
    layers float8 converted, the optimizer's class, its moments (AdamW's exp_avg, exp_avg_sq), those held
    quantised and their bytes, the devices the moments live on, the dtypes the output head computed in, and the
    most gradient reductions a rank posted in the last step (the flight recorder's)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from llmtrain.parallel.tensors import local_tensor
    from llmtrain.train.memory import tensor_bytes

    float8 = [name for name, module in parts.model.module.named_modules() if type(module).__name__ == "Float8Linear"]
    optimizer = parts.model.optimizer
    moments = [
        local_tensor(value)
        for state in optimizer.state.values()
        for key, value in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    ]
    quantised = [moment for moment in moments if is_traceable_wrapper_subclass(moment)]
    mine = {
        "float8_layers": sorted(name.removeprefix("module.") for name in float8),
        "optimizer": type(optimizer).__name__,
        "moments": len(moments),
        "quantised_moments": len(quantised),
        "quantised_values": sum(moment.numel() for moment in quantised),
        "quantised_bytes": tensor_bytes(quantised),
        "moment_devices": sorted({moment.device.type for moment in moments}),
        "computed_in": sorted(computed_in),
        "gradient_reductions": sum(
            entry["time_created_ns"] >= last_step_began and is_gradient_reduction(entry)
            for entry in flight_entries()[0]
        ),
    }
    every = [mine]
    if runtime.world_size > 1:
        every = [{} for _ in range(runtime.world_size)]
        torch.distributed.all_gather_object(every, mine)
    return {
        "float8_layers": sorted({name for rank in every for name in rank["float8_layers"]}),
        "optimizer": sorted({rank["optimizer"] for rank in every}),
        "moment_devices": sorted({device for rank in every for device in rank["moment_devices"]}),
        "computed_in": sorted({dtype for rank in every for dtype in rank["computed_in"]}),
        "gradient_reductions": max(rank["gradient_reductions"] for rank in every),
        **{
            key: sum(rank[key] for rank in every)
            for key in ("moments", "quantised_moments", "quantised_values", "quantised_bytes")
        },
    }


def is_gradient_reduction(entry: dict) -> bool:
    """A reduce-scatter or all-reduce of more than a thousand values (gloo's FSDP reduces by all-reduce; the step's
    loss, norm and flags are a value each, the gradient norm one per tensor)."""
    values = sum(math.prod(size) for size in entry.get("input_sizes", []))
    return "reduce" in entry.get("profiling_name", "") and values > 1024


def adapter_answers(parts) -> dict:
    """The lm-eval adapter's answers (llmtrain/lm_eval_model.py) on the first eval.tasks file's first examples: greedy
    completions, then the log-likelihoods and greedy flags of each choice and each completion, and the rolling
    log-likelihood of a document several model lengths long."""
    from lm_eval.api.instance import Instance

    from llmtrain.lm_eval_model import LiveModel

    train = parts.config.train
    lm = LiveModel(parts.model, parts.data.tokenizer, parts.facts.shape.max_seq_len, train.micro_batch_size, False)
    with open(parts.config.eval.tasks[0]) as f:
        records = [json.loads(line) for line in f][:6]
    contexts = [record.get("context", record.get("ctx")) for record in records]
    generation = {"until": ["."], "max_gen_toks": 6, "do_sample": False}
    parts.model.module.eval()
    generated = lm.generate_until(
        [Instance("generate_until", {}, (context, dict(generation)), i) for i, context in enumerate(contexts)]
    )
    pairs = [(c, " " + choice) for c, r in zip(contexts, records) for choice in r.get("choices", r.get("endings"))]
    pairs += [(context, text) for context, text in zip(contexts, generated) if text]
    answers = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    document = " ".join(contexts * 8)
    return {
        "generated": generated,
        "loglikelihoods": [logprob for logprob, _ in answers],
        "greedy": [greedy for _, greedy in answers],
        "rolling": lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (document,), 0)]),
    }


def _chosen(layout: list[str]) -> list[str]:
    """The overrides before the layout's first `parallel` one: what it trains rather than how it splits it."""
    parallel = [i for i, override in enumerate(layout) if override.startswith("parallel")]
    return layout[: parallel[0] if parallel else len(layout)]


def reference_name(layout: str) -> str:
    return " ".join(["single", *_chosen(layout.split())])


def combined(common: list[str], layout: list[str]) -> list[str]:
    """The overrides of a run: the common ones, then the layout's (whose own choices replace the common ones)."""
    chosen = {override.split("=")[0] for override in _chosen(layout)}
    return [*[override for override in common if override.split("=")[0] not in chosen], *layout]


# Seconds after which a group that has not finished prints every thread's stack on each rank and exits (unset: no
# deadline): a hang then fails with where each rank waited.
DEADLINE = "LLMTRAIN_GROUP_DEADLINE_S"


def main(out_dir: str, common: str, layouts: list[str]) -> None:
    if os.environ.get(DEADLINE):
        faulthandler.dump_traceback_later(float(os.environ[DEADLINE]), exit=True)
    overrides = common.split()
    results: dict[str, dict] = {}
    references: dict[str, dict | None] = {}
    if os.environ["RANK"] == "0":  # the unsplit models first, alone: the other ranks wait to form the group
        alone = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
        for name in dict.fromkeys(reference_name(layout) for layout in layouts):
            chosen = name.split()[1:]  # what the layouts compared with it train
            run_dir = os.path.join(out_dir, f"reference-{len(references)}")
            results[name], references[name] = train(combined(overrides, [*chosen, "parallel=single"]), alone, run_dir)
    runtime = init_runtime("cpu")
    for index, layout in enumerate(layouts):
        curves, weights = train(combined(overrides, layout.split()), runtime, os.path.join(out_dir, f"layout-{index}"))
        if runtime.is_main:
            reference = references[reference_name(layout)]
            assert weights is not None and reference is not None
            results[layout] = {
                **curves,
                "same_names": sorted(weights) == sorted(reference),
                "weight_difference": max_weight_difference(weights, reference),
            }
    if runtime.is_main:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
