"""A small conversation file for trying fine-tuning offline (data=sft): questions about the running Python's standard
library, answered by the docstrings of its functions and classes, read from the source files without importing them.

    python -m llmtrain.tools.stdlib_conversations chats.jsonl              # 2,000 conversations
    python -m llmtrain.tools.stdlib_conversations chats.jsonl --count 500

Each line is `{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}`; every third conversation asks a
follow-up about another name of the same module. The same Python writes the same file.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import sysconfig
from collections.abc import Iterator

from llmtrain.data.sources import stdlib_files
from llmtrain.errors import closed_pipe_is_quiet, exits_on_run_error


def documented_names(path: str) -> list[tuple[str, str, str]]:
    """(module.name, "function" or "class", the docstring's first paragraph) of the public functions and classes
    defined in `path`; none in a private or test module."""
    root = sysconfig.get_paths()["stdlib"]
    module = os.path.relpath(path, root).removesuffix(".py").replace(os.sep, ".").removesuffix(".__init__")
    if any(part.startswith("_") or part.startswith("test") for part in module.split(".")):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):  # a deliberately broken test file of the stdlib
        return []
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            answer = " ".join(doc.split("\n\n")[0].split()) if doc else ""
            if 20 <= len(answer) <= 400:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found.append((f"{module}.{node.name}", kind, answer))
    return found


def conversations(count: int) -> Iterator[dict]:
    """Up to `count` conversations, module by module in the stdlib's sorted order."""
    asked = 0
    for path in stdlib_files():
        names = documented_names(path)
        for i, (name, kind, answer) in enumerate(names):
            if asked == count:
                return
            messages = [
                {"role": "user", "content": f"What does the {kind} `{name}` do?"},
                {"role": "assistant", "content": answer},
            ]
            if asked % 3 == 2 and len(names) > 1:
                other, _, other_answer = names[(i + 1) % len(names)]
                messages += [
                    {"role": "user", "content": f"And `{other}`?"},
                    {"role": "assistant", "content": other_answer},
                ]
            asked += 1
            yield {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--count", type=int, default=2000, help="conversations to write (default 2000)")
    args = parser.parse_args()
    written = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for record in itertools.islice(conversations(args.count), args.count):
            f.write(json.dumps(record) + "\n")
            written += 1
    print(f"wrote {written:,} conversations to {args.out}")


if __name__ == "__main__":
    with closed_pipe_is_quiet(), exits_on_run_error():
        main()
