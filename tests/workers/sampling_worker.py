"""Run by tests under torchrun: the sampler on several layouts in one process group. Each layout's model is built
from the same seed; its data-parallel ranks take their share of PROMPTS (prompt i on the rank i // share), draw
GROUP completions of each, and rank 0 writes OUT_DIR/results.json: per layout, every prompt's completions in the
order of the prompts, and every completion token's log-probability under the model then the entropy at each
(`log_probs`: what a policy gradient weighs and reports, scoring.token_log_probs), each row prompt then completion,
the prompt unscored. A layout's
overrides before its first `parallel` one choose its model, which one process samples unsplit first
(`single <those overrides>`), before the group forms.

    torchrun --nproc_per_node=N tests/workers/sampling_worker.py OUT_DIR "<overrides for all>" "<layout 1>" ...
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from llmtrain.model.sampling import SamplingSettings
from llmtrain.model.scoring import UNSCORED, token_log_probs
from llmtrain.parallel.sampling import sample_completions
from llmtrain.process.runtime import Runtime, init_runtime
from llmtrain.run.build import build_parallel_model
from llmtrain.tools import compose_config

PROMPTS = [[3, 7, 11], [5], [8, 9, 10, 11, 12], [2, 4], [13, 1, 6], [7, 7, 7, 7]]
GROUP = 3
VOCAB = 61
SETTINGS = SamplingSettings(max_new_tokens=8, temperature=0.9, top_k=30, top_p=0.95, stop_ids=(0,))
WIDTH = max(len(prompt) for prompt in PROMPTS) + SETTINGS.max_new_tokens


def completions(overrides: list[str], runtime: Runtime) -> dict:
    """Every prompt's GROUP completions under the layout of `overrides`, and their tokens' log-probabilities, as
    rank 0 gathers them (others: {})."""
    model = build_parallel_model(compose_config(overrides), runtime, VOCAB)
    share = len(PROMPTS) // model.plan.dp_size
    first = model.mesh.dp_rank * share
    prompts = PROMPTS[first : first + share]
    mine = sample_completions(model, prompts, list(range(first, first + share)), GROUP, SETTINGS, seed=5).rows()
    log_probs = _log_probs(model, [prompt for prompt in prompts for _ in range(GROUP)], mine)
    grouped = [(mine[i * GROUP : (i + 1) * GROUP], log_probs[i * GROUP : (i + 1) * GROUP]) for i in range(share)]
    if runtime.distributed:
        gathered: list = [None] * runtime.world_size
        dist.all_gather_object(gathered, (model.mesh.dp_rank, grouped))
        by_dp_rank = dict(gathered)  # tensor-parallel ranks of one data-parallel rank drew the same rows
        grouped = [entry for rank in sorted(by_dp_rank) for entry in by_dp_rank[rank]]
    if not runtime.is_main:
        return {}
    return {"completions": [rows for rows, _ in grouped], "log_probs": [values for _, values in grouped]}


def _log_probs(model, prompts: list[list[int]], drawn: list[list[int]]) -> list[list[float]]:
    """Each completion token's log-probability, then the entropy at each, row by row: prompt and completion in one
    row of WIDTH + 1 tokens (0 after the completion), the prompt's targets and the padding unscored."""
    rows = torch.zeros(len(drawn), WIDTH + 1, dtype=torch.long)
    scored = torch.zeros(len(drawn), WIDTH, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, drawn)):
        rows[row, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        scored[row, len(prompt) - 1 : len(prompt) - 1 + len(completion)] = True
    targets = torch.where(scored, rows[:, 1:], UNSCORED)
    values = model.row_sums([(rows[:, :-1], targets)], token_log_probs(WIDTH, SETTINGS.temperature))
    return [torch.cat([row[:WIDTH][mask], row[WIDTH:][mask]]).tolist() for row, mask in zip(values.cpu(), scored)]


def model_overrides(layout: str) -> str:
    """The overrides of `layout` before its first `parallel` one: what it samples from."""
    words = layout.split()
    first = next(i for i, word in enumerate(words) if word.startswith("parallel"))
    return " ".join(words[:first])


def main(out_dir: str, common: str, layouts: list[str]) -> None:
    alone = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    results: dict = {}
    if os.environ.get("RANK", "0") == "0":
        for model in dict.fromkeys(model_overrides(layout) for layout in layouts):
            results[f"single {model}".strip()] = completions([*common.split(), *model.split()], alone)
    runtime = init_runtime("cpu")
    for layout in layouts:
        results[layout] = completions([*common.split(), *layout.split()], runtime)
    if runtime.is_main:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    runtime.shutdown(synchronize=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
