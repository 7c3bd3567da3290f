"""gpu_check's verdicts and what it prints: each row's losses against its reference's, the table, and the speed
section (each feature's tokens/s against its reference's from the same call; a missed target is reported, not a
failure of the check, whose exit status is about correctness)."""

from __future__ import annotations

from typing import Any

from llmtrain.differences import max_relative_difference, within
from llmtrain.tools.gpu_check_runs import Row
from llmtrain.tools.gpu_check_table import Check

# The speed section: (row, its reference, the least ratio of their tokens/s the row is held to; None: reported).
# Each feature exists to make a run fit or go faster: below its ratio it costs more than a user would guess.
SPEED_TARGETS: list[tuple[str, str, float | None]] = [
    ("compiled none", "bare", 0.97),  # llmtrain's step against the tutorial loop, compiled whole
    ("fsdp 1 rank", "bf16", 0.9),
    ("fsdp moe 1 rank", "moe eager", 0.85),
    ("compiled selective", "compiled none", 0.9),  # the policy saves the matmuls: recomputes only cheap ops
    ("llama float8", "llama bf16", 1.0),  # float8 where it converts layers large enough to pay
    ("float8 compiled", "compiled none", None),  # GPT-2's layers: float8 converts one in six (the start summary)
    ("adamw 8-bit", "bf16 long", 0.9),
    ("adamw offload", "bf16 long", 0.8),
    ("document compiled", "compiled none", None),
    ("muon", "bf16", None),
    ("moe eager", "bf16", None),
    ("dropout compiled", "compiled none", None),
    ("qlora", "lora", None),  # what dequantising the base each matmul costs against a bf16 base
]
# Model FLOPs utilisation a row is held to: llama3.2-1b whole, bf16 compiled at sequence 2,048.
MFU_TARGETS = {"llama3.2-1b": 0.45}


def compare_losses(row: Row, check: Check, losses: dict[str, list[dict[str, Any]]]) -> None:
    """Fail the row when its losses stray from its reference's by more than the check's tolerance."""
    if check.reference is None or row.status != "ok" or check.reference not in losses:
        return
    ours = {r["step"]: r["loss"] for r in losses[check.name]}
    theirs = {r["step"]: r["loss"] for r in losses[check.reference]}
    steps = sorted(set(ours) & set(theirs))
    if check.resume_from:
        steps = [s for s in steps if s > 5]
    row.difference = max_relative_difference([ours[s] for s in steps], [theirs[s] for s in steps])
    if not within(row.difference, check.tolerance):
        row.status = "FAIL"
        row.notes.append(f"loss differs from {check.reference} by {row.difference:.2%} > {check.tolerance:.2%}")


def format_table(rows: list[Row]) -> str:
    """The rows as a table of aligned columns, one line each."""
    header = [
        "check",
        "status",
        "s",
        "GPU",
        "loss first->final",
        "vs ref",
        "tokens/s",
        "MFU",
        "peak/reserved GiB",
        "notes",
    ]
    lines = []
    for r in rows:
        loss = f"{r.first_loss:.3f}->{r.final_loss:.3f}" if r.first_loss is not None else ""
        memory = f"{r.peak_gib:.1f}/{r.reserved_gib:.1f}" if r.peak_gib is not None else ""
        lines.append(
            [
                r.name,
                r.status,
                f"{r.seconds:.0f}",
                r.gpu,
                loss,
                f"{r.difference:.2%}" if r.difference is not None else "",
                f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "",
                f"{r.mfu:.1%}" if r.mfu is not None else "",
                memory,
                "; ".join(r.notes),
            ]
        )
    widths = [max(len(str(x)) for x in column) for column in zip(header, *lines)]
    return "\n".join(" | ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *lines])


def speed_section(rows: list[Row]) -> str:
    """Each feature's tokens/s against its reference's from the same call, and the MFU targets, as lines; a row
    missing (not run, failed) is named so."""
    by_name = {row.name: row for row in rows}
    lines = ["speed: tokens/s against the reference's, in this call"]
    for name, reference, target in SPEED_TARGETS:
        row, ref = by_name.get(name), by_name.get(reference)
        if row is None or ref is None:
            continue
        if not (row.tokens_per_s and ref.tokens_per_s):
            lines.append(f"  {name} / {reference}: not measured ({row.status}; {ref.status})")
            continue
        ratio = row.tokens_per_s / ref.tokens_per_s
        verdict = "" if target is None else f"  target {target:.2f}x: {'met' if ratio >= target else 'MISSED'}"
        lines.append(
            f"  {name} / {reference}: {ratio:.3f}x ({row.tokens_per_s:,.0f} / {ref.tokens_per_s:,.0f}){verdict}"
        )
    for name, target in MFU_TARGETS.items():
        row = by_name.get(name)
        if row is not None and row.mfu is not None:
            lines.append(f"  {name} MFU {row.mfu:.1%}  target {target:.0%}: {'met' if row.mfu >= target else 'MISSED'}")
    return "\n".join(lines)
