"""The KV-cached sampler against transformers' `generate` (with its cache) on the same model and prompts, side by
side in one process.

    python -m llmtrain.bench.sampling [--prompts 8] [--prompt-tokens 32] [--new-tokens 64] [--rounds 3] [overrides...]
    python -m llmtrain.bench.sampling model=smollm2-135m
    python -m llmtrain.bench.sampling --device cuda model=qwen3-0.6b       # gpu_check's row

The model is the config's (`model=...`, seeded weights), and transformers' is the same model converted as
`llmtrain.export` converts it. Both decode the same left-padded prompts greedily for exactly --new-tokens tokens
(no stop token) in fp32 on --device (the CPU by default), alternating for --rounds rounds after a warm-up each;
tokens/s counts the new tokens of every row. Printed: each side's median tokens/s, their ratio, and the share of new
tokens the two decodings agree on (greedy choices of fp32 logits summed in other orders agree but for near ties)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmtrain.export import hf_model_of
from llmtrain.model import build_model
from llmtrain.model.sampling import SamplingSettings, sample
from llmtrain.tools import compose_config


def _ours(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, list[list[int]]]:
    settings = SamplingSettings(new_tokens, temperature=0)
    started = time.perf_counter()
    drawn = sample(model.decode, prompts, range(len(prompts)), 1, settings, 0, device).rows()
    return time.perf_counter() - started, drawn  # rows() reads the tokens on the host: the device is waited for


def _theirs(hf_model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> tuple[float, list[list[int]]]:
    longest = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (longest - len(prompt)) + prompt for prompt in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in prompts], device=device)
    started = time.perf_counter()
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            use_cache=True, pad_token_id=0,
        )  # fmt: skip
    return time.perf_counter() - started, out[:, longest:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32, help="the longest prompt; the others shorter")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args, overrides = parser.parse_known_args()
    config = compose_config(["train.device=cpu", *overrides])
    device = torch.device(args.device)
    vocab = config.model.vocab_size or 50304
    model = build_model(config.model, vocab, config.seed).eval()
    hf_model = hf_model_of(model, eos_id=vocab - 1).to(device)
    model.to(device)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(args.prompt_tokens // 2, args.prompt_tokens, args.prompts).round().int().tolist()
    prompts = [torch.randint(1, vocab - 1, (n,), generator=generator).tolist() for n in lengths]
    timings: dict[str, list[float]] = {"llmtrain": [], "transformers": []}
    for round_index in range(args.rounds + 1):
        ours_s, ours = _ours(model, prompts, args.new_tokens, device)
        theirs_s, theirs = _theirs(hf_model, prompts, args.new_tokens, device)
        if round_index:  # the first round warms both up
            timings["llmtrain"].append(ours_s)
            timings["transformers"].append(theirs_s)
    tokens = args.prompts * args.new_tokens
    agree = sum(a == b for mine, their in zip(ours, theirs) for a, b in zip(mine, their)) / tokens
    rates = {name: tokens / statistics.median(seconds) for name, seconds in timings.items()}
    print(f"model {config.model.name}: {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, "
          f"{args.new_tokens} new tokens each, greedy, fp32, on {args.device}")  # fmt: skip
    for name, rate in rates.items():
        print(f"  {name:13s} {rate:10,.1f} tokens/s")
    print(f"  llmtrain / transformers: {rates['llmtrain'] / rates['transformers']:.2f}x; tokens agreeing: {agree:.1%}")


if __name__ == "__main__":
    main()
