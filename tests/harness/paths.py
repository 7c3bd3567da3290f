"""Where the repository, the tests and the scripts they start are."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
# The scripts the tests start (torchrun's workers, the warm interpreter); pyproject puts the folder on the path so the
# tests import their shared names as the scripts import each other.
WORKERS = TESTS / "workers"
