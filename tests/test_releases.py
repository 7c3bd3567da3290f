"""The torch releases llmtrain admits: pyproject's floor is releases.TORCH_FLOOR, and an older torch is refused in
one line when llmtrain is imported (a real interpreter that finds an older torch's metadata first on its path)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

from llmtrain.releases import TORCH_FLOOR, torch_release


def test_pyprojects_floor_is_the_one_the_code_refuses_below():
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text())
    assert floor and tuple(map(int, floor.groups())) == TORCH_FLOOR
    assert torch_release() >= TORCH_FLOOR


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
