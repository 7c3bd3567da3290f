"""Options crossed, not just alone (tests/harness/crossed.py): docs/crossed.md's pairwise matrix over the catalog's
objectives, layouts and families and the options a run adds holds every pair of values in a row or refuses it in
one line before any rank starts; every row trains with finite losses and resumes."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Callable

import pytest
from harness import crossed
from harness.paths import WORKERS
from harness.processes import torchrun
from harness.runs import LOSS_RTOL

ROWS = crossed.documented()
# The rows' runs take about 18 minutes on 2 cores, beside the suite's budget: .ci/run's crossed tier runs them.
crossed_tier_only = pytest.mark.skipif(
    not os.environ.get("LLMTRAIN_CROSSED_TIER"),
    reason="the matrix's runs: LLMTRAIN_CROSSED_TIER=1 python -m pytest -m crossed (.ci/run's crossed tier)",
)


@pytest.mark.slow
def test_the_matrix_holds_every_pair_the_checks_accept_and_refuses_the_rest_in_one_line():
    """Every row is accepted as a whole; a pair no row holds is refused alone, in one line; and docs/crossed.md is
    the matrix as it stands (its refusals' lines included): a value the catalog gains fails here until the matrix
    is written again."""
    regenerate = "python tests/harness/crossed.py > docs/crossed.md"
    refused = {row: crossed.refusal(row) for row in ROWS if crossed.refusal(row)}
    assert not refused, f"rows refused (the catalog changed: {regenerate}): {refused}"
    held = crossed.covered(ROWS)
    for pair in crossed.pairs():
        if pair not in held:
            said = crossed.refusal(crossed.alone(pair))
            assert said is not None, f"{pair} is accepted but no row holds it: {regenerate}"
            assert "\n" not in said, (pair, said)
    assert crossed.DOCUMENT.read_text() == crossed.markdown(ROWS), f"docs/crossed.md is not current: {regenerate}"


# Rows a process group runs: the first test of each chunk runs its rows, well within pytest's timeout per test (on
# 2 cores, about 5 seconds a row)
CHUNK = 24


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Callable[[int], dict]:
    """Row `number`'s run: tests/workers/crossed_worker.py runs the rows of its chunk in one process group of 2
    ranks, the first time one of them is asked for."""
    done: dict[str, dict] = {}
    failed: dict[int, str] = {}  # a chunk whose run failed, once: its other rows fail with its error, not run again

    def run_of(number: int) -> dict:
        first = (number - 1) // CHUNK * CHUNK + 1
        if first in failed:
            pytest.fail(f"rows {first}-{first + CHUNK - 1} ran in one process group, which failed: {failed[first]}")
        if str(number) not in done:
            out = tmp_path_factory.mktemp("crossed")
            rows = [
                {"name": str(i), "overrides": crossed.overrides(ROWS[i - 1], crossed.test_files()),
                 "ranks": crossed.world_size(ROWS[i - 1])}
                for i in range(first, min(first + CHUNK, len(ROWS) + 1))
            ]  # fmt: skip
            (out / "rows.json").write_text(json.dumps(rows))
            try:
                torchrun(
                    crossed.RANKS, str(WORKERS / "crossed_worker.py"), str(out), str(out / "rows.json"), timeout=540
                )
            except (AssertionError, subprocess.TimeoutExpired) as error:
                failed[first] = str(error)[-2000:]
                raise
            done.update(json.loads((out / "results.json").read_text()))
        return done[str(number)]

    return run_of


@pytest.mark.slow
@pytest.mark.crossed
@crossed_tier_only
@pytest.mark.parametrize("number", range(1, len(ROWS) + 1), ids=lambda number: " ".join(ROWS[number - 1]))
def test_a_row_trains_with_finite_losses_and_resumes_where_it_saved(number, results):
    """Both steps' losses finite; built again from the checkpoint of step 1, the run takes step 2 as it did; a row
    with train.compile compiled its graphs (without, only 8-bit AdamW's update is compiled)."""
    run, row = results(number), dict(zip(crossed.FACTORS, ROWS[number - 1]))
    optimizer_graphs = 1 if row["state"] == "8-bit" else 0
    assert (run["compiled_graphs"] > optimizer_graphs) == (row["compile"] == "on"), run
    losses, resumed = run["losses"], run["resumed"]
    assert list(losses) == ["1", "2"] and all(math.isfinite(loss) for loss in losses.values()), run
    assert list(resumed) == ["2"] and resumed["2"] == pytest.approx(losses["2"], rel=LOSS_RTOL, abs=1e-12), run
