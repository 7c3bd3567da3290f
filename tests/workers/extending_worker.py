"""docs/extending.md's code, read out of the page and installed into this process: each fenced block the page marks
`<!-- new: PATH -->` (a file the reader creates) or `<!-- edit: PATH TABLE -->` (rows the reader adds to a table of
llmtrain/catalog/) is run as the page says it goes in. tests/test_extending.py installs them in its own process
(undone after each test); run by it under torchrun, this installs them, then runs tests/workers/layout_worker.py's
layouts:

    torchrun --nproc_per_node=N tests/workers/extending_worker.py OUT_DIR "<overrides for all>" "<layout 1>" ...
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from llmtrain import catalog

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "extending.md"
MARKED = re.compile(r"<!-- (new|edit): ([^>]+?) -->\n```\w*\n(.*?)\n```", re.S)


def blocks() -> dict[str, str]:
    """The page's marked blocks by their marker: "llmtrain/catalog/layouts.py LAYOUTS", "conf/optim/lion.yaml", ..."""
    return {marker: text for _, marker, text in MARKED.findall(GUIDE.read_text(encoding="utf-8"))}


def edits() -> list[str]:
    """The markers of the page's blocks that add to a file that exists, in the page's order."""
    return [marker for kind, marker, _ in MARKED.findall(GUIDE.read_text(encoding="utf-8")) if kind == "edit"]


def _rows(marker: str) -> dict[str, Any]:
    """A block of dictionary entries (rows as the page adds them to a catalog table), evaluated where the table is."""
    return eval("{" + blocks()[marker] + "}", dict(vars(catalog)))


def _install_rows(patch: pytest.MonkeyPatch, table: str) -> dict[str, Any]:
    """The page's rows of the catalog's `table`, added to it."""
    rows = _rows(next(marker for marker in edits() if marker.split()[1] == table))
    for name, row in rows.items():
        patch.setitem(getattr(catalog, table), name, row)
    return rows


def _new_module(path: str, patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's new file `path` as the module it would be, importable by its name (so a row's import string
    finds it)."""
    module = ModuleType(path.removesuffix(".py").replace("/", "."))
    module.__file__ = str(REPO / path)
    patch.setitem(sys.modules, module.__name__, module)
    exec(compile(blocks()[path], f"{GUIDE} ({path})", "exec"), vars(module))
    return module


def install_layout(patch: pytest.MonkeyPatch) -> dict[str, catalog.LayoutSpec]:
    """The page's layout row in LAYOUTS."""
    return _install_rows(patch, "LAYOUTS")


def install_family(patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's model module, its planner shapes and its row in MODEL_FAMILIES; the model module."""
    module = _new_module("llmtrain/model/parallel_block.py", patch)
    _new_module("llmtrain/planner/parallel_block.py", patch)
    _install_rows(patch, "MODEL_FAMILIES")
    return module


def install_optimizer(patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's optimizer module and its row in OPTIMIZERS."""
    module = _new_module("llmtrain/optim/lion.py", patch)
    _install_rows(patch, "OPTIMIZERS")
    return module


def install_objective(patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's objective module and its row in OBJECTIVES."""
    module = _new_module("llmtrain/train/ipo.py", patch)
    _install_rows(patch, "OBJECTIVES")
    return module


def install_data_source(patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's data source: its documents' module and its row in DATA_SOURCES (its option file: write_options)."""
    module = _new_module("llmtrain/data/lines.py", patch)
    _install_rows(patch, "DATA_SOURCES")
    return module


def install_reward(patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's reward module and its row in REWARDS."""
    module = _new_module("llmtrain/data/answer_text.py", patch)
    _install_rows(patch, "REWARDS")
    return module


def write_options(directory: Path) -> str:
    """The page's new option files (conf/<group>/<name>.yaml) under `directory`; the override that makes Hydra
    find them beside conf/."""
    for marker, text in blocks().items():
        if marker.startswith("conf/"):
            path = directory / marker.removeprefix("conf/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n")
    return f"hydra.searchpath=[file://{directory}]"


if __name__ == "__main__":
    from layout_worker import main

    installed = pytest.MonkeyPatch()  # for the life of this process
    install_layout(installed)
    install_family(installed)
    install_optimizer(installed)
    install_objective(installed)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
