"""How far runs are from a reference run: the parity table.

    python -m llmtrain.tools.compare_runs outputs/single outputs/ddp outputs/fsdp ...

For each run directory: the largest relative difference of the per-step loss, validation loss and gradient norm
from the reference (the first directory), and the largest absolute difference of the final weights (model.pt).
A metric that is not finite (NaN, inf) on either side counts as an infinite difference; so does a NaN weight, or an
infinite one the other side does not match (the padded vocabulary's -inf mask matches).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from llmtrain.checkpoint import load_final_model
from llmtrain.differences import largest, max_relative_difference, tensor_difference
from llmtrain.errors import closed_pipe_is_quiet

METRICS = ("loss", "val_loss", "grad_norm")


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def max_weight_difference(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of any weight (differences.tensor_difference: infinite for a NaN on either
    side, or an infinity the other side does not hold in the same place)."""
    if weights.keys() != reference.keys():
        raise ValueError(f"different parameters: {sorted(weights.keys() ^ reference.keys())}")
    return largest(tensor_difference(weights[name], expected) for name, expected in reference.items())


def compare(run_dir: str, reference_dir: str) -> dict[str, float]:
    """Max relative difference per metric, and max absolute weight difference, of a run from the reference."""
    ours, theirs = read_metrics(run_dir), read_metrics(reference_dir)
    if [m["step"] for m in ours] != [m["step"] for m in theirs]:
        raise ValueError(f"{run_dir} and {reference_dir} logged different steps")
    result = {
        key: max_relative_difference([m[key] for m in ours if key in m], [m[key] for m in theirs if key in m])
        for key in METRICS
    }
    final = load_final_model(os.path.join(run_dir, "model.pt"))
    expected = load_final_model(os.path.join(reference_dir, "model.pt"))
    if final.keys() != expected.keys():
        raise ValueError(f"{run_dir} has other parameters than {reference_dir}")
    result["weights"] = max_weight_difference(final, expected)
    return result


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m llmtrain.tools.compare_runs REFERENCE_DIR RUN_DIR [RUN_DIR ...]")
    reference, runs = argv[0], argv[1:]
    print(f"{'run':<40} {'loss':>10} {'val_loss':>10} {'grad_norm':>10} {'weights':>10}")
    print(f"{'(max relative difference; weights: max absolute)':<40}")
    for run in runs:
        d = compare(run, reference)
        print(f"{run:<40} {d['loss']:10.2e} {d['val_loss']:10.2e} {d['grad_norm']:10.2e} {d['weights']:10.2e}")


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
