"""What serving costs: the chat's answers drawn by the sampler alone, by the engine with their text streamed, and by
the server over HTTP (OpenAI's API, streamed and whole), side by side in one process.

    python -m llmtrain.bench.chat_serving outputs/<run> [--new-tokens 128] [--rounds 5] [--device cuda]
    python -m llmtrain.bench.chat_serving --device cuda model=qwen3-0.6b       # seeded weights: gpu_check's row

The model is the path's (a checkpoint, run directory or exported directory), whole in this process, on --device in
train.precision, as `python -m llmtrain.chat` holds it; without a path, the config's (`model=...`) with seeded
weights and a small byte-level BPE (a plain transcript: no chat template). Every way draws the same answer to the
same chat prompt (the same seed, temperature 0.8, top-k 50, --new-tokens tokens: the model's stop tokens ignored, as
vLLM's `ignore_eos`), so each counts the same tokens; they take turns for --rounds rounds after a warm-up round, and
the median of each is printed with its ratio to the sampler alone. The server runs on a thread of this process,
listening on 127.0.0.1; its client reads the stream as it comes (time to the first piece printed too)."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from llmtrain.chat.api import Defaults
from llmtrain.chat.engine import Answerer, Engine, Peers
from llmtrain.chat.models import chat_config, whole_answerer, whole_model_answerer
from llmtrain.chat.server import ChatServer
from llmtrain.chat.text import StreamedAnswer
from llmtrain.config import RootConfig
from llmtrain.data.tokenizers import EOS_TOKEN, train_bpe
from llmtrain.model import build_model
from llmtrain.model.sampling import SamplingSettings, sample
from llmtrain.process.runtime import init_runtime

QUESTION = [{"role": "user", "content": "Write a short function that reads a file and returns its lines."}]


Timing = tuple[float, float, int]  # seconds to the first piece (0: answered whole), seconds in all, tokens drawn


def _post(port: int, body: dict) -> Timing:
    """(seconds to the first piece of text, seconds in all, tokens drawn) of one request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    first, tokens = None, 0
    if not body.get("stream"):
        tokens = json.loads(response.read())["usage"]["completion_tokens"]
        first = time.perf_counter() - started
    else:
        for line in response:
            if first is None and b'"content": "' in line and b'"content": ""' not in line:
                first = time.perf_counter() - started
            if line.startswith(b"data: {") and b'"usage"' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    connection.close()
    return first or 0.0, time.perf_counter() - started, tokens


def seeded_answerer(config: RootConfig, device: torch.device) -> Answerer:
    """The config's model with seeded weights, its vocabulary a byte-level BPE of the question's text."""
    from transformers import PreTrainedTokenizerFast

    backend = train_bpe([QUESTION[0]["content"]] * 4, vocab_size=300)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN)
    model = build_model(config.model, len(tokenizer), config.seed).eval()
    return whole_model_answerer(f"seeded {config.model.name}", model, tokenizer, config, False, device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="a checkpoint, run directory or exported directory (none: seeded)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (train.device's)")
    args, overrides = parser.parse_known_args(argv)
    if args.path and "=" in args.path and not os.path.exists(args.path):  # no path: a key came first
        args.path, overrides = None, [args.path, *overrides]
    config = chat_config([f"train.device={args.device}", *overrides])
    device = init_runtime(config.train.device).device
    answerer = whole_answerer(args.path, config, False, device) if args.path else seeded_answerer(config, device)
    engine = Engine([answerer], Peers())
    prompt = answerer.prompts.ids(QUESTION)
    new_tokens = answerer.room(prompt, args.new_tokens)
    server = ChatServer(("127.0.0.1", 0), engine, Defaults(max_tokens=new_tokens), None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        timings = _timed(_ways(engine, answerer, prompt, new_tokens, int(server.server_address[1])), args.rounds)
    finally:
        server.shutdown()
    _report(timings, f"{answerer.name} on {device}: {len(prompt)}-token chat prompt", args.rounds)


def _ways(
    engine: Engine, answerer: Answerer, prompt: list[int], new_tokens: int, port: int
) -> dict[str, Callable[[], Timing]]:
    """Each way of drawing the same answer: the sampler, the engine streaming text, the server streamed and whole."""
    settings = SamplingSettings(new_tokens, 0.8, 50, 1.0)  # no stop token: every way draws --new-tokens
    body = {"messages": QUESTION, "max_tokens": new_tokens, "temperature": 0.8, "top_k": 50, "seed": 0}
    body["ignore_eos"] = True
    device = answerer.device

    def sampler() -> Timing:
        started = time.perf_counter()
        (drawn,) = sample(answerer.decode, [prompt], [0], 1, settings, 0, device).rows()
        return 0.0, time.perf_counter() - started, len(drawn)

    def streamed() -> Timing:
        started, first = time.perf_counter(), None
        tokens = engine.answer(answerer.name, prompt, settings, 0)
        answer = StreamedAnswer(tokens, answerer.prompts.backend, settings.stop_ids)
        for _ in answer:
            first = first or time.perf_counter() - started
        return first or 0.0, time.perf_counter() - started, len(answer.ids)

    return {
        "sampler alone": sampler,
        "engine, text streamed": streamed,
        "server, streamed (SSE)": lambda: _post(port, {**body, "stream": True}),
        "server, whole answer": lambda: _post(port, body),
    }


def _timed(ways: dict[str, Callable[[], Timing]], rounds: int) -> dict[str, list[Timing]]:
    """Each way's timings over `rounds` rounds, after a round that warms every way up; every way drew as many."""
    timings: dict[str, list[Timing]] = {way: [] for way in ways}
    for round_index in range(rounds + 1):
        for way, run in ways.items():
            measured = run()
            if round_index:
                timings[way].append(measured)
    tokens = {way: {n for _, _, n in runs} for way, runs in timings.items()}
    assert len(set().union(*tokens.values())) == 1, f"the ways drew different answers: {tokens}"
    return timings


def _report(timings: dict[str, list[Timing]], what: str, rounds: int) -> None:
    drawn = timings["sampler alone"][0][2]
    print(f"{what}, {drawn} tokens drawn, median of {rounds} rounds")
    base = drawn / statistics.median(seconds for _, seconds, _ in timings["sampler alone"])
    for way, runs in timings.items():
        rate = drawn / statistics.median(seconds for _, seconds, _ in runs)
        first = statistics.median(first for first, _, _ in runs)
        first_text = f", first piece after {first * 1000:.0f} ms" if first else ""
        print(f"  {way:24s} {rate:9,.1f} tokens/s  ({rate / base:.2f}x the sampler's{first_text})")


if __name__ == "__main__":
    main()
