"""`python -m llmtrain.tools.layout_doc [--write]`: what is made from llmtrain/catalog/layouts.py's LAYOUTS rows, one
per layout: conf/parallel/<name>.yaml (the option `parallel=<name>` and its --help line), and the layout tables of
README.md and docs/parallelism.md. Without --write it names the files that differ from their rows; the test suite
checks that none does."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from llmtrain.catalog import AUTO, AUTO_DESCRIPTION, AUTO_EXAMPLES, LAYOUTS, LayoutSpec
from llmtrain.config import CONF_DIR
from llmtrain.errors import closed_pipe_is_quiet

ROOT = os.path.dirname(CONF_DIR)
OPTIONS = os.path.join(CONF_DIR, "parallel")
WRITTEN_BY = (
    "Written by `python -m llmtrain.tools.layout_doc --write` from its row in llmtrain/catalog/layouts.py: edit that."
)
TABLE_START = (
    "<!-- layouts: written by `python -m llmtrain.tools.layout_doc --write` from llmtrain/catalog/layouts.py -->"
)
TABLE_END = "<!-- end of layouts -->"
# What a user can add to a row's layout, and how the planner picks one: table lines, not layouts.
README_EXTRAS = (
    "| any FSDP or pipeline layout + `parallel.cp=C` | each sequence over C ranks, attention around a ring | ring "
    "attention written here |",
    "| any FSDP or pipeline layout + `parallel.ep=E` | a mixture's experts over E ranks | all-to-all dispatch "
    "written here |",
    f"| `{AUTO}` | what the planner predicts fastest among those that fit | `llmtrain/planner/` |",
)
STATE_EXTRAS = (
    "| any FSDP or pipeline layout with `parallel.cp=C` | FSDP's shards span N·C | as parameters | as parameters | "
    "+ each layer's keys and values around the ring of C ranks, forward and (with their gradients) backward; "
    "activations /C | `apply_context_parallel`, ring attention written here |",
    "| any FSDP or pipeline layout with `parallel.ep=E` (MoE) | dense as the layout; experts Ψₑ/(N·C) (E ranks × "
    "FSDP over N·C/E) | as parameters | as parameters | + per mixture block two all-to-alls of the routed slots "
    "(top_k × tokens × d_model) forward and two backward, and one of the per-expert counts | "
    "`apply_expert_parallel`: DTensor `Shard(0)` experts, all-to-all written here, `fully_shard` on the experts |",
)


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, 116, initial_indent="# ", subsequent_indent="# ")


def _yaml_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def option_file(name: str, spec: LayoutSpec) -> str:
    """conf/parallel/<name>.yaml: the row's words as its opening comment, then the keys it sets."""
    parameters, gradients, state = spec.state
    lines = _comment(spec.description)
    lines += _comment(f"Per rank: parameters {parameters}, gradients {gradients}, AdamW state {state}.")
    lines += _comment(f"Communication per step: {spec.communication}.")
    lines += [f"#   {example}" for example in spec.examples]
    lines += _comment(WRITTEN_BY)
    lines.append(f"layout: {name}")
    lines += [f"{key}: {_yaml_value(value)}" for key, value in {**spec.degrees, **spec.settings}.items()]
    return "\n".join(lines) + "\n"


def auto_option_file() -> str:
    lines = _comment(AUTO_DESCRIPTION) + [f"#   {example}" for example in AUTO_EXAMPLES] + _comment(WRITTEN_BY)
    return "\n".join([*lines, f"layout: {AUTO}"]) + "\n"


def readme_table() -> list[str]:
    rows = ["| layout | splits | built from |", "|---|---|---|"]
    rows += [f"| `{name}` | {spec.splits} | {spec.built_from} |" for name, spec in LAYOUTS.items()]
    return [*rows, *README_EXTRAS]


def state_table() -> list[str]:
    rows = [
        "| layout | parameters | gradients | AdamW state | communication | built from |",
        "|---|---|---|---|---|---|",
    ]
    rows += [
        f"| `{name}` | {' | '.join(spec.state)} | {spec.communication} | {spec.built_from} |"
        for name, spec in LAYOUTS.items()
    ]
    return [*rows, *STATE_EXTRAS]


def with_table(page: str, table: list[str]) -> str:
    """`page` with the lines between its layout markers replaced by `table`."""
    head, start, rest = page.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not (start and end):
        raise ValueError(f"the page has no {TABLE_START} ... {TABLE_END} block")
    return "\n".join([head + start, *table, end + tail])


def rendered() -> dict[str, str]:
    """Every file the rows make, by path, with the text it should hold."""
    files = {os.path.join(OPTIONS, f"{name}.yaml"): option_file(name, spec) for name, spec in LAYOUTS.items()}
    files[os.path.join(OPTIONS, f"{AUTO}.yaml")] = auto_option_file()
    for page, table in (("README.md", readme_table()), (os.path.join("docs", "parallelism.md"), state_table())):
        path = os.path.join(ROOT, page)
        with open(path, encoding="utf-8") as f:
            files[path] = with_table(f.read(), table)
    return files


def stale() -> list[str]:
    """The files that differ from their rows, and option files that no row makes."""
    files = rendered()
    differing = []
    for path, text in files.items():
        if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
            differing.append(path)
    orphans = [os.path.join(OPTIONS, n) for n in os.listdir(OPTIONS) if os.path.join(OPTIONS, n) not in files]
    return differing + orphans


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.tools.layout_doc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the files instead of naming those that differ")
    args = parser.parse_args()
    if not args.write:
        differing = stale()
        print("\n".join(differing) if differing else "every file is what its row makes")
        sys.exit(1 if differing else 0)
    files = rendered()
    for name in os.listdir(OPTIONS):
        if os.path.join(OPTIONS, name) not in files:
            os.remove(os.path.join(OPTIONS, name))
    for path, text in files.items():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"wrote {len(files)} files")


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
