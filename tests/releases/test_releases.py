"""The torch releases llmtrain admits: pyproject's floor is releases.TORCH_FLOOR, an older torch is refused in one
line when llmtrain is imported (a real interpreter that finds an older torch's metadata first on its path), and the
release tier's layouts.

The release tier (`.ci/run`: `python -m pytest -m releases` under each other release a user gets: the floor, which
the GPU images ship, and the newest `pip install torch` picks) runs the tests marked `releases`: what differs
between releases (DCP's async stager, optimizer state placement, the attention kernels' aten signatures, float8,
document masks, LoRA) in process, an async save and resume (test_checkpoint.py), and every layout family for two
steps in two 2-rank process groups (below, and test_release_features.py). The main suite covers those in its own
tests, so they run only in the tier (LLMTRAIN_RELEASE_TIER=1).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from harness.corpora import DOCUMENTS
from harness.layouts import BF16, RELEASE_COMMON, assert_matches_single, layout_group, release_tier_only
from harness.paths import REPO

from llmtrain.releases import TORCH_FLOOR, torch_release

pytestmark = pytest.mark.releases


def test_pyprojects_floor_is_the_one_the_code_refuses_below():
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text())
    assert floor and tuple(map(int, floor.groups())) == TORCH_FLOOR
    assert torch_release() >= TORCH_FLOOR


@pytest.mark.slow
def test_an_older_torch_is_refused_in_one_line(tmp_path):
    info = tmp_path / "torch-2.9.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.1\n")
    done = subprocess.run(
        [sys.executable, "-c", "import llmtrain"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert done.stderr == "error: llmtrain needs torch >= 2.11, found 2.9.1: pip install 'torch>=2.11'\n"


# The layout families on 2 ranks, each against one process: data-parallel ones (DDP, ZeRO-1 with Muon's slices, ZeRO-2,
# bf16 FSDP), tensor parallelism with sequence parallelism, and a pipeline (1F1B, packed documents through its
# stages). Context and expert parallelism, with what other features add, are in
# tests/releases/test_release_features.py: two
# groups, so that the tier's two workers share them.
RELEASE_LAYOUTS = [
    "parallel=ddp",
    "optim=muon parallel=zero1",
    "parallel=zero2",
    f"{BF16} parallel=fsdp",
    "parallel=tp parallel.sequence_parallel=true train.micro_batch_size=8",
    f"{DOCUMENTS} parallel=pp parallel.pp_schedule=1f1b parallel.microbatches=4",
]


@pytest.fixture(scope="module")
def release_results(tmp_path_factory) -> dict:
    return layout_group(tmp_path_factory, 2, RELEASE_COMMON, RELEASE_LAYOUTS)


@pytest.mark.slow
@release_tier_only
@pytest.mark.parametrize("layout", RELEASE_LAYOUTS)
def test_every_layout_family_on_this_torch_matches_one_process(layout, release_results):
    assert_matches_single(release_results, layout)
