"""The planner's predicted tokens per second per GPU, and memory per GPU, beside published measurements of real
runs (llmtrain/planner/published.py), each planned as llmtrain would run it:

    python -m llmtrain.bench.published_runs

Two tables. MosaicML's MPT runs, a row each: the model, the machine and GPU count, sequence length, micro-batch,
activation checkpointing, the published and the predicted tokens/s/GPU and the error (predicted / published - 1).
torchtitan's Llama 3.1 runs: the same for tokens/s/GPU and for memory per GPU (the planner's heaviest rank). The
step time is the planner's: compute at the machine's `hardware.mfu` of its peak, plus the communication it cannot
hide.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import cast

from omegaconf import OmegaConf

from llmtrain.config import RootConfig
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.model import meta_model, num_parameters
from llmtrain.planner.auto import configured_cost
from llmtrain.planner.cost import GIB
from llmtrain.planner.published import (
    LLAMA31_VOCABULARY,
    MPT_VOCABULARY,
    PUBLISHED_LLAMA_RUNS,
    PUBLISHED_RUNS,
    SOURCE,
    TORCHTITAN_CALIBRATING,
    TORCHTITAN_SOURCE,
    PublishedLlamaRun,
    PublishedRun,
    calibrating,
)
from llmtrain.tools import compose_config


@dataclass(frozen=True)
class Prediction:
    run: PublishedRun
    tokens_per_gpu: float
    parameters: int  # of the model llmtrain builds for it

    @property
    def error(self) -> float:
        return self.tokens_per_gpu / self.run.tokens_per_gpu - 1


def predict(run: PublishedRun) -> Prediction:
    config = cast(RootConfig, OmegaConf.to_object(compose_config(run.overrides())))
    ranks_per_node = min(config.hardware.gpus_per_node, run.gpus)
    step = configured_cost(config, run.gpus, ranks_per_node, MPT_VOCABULARY, bf16=True).step_time_s
    parameters = num_parameters(meta_model(config.model, MPT_VOCABULARY))
    return Prediction(run, run.batch * run.seq_len / step / run.gpus, parameters)


def table(predictions: list[Prediction]) -> str:
    columns = ["model", "machine", "GPUs", "sequence", "micro-batch", "checkpointing", "published tokens/s/GPU"]
    lines = ["| " + " | ".join([*columns, "predicted", "error", "row"]) + " |", "|---" * (len(columns) + 3) + "|"]
    calibration = calibrating()
    for p in predictions:
        r = p.run
        lines.append(
            f"| MPT {r.model} | {r.hardware} | {r.gpus} | {r.seq_len} | {r.micro_batch} | "
            f"{'yes' if r.checkpointing else 'no'} | {r.tokens_per_gpu:,.0f} | {p.tokens_per_gpu:,.0f} | "
            f"{p.error:+.1%} | {'calibrates' if r in calibration else 'tests'} |"
        )
    held_out = [abs(p.error) for p in predictions if p.run not in calibration]
    errors = [abs(p.error) for p in predictions]
    lines += [
        "",
        f"held-out half: median |error| {statistics.median(held_out):.1%}, worst {max(held_out):.1%}; all rows: "
        f"median {statistics.median(errors):.1%}, worst {max(errors):.1%}; source: {SOURCE}",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class LlamaPrediction:
    run: PublishedLlamaRun
    tokens_per_gpu: float
    memory_gib: float

    @property
    def tokens_error(self) -> float:
        return self.tokens_per_gpu / self.run.tokens_per_gpu - 1

    @property
    def memory_error(self) -> float:
        return self.memory_gib / self.run.memory_gib - 1


def predict_llama(run: PublishedLlamaRun) -> LlamaPrediction:
    config = cast(RootConfig, OmegaConf.to_object(compose_config(run.overrides())))
    # torchtitan's loss upcasts all of a micro-batch's logits to fp32 at once, eagerly (its compile takes the blocks)
    ranks_per_node = min(config.hardware.gpus_per_node, run.gpus)
    cost = configured_cost(config, run.gpus, ranks_per_node, LLAMA31_VOCABULARY, True, loss="whole")
    tokens = config.train.batch_size * run.seq_len / cost.step_time_s / run.gpus
    return LlamaPrediction(run, tokens, max(rank.total for rank in cost.ranks) / GIB)


def llama_table(predictions: list[LlamaPrediction]) -> str:
    columns = ["model", "GPUs", "layout", "sequence", "local batch", "checkpointing", "compile", "float8"]
    measures = ["tokens/s/GPU published", "predicted", "error", "memory GiB published", "predicted", "error", "row"]
    lines = ["| " + " | ".join([*columns, *measures]) + " |", "|---" * (len(columns) + len(measures)) + "|"]
    for p in predictions:
        r = p.run
        layout = " ".join(o.removeprefix("parallel.").removeprefix("parallel=") for o in r.layout)
        lines.append(
            f"| Llama 3.1 {r.model.upper()} | {r.gpus} | {layout} | {r.seq_len} | {r.local_batch} | "
            f"{r.checkpointing} | {'yes' if r.compile else 'no'} | {'yes' if r.float8 else 'no'} | "
            f"{r.tokens_per_gpu:,.0f} | {p.tokens_per_gpu:,.0f} | {p.tokens_error:+.1%} | "
            f"{r.memory_gib:.1f} | {p.memory_gib:.1f} | {p.memory_error:+.1%} | "
            f"{'calibrates' if r in TORCHTITAN_CALIBRATING else 'tests'} |"
        )
    held_out = [p for p in predictions if p.run not in TORCHTITAN_CALIBRATING]
    tokens, memory = [abs(p.tokens_error) for p in held_out], [abs(p.memory_error) for p in predictions]
    lines += [
        "",
        f"tokens/s/GPU, held-out rows: median |error| {statistics.median(tokens):.1%}, worst {max(tokens):.1%}; "
        f"memory, every row: median |error| {statistics.median(memory):.1%}, worst {max(memory):.1%}; source: "
        f"{TORCHTITAN_SOURCE}",
    ]
    return "\n".join(lines)


def main() -> None:
    print(table([predict(run) for run in PUBLISHED_RUNS]))
    print()
    print(llama_table([predict_llama(run) for run in PUBLISHED_LLAMA_RUNS]))


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
