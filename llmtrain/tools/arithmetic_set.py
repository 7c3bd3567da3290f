"""An arithmetic prompt set for trying reinforcement learning offline (data=rl): word problems of GSM8K's shape,
whose answer is a number the `exact_number` reward checks.

    python -m llmtrain.tools.arithmetic_set prompts.jsonl                  # 2,000 chat prompts
    python -m llmtrain.tools.arithmetic_set prompts.jsonl --count 500 --text --max-operand 9

Each line is `{"prompt": [{"role": "user", "content": ...}], "answer": "n"}` (with --text, `prompt` is text for a
base model: `Q: ... A:`). A problem takes two or three operands in [1, --max-operand] and one or two of + - x,
worded as GSM8K's first steps are; the prompt asks for the answer after `####`, as GSM8K's solutions end. The same
--seed writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator

from llmtrain.errors import closed_pipe_is_quiet, exits_on_run_error

NAMES = ("Ada", "Ben", "Chen", "Dara", "Emil", "Fatima", "Goro", "Hana", "Ivan", "Jae")
THINGS = ("apples", "marbles", "stamps", "books", "shells", "coins", "pencils", "stickers")
# (operator, its clause) where a problem goes on from a count `n` of things
STEPS = (
    ("+", "then gets {k} more"),
    ("-", "then gives away {k}"),
    ("*", "then has {k} times as many"),
)
INSTRUCTION = "Give the final answer after ####."


def problem(rng: random.Random, max_operand: int) -> tuple[str, int]:
    """A word problem and its answer: a count, then one or two steps on it, never below 0."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    count = rng.randint(1, max_operand)
    sentence = [f"{name} has {count} {thing}"]
    for _ in range(rng.randint(1, 2)):
        operator, clause = rng.choice([step for step in STEPS if count or step[0] != "-"])
        if operator == "-":
            k = rng.randint(1, min(count, max_operand))
            count -= k
        else:
            k = rng.randint(1 if operator == "+" else 2, max(max_operand, 2))
            count = count + k if operator == "+" else count * k
        sentence.append(clause.format(k=k))
    return f"{', '.join(sentence)}. How many {thing} does {name} have now?", count


def records(count: int, seed: int, max_operand: int, text: bool) -> Iterator[dict]:
    rng = random.Random(seed)
    for _ in range(count):
        question, answer = problem(rng, max_operand)
        asked = f"{question} {INSTRUCTION}"
        prompt: object = f"Q: {asked}\nA:" if text else [{"role": "user", "content": asked}]
        yield {"prompt": prompt, "answer": str(answer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--count", type=int, default=2000, help="prompts to write (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="which problems (default 0)")
    parser.add_argument("--max-operand", type=int, default=20, help="the largest number a problem states (default 20)")
    parser.add_argument("--text", action="store_true", help="text prompts for a base model, not chat messages")
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for record in records(args.count, args.seed, args.max_operand, args.text):
            f.write(json.dumps(record) + "\n")
    print(f"wrote {args.count:,} prompts to {args.out}")


if __name__ == "__main__":
    with closed_pipe_is_quiet(), exits_on_run_error():
        main()
