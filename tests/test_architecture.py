"""The package's imports run one way: each module imports only from its own layer or the layers below it, and no
modules import each other in a circle, counting imports inside functions and `if TYPE_CHECKING:` imports (which
never run, but say the same dependence). Read from the source with ast: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "llmtrain"

# Bottom to top: a module of layer k imports modules of layers <= k. An area is a package or module of llmtrain/, or
# one module of a package whose modules stand on different layers (run.runtime). A module run as a command (one with
# an `if __name__ == "__main__":` block) is in the top layer wherever it lives.
LAYERS = [
    {"errors", "faults", "optional", "catalog", "domains", "config", "parallel_plan", "hub", "releases", "differences"}
    | {"files", "run", "run.runtime", "run.launch_env", "run.run_dir", "run.attempts"},
    {"model", "data", "optim"},
    {"parallel"},
    {"planner", "checkpoint"},
    {"train"},
    {"run.build", "run.laid_out", "run.job", "run.retry", "run.reporting", "run.exits", "run.spawn", "lm_eval_model"},
    {"run.entry", "tools", "bench", "export", "generate", "chat"},
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
    """module -> the package modules it imports; and the modules that are commands."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    commands = set()
    for module, path in paths.items():
        source = path.read_text()
        if 'if __name__ == "__main__":' in source:
            commands.add(module)
        graph[module] = _imports(ast.parse(source), module, path.name == "__init__.py", set(paths))
    return graph, commands


def _layer(module: str, commands: set[str]) -> int:
    if module in commands:
        return len(LAYERS) - 1
    parts = module.split(".")[1:]
    for area in (".".join(parts[:2]), parts[0]):  # a package's module where it has its own layer, else the package
        for index, members in enumerate(LAYERS):
            if area in members:
                return index
    raise AssertionError(f"{module} is in no layer: add llmtrain/{parts[0]} to LAYERS in {__file__}")


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
    graph, commands = _graph()
    upward = [
        f"{module} (layer {_layer(module, commands)}) imports {target} (layer {_layer(target, commands)})"
        for module, targets in sorted(graph.items())
        if module != "llmtrain"
        for target in sorted(targets)
        if _layer(target, commands) > _layer(module, commands)
    ]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)
    assert not _cycles(graph), f"modules that import each other in a circle: {_cycles(graph)}"
