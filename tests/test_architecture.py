"""The package's imports run one way, read as folders as well as modules: each package (a folder of llmtrain/, or one
of its top-level modules) stands on one layer and imports only from its own layer or the layers below; no modules
import each other in a circle, and no folders do, at any depth (parallel/ and parallel/pipeline/ as much as train/
and run/). Imports inside functions and `if TYPE_CHECKING:` imports count (they never run, but say the same
dependence). Read from the source with ast: nothing is imported."""

from __future__ import annotations

import ast
from fnmatch import fnmatch
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "llmtrain"
# The repository's top level as the design fixes it: nothing a command wrote (a plan, a checkpoint) is committed there.
TOP_LEVEL = {
    "train.py",
    "conf",
    "llmtrain",
    "tests",
    "launch",
    "pyproject.toml",
    "README.md",
    "docs",
    ".ci",
    ".gitignore",
}

# Bottom to top: a package of layer k imports packages of layers <= k; the commands stand on top.
LAYERS = [
    {"errors", "files", "optional", "domains", "differences", "releases", "faults", "hub", "catalog"},
    {"process"},
    {"config", "parallel_plan"},
    {"model", "data", "optim"},
    {"parallel"},
    {"planner", "checkpoint"},
    {"train"},
    {"run", "lm_eval_model"},
    {"tools", "bench", "export", "generate", "evaluate", "chat"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules this module imports. `from llmtrain.model import hf_gpt2` imports the submodule;
    `from llmtrain.model import GPT` the package's own code."""
    found: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            if name.startswith("llmtrain."):
                while name not in modules:  # an attribute of a module: that module
                    name = name.rpartition(".")[0]
                found.add(name)
        pending.extend(ast.iter_child_nodes(node))
    found.discard(module)
    return found


def _graph() -> tuple[dict[str, set[str]], set[str]]:
    """module -> the package modules it imports; and the modules that are packages (an __init__.py)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {
        module: _imports(ast.parse(path.read_text()), module, path.name == "__init__.py", set(paths))
        for module, path in paths.items()
    }
    return graph, {module for module, path in paths.items() if path.name == "__init__.py"}


def _layer(module: str) -> int:
    package = module.split(".")[1]
    for index, members in enumerate(LAYERS):
        if package in members:
            return index
    raise AssertionError(f"{module} is in no layer: add {package} to LAYERS in {__file__}")


def _folder(module: str, packages: set[str], depth: int) -> str:
    """The folder a module is in, cut to `depth` levels below llmtrain/; a top-level module is a folder of its own."""
    parts = module.split(".")[1:]
    if module not in packages and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts[:depth])


def _folder_graph(graph: dict[str, set[str]], packages: set[str], depth: int) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "llmtrain":
            continue
        source = _folder(module, packages, depth)
        folders.setdefault(source, set())
        for target in targets:
            folders.setdefault(_folder(target, packages, depth), set())
            if _folder(target, packages, depth) != source:
                folders[source].add(_folder(target, packages, depth))
    return folders


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_imports_run_down_the_layers_and_never_in_a_circle():
    graph, _ = _graph()
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in sorted(graph.items())
        if module != "llmtrain"
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)
    assert not _cycles(graph), f"modules that import each other in a circle: {_cycles(graph)}"


def test_folders_never_import_each_other():
    graph, packages = _graph()
    deepest = max(len(module.split(".")) for module in packages)
    for depth in range(1, deepest):
        circles = _cycles(_folder_graph(graph, packages, depth))
        assert not circles, f"folders that import each other in a circle ({depth} deep): {circles}"


def test_every_layer_names_a_package_that_exists():
    named = set().union(*LAYERS)
    assert sum(len(members) for members in LAYERS) == len(named), "a package named on two layers"
    on_disk = {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    on_disk |= {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert named == on_disk, (
        f"named but absent: {sorted(named - on_disk)}; present but unnamed: {sorted(on_disk - named)}"
    )


def test_the_top_level_holds_what_the_design_fixes():
    """What a command wrote and .gitignore does not name (a plan, a checkpoint) has no place beside the design's
    entries; hidden entries (.ci, tools' caches) are not looked at."""
    root = PACKAGE.parent
    ignored = [line.strip().rstrip("/") for line in (root / ".gitignore").read_text().splitlines() if line.strip()]
    top = {path.name for path in root.iterdir() if not path.name.startswith(".")}
    stray = {name for name in top - TOP_LEVEL if not any(fnmatch(name, pattern) for pattern in ignored)}
    assert not stray, f"at the top level beside what the design fixes: {sorted(stray)}"
