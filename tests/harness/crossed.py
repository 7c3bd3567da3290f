"""Options crossed, not just alone: a pairwise matrix (allpairspy) over the catalog's objectives and layouts, the
tiny preset of every family, and the options a run can add. Each row is a config the checks before any rank starts
accept (config validation, then the layout on its world size); every pair of values meets in a row, or is refused
by those checks in one line. tests/workers/crossed_worker.py trains and resumes the rows; docs/crossed.md prints the
matrix (`python tests/harness/crossed.py > docs/crossed.md`).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import tempfile
from pathlib import Path

from allpairspy import AllPairs
from omegaconf import OmegaConf

if __name__ == "__main__":  # run as a script: the tests' folder on the path, as under pytest
    sys.path.insert(0, str(Path(__file__).parents[1]))

from harness.corpora import DIGIT_REWARD, DOCUMENT_CORPUS, write_preference_data, write_prompt_data
from harness.paths import REPO
from llmtrain import catalog
from llmtrain.config import validate
from llmtrain.errors import ConfigError
from llmtrain.parallel_plan import check_layout
from llmtrain.tools import compose_config

# What each objective trains on, in the test's files: {pairs}, {tokenizer} and {prompts} name those a test writes
# (write_preference_data, write_prompt_data). DPO and GRPO read 64 tokens: a prompt and its answer or completion.
OBJECTIVE_DATA: dict[str, tuple[str, ...]] = {
    "next_token": (f"data=local data.path={DOCUMENT_CORPUS} data.tokenizer.kind=byte train.seq_len=32",),
    "dpo": (
        "data=preference data.path={pairs} data.tokenizer.kind=hf data.tokenizer.name={tokenizer} train.seq_len=64",
    ),
    "grpo": (
        "data=rl data.path={prompts} data.tokenizer.kind=byte train.seq_len=64 rl.group_size=4 rl.max_new_tokens=6",
        *DIGIT_REWARD,
    ),
}
RANKS = 2
DOCUMENT = REPO / "docs" / "crossed.md"
# Two blocks, two steps of 8 rows (of train.steps=3: no end-of-run checkpoint); a checkpoint after each step, the
# guard judging step 2 against step 1
RUN = (
    "model.n_layer=2 train.steps=3 train.batch_size=8 train.micro_batch_size=2 optim.warmup_steps=1 "
    "train.eval_every=0 checkpoint.every=1 train.save_model=false train.spike_window=1 train.device=cpu "
    "logging.wandb.mode=disabled"
)


def _layouts() -> dict[str, str]:
    """The catalog's layouts that run on RANKS ranks (single on one), and the degrees a layout's planner may add."""
    names = {}
    for name, spec in catalog.LAYOUTS.items():
        ranks = math.prod(degree if isinstance(degree, int) and degree > 1 else 2 for degree in spec.degrees.values())
        if ranks > RANKS:
            continue  # a layout of more degrees than two ranks give each a 2 (hsdp, the 2-D and 3-D ones)
        names[name] = f"parallel={name}"
        for extra in spec.planner_extras:
            names[f"{name} {extra}={RANKS}"] = f"parallel={name} parallel.{extra}={RANKS}"
    return names


def _families() -> dict[str, str]:
    """Each family's tiny preset (conf/model/*tiny.yaml), one with experts first (expert parallelism takes it)."""
    names = sorted(path.stem for path in (REPO / "conf" / "model").glob("*tiny.yaml"))
    return {name: f"model={name}" for name in sorted(names, key=lambda name: name != "moe-tiny")}


# factor -> value -> its overrides. Each factor's first value is the one it takes beside a pair judged alone, chosen
# so that it refuses nothing by itself (adapters on, which DPO and an NF4 base need; a family with experts)
FACTORS: dict[str, dict[str, str]] = {
    "objective": {name: " ".join(OBJECTIVE_DATA[name]) for name in catalog.OBJECTIVES},
    "layout": _layouts(),
    "family": _families(),
    "adapters": {"lora": "model.lora.rank=4", "none": ""},
    # wide enough that each NF4 weight splits into two FSDP shards of whole groups (a narrower one is refused as
    # the layout is built, not before: parallel/fsdp.py's check reads the built weights)
    "base": {"as trained": "", "nf4": "model.quantize_base=nf4 model.d_model=256"},
    "attention": {name: f"train.attention={name}" for name in catalog.ATTENTION_MODES},
    "on_spike": {name: f"train.on_spike={name}" for name in catalog.SPIKE_ACTIONS},
    "state": {"32-bit": "", "8-bit": "optim.state_bits=8"},
    "offload": {"off": "", "on": "optim.offload=true"},
    "optimizer": {name: f"optim={name}" for name in catalog.OPTIMIZERS},
    # compiled by dynamo and AOTAutograd, the kernels eager: the graphs inductor would take (a graph break under
    # fullgraph, a recompile, a tensor subclass dynamo cannot trace fail here as there), without its ~30 s of code
    # generation a row on 2 CPU cores (inductor's kernels: the compiled layouts' parity tests)
    "compile": {"off": "", "on": "train.compile=true train.compile_backend=aot_eager"},
}
Row = tuple[str, ...]  # a value of each factor, in FACTORS' order
Pair = tuple[tuple[str, str], tuple[str, str]]  # (factor, value) twice, in FACTORS' order


def overrides(row: Row, files: dict[str, str]) -> list[str]:
    """The train.py overrides of a row, the test's files put in."""
    words = " ".join([RUN, *(FACTORS[factor][value] for factor, value in zip(FACTORS, row))]).split()
    return [word.format(**files) for word in words]


def world_size(row: Row) -> int:
    return 1 if row[list(FACTORS).index("layout")] == "single" else RANKS


@functools.cache
def test_files() -> dict[str, str]:
    """The files the objectives' data names, written once a process (a data path that does not exist is refused)."""
    directory = Path(tempfile.mkdtemp(prefix="llmtrain-crossed-"))
    tokenizer, pairs_file = write_preference_data(directory)
    return {"tokenizer": str(tokenizer), "pairs": str(pairs_file), "prompts": str(write_prompt_data(directory))}


@functools.cache
def refusal(row: Row) -> str | None:
    """What the checks before any rank starts say of a row: None, or their one-line error."""
    words = overrides(row, test_files())
    try:
        config = compose_config(words)
        validate(config)
        check_layout(OmegaConf.to_object(config), words, world_size(row))
    except ConfigError as error:
        return str(error)
    return None


def alone(pair: Pair) -> Row:
    """The row of a pair, every other factor at its first value."""
    chosen = dict(pair)
    return tuple(chosen.get(factor, next(iter(values))) for factor, values in FACTORS.items())


def pairs() -> list[Pair]:
    """Every pair of values of two factors."""
    named = [[(factor, value) for value in values] for factor, values in FACTORS.items()]
    return [pair for a, b in itertools.combinations(named, 2) for pair in itertools.product(a, b)]


def _held(values: list[str]) -> list[Pair]:
    return list(itertools.combinations(zip(FACTORS, values), 2))


def generated() -> list[Row]:
    """The rows, each accepted, every pair accepted alone in one: allpairspy's (the factors with most values first,
    as its greedy search covers best), then a row for each pair it left out (it stops at the first row that adds no
    pair, which under refusals comes early), filled with the values that hold the most pairs still missing."""
    order = sorted(range(len(FACTORS)), key=lambda i: -len(list(FACTORS.values())[i]))
    names = [list(FACTORS)[i] for i in order]

    def in_order(values: list[str]) -> Row:
        named = dict(zip(names, values))
        return tuple(named.get(factor, "") for factor in FACTORS)

    def accepted(values: list[str]) -> bool:
        named = [(name, value) for name, value in zip(FACTORS, in_order(values)) if value]
        if any(refusal(alone(pair)) for pair in itertools.combinations(named, 2)):
            return False
        return len(values) < len(FACTORS) or refusal(in_order(values)) is None

    rows = [in_order(list(row)) for row in AllPairs([list(FACTORS[name]) for name in names], filter_func=accepted)]
    for pair in pairs():
        if pair in covered(rows) or refusal(alone(pair)):
            continue
        row, missing = list(alone(pair)), set(pairs()) - covered(rows)
        for i, factor in enumerate(FACTORS):
            if factor in (pair[0][0], pair[1][0]):
                continue
            options = [row[:i] + [value] + row[i + 1 :] for value in FACTORS[factor]]
            options = [option for option in options if refusal(tuple(option)) is None]
            row = max(options, key=lambda option: len(missing & set(_held(option))))
        rows.append(tuple(row))
    return rows


def documented() -> list[Row]:
    """The rows docs/crossed.md holds (generated() when it was last written)."""
    lines = DOCUMENT.read_text().splitlines()
    cells = [line.strip("|").split("|") for line in lines if line.startswith("| ") and line[2].isdigit()]
    return [tuple(cell.strip() for cell in row[1:]) for row in cells]


def covered(rows: list[Row]) -> set[Pair]:
    """The pairs the rows hold."""
    return {pair for row in rows for pair in _held(list(row))}


def markdown(rows: list[Row]) -> str:
    """docs/crossed.md: the rows, and each pair no row holds with the line that refuses it."""
    held = covered(rows)
    lines = [
        "# Options crossed",
        "",
        "Generated by `python tests/harness/crossed.py > docs/crossed.md` (allpairspy, then a row for each pair it",
        "leaves out); held by `tests/train/test_crossed.py`. Every pair of two factors' values meets in a row, or is",
        "refused in one line before any rank starts: the refusals below, with every other factor at its first value",
        "(adapters on, a family with experts). That is checked in the slow tier; the rows run in .ci/run's crossed",
        "tier (`LLMTRAIN_CROSSED_TIER=1 python -m pytest -m crossed`, about 18 minutes on 2 cores): each trains two",
        "steps on 2 gloo ranks (`single` on one), saving after each, then resumes from its first checkpoint in a",
        "fresh build and takes step 2 again, every loss finite and the resumed step's the first run's. `compile`",
        "compiles with `train.compile_backend=aot_eager` (dynamo's and AOTAutograd's graphs, as inductor gets them;",
        "inductor's kernels are the compiled layouts' parity tests'). NF4 rows are 256 wide, so that every NF4 weight",
        "splits into two FSDP shards of whole groups.",
        "",
        f"{len(rows)} rows over {len(FACTORS)} factors; {len(held)} of {len(pairs())} pairs run.",
        "",
        "| # | " + " | ".join(FACTORS) + " |",
        "|---|" + "---|" * len(FACTORS),
    ]
    lines += [f"| {i} | " + " | ".join(row) + " |" for i, row in enumerate(rows, 1)]
    lines += ["", "## Pairs refused", "", "| pair | refused with |", "|---|---|"]
    for pair in pairs():
        if pair not in held:
            said = _shown(refusal(alone(pair)) or "ACCEPTED: no row holds it").replace("|", "\\|")
            lines.append(f"| {pair[0][0]}={pair[0][1]}, {pair[1][0]}={pair[1][1]} | {said} |")
    return "\n".join(lines) + "\n"


def _shown(text: str) -> str:
    """A refusal as the docs print it: the test's files by what they hold, the repository's by their paths in it."""
    for name, path in test_files().items():
        text = text.replace(path, f"<{name}>")
    return text.replace(f"{REPO}/", "")


if __name__ == "__main__":
    print(markdown(generated()), end="")
