"""MFU's denominator and the memory each step reports: what the GPU path computes from the device, fed the values a
device gives (the GPU check runs them on a card)."""

from __future__ import annotations

import pytest

from llmtrain.train.metrics import memory_record, mfu, peak_flops_of
from llmtrain.train.report import end_summary, format_end_summary


@pytest.mark.parametrize(
    "name, bf16_peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4080", 97.5e12),
    ],
)
def test_each_card_is_scored_against_its_own_peak_and_fp32_against_tf32(name, bf16_peak):
    assert peak_flops_of(name, bf16=True) == bf16_peak
    assert peak_flops_of(name, bf16=False) == bf16_peak / 2
    assert mfu(1000.0, bf16_peak / 1000, peak_flops_of(name, bf16=True)) == pytest.approx(1.0)


def test_an_unknown_card_has_no_mfu():
    assert peak_flops_of("Some Future GPU", bf16=True) is None
    assert mfu(1000.0, 1e9, None) is None


def test_a_step_reports_its_allocated_and_reserved_peaks_and_allocator_trouble():
    stats = {
        "allocated_bytes.all.peak": 3 * 2**30,
        "reserved_bytes.all.peak": 4 * 2**30,
        "num_alloc_retries": 2,
        "num_ooms": 0,
    }
    record = memory_record(stats)
    assert record == {"peak_memory_gib": 3.0, "peak_reserved_gib": 4.0, "alloc_retries": 2, "ooms": 0}
    records = [
        {"step": 1, "loss": 5.0, "tokens_per_s": 100.0, **record},
        {"step": 2, "loss": 4.0, "tokens_per_s": 100.0, **memory_record({**stats, "reserved_bytes.all.peak": 2**31})},
    ]
    text = format_end_summary(end_summary(records, tokens_per_step=100, train_seconds=2.0, wall_seconds=3.0))
    assert "3.00 GiB peak allocated, 4.00 GiB reserved" in text
    assert "flushed its cache 2 times" in text and "expandable_segments:True" in text
