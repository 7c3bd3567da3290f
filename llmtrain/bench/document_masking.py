"""What attention within each packed document (`train.attention=document`) costs per step, and what it changes in
what a model learns, against causal attention over the whole window.

    python -m llmtrain.bench.document_masking [--steps 300] [--repeats 10] [overrides...]

The corpus: short documents, each docstring of the running Python's standard library under 600 characters (3,598
of 138 characters on average on CPython 3.11), written as a local jsonl and read by `data=local` in byte tokens, so
that a window of 256 tokens packs a few documents.

Cost: the median seconds of one training step's forward and backward (the single layout, as training runs it) at
each window length, document against causal, on the same batches. Quality: `model=tiny` trained --steps steps each
way from the same seed on the same batches, then its loss on the held-out windows read both ways: packed (causal,
each token seeing the documents before it in the window) and each document alone (the document mask: by
tests/model/test_documents.py the same logits as the document fed by itself, which is how a model meets a prompt).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import cast

import torch
from omegaconf import OmegaConf

from llmtrain.config import RootConfig
from llmtrain.errors import closed_pipe_is_quiet
from llmtrain.model import cross_entropy_loss
from llmtrain.model.documents import document_starts
from llmtrain.model.scoring import TokenMarks
from llmtrain.process.runtime import Runtime
from llmtrain.run.build import build_parallel_model, build_training
from llmtrain.tools import compose_config
from llmtrain.train.loop import Trainer
from llmtrain.train.objectives import token_rows

QUIET = ["logging.wandb.mode=disabled", "checkpoint.resume=none", "train.save_model=false", "logging.progress=lines"]
MODES = ("causal", "document")
ONE_PROCESS = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")


def write_corpus(path: Path, longest: int = 600) -> tuple[int, float]:
    """The standard library's docstrings under `longest` characters as a jsonl of documents; (count, mean length)."""
    lengths = []
    with open(path, "w") as out:
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            try:
                tree = ast.parse(source.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    text = ast.get_docstring(node)
                    if text and len(text) < longest:
                        out.write(json.dumps({"text": text}) + "\n")
                        lengths.append(len(text))
    return len(lengths), statistics.mean(lengths)


def step_seconds(overrides: list[str], repeats: int) -> dict[str, float]:
    """Median seconds of one forward/backward over a global batch, per attention mode, on the same batches."""
    found = {}
    for mode in MODES:
        config = cast(RootConfig, OmegaConf.to_object(compose_config([*QUIET, *overrides, f"train.attention={mode}"])))
        with tempfile.TemporaryDirectory() as run_dir:
            parts = build_training(config, ONE_PROCESS, run_dir)
            try:
                batch = parts.train_slice.micro_batches(token_rows(parts.data.train.next()), ONE_PROCESS.device)
            finally:
                parts.data.close()
        tokenizer = parts.data.tokenizer
        model = build_parallel_model(config, ONE_PROCESS, tokenizer.vocab_size, marks=TokenMarks(tokenizer.eos_id))
        seconds = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            model.forward_backward(batch)
            seconds.append(time.perf_counter() - started)
            model.optimizer.zero_grad()
        found[mode] = statistics.median(seconds[1:])  # the first warms the allocator
    return found


def trained_losses(overrides: list[str], mode: str, steps: int) -> dict[str, float]:
    """A model trained `steps` steps with attention `mode`; its held-out loss read packed and per document."""
    run = [f"train.attention={mode}", f"train.steps={steps}", f"train.eval_every={steps}"]
    config = compose_config([*QUIET, *overrides, *run])
    with tempfile.TemporaryDirectory() as run_dir:
        parts = build_training(cast(RootConfig, OmegaConf.to_object(config)), ONE_PROCESS, run_dir)
        try:
            trainer = Trainer(parts, lambda record: None)
            parts.model.module.train()
            for _ in range(steps):
                trainer.advance()
        finally:
            parts.data.close()
    module, eos = parts.model.module.eval(), parts.data.tokenizer.eos_id
    rows = torch.from_numpy(parts.data.validation[0].rows)
    losses: dict[str, list[float]] = {"packed": [], "per document": []}
    with torch.no_grad():
        for window in rows.split(16):
            inputs, targets = window[:, :-1], window[:, 1:]
            losses["packed"].append(cross_entropy_loss(module(inputs), targets).item())
            per_document = module(inputs, documents=document_starts(inputs, eos))
            losses["per document"].append(cross_entropy_loss(per_document, targets).item())
    return {read: statistics.mean(values) for read, values in losses.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="training steps of each quality run")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per mode and window length")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (e.g. model=llama-tiny)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as corpus_dir:
        corpus = Path(corpus_dir) / "docstrings.jsonl"
        count, mean_length = write_corpus(corpus)
        data = [
            "data=local",
            f"data.path={corpus}",
            "data.tokenizer.kind=byte",
            "model=tiny",
            "train.batch_size=16",
            "train.micro_batch_size=16",
            "train.eval_batches=1",
            "data.val_fraction=0.1",
        ]
        print(f"corpus: {count:,} standard-library docstrings, {mean_length:.0f} characters on average (byte tokens)")
        print(f"\nstep time (forward + backward of 16 windows, one process, {torch.get_num_threads()} threads)")
        print(f"{'window':>7} {'causal s':>9} {'document s':>11} {'ratio':>6}")
        for seq_len in (256, 1024):
            window = ["train.seq_len=" + str(seq_len), f"model.max_seq_len={seq_len}"]
            seconds = step_seconds([*data, *window, *args.overrides], args.repeats)
            ratio = seconds["document"] / seconds["causal"]
            print(f"{seq_len:>7} {seconds['causal']:>9.4f} {seconds['document']:>11.4f} {ratio:>6.2f}", flush=True)
        print(f"\nheld-out loss after {args.steps} steps (model=tiny, windows of 256; nats per token)")
        print(f"{'trained':>9} {'read packed':>12} {'read per document':>18}")
        for mode in MODES:
            losses = trained_losses([*data, "train.seq_len=256", *args.overrides], mode, args.steps)
            print(f"{mode:>9} {losses['packed']:>12.4f} {losses['per document']:>18.4f}", flush=True)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
