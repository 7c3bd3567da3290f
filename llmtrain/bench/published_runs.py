"""The planner's predicted tokens per second per GPU beside published measurements of real runs
(llmtrain/planner/published.py), each planned as llmtrain would run it:

    python -m llmtrain.bench.published_runs

One row per run: the model, the machine and GPU count, sequence length, micro-batch, activation checkpointing, the
published and the predicted tokens/s/GPU and the error (predicted / published - 1). The step time is the planner's:
compute at the machine's `hardware.mfu` of its peak, plus the communication it cannot hide.
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
from llmtrain.planner.published import MPT_VOCABULARY, PUBLISHED_RUNS, SOURCE, PublishedRun
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
    lines = ["| " + " | ".join([*columns, "predicted", "error"]) + " |", "|---" * (len(columns) + 2) + "|"]
    for p in predictions:
        r = p.run
        lines.append(
            f"| MPT {r.model} | {r.hardware} | {r.gpus} | {r.seq_len} | {r.micro_batch} | "
            f"{'yes' if r.checkpointing else 'no'} | {r.tokens_per_gpu:,.0f} | {p.tokens_per_gpu:,.0f} | "
            f"{p.error:+.1%} |"
        )
    errors = [abs(p.error) for p in predictions]
    lines += ["", f"median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}; source: {SOURCE}"]
    return "\n".join(lines)


def main() -> None:
    print(table([predict(run) for run in PUBLISHED_RUNS]))


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
