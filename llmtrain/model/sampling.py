"""Sampling completions with a KV cache (kv_cache.py): one prefill per prompt, shared by the `group` completions
drawn from it, then one batched forward pass per new token over every unfinished row.

A token is drawn by the Gumbel-max trick: argmax(logits / temperature + g), the noise g = -log(-log u) from
counter-based uniforms (counter_random.py) indexed by (the run's seed, the prompt's id, the completion's number in
its group, the position, the vocabulary entry). So a completion depends on its prompt, its seed and the model alone:
not on the batch it was drawn in, the rank that drew it or the device (the same seed gives the same completions
under every layout). top-k keeps the k likeliest tokens and top-p the fewest whose probability reaches p, both
before the draw; temperature 0 takes the likeliest. A row ends after a stop token (the tokenizer's end of text, a
chat template's end of turn), which its completion keeps, or at `max_new_tokens`."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from llmtrain.model.counter_random import uniform
from llmtrain.model.kv_cache import KVCache

# (tokens (rows, t), the cache those rows' keys are kept in) -> the last position's logits (rows, 1, vocabulary): one
# forward pass of the model over the next columns, the cache's `filled` ones before them. A whole model's `decode`
# (LayeredModel's, model/base.py) is one; a laid-out model's is parallel/sampling.py's `laid_out_decode`.
DecodeStep = Callable[[torch.Tensor, KVCache], torch.Tensor]


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0  # 0: the likeliest token
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    stop_ids: tuple[int, ...] = ()  # a completion ends after one of these, which it keeps


@dataclass(frozen=True)
class Completions:
    """`group` completions of each prompt, the prompt's consecutively: tokens (rows, max_new_tokens) padded with 0
    after each row's end, lengths (rows,) counting its stop token, and whether it ended on one (not cut at
    max_new_tokens)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    stopped: torch.Tensor

    def rows(self) -> list[list[int]]:
        """Each completion's tokens, its padding left out."""
        return [row[:length].tolist() for row, length in zip(self.tokens, self.lengths.tolist())]


def completion_seed(seed: int, prompt_id: int, sample: int) -> int:
    """The 62-bit seed of completion `sample` of prompt `prompt_id` under the run's `seed`."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def sample(
    decode: DecodeStep,
    prompts: Sequence[Sequence[int]],
    prompt_ids: Sequence[int],
    group: int,
    settings: SamplingSettings,
    seed: int,
    device: torch.device,
    any_unfinished: Callable[[bool], bool] = lambda unfinished: unfinished,
) -> Completions:
    """`group` completions of each of `prompts` (token ids, each known by its id in `prompt_ids`: its seeds come
    from it). `any_unfinished`: whether any row of any process still decodes, given this process's answer (every
    process that shares the model's collectives runs as many forward passes)."""
    rows = len(prompts) * group
    tokens = torch.zeros(rows, settings.max_new_tokens, dtype=torch.long, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    columns = drawn_columns(decode, prompts, prompt_ids, group, settings, seed, device, any_unfinished)
    for position, column in enumerate(columns):
        tokens[:, position] = column.tokens
        lengths += column.drew.long()
        stopped = column.stopped
    return Completions(tokens, lengths, stopped)


@dataclass(frozen=True)
class Column:
    """One position of every row's completion: its tokens (rows,), 0 in a row that had ended before it; which rows
    drew theirs (had not ended); and which rows have ended on a stop token, this one's included."""

    tokens: torch.Tensor
    drew: torch.Tensor
    stopped: torch.Tensor


def drawn_columns(
    decode: DecodeStep,
    prompts: Sequence[Sequence[int]],
    prompt_ids: Sequence[int],
    group: int,
    settings: SamplingSettings,
    seed: int,
    device: torch.device,
    any_unfinished: Callable[[bool], bool] = lambda unfinished: unfinished,
) -> Generator[Column, None, None]:
    """`sample`'s completions a position at a time, as they are drawn (a chat streams them): each column is drawn
    when the one before it has been taken, and a caller that stops taking them stops the decoding."""
    longest = max(len(prompt) for prompt in prompts)
    starts = torch.tensor([longest - len(prompt) for prompt in prompts], device=device)
    padded = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        padded[row, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
    cache = KVCache(starts, longest + settings.max_new_tokens)
    last = decode(padded, cache)[:, -1].repeat_interleave(group, dim=0)
    cache.advance(longest)
    cache.repeat_rows(group)
    seeds = torch.tensor(
        [completion_seed(seed, prompt_id, k) for prompt_id in prompt_ids for k in range(group)], device=device
    )
    stopped = torch.zeros(len(prompts) * group, dtype=torch.bool, device=device)
    stops = torch.tensor(settings.stop_ids, dtype=torch.long, device=device)
    for position in range(settings.max_new_tokens):
        drawn = draw(last, settings, seeds, position)
        running = ~stopped
        tokens = torch.where(running, drawn, 0)
        stopped = stopped | (running & torch.isin(drawn, stops))
        yield Column(tokens, running, stopped)
        if position + 1 == settings.max_new_tokens or not any_unfinished(not bool(stopped.all())):
            return
        last = decode(tokens[:, None], cache)[:, -1]
        cache.advance(1)


def draw(logits: torch.Tensor, settings: SamplingSettings, seeds: torch.Tensor, position: int) -> torch.Tensor:
    """(rows,): each row's token from its logits (rows, vocabulary) at completion position `position`."""
    logits = logits.float()
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    logits = filtered(logits / settings.temperature, settings.top_k, settings.top_p)
    vocabulary = logits.shape[-1]
    counters = position * vocabulary + torch.arange(vocabulary, device=logits.device)
    gumbel = -torch.log(-torch.log(uniform(counters[None, :], seeds[:, None])))
    return (logits.double() + gumbel).argmax(dim=-1)


def filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` with every token outside the top-k, then outside the top-p nucleus, at -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(dim=-1) - torch.softmax(ordered, dim=-1)
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
