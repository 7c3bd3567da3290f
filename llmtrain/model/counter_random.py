"""Random numbers from counters: the value drawn for counter i under a seed is splitmix64's hash of (i + seed), so
any process, on any device and under any split of the work, draws the same number for the same counter (dropout's
masks, the sampler's Gumbel noise). Int64 tensors throughout: multiplications wrap, right shifts are masked to be
logical ones, and under torch.compile the hash is part of the graph (no torch.Generator)."""

from __future__ import annotations

import torch


def _signed(constant: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


# splitmix64's finaliser (Steele, Lea & Flood, 2014).
_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def hashed(counters: torch.Tensor, seed: torch.Tensor | int) -> torch.Tensor:
    """64 random bits (int64) per counter: splitmix64's output for step `counter` of `seed`."""
    # (i + seed) * golden: splitmix64's state for step i of the seed (the seed added first: the compiler keeps
    # index arithmetic exact, and i * golden alone would overflow there).
    z = (counters + seed) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def uniform(counters: torch.Tensor, seed: torch.Tensor | int) -> torch.Tensor:
    """A float64 in (0, 1) per counter, from the hash's top 53 bits (never 0 or 1: a logarithm of it is finite)."""
    bits = _shift_right(hashed(counters, seed), 11)
    return (bits.double() + 0.5) / float(1 << 53)
