"""Data-parallel layouts reproduce `single`: real multi-process gloo runs of the entry point on CPU."""

from __future__ import annotations

import pytest
from conftest import PARITY, assert_parity, json_lines, layout_strategy, run_train, torchrun

from llmtrain.config import ConfigError

pytestmark = pytest.mark.slow


# Each family once, at 4 ranks where it shards (the 15-minute suite budget on two cores).
@pytest.mark.parametrize(
    "layout, nproc, extra",
    [
        ("ddp", 2, []),
        ("zero1", 4, []),
        ("zero2", 4, []),
        ("fsdp", 4, []),
        ("hsdp", 4, ["parallel.dp_shard=2"]),
    ],
)
def test_layout_matches_single(layout, nproc, extra, reference, layout_run):
    run = layout_run(f"parallel={layout}", *extra, nproc=nproc)
    assert_parity(run, reference)
    assert f"layout    {'fsdp' if layout in ('zero2', 'hsdp') else layout}" in run.stderr + run.stdout


def test_only_rank_zero_writes_and_speaks(layout_run):
    run = layout_run("parallel=ddp", nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (run.stdout + run.stderr).count("model     tiny") == 1
    assert len(run.metrics) == 10


@pytest.fixture(scope="module")
def memory_rows() -> list[dict]:
    """layout_memory's rows for three layouts measured one after another in one 4-rank process group."""
    return json_lines(torchrun(4, "-m", "llmtrain.tools.layout_memory", "--layouts=zero1,zero2,fsdp").stdout)


@pytest.mark.parametrize("layout", ["zero1", "zero2", "fsdp"])  # DDP holds everything; HSDP is FSDP per node
def test_state_per_rank_follows_the_zero_formulas(layout, memory_rows):
    rows = [row for row in memory_rows if row["parallel"] == layout]
    assert len(rows) == 4
    n_params = rows[0]["parameters"]
    # Shards are padded to equal size per parameter (FSDP) or per flat buffer (ZeRO-1): at most one row of each
    # tensor, bounded here by 1% of the model.
    padding = 0.01 * 4 * n_params
    for row in rows:
        for key in ("params", "grads", "optimizer"):
            assert abs(row[key] - row["expected"][key]) <= padding * (2 if key == "optimizer" else 1), (key, row)
    full = 4 * n_params
    during_step = rows[0]["params_during_step"]
    if layout == "zero2":
        assert during_step == pytest.approx(full, rel=0.01)  # gathered parameters kept for backward
    if layout == "fsdp":
        assert during_step < 0.5 * full  # blocks re-sharded after their forward


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        (["parallel=ddp", "parallel.dp_replicate=3"], 2, "parallel.dp_replicate=3"),
        (["parallel=fsdp", "parallel.dp_replicate=-1"], 2, "-1"),
        (["parallel=hsdp", "parallel.dp_shard=2"], 3, "world size 3"),
    ],
)
def test_bad_layouts_are_refused_before_any_process_group(overrides, world_size, message):
    with pytest.raises(ConfigError) as error:
        layout_strategy(*overrides, world_size=world_size)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "overrides, nproc, message",
    [
        (["parallel=ddp", "train.batch_size=6", "train.micro_batch_size=2"], 2, "train.batch_size=6"),
        (["parallel=ddp_tp"], 0, "parallel.tp=2"),  # a degree above 1 needs more than one process
    ],
)
def test_bad_layouts_fail_with_one_line(overrides, nproc, message, train):
    run = train(*overrides, nproc=nproc)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], run.stderr[-3000:]
    assert not (run.run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("layout, nproc", [("parallel=fsdp", 1), ("parallel=pp", 0)])
def test_a_multi_process_layout_on_one_process_trains_as_single(layout, nproc, reference, tmp_path, cache_dir):
    """`torchrun train.py parallel=fsdp` (torchrun starts one process unless told otherwise) and `python train.py
    parallel=pp`: every degree is 1, so the layout runs on a process group of one and learns what single does."""
    run = run_train(tmp_path, cache_dir, *PARITY, layout, nproc=nproc)
    assert_parity(run, reference)
    assert "(one process: nothing is split)" in run.stdout + run.stderr


def test_unknown_layout_lists_the_options(train):
    run = train("parallel=zero9")
    assert run.returncode != 0 and "Available options in 'parallel'" in run.stderr and "fsdp" in run.stderr
