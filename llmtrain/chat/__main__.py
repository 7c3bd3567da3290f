"""Talk to a trained model: a chat in the terminal, or served to the browser and to OpenAI's clients.

    python -m llmtrain.chat outputs/<run>                         # the run's latest checkpoint, in the terminal
    python -m llmtrain.chat outputs/<run> --compare               # adapters on and off, each answering every message
    python -m llmtrain.chat outputs/sft --compare outputs/base    # two checkpoints (or exported directories)
    python -m llmtrain.chat exported/ --serve --port 8000         # the page at http://127.0.0.1:8000/ and /v1/...
    torchrun --nproc_per_node=2 -m llmtrain.chat outputs/<run> parallel=tp --serve   # laid out over 2 ranks

The path is a checkpoint (step-*), a checkpoint directory, a run directory (its latest complete checkpoint) or a
Hugging Face directory (llmtrain.export's, or a released model's). A model with a chat template is spoken to in its
turns, as SFT trained it; one without (pretrained on plain text here) reads a plain transcript, "User: ..." and
"Assistant: ..." lines. Answers are drawn by the KV-cached sampler (llmtrain/model/sampling.py) with the settings
the options give (a request or /set may change them): the same conversation, settings and seed give the same answer.

In one process the model is whole, on train.device in train.precision (autocast in bf16, as in training). Under
torchrun it is laid out over the ranks as training lays it out (parallel=..., train.precision=..., hardware=...:
training's keys after the options): rank 0 talks, every rank computes. `--serve` gives the page (the conversation,
streamed, its sampling settings, two models side by side) and OpenAI's API: /v1/chat/completions, /v1/completions
(streamed or not; lm-eval's local-completions with echo and logprobs), /v1/models. It listens on 127.0.0.1 unless
--host says otherwise: it has no authentication, so expose it to no network you do not trust."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from llmtrain.chat.api import Defaults
from llmtrain.chat.engine import Engine, Peers
from llmtrain.chat.models import answerers, chat_config
from llmtrain.errors import ConfigError, closed_pipe_is_quiet, exits_on_run_error


def _arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m llmtrain.chat",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", help="a checkpoint, checkpoint directory, run directory or exported HF directory")
    parser.add_argument(
        "--compare",
        nargs="?",
        const="",
        metavar="OTHER",
        help="answer each message twice: with and without the low-rank adapters, or by the model at OTHER",
    )
    parser.add_argument("--serve", action="store_true", help="serve the page and the API instead of the terminal chat")
    parser.add_argument(
        "--host", default="127.0.0.1", help="the address to serve on (default: 127.0.0.1, this machine alone)"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="the port to serve on, 0: any free one (default: %(default)s)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("LLMTRAIN_API_KEY"),
        help="the key the API asks for (Authorization: Bearer KEY, as vLLM's --api-key; default: $LLMTRAIN_API_KEY, "
        "none); the page is opened at the URL printed, which carries it",
    )
    parser.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web page origin (https://example.org, or *) besides this server's own that may use the API; "
        "repeatable (default: none: another site's page the user opens cannot make the model generate)",
    )
    settings = parser.add_argument_group("sampling (a request or the terminal's /set changes them)")
    settings.add_argument(
        "--temperature", type=float, default=Defaults.temperature, help="0: the likeliest token (default: %(default)s)"
    )
    settings.add_argument(
        "--top-k", type=int, default=Defaults.top_k, help="the k likeliest tokens, 0: all (default: %(default)s)"
    )
    settings.add_argument(
        "--top-p",
        type=float,
        default=Defaults.top_p,
        help="the fewest tokens reaching p, 1: all (default: %(default)s)",
    )
    settings.add_argument("--max-new-tokens", type=int, default=None, help="an answer's longest (default: the context)")
    settings.add_argument("--seed", type=int, default=Defaults.seed, help="the draws' seed (default: %(default)s)")
    parser.add_argument("--raw", action="store_true", help="a plain transcript even where a chat template is")
    args, overrides = parser.parse_known_args(argv)
    if args.compare and "=" in args.compare and not os.path.exists(args.compare):  # `--compare key=value`: a key
        args.compare, overrides = "", [args.compare, *overrides]
    return args, overrides


def serve(engine: Engine, names: list[str], defaults: Defaults, args: argparse.Namespace) -> None:
    from llmtrain.chat.server import LOOPBACK, ChatServer, Guard

    host, port = args.host, args.port
    guard = Guard(args.api_key, tuple(args.allow_origin))
    try:
        server = ChatServer((host, port), engine, defaults, names if len(names) > 1 else None, guard)
    except OSError as error:
        raise ConfigError(
            f"--host {host} --port {port} cannot be served on ({error.strerror}): --port 0 takes any free one"
        ) from None
    if host not in LOOPBACK and guard.api_key is None:
        print(f"warning: --host {host} serves beyond this machine with no key: set --api-key", flush=True)
    page = server.url + (f"#key={guard.api_key}" if guard.api_key else "")
    print(f"serving {', '.join(names)} at {page} (OpenAI API under {server.url}v1/); Ctrl-C ends", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("", flush=True)
    finally:
        server.server_close()


def main(argv: list[str]) -> None:
    from llmtrain.process.runtime import init_runtime

    args, overrides = _arguments(argv)
    if not os.path.exists(args.path):
        raise ConfigError(f"{args.path} does not exist: give a checkpoint, a run directory or an exported directory")
    if args.compare and not os.path.exists(args.compare):
        raise ConfigError(f"--compare {args.compare} does not exist: give a checkpoint, run or exported directory")
    config = chat_config(overrides)
    runtime = init_runtime(config.train.device)
    engine = Engine(answerers(args.path, args.compare, args.raw, config, runtime), Peers())
    if not runtime.is_main:
        engine.follow()
        runtime.shutdown()
        return
    defaults = Defaults(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed)
    print(f"loaded {', '.join(engine.names)} on {runtime.device} ({runtime.world_size} process(es))", flush=True)
    try:
        if args.serve:
            serve(engine, engine.names, defaults, args)
        else:
            from llmtrain.chat.terminal import chat_in_terminal

            chat_in_terminal(engine, engine.names, defaults)
    finally:
        engine.close()
        runtime.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_grad_enabled(False)
    with closed_pipe_is_quiet(), exits_on_run_error():
        main(sys.argv[1:])
