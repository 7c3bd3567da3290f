"""What a chat asks of its models: an answer's tokens as they are drawn, and the log-probabilities of a row's tokens.

An Answerer is one model under a name: a whole model in this process, or this rank's part of a model laid out over
the ranks that launched the chat (torchrun). Its answers are drawn by the KV-cached sampler
(llmtrain/model/sampling.py, `drawn_columns`), so an answer is the sampler's for the same tokens, settings and seed,
whether it is streamed, served or sampled by `llmtrain.generate`.

Laid out, every rank runs every forward pass: rank 0 (the terminal or the server) posts each piece of work to the
job's store, where the other ranks wait for it (`Engine.follow`: a store's wait, no collective to time out while
nobody types), and the ranks agree after each token whether to go on (an all-reduce of one flag: rank 0 stops early
where its reader has what it wanted, a stop text or a closed connection). One piece of work at a time: a second
request waits for the first's answer."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmtrain.data.chat_prompt import PromptFormat
from llmtrain.model.base import LayeredModel
from llmtrain.model.kv_cache import KVCache
from llmtrain.model.lora import adapters_disabled, has_adapters
from llmtrain.model.sampling import DecodeStep, SamplingSettings, drawn_columns
from llmtrain.parallel.sampling import laid_out_decode, still_decoding
from llmtrain.parallel.tensors import full_tensor

# A laid-out rank's wait for rank 0's next piece of work is one store wait of this long, then another.
FOLLOWER_WAIT = timedelta(hours=1)
WORK_KEY = "llmtrain/chat/work/{}"


class RequestError(ValueError):
    """A request the chat cannot answer, and why (the terminal prints it, the server answers it with 4xx); `param`
    names the request's field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class Answerer:
    """A model a chat answers with, under `name`: `model` (whole, or this rank's part of it laid out) and its
    tokenizer's way with conversations (`prompts`); `device` where its inputs go; `context` what each forward pass
    runs within (autocast); `adapters` False: its low-rank adapters switched off (its base model answers)."""

    name: str
    model: LayeredModel
    prompts: PromptFormat
    device: torch.device
    context: Callable[[], AbstractContextManager] = nullcontext
    adapters: bool = True
    # what one position of one row holds in this rank's KV cache (measured_cache_bytes); 0: not measured, no bound
    cache_bytes: int = 0

    @property
    def max_seq_len(self) -> int:
        return self.model.context_length

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def has_adapters(self) -> bool:
        return has_adapters(self.model)

    @contextmanager
    def _within(self) -> Iterator[None]:
        """What each forward pass runs within: the precision's context, and the adapters off where asked."""
        with self.context(), nullcontext() if self.adapters else adapters_disabled(self.model):
            yield

    @property
    def decode(self) -> DecodeStep:
        return laid_out_decode(self.model, self._within)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(rows, t, vocabulary) in fp32: every position's logits of the whole rows `tokens`."""
        with torch.no_grad(), self._within():
            return full_tensor(self.model(tokens)).float()

    def room(self, prompt: Sequence[int], max_new_tokens: int | None) -> int:
        """The new tokens an answer to `prompt` may have: `max_new_tokens` within the context (None: as many as the
        context and the device's free memory hold); RequestError where the prompt leaves no room, or where the KV
        cache of the answer asked for would not fit the device's free memory (never an out-of-memory mid-answer)."""
        if len(prompt) >= self.max_seq_len:
            raise RequestError(
                f"the prompt is {len(prompt)} tokens and {self.name}'s context is {self.max_seq_len}: shorten it "
                f"(in a chat: /reset, or a shorter system text)",
                param="messages",
            )
        held = self._positions_memory_holds()
        if held <= len(prompt):
            raise RequestError(
                f"the prompt is {len(prompt)} tokens and {self.device}'s free memory holds the KV cache of "
                f"{held} positions: shorten it",
                param="messages",
            )
        fits = min(self.max_seq_len, held) - len(prompt)
        if max_new_tokens is None:
            return fits
        asked = min(max_new_tokens, self.max_seq_len - len(prompt))
        if asked > fits:
            raise RequestError(
                f"max_tokens={max_new_tokens}: the KV cache of a {len(prompt)}-token prompt and its answer would not "
                f"fit {self.device}'s free memory; ask for at most {fits}",
                param="max_tokens",
            )
        return asked

    def _positions_memory_holds(self) -> int:
        """The positions of one row whose KV cache fits the device's free memory: the cache doubles as it grows, so
        one whole doubling is kept spare, and a tenth of the memory for the forward pass's activations."""
        if not self.cache_bytes:
            return self.max_seq_len
        return int(0.9 * free_memory_bytes(self.device) / (2 * self.cache_bytes))


def free_memory_bytes(device: torch.device) -> int:
    """What this process could still allocate on `device`: the GPU's free memory and what torch's allocator holds
    unused, or the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measured_cache_bytes(
    model: LayeredModel, device: torch.device, context: Callable[[], AbstractContextManager] = nullcontext
) -> int:
    """Collective where the model is laid out: what one position of one row holds in this rank's KV cache (its
    blocks, its heads, the dtype its forward pass computes in), measured by decoding one token."""
    cache = KVCache(torch.zeros(1, dtype=torch.long, device=device), 1)
    laid_out_decode(model, context)(torch.zeros(1, 1, dtype=torch.long, device=device), cache)
    return cache.nbytes


@dataclass(frozen=True)
class Work:
    """One piece of work every rank runs: `answer` (draw an answer) or `score` (log-probabilities), or `quit`."""

    kind: str
    model: str = ""
    tokens: list[int] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


class Peers:
    """The ranks an Engine's models are laid out over, as rank 0 sees them (one process alone: nothing to tell)."""

    def __init__(self) -> None:
        self.laid_out = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.store = dist.distributed_c10d._get_default_store() if self.laid_out else None
        self.posted = 0

    def post(self, work: Work) -> None:
        """Rank 0: the next piece of work, for the others."""
        if self.store is not None:
            self.store.set(WORK_KEY.format(self.posted), json.dumps(asdict(work)))
            self.posted += 1

    def next_work(self) -> Work:
        """Another rank: rank 0's next piece of work, however long it waits for it."""
        assert self.store is not None
        key = WORK_KEY.format(self.posted)
        while True:
            try:
                self.store.wait([key], FOLLOWER_WAIT)
                break
            except dist.DistStoreError as error:  # the wait's time is up: wait again
                if "timeout" not in str(error).lower():
                    raise
        self.posted += 1
        return Work(**json.loads(self.store.get(key)))


class Engine:
    """The chat's models by name, answering one piece of work at a time (collectively where laid out)."""

    def __init__(self, answerers: Sequence[Answerer], peers: Peers):
        self.answerers = {answerer.name: answerer for answerer in answerers}
        self.peers = peers
        self._one_at_a_time = threading.Lock()

    @property
    def names(self) -> list[str]:
        return list(self.answerers)

    def answerer(self, name: str | None) -> Answerer:
        """The model named `name` (None: the first); RequestError (404) where there is none of that name."""
        if name is None or name == "":
            return next(iter(self.answerers.values()))
        if name not in self.answerers:
            raise RequestError(
                f"model {name!r} is not served here: choose one of {', '.join(self.answerers)}", "model", 404
            )
        return self.answerers[name]

    def answer(
        self, name: str, prompt: Sequence[int], settings: SamplingSettings, seed: int
    ) -> Generator[int, None, None]:
        """The tokens of `name`'s answer to `prompt`, each as it is drawn, the stop token (if one ends it) last.
        Closing the iterator early ends the decoding on every rank. `settings.max_new_tokens` must fit the context
        (Answerer.room)."""
        work = Work("answer", name, list(prompt), asdict(settings), seed)
        with self._one_at_a_time:
            self.peers.post(work)
            yield from self._answer(work, rank_zero=True)

    def log_probabilities(self, name: str, tokens: Sequence[int]) -> torch.Tensor:
        """(t, vocabulary) fp32 log-probabilities of each next token of the row `tokens`, from position 0's on."""
        work = Work("score", name, list(tokens))
        with self._one_at_a_time:
            self.peers.post(work)
            return self._score(work)

    def follow(self) -> None:
        """Another rank than 0 where laid out: run rank 0's work, the forward passes alone, until it quits."""
        while (work := self.peers.next_work()).kind != "quit":
            if work.kind == "answer":
                for _ in self._answer(work, rank_zero=False):
                    pass
            else:
                self._score(work)

    def close(self) -> None:
        """Rank 0: the other ranks stop following."""
        self.peers.post(Work("quit"))

    def _answer(self, work: Work, rank_zero: bool) -> Generator[int, None, None]:
        answerer = self.answerers[work.model]
        settings = SamplingSettings(**{**work.settings, "stop_ids": tuple(work.settings["stop_ids"])})
        reader_left = [False]  # rank 0's: True once its reader has closed the answer

        def any_unfinished(unfinished: bool) -> bool:
            return still_decoding(unfinished, answerer.device, stop=reader_left[0])

        tokens, device = [work.tokens], answerer.device
        columns = drawn_columns(answerer.decode, tokens, [0], 1, settings, work.seed, device, any_unfinished)
        try:
            for column in columns:
                if bool(column.drew[0]):
                    yield int(column.tokens[0])
        finally:
            if rank_zero and self.peers.laid_out:
                reader_left[0] = True
                next(columns, None)  # the other ranks hear that it ends: the next agreement says stop
            columns.close()

    def _score(self, work: Work) -> torch.Tensor:
        answerer = self.answerers[work.model]
        row = torch.tensor([work.tokens], device=answerer.device)
        return torch.log_softmax(answerer.logits(row)[0], dim=-1)
