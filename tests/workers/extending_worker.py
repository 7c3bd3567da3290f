"""docs/extending.md's code, read out of the page and installed into this process: each fenced block the page marks
`<!-- new: PATH -->` (a file the reader creates) or `<!-- edit: PATH WHAT -->` (what the reader adds to a file) is
run as the page says it goes in. tests/test_extending.py installs them in its own process (undone after each test);
run by it under torchrun, this installs them, then runs tests/workers/layout_worker.py's layouts:

    torchrun --nproc_per_node=N tests/workers/extending_worker.py OUT_DIR "<overrides for all>" "<layout 1>" ...
"""

from __future__ import annotations

import ast
import difflib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import llmtrain.model
import llmtrain.optim
from llmtrain import catalog
from llmtrain.parallel import family

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "extending.md"
MARKED = re.compile(r"<!-- (?:new|edit): ([^>]+?) -->\n```\w*\n(.*?)\n```", re.S)


def blocks() -> dict[str, str]:
    """The page's marked blocks by their marker: "llmtrain/catalog.py LAYOUTS", "conf/optim/lion.yaml", ..."""
    return dict(MARKED.findall(GUIDE.read_text(encoding="utf-8")))


def _rows(marker: str, namespace: dict[str, Any]) -> dict:
    """A block of dictionary entries (rows as the page adds them to a table), evaluated where the table is."""
    return eval("{" + blocks()[marker] + "}", dict(namespace))


def _edited(marker: str, module: ModuleType) -> dict[str, Any]:
    """`module`'s namespace with the block run in it, as if added to the module's source (the module is untouched)."""
    namespace = dict(vars(module))
    exec(compile(blocks()[marker], f"{GUIDE} ({marker})", "exec"), namespace)
    return namespace


def _new_module(path: str, patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's new file `path` as the module it would be, importable by its name."""
    module = ModuleType(path.removesuffix(".py").replace("/", "."))
    module.__file__ = str(REPO / path)
    patch.setitem(sys.modules, module.__name__, module)
    exec(compile(blocks()[path], f"{GUIDE} ({path})", "exec"), vars(module))
    return module


def _replace(patch: pytest.MonkeyPatch, old: Callable, new: Callable) -> None:
    """`new` wherever the package holds `old` (its module, and every module that imported it by name)."""
    for module in [m for name, m in sys.modules.items() if name.startswith("llmtrain") and m is not None]:
        for attribute, value in list(vars(module).items()):
            if value is old:
                patch.setattr(module, attribute, new)


def added_lines(function: Callable, marker: str) -> list[str]:
    """The lines the page's version of `function` adds to the package's, docstrings and comments aside; an
    AssertionError naming them if it also changes or drops some (the page then shows a function the package no
    longer has)."""

    def lines(source: str) -> list[str]:
        tree = ast.parse(textwrap.dedent(source))
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function.__name__)
        if ast.get_docstring(node) is not None:
            node.body = node.body[1:]
        return [line.strip() for line in ast.unparse(node).splitlines()]

    ours, page = lines(inspect.getsource(function)), lines(blocks()[marker])
    added, differing = [], []
    for op, a, b, c, d in difflib.SequenceMatcher(a=ours, b=page, autojunk=False).get_opcodes():
        if op == "insert":
            added += page[c:d]
        elif op != "equal":
            differing += [f"- {line}" for line in ours[a:b]] + [f"+ {line}" for line in page[c:d]]
    assert not differing, f"docs/extending.md's {function.__name__} is not the package's plus lines:\n" + "\n".join(
        differing
    )
    return added


def install_layout(patch: pytest.MonkeyPatch) -> dict[str, catalog.LayoutSpec]:
    """The page's layout row in LAYOUTS."""
    rows = _rows("llmtrain/catalog.py LAYOUTS", vars(catalog))
    for name, row in rows.items():
        patch.setitem(catalog.LAYOUTS, name, row)
    return rows


def install_family(patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's model module, its row in FAMILIES and the meta_model that chooses it."""
    module = _new_module("llmtrain/model/squared_relu.py", patch)
    functions = _edited("llmtrain/parallel/family.py functions", family)
    for model_class, spec in _rows("llmtrain/parallel/family.py FAMILIES", functions).items():
        patch.setitem(family.FAMILIES, model_class, spec)
    _replace(
        patch, llmtrain.model.meta_model, _edited("llmtrain/model/__init__.py meta_model", llmtrain.model)["meta_model"]
    )
    return module


def install_optimizer(patch: pytest.MonkeyPatch) -> ModuleType:
    """The page's optimizer module, its row in OPTIMIZERS and the build_optimizer that builds it."""
    module = _new_module("llmtrain/optim/lion.py", patch)
    for name, row in _rows("llmtrain/catalog.py OPTIMIZERS", vars(catalog)).items():
        patch.setitem(catalog.OPTIMIZERS, name, row)
    edited = _edited("llmtrain/optim/__init__.py build_optimizer", llmtrain.optim)
    _replace(patch, llmtrain.optim.build_optimizer, edited["build_optimizer"])
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
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
