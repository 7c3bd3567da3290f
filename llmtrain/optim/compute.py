"""Where an optimizer's parameters compute, and in what precision: what each optimizer's builder (its row's
`builder` in llmtrain/catalog/optimizers.py's OPTIMIZERS) is given beside its parameter groups and the optim config."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Compute:
    """`device`: where the parameters and their gradients are (optim.offload keeps AdamW's state off it);
    `dtype`: the run's compute precision (Muon's Newton-Schulz iterations run in it: bf16 where the run computes in
    bf16, as torch.optim.Muon always does; fp32 otherwise, so that CPU runs compare layouts at fp32's tolerance)."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32


# fp32 parameters on the host: the default of the tools and tests that build an optimizer outside a run.
HOST = Compute()
