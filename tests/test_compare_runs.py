"""The parity table's comparison (llmtrain/tools/compare_runs.py) fails runs that went non-finite: a NaN or an
infinity on either side, at any step, in any metric or weight, is an infinite difference (Python's max would drop a
NaN that does not come first, and a run that blew up late would compare as equal)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint.final import save_final_model
from llmtrain.differences import max_relative_difference
from llmtrain.tools.compare_runs import compare, max_weight_difference

NAN, INF = float("nan"), float("inf")


def run(directory: Path, losses: list[float], val_loss: float = 2.0, last_weight: float = 0.5) -> str:
    directory.mkdir()
    records = [{"step": step + 1, "loss": loss, "grad_norm": 1.0} for step, loss in enumerate(losses)]
    records[-1]["val_loss"] = val_loss
    (directory / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    weights = {"a": torch.ones(3), "b": torch.full((2, 2), 0.5), "c": torch.tensor([0.25, last_weight])}
    save_final_model(weights, str(directory / "model.pt"))
    return str(directory)


@pytest.fixture
def reference(tmp_path) -> str:
    return run(tmp_path / "reference", [3.0, 2.5, 2.0])


def test_equal_runs_compare_as_equal(tmp_path, reference):
    differences = compare(run(tmp_path / "same", [3.0, 2.5, 2.0]), reference)
    assert differences == {"loss": 0.0, "val_loss": 0.0, "grad_norm": 0.0, "weights": 0.0}


@pytest.mark.parametrize(
    "change, key",
    [
        ({"losses": [3.0, 2.5, NAN]}, "loss"),  # a NaN at the last step, after finite ones
        ({"losses": [3.0, INF, 2.0]}, "loss"),
        ({"val_loss": NAN}, "val_loss"),
        ({"last_weight": NAN}, "weights"),  # in the last element of the last tensor, not the first
        ({"last_weight": -INF}, "weights"),
    ],
)
def test_a_non_finite_value_on_one_side_fails(tmp_path, reference, change, key):
    arguments = {"losses": [3.0, 2.5, 2.0], **change}
    broken = run(tmp_path / "broken", **arguments)
    assert compare(broken, reference)[key] == math.inf
    assert compare(reference, broken)[key] == math.inf  # whichever side holds it


def test_non_finite_values_on_both_sides_fail():
    assert max_relative_difference([1.0, NAN], [1.0, NAN]) == math.inf
    assert max_relative_difference([INF], [INF]) == math.inf  # a loss is never legitimately infinite
    nan = {"w": torch.tensor([1.0, NAN])}
    assert max_weight_difference(nan, nan) == math.inf


def test_a_mask_of_minus_infinity_on_both_sides_is_equal():
    """The padded vocabulary's head bias (-inf on the padding rows) is the same in every run; an infinity of the
    other sign, or in another place, is not."""
    mask = {"bias": torch.tensor([0.0, 0.0, -INF]), "w": torch.tensor([1.0, 2.0])}
    other = {"bias": torch.tensor([0.0, 0.0, -INF]), "w": torch.tensor([1.0, 2.5])}
    assert max_weight_difference(other, mask) == 0.5
    assert max_weight_difference({**other, "bias": torch.tensor([0.0, -INF, 0.0])}, mask) == math.inf
    assert max_weight_difference({**other, "bias": torch.tensor([0.0, 0.0, INF])}, mask) == math.inf
