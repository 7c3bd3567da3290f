"""Downstream multiple-choice tasks scored on the live model, whatever its layout (`eval.tasks`).

Every row (an example's context and one of its choices, llmtrain/data/tasks.py) goes through the layout's own
forward-only path, which returns whole rows' summed choice losses and token counts (ParallelModel.row_sums:
tensor-parallel vocabulary shards, context-parallel sequence shards and pipeline stages are combined there).
The rows are dealt to the data-parallel ranks in turn, padded to a whole number of micro-batches per rank so that
every rank runs the same forwards (FSDP gathers in each), and all-gathered back in order.

`acc` and `acc_norm` are lm-evaluation-harness's multiple-choice metrics: an example counts for `acc` when its
label's choice has the greatest log-likelihood (the least summed loss), for `acc_norm` when it has the greatest
log-likelihood per character of the choice string.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from llmtrain.data.tasks import Task
from llmtrain.model.scoring import SUMMED_LOSSES, RowStatistic
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.process.runtime import all_gather_single


def score_rows(
    model: ParallelModel,
    inputs: np.ndarray,
    targets: np.ndarray,
    micro_batch_size: int,
    statistic: RowStatistic = SUMMED_LOSSES,
) -> torch.Tensor:
    """Collective: (rows, statistic.columns), each row's `statistic` (its summed scored loss, scored-token count and
    greedy matches by default), on every rank."""
    device, rows = model.runtime.device, len(inputs)
    dp_mesh = model.mesh.dp_mesh
    dp, rank = (dp_mesh.size(), dp_mesh.get_local_rank()) if dp_mesh is not None else (1, 0)
    per_rank = -(-rows // (dp * micro_batch_size)) * micro_batch_size
    order = np.arange(per_rank * dp) % max(rows, 1)  # the padding repeats rows; their results are dropped
    mine = order[rank::dp]
    micro_batches = [
        (torch.from_numpy(inputs[chunk]), torch.from_numpy(targets[chunk]))
        for chunk in np.split(mine, len(mine) // micro_batch_size)
    ]
    sums = model.row_sums(micro_batches, statistic).to(device)
    if dp > 1:
        columns = statistic.columns
        gathered = torch.empty(dp * len(sums), columns, dtype=sums.dtype, device=device)
        all_gather_single(gathered, sums, group=model.mesh.dp_group)
        # back to the order the rows were dealt in
        sums = gathered.view(dp, -1, columns).transpose(0, 1).reshape(-1, columns)
    return sums[:rows]


def task_accuracy(task: Task, sums: torch.Tensor) -> dict[str, float]:
    """acc and acc_norm of `task` from its rows' summed losses (column 0), as lm-eval's multiple_choice
    process_results computes them: argmax of the log-likelihoods, and of the log-likelihoods divided by each
    choice's length in characters (the first among equals)."""
    loglikelihoods = -sums[:, 0].double().cpu().numpy()
    correct = correct_norm = 0
    start = 0
    for count, label in zip(task.choices.tolist(), task.labels.tolist()):
        lls, lengths = loglikelihoods[start : start + count], task.lengths[start : start + count]
        correct += int(np.argmax(lls) == label)
        with np.errstate(divide="ignore", invalid="ignore"):  # an empty choice divides by 0, as in lm-eval
            correct_norm += int(np.argmax(lls / lengths) == label)
        start += count
    examples = max(len(task.labels), 1)
    return {"acc": correct / examples, "acc_norm": correct_norm / examples}


def evaluate_tasks(model: ParallelModel, tasks: list[Task], micro_batch_size: int) -> dict[str, float]:
    """`eval/<task>/acc`, `eval/<task>/acc_norm` for every task, and `eval/seconds`: what the evaluation took."""
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    model.module.eval()
    try:
        for task in tasks:
            sums = score_rows(model, task.inputs, task.targets, micro_batch_size)
            for name, value in task_accuracy(task, sums).items():
                metrics[f"eval/{task.name}/{name}"] = value
    finally:
        model.module.train()
    metrics["eval/seconds"] = time.perf_counter() - started
    return metrics
