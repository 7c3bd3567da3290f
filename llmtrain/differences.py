"""How far a result is from its reference, and whether that is within a tolerance: the one place where the checks
(gpu_check, ring_kernel_check, compare_runs) and the tests' helpers compare numbers. A NaN or an infinity on either
side is an infinite difference, and an infinite difference is within no tolerance: `difference > tolerance` is
false for NaN, and Python's max drops a NaN that does not come first, so neither is used to judge."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def within(difference: float, tolerance: float) -> bool:
    """Whether `difference` is a finite number no larger than `tolerance`."""
    return math.isfinite(difference) and difference <= tolerance


def largest(differences: Iterable[float]) -> float:
    """The largest of `differences` (0 for none); NaN where any is NaN, whatever its place."""
    found = [float(d) for d in differences]
    return math.nan if any(math.isnan(d) for d in found) else max(found, default=0.0)


def relative_difference(x: float, y: float) -> float:
    """|x - y| / |y| (|x - y| where y is 0); infinite when either is not finite."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return math.inf
    return abs(x - y) / abs(y) if y else abs(x - y)


def max_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        raise ValueError(f"different number of values: {len(a)} vs {len(b)}")
    return largest(relative_difference(x, y) for x, y in zip(a, b))


def tensor_difference(ours: torch.Tensor, reference: torch.Tensor, relative: bool = False) -> float:
    """The largest absolute difference of two tensors of one shape (`relative`: divided by the reference's largest
    magnitude). Infinite when either holds a NaN, or an infinity the other does not hold in the same place (a
    -inf mask on both sides is equal)."""
    got, expected = ours.detach().double(), reference.detach().double()
    if bool(torch.isnan(got).any()) or bool(torch.isnan(expected).any()):
        return math.inf
    infinite = torch.isinf(got) | torch.isinf(expected)
    if not torch.equal(got[infinite], expected[infinite]):
        return math.inf
    finite = ~infinite
    if not bool(finite.any()):
        return 0.0
    worst = float((got[finite] - expected[finite]).abs().max())
    return worst / float(expected[finite].abs().max()) if relative else worst
