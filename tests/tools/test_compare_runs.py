"""The one place that judges differences (llmtrain/differences.py), and the parity table built on it
(llmtrain/tools/compare_runs.py), fail what went non-finite: a NaN or an infinity on either side, at any step, in
any metric, weight or kernel output, is an infinite difference, and no tolerance admits one (Python's max would drop
a NaN that does not come first, and `NaN > tolerance` is false: a run that blew up late would compare as equal)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint.final import save_final_model
from llmtrain.differences import largest, max_relative_difference, tensor_difference, within
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


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_no_tolerance_admits_a_non_finite_difference(bad):
    assert within(0.01, 0.02) and not within(0.03, 0.02)
    assert not within(bad, 0.02) and not within(bad, INF)
    for place in range(3):  # wherever the NaN stands among the others
        values = [0.001, 0.002, 0.003]
        values[place] = NAN
        assert math.isnan(largest(values)) and not within(largest(values), 1.0)


@pytest.mark.parametrize("bad", [NAN, INF])
def test_a_kernel_output_with_one_non_finite_element_fails_on_either_side(bad):
    """What ring_kernel_check and the tests' workers judge kernels by: one NaN or infinity among finite values,
    in the output or in the reference, makes the (relative) difference infinite."""
    reference = torch.randn(2, 4, 8, 16)
    broken = reference.clone()
    broken[1, 3, 7, 15] = bad
    for relative in (False, True):
        assert tensor_difference(reference, reference, relative) == 0.0
        assert tensor_difference(broken, reference, relative) == math.inf
        assert tensor_difference(reference, broken, relative) == math.inf
        assert not within(tensor_difference(broken, reference, relative), 1.0)


def test_the_ring_kernel_checks_verdict_fails_a_nan_gradient():
    """The row the first H200 reported as ok: bf16 documents with dq and dk NaN."""
    from llmtrain.tools.ring_kernel_check import passes

    assert passes({"output": 1.9e-3, "dq": 1.5e-3, "dk": 4.5e-3, "dv": 3.9e-3}, 2e-2)
    assert not passes({"output": 1.9e-3, "dq": NAN, "dk": NAN, "dv": 3.9e-3}, 2e-2)
    assert not passes({"output": NAN, "dq": 1.5e-3}, 2e-2)


def test_the_gpu_checks_loss_comparison_fails_a_nan_step():
    from llmtrain.tools.gpu_check_report import compare_losses
    from llmtrain.tools.gpu_check_runs import Row
    from llmtrain.tools.gpu_check_table import Check

    losses = {
        "bf16": [{"step": s, "loss": 3.0 - s / 10} for s in range(1, 4)],
        "late nan": [{"step": 1, "loss": 2.9}, {"step": 2, "loss": 2.8}, {"step": 3, "loss": NAN}],
    }
    row = Row("late nan")
    compare_losses(row, Check("late nan", [], "a NaN at the last step", reference="bf16", tolerance=0.03), losses)
    assert row.status == "FAIL" and row.difference == math.inf
