"""Every name the documentation hands a reader resolves: README.md, docs/*.md and the package's docstrings and
comments, read as text. A dotted name `llmtrain.x.y.Name` (or `llmtrain.x.y:Name`) is a module of the package and a
name it defines; a path `llmtrain/x/y.py`, `tests/...`, `conf/...` is a file or folder of the repository, a shorter
one (`parallel/tp.py`, `tp.py`) the end of one; `path.py's Name` names something that file defines. Read with ast:
nothing is imported. Files a guide tells the reader to create are marked `<!-- new: PATH -->` beside their block
(docs/extending.md): names inside them are the reader's to make."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "llmtrain"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

DOTTED = re.compile(r"(?<![\w.])llmtrain(?:\.\w+)+(?::\w+)?")
# From the repository's top: a file or a folder (trailing /); a placeholder's prefix (conf/parallel/<name>.yaml) is
# skipped.
ROOTED = re.compile(r"(?<![\w./-])(?:llmtrain|tests|conf|docs|launch|\.ci)/[\w./-]*")
# A shorter path to a Python file, or its bare name: the end of a path in the repository.
PYTHON_FILE = re.compile(r"(?<![\w./-])(?:\w+/)*\w+\.py\b")
# `path.py`'s `name`, or path.py's NAME (a plain word after 's counts when it reads as code: Capitalised or snake_case).
OWNED = re.compile(r"`?((?:[\w-]+/)*\w+\.py)`?'s\s+(?:`([\w.]+)|([A-Z]\w*|\w+_\w+))")
NEW_FILE = re.compile(r"<!-- new: (\S+) -->")


@dataclass(frozen=True)
class Mention:
    name: str
    where: str  # path:line

    def __str__(self) -> str:
        return f"{self.name}  ({self.where})"


def _texts() -> Iterator[tuple[str, int, str]]:
    """(file, first line, text) of every page, docstring and comment."""
    for page in PAGES:
        yield str(page.relative_to(REPO)), 1, page.read_text(encoding="utf-8")
    for path in sorted(PACKAGE.rglob("*.py")):
        source, relative = path.read_text(encoding="utf-8"), str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[0] if node.body else None
                if (
                    isinstance(body, ast.Expr)
                    and isinstance(body.value, ast.Constant)
                    and isinstance(body.value.value, str)
                ):
                    yield relative, body.lineno, body.value.value
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                yield relative, token.start[0], token.string


def _mentions(pattern: re.Pattern[str], texts: list[tuple[str, int, str]]) -> Iterator[tuple[re.Match[str], str]]:
    for file, first_line, text in texts:
        for match in pattern.finditer(text):
            yield match, f"{file}:{first_line + text.count(chr(10), 0, match.start())}"


def _repository_files() -> set[str]:
    files = set()
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if parts[0] not in (".git", ".venv", "outputs", "multirun") and "__pycache__" not in parts and path.is_file():
            files.add("/".join(parts))
    return files


FILES = _repository_files()
NEW = {path for page in PAGES for path in NEW_FILE.findall(page.read_text(encoding="utf-8"))}


def _file(path: str) -> str | None:
    """The repository file `path` names: itself, or the one file it ends (None: none, or several)."""
    if path in FILES:
        return path
    ends = [file for file in FILES if file.endswith("/" + path)]
    return ends[0] if len(ends) == 1 else None


def _path_resolves(path: str) -> bool:
    path = path.rstrip(".,;:")
    if path in NEW or path in FILES or (REPO / path).exists():  # llmtrain/conf links to conf/
        return True
    return any(file.endswith("/" + path) for file in FILES)


def _bound_names(tree: ast.AST) -> dict[str, ast.AST]:
    """The names a module or class body binds, each with its node (an import's node for an imported name)."""
    names: dict[str, ast.AST] = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` and guarded definitions
            names.update(_bound_names(node))
    return names


def _module_file(module: str) -> Path | None:
    base = REPO / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _defines(path: Path, attributes: list[str]) -> bool:
    """Whether the module at `path` defines `attributes[0]` (a class holding `attributes[1]`, ...), following
    `from llmtrain... import` to where an imported name is defined."""
    scope: ast.AST = ast.parse(path.read_text(encoding="utf-8"))
    for index, attribute in enumerate(attributes):
        node = _bound_names(scope).get(attribute)
        if node is None:
            return False
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmtrain") and not node.level:
            source = _module_file(f"{node.module}.{attribute}") or _module_file(node.module)
            rest = attributes[index + 1 :] if _module_file(f"{node.module}.{attribute}") else attributes[index:]
            return source is not None and (not rest or _defines(source, rest))
        if index + 1 < len(attributes) and not isinstance(node, ast.ClassDef):
            return True  # an attribute of a value: as far as reading the source goes
        scope = node
    return True


def _dotted_resolves(name: str) -> bool:
    name = name.rstrip(".")
    parts = name.replace(":", ".").split(".")
    for split in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:split]))
        if path is not None:
            rest = parts[split:]
            return not rest or _defines(path, rest)
    return False


def _new(name: str) -> bool:
    """Whether `name` is inside a file a guide has the reader create."""
    as_path = name.split(":")[0].replace(".", "/")
    return any(as_path.startswith(new.removesuffix(".py")) for new in NEW if new.endswith(".py"))


def unresolved() -> list[Mention]:
    texts = list(_texts())
    missing: list[Mention] = []
    for match, where in _mentions(DOTTED, texts):
        if not _new(match.group()) and not _dotted_resolves(match.group()):
            missing.append(Mention(match.group().rstrip("."), where))
    for pattern in (ROOTED, PYTHON_FILE):
        for match, where in _mentions(pattern, texts):
            text = match.string
            placeholder = text[match.end() : match.end() + 1] in ("<", "{", "*", "$")
            if not placeholder and not _path_resolves(match.group()):
                missing.append(Mention(match.group().rstrip(".,;:"), where))
    for match, where in _mentions(OWNED, texts):
        path, name = match.group(1), match.group(2) or match.group(3)
        file = _file(path)
        if path not in NEW and file is not None and file.endswith(".py") and not _defines(REPO / file, name.split(".")):
            missing.append(Mention(f"{path}'s {name}", where))
    return list(dict.fromkeys(missing))


def test_every_name_the_docs_mention_resolves():
    missing = unresolved()
    assert not missing, "names the docs mention that do not resolve:\n" + "\n".join(map(str, missing))


def test_the_architecture_pages_layers_are_modules():
    """docs/architecture.md's table of import layers names modules and packages of llmtrain (`model/`: a
    package), beyond the paths the test above reads."""
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = [line for line in page.splitlines() if line.startswith("| ") and "`" in line]
    named = [name for line in table for name in re.findall(r"`([\w/.]+)`", line.split("|")[2])]
    assert named
    missing = [name for name in named if _module_file(f"llmtrain.{name.rstrip('/')}") is None]
    assert not missing, f"docs/architecture.md's layer table names modules llmtrain does not have: {missing}"
