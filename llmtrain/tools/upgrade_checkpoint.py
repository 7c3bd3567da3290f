"""`python -m llmtrain.tools.upgrade_checkpoint DIR [DIR ...]`: bring checkpoints written by earlier llmtrain
releases to the format training reads: a data position pickled as `data.pkl` becomes `data.pt` (loaded
weights-only), and a checkpoint without `checksums.json` gets one, from its files as they are now.

Reading a pickle can run any code it holds, so training refuses `data.pkl`; and a checkpoint without checksums
cannot show that its files are the ones written. Running this command is the decision that the checkpoint is
trusted and intact. DIR is one step-* directory or a directory of them."""

from __future__ import annotations

import argparse
import os
import pickle
import sys

from llmtrain.checkpoint import checksums
from llmtrain.checkpoint.manager import is_checkpoint_name
from llmtrain.checkpoint.safe_load import PICKLED_DATA_POSITION, write_data_position
from llmtrain.errors import closed_pipe_is_quiet


def upgrade(path: str) -> bool:
    """Convert one checkpoint; False when there was nothing to convert (already current, or not a checkpoint)."""
    pickled = os.path.join(path, PICKLED_DATA_POSITION)
    converted = os.path.isfile(pickled)
    if converted:
        with open(pickled, "rb") as f:
            position = pickle.load(f)  # the user vouched for this file by running the command
        write_data_position(path, position)
        os.remove(pickled)
    if converted or not os.path.isfile(os.path.join(path, checksums.CHECKSUMS)):
        checksums.seal(path)  # last: the files as they now are
        return True
    return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m llmtrain.tools.upgrade_checkpoint",
        description="Bring trusted checkpoints of earlier releases to today's format: data.pkl (a pickle) into "
        "data.pt, which training reads without running code, and checksums.json where there is none.",
    )
    parser.add_argument("paths", nargs="+", metavar="DIR", help="a step-* directory, or a directory of them")
    args = parser.parse_args(argv)
    for path in args.paths:
        if not os.path.isdir(path):
            sys.exit(f"error: {path} is not a directory: name a step-* checkpoint or the directory holding them")
        steps = [path] if is_checkpoint_name(path) else [os.path.join(path, n) for n in sorted(os.listdir(path))]
        converted = [step for step in steps if is_checkpoint_name(step) and upgrade(step)]
        print(f"{path}: {len(converted)} checkpoint(s) converted")


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
