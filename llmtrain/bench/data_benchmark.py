"""The data pipeline alone, no model: streamed against prepared, per data-parallel rank and on resume.

    python -m llmtrain.bench.data_benchmark [--source stdlib|local --path FILES] [--tokenizer byte|bpe]
        [--dp 1,2,4,8] [--resume-steps 10,10000] [--store DIR] [data.* overrides, e.g. data.cache_dir=/tmp/cache]

The data config is the one `train.py` would run with the same overrides (conf/data/<source>.yaml). Without
--store, the corpus is first prepared into a temporary directory with `llmtrain.data.prepare` (prepare.num_proc =
--num-proc, 1 by default as for prepare), and its throughput is printed.

Throughput (tokens/s per rank, ranks simulated one after another in this process; training makes the same
batches in a background thread, llmtrain/data/prefetch.py, timed here without it). A streamed rank
reads and tokenises the whole global stream and keeps its 1/dp of each batch, so its work per step is
batch_size x (seq_len + 1) tokens whatever dp is, and the tokens it trains on per second fall as 1/dp. A prepared
rank reads only its own batch_size/dp rows from the store, so its rate stays about level. Read
"prepared/streaming" as how much faster the input side of one rank is; whether it matters depends on how the step
time compares with the streamed rate (a step that takes longer than the stream does to make a batch hides it).
Each dp is timed over at least --min-seconds as well as --steps batches per path: streamed tokenisation comes in
lumps of 64 documents, which a short window may miss, and a prepared batch takes well under a millisecond.

Mixture (data=mix): the same store read as three weighted sources (5 : 3 : 2), each with its own permutation per
epoch, drawn sample by sample by weight; "mixture/prepared" is what the mixing costs a rank.

Resume latency: seconds from "the process holds the checkpoint's data position" to "the first batch after it is in
hand", at each --resume-steps step. Streamed: a new TrainingWindows, load_state_dict, StreamedBatches.next() (the
position holds both shuffle buffers, so nothing is re-tokenised, but the source may have to skip to its place in
a shard). Prepared: PreparedBatches at position {"next_sample": step x batch_size, ...}.next(), one index
computation. The median of --repeats resumes is reported, each checked against the batch an uninterrupted stream
gives there (same_batch).

Each measurement prints one JSON line as it finishes ({"kind": "prepare" | "throughput" | "resume", ...}); the
tables follow at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from omegaconf import OmegaConf

from llmtrain.config import DataConfig, PrepareConfig, validate_data
from llmtrain.data import build_tokenizer, training_windows
from llmtrain.data.files import check_data_files
from llmtrain.data.mixture import MixtureBatches, MixtureSource
from llmtrain.data.prefetch import Batches
from llmtrain.data.prepare import prepare
from llmtrain.data.prepared import PreparedBatches
from llmtrain.data.sources import TRAIN
from llmtrain.data.store import read_manifest
from llmtrain.data.stream import RankSlice, StreamedBatches
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import ConfigError, closed_pipe_is_quiet
from llmtrain.tools import compose_config

PROGRESS_EVERY_S = 10.0
# The mixture measured against one store: three sources of these weights (each the store itself).
MIXTURE_WEIGHTS = (5.0, 3.0, 2.0)


def data_config(source: str, path: str | None, tokenizer: str, overrides: list[str]) -> tuple[DataConfig, int]:
    """The data config and seed `train.py data=<source> ...` would run with."""
    cfg = compose_config([f"data={source}", *overrides])
    # Set after composing, not as overrides: a path or glob need not survive Hydra's override grammar.
    cfg.data.tokenizer.kind = tokenizer
    if path is not None:
        cfg.data.path = path
    data_cfg = cast(DataConfig, OmegaConf.to_object(cfg.data))
    validate_data(data_cfg)
    check_data_files(data_cfg)
    return data_cfg, int(cfg.seed)


def streaming_throughput(
    data_cfg: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    dp: int,
    steps: int,
    min_seconds: float,
) -> dict[str, Any]:
    """Rank 0 of dp streaming: its trained tokens/s over at least `steps` batches and `min_seconds`."""
    per_rank = batch_size // dp
    windows = training_windows(data_cfg, tokenizer, seq_len, seed)
    batches = StreamedBatches(windows, RankSlice(batch_size, per_rank, 0, dp))
    batches.next()  # warm-up: fills the document and window shuffle buffers, which a running job has done long ago
    taken, started = 0, time.perf_counter()
    while taken < steps or time.perf_counter() - started < min_seconds:
        rows = batches.next()
        assert rows.shape == (per_rank, seq_len + 1), rows.shape
        taken += 1
    seconds = time.perf_counter() - started
    return {
        "kind": "throughput",
        "path": "streaming",
        "dp": dp,
        "tokens_per_s_per_rank": taken * per_rank * seq_len / seconds,
        "steps": taken,
        "seconds": round(seconds, 4),
        "rows_per_rank": per_rank,
        # Every rank cuts the whole global batch out of the stream it tokenised, whatever its share.
        "tokens_tokenised_per_rank_per_step": batch_size * (seq_len + 1),
    }


def prepared_throughput(
    store: str, seq_len: int, batch_size: int, seed: int, dp: int, steps: int, min_seconds: float
) -> dict[str, Any]:
    """Every rank of dp reading at least `steps` batches (and min_seconds / dp) from the store, one rank after
    another: mean trained tokens/s per rank, and the tokens each read per step (counted from what next() returned)."""
    return _reading_throughput(
        "prepared", lambda rows: PreparedBatches(store, seq_len, seed, rows, None), seq_len, batch_size, dp, steps,
        min_seconds,
    )  # fmt: skip


def mixture_throughput(
    store: str, seq_len: int, batch_size: int, seed: int, dp: int, steps: int, min_seconds: float
) -> dict[str, Any]:
    """prepared_throughput for data=mix: MIXTURE_WEIGHTS' sources, each the store (its windows read as three
    sources' are: by source, a permutation per source and epoch), drawn sample by sample by weight."""
    sources = [MixtureSource(f"source{i}", store, weight, None) for i, weight in enumerate(MIXTURE_WEIGHTS)]
    return _reading_throughput(
        "mixture", lambda rows: MixtureBatches(sources, seq_len, seed, rows, False, None), seq_len, batch_size, dp,
        steps, min_seconds,
    )  # fmt: skip


def _reading_throughput(
    path: str,
    batches_of: Callable[[RankSlice], Batches],
    seq_len: int,
    batch_size: int,
    dp: int,
    steps: int,
    min_seconds: float,
) -> dict[str, Any]:
    per_rank = batch_size // dp
    rates, read, taken = [], 0, 0
    for rank in range(dp):
        batches = batches_of(RankSlice(batch_size, per_rank, rank, dp))
        batches.next()  # warm-up: the epoch's permutation of the store's windows
        # A batch takes well under a millisecond: fewer than a few hundred of them time mostly the clock's noise.
        rank_taken, started = 0, time.perf_counter()
        while rank_taken < steps or time.perf_counter() - started < min_seconds / dp:
            read += batches.next().size
            rank_taken += 1
        rates.append(rank_taken * per_rank * seq_len / (time.perf_counter() - started))
        taken += rank_taken
    return {
        "kind": "throughput",
        "path": path,
        "dp": dp,
        "tokens_per_s_per_rank": float(np.mean(rates)),
        "tokens_per_s_per_rank_min": min(rates),
        "steps": taken // dp,
        "ranks_timed": dp,
        "rows_per_rank": per_rank,
        "tokens_read_per_rank_per_step": read // taken,
    }


def _timed(resume: Callable[[], np.ndarray], expected: np.ndarray, repeats: int) -> dict[str, Any]:
    """The median of `repeats` fresh resumes (one can catch a garbage collection or a cold page), each checked
    against the batch the uninterrupted stream gives there."""
    seconds, same = [], True
    for _ in range(repeats):
        started = time.perf_counter()
        batch = resume()
        seconds.append(time.perf_counter() - started)
        same = same and bool(np.array_equal(batch, expected))
    return {"seconds": float(np.median(seconds)), "seconds_each": [round(t, 5) for t in seconds], "same_batch": same}


def streaming_resume(
    data_cfg: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    resume_steps: list[int],
    repeats: int,
) -> list[dict[str, Any]]:
    """For each step S (ascending), one stream advanced to S gives the position; the timed part is what a
    resumed run does with it. dp = 1: a streamed rank's work does not depend on dp."""
    rank_slice = RankSlice(batch_size, batch_size, 0, 1)
    stream = training_windows(data_cfg, tokenizer, seq_len, seed)
    done, advancing, last_note = 0, 0.0, time.perf_counter()
    rows = []
    for step in sorted(resume_steps):
        started = time.perf_counter()
        while done < step:
            for _ in itertools.islice(stream, batch_size):
                pass
            done += 1
            if time.perf_counter() - last_note > PROGRESS_EVERY_S:
                last_note = time.perf_counter()
                print(f"  advancing the stream: batch {done:,} of {step:,}", file=sys.stderr, flush=True)
        advancing += time.perf_counter() - started
        position = stream.state_dict()
        expected = np.stack(list(itertools.islice(stream, batch_size)))  # what the uninterrupted run trains on next
        done += 1

        def resume(position: dict = position) -> np.ndarray:
            resumed = training_windows(data_cfg, tokenizer, seq_len, seed)
            resumed.load_state_dict(position)
            batch = StreamedBatches(resumed, rank_slice).next()
            return batch

        row = {"kind": "resume", "path": "streaming", "step": step, **_timed(resume, expected, repeats)}
        row["seconds_to_reach_step"] = round(advancing, 2)  # not part of the resume: what reaching the step took
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def prepared_resume(
    store: str, seq_len: int, batch_size: int, seed: int, resume_steps: list[int], repeats: int
) -> list[dict[str, Any]]:
    """For each step S, PreparedBatches at S's position and its first batch, timed; dp = 1 as for streaming."""
    rank_slice = RankSlice(batch_size, batch_size, 0, 1)
    reference = PreparedBatches(store, seq_len, seed, rank_slice, None)
    done, rows = 0, []
    for step in sorted(resume_steps):
        while done < step:
            reference.next()
            done += 1
        position = reference.state_dict()
        expected = reference.next()
        done += 1
        assert position == {"next_sample": step * batch_size, "windows": reference.windows.count, "window": seq_len + 1}

        def resume(position: dict = position) -> np.ndarray:
            return PreparedBatches(store, seq_len, seed, rank_slice, position).next()

        row = {"kind": "resume", "path": "prepared", "step": step, **_timed(resume, expected, repeats)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _prepare_store(data_cfg: DataConfig, out: str, num_proc: int) -> dict[str, Any]:
    manifest = prepare(data_cfg, PrepareConfig(out=out, num_proc=num_proc))
    tokens = sum(split["tokens"] for split in manifest["splits"].values())
    row = {
        "kind": "prepare",
        "tokens": tokens,
        "train_tokens": manifest["splits"][TRAIN]["tokens"],
        "seconds": manifest["seconds"],
        "num_proc": manifest["num_proc"],
        "tokens_per_s": tokens / manifest["seconds"],
    }
    print(json.dumps(row), flush=True)
    return row


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _throughput_table(rows: list[dict[str, Any]], dps: list[int]) -> str:
    by = {(r["path"], r["dp"]): r for r in rows}
    lines = [
        f"{'dp':>3}  {'streaming tok/s/rank':>20}  {'prepared tok/s/rank':>19}  {'prepared/streaming':>18}  "
        f"{'mixture tok/s/rank':>18}  {'mixture/prepared':>16}  {'tokenised/rank/step':>19}  {'read/rank/step':>14}"
    ]
    for dp in dps:
        streamed, prepared, mixture = by[("streaming", dp)], by[("prepared", dp)], by[("mixture", dp)]
        s, p, m = (row["tokens_per_s_per_rank"] for row in (streamed, prepared, mixture))
        lines.append(
            f"{dp:>3}  {s:>20,.0f}  {p:>19,.0f}  {p / s:>17.1f}x  {m:>18,.0f}  {m / p:>15.2f}x  "
            f"{streamed['tokens_tokenised_per_rank_per_step']:>19,}  {prepared['tokens_read_per_rank_per_step']:>14,}"
        )
    return "\n".join(lines)


def _resume_table(rows: list[dict[str, Any]], steps: list[int]) -> str:
    by = {(r["path"], r["step"]): r for r in rows}
    lines = [f"{'step':>7}  {'streaming ms':>12}  {'prepared ms':>11}  {'streaming/prepared':>18}  {'same batch':>10}"]
    for step in sorted(steps):
        streamed, prepared = by[("streaming", step)], by[("prepared", step)]
        s, p = streamed["seconds"], prepared["seconds"]
        same = "yes" if streamed["same_batch"] and prepared["same_batch"] else "NO"
        lines.append(f"{step:>7,}  {s * 1e3:>12.1f}  {p * 1e3:>11.2f}  {s / p:>17.0f}x  {same:>10}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every measurement `args` asks for; prints JSON lines as they finish and the tables at the end."""
    dps, resume_steps = list(dict.fromkeys(_int_list(args.dp))), sorted(set(_int_list(args.resume_steps)))
    for dp in dps:
        if dp < 1 or args.batch_size % dp:
            raise ConfigError(f"--dp {dp} does not divide --batch-size {args.batch_size}")
    overrides = list(args.overrides) + ([f"data.cache_dir={args.cache_dir}"] if args.cache_dir else [])
    data_cfg, seed = data_config(args.source, args.path, args.tokenizer, overrides)
    seed = args.seed if args.seed is not None else seed

    started = time.perf_counter()
    tokenizer = build_tokenizer(data_cfg, is_main=True, barrier=lambda: None)
    print(f"tokenizer {args.tokenizer}: {tokenizer.vocab_size:,} ids, ready in {time.perf_counter() - started:.1f} s")

    results: dict[str, list[dict[str, Any]]] = {"prepare": [], "throughput": [], "resume": []}
    with tempfile.TemporaryDirectory(prefix="llmtrain-data-benchmark-") as scratch:
        store = args.store
        if store is None:
            store = os.path.join(scratch, "store")
            results["prepare"].append(_prepare_store(data_cfg, store, args.num_proc))
        manifest = read_manifest(store)
        if manifest["tokenizer"]["kind"] != args.tokenizer:
            print(
                f"note: the store at {store} is tokenised with {manifest['tokenizer']['kind']}, the streamed path "
                f"with {args.tokenizer}: the two paths are not tokenising the same way",
                file=sys.stderr,
            )
        print(
            f"data={args.source} tokenizer={args.tokenizer} seq_len={args.seq_len} batch_size={args.batch_size} "
            f"seed={seed}; store {store}: {manifest['splits'][TRAIN]['tokens']:,} training tokens",
            flush=True,
        )

        results["throughput"] = _throughputs(args, data_cfg, tokenizer, store, seed, dps)
        if resume_steps:
            results["resume"] += streaming_resume(
                data_cfg, tokenizer, args.seq_len, args.batch_size, seed, resume_steps, args.repeats
            )
            results["resume"] += prepared_resume(store, args.seq_len, args.batch_size, seed, resume_steps, args.repeats)

    _print_tables(args, results, dps, resume_steps)
    return results


def _throughputs(
    args: argparse.Namespace, data_cfg: DataConfig, tokenizer: Tokenizer, store: str, seed: int, dps: list[int]
) -> list[dict[str, Any]]:
    """Streamed, prepared and mixed reading at each data-parallel size, each row printed as it finishes."""
    rows = []
    for dp in dps:
        row = streaming_throughput(
            data_cfg, tokenizer, args.seq_len, args.batch_size, seed, dp, args.steps, args.min_seconds
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
        for measure in (prepared_throughput, mixture_throughput):
            row = measure(store, args.seq_len, args.batch_size, seed, dp, args.steps, args.min_seconds)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _print_tables(
    args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], dps: list[int], resume_steps: list[int]
) -> None:
    """The tables of `results`, after the JSON lines."""
    for row in results["prepare"]:
        print(
            f"\nprepare: {row['tokens']:,} tokens in {row['seconds']:.1f} s with num_proc={row['num_proc']}, "
            f"{row['tokens_per_s']:,.0f} tokens/s"
        )
    print(f"\nthroughput per rank ({args.source}, {args.tokenizer}, seq_len {args.seq_len}, batch {args.batch_size})")
    print(_throughput_table(results["throughput"], dps))
    if resume_steps:
        print(f"\nresume: checkpoint position -> first batch in hand (dp 1, batch {args.batch_size})")
        print(_resume_table(results["resume"], resume_steps))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--source", choices=("stdlib", "local"), default="stdlib")
    parser.add_argument("--path", default=None, help="data=local: a file, a folder or a glob")
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    parser.add_argument("--cache-dir", default=None, help="data.cache_dir: where a trained BPE is cached")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32, help="global sequences per step")
    parser.add_argument("--seed", type=int, default=None, help="default: the training config's")
    parser.add_argument("--steps", type=int, default=50, help="batches timed per measurement")
    parser.add_argument("--min-seconds", type=float, default=5.0, help="time each dp's measurement at least this long")
    parser.add_argument("--dp", default="1,2,4,8", help="data-parallel sizes, comma-separated")
    parser.add_argument("--resume-steps", default="10,10000", help="steps to resume at, comma-separated ('' for none)")
    parser.add_argument("--repeats", type=int, default=3, help="resumes timed per step (the median is reported)")
    parser.add_argument("--store", default=None, help="a prepared store to read (default: prepare one, temporarily)")
    parser.add_argument("--num-proc", type=int, default=1, help="processes preparing the store (prepare.num_proc)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.window_shuffle_buffer=256")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    try:
        return run(parse_args(argv))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    with closed_pipe_is_quiet():
        main()
