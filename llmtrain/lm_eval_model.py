"""llmtrain's live model as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`, the `eval` extra).

Every request becomes a row of tokens scored through the layout's own forward-only path
(llmtrain/train/downstream.py: score_rows), so a model laid out by any layout, sharded or pipelined, answers as the
unsplit model does. Every rank runs the harness alike, as one process of one (lm-eval's rank 0), building the same
requests in the same order; each batch of rows is dealt to the data-parallel ranks and gathered back, so every rank
holds every answer and takes the same next step.

- `loglikelihood`: a row is context + continuation (its last max_length + 1 tokens, as lm-eval's own Hugging Face
  backend cuts it); the continuation's summed log-probability, and whether each of its tokens is the most likely.
- `loglikelihood_rolling`: lm-eval's disjoint windows of at most max_length tokens, each conditioned on the
  tokens before it, their log-probabilities summed per document.
- `generate_until`: greedy decoding, one forward of the batch's rows per new token (no key-value cache: each token
  re-reads its row), until a stop sequence, the end-of-text token or max_gen_toks.
Rows of similar length are batched together (longest first), each batch as wide as its longest row.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from llmtrain import faults
from llmtrain.data.tasks import scoring_rows
from llmtrain.data.tokenizers import Tokenizer
from llmtrain.errors import ConfigError
from llmtrain.model.scoring import NEXT_TOKENS
from llmtrain.parallel.parallel_model import ParallelModel
from llmtrain.train.downstream import score_rows
from llmtrain.train.observers import Observers, StepObserver

# Micro-batches each data-parallel rank runs per call: enough rows to keep every rank busy between the gathers.
MICRO_BATCHES_PER_CALL = 8


class LiveModel(TemplateLM):
    """`model` (laid out on this rank) with the tokenizer it was trained with, answering lm-eval's requests. Each
    call that scores rows is a step to `observers` (the hang watchdog: phase "evaluating") and to the fault points."""

    def __init__(
        self,
        model: ParallelModel,
        tokenizer: Tokenizer,
        max_length: int,
        micro_batch_size: int,
        show_progress: bool,
        rank: int = 0,
        observers: tuple[StepObserver, ...] = (),
    ):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        # lm-eval's `rank` is its own process's place among its ranks (always 0 here: every rank runs it alike)
        self.process_rank, self.observers, self.calls = rank, Observers(observers), 0
        self.max_length, self.micro_batch_size = max_length, micro_batch_size
        self.rows_per_call = micro_batch_size * model.plan.dp_size * MICRO_BATCHES_PER_CALL
        self.show_progress = show_progress
        self.max_gen_toks = 256  # lm-eval's default where a task sets none

    @contextmanager
    def _scoring_call(self) -> Iterator[None]:
        """One call of the layout's forward path, watched as a training step is (a rank that stops making progress
        ends the evaluation as it ends training)."""
        self.calls += 1
        call, started = self.calls, time.perf_counter()
        self.observers.phase_begins(call, "evaluating")
        faults.step_begins(call, self.process_rank)
        faults.phase_begins(call, "evaluating", self.process_rank)
        yield
        self.observers.step_ends(call, time.perf_counter() - started)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode_batch([string])[0].tolist()

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows = [context + continuation for _, context, continuation in requests]
        lengths = [len(continuation) for _, _, continuation in requests]
        return self._continuations(rows, lengths, "log-likelihoods")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows, lengths, owners = [], [], []
        for owner, request in enumerate(requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(request.args[0]),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, windows):
                rows.append(context + continuation)
                lengths.append(len(continuation))
                owners.append(owner)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._continuations(rows, lengths, "rolling log-likelihoods")):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _continuations(self, rows: list[list[int]], lengths: list[int], what: str) -> list[tuple[float, bool]]:
        """Per row, its last `lengths[i]` tokens' summed log-probability and whether each is the most likely."""
        kept = [np.asarray(row[-(self.max_length + 1) :], dtype=np.int64) for row in rows]
        scored = [min(length, len(row) - 1) for row, length in zip(kept, lengths)]
        answers: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(kept[i]))
        with tqdm(total=len(rows), desc=what, disable=not self.show_progress) as progress:
            for start in range(0, len(order), self.rows_per_call):
                batch = order[start : start + self.rows_per_call]
                inputs, targets = scoring_rows([kept[i] for i in batch], [scored[i] for i in batch], self.max_length)
                with self._scoring_call():
                    sums = score_rows(self.model, inputs, targets, self.micro_batch_size).double().cpu()
                for i, (loss, count, greedy) in zip(batch, sums.tolist()):
                    answers[i] = (-loss, greedy == count)
                progress.update(len(batch))
        return answers

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, stops, budgets = [], [], []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs["do_sample"]:
                raise ConfigError(
                    f"a task asks for sampled generations ({gen_kwargs}): llmtrain.evaluate generates greedily; choose "
                    f"tasks that generate with do_sample: false"
                )
            budget = min(kwargs["max_gen_toks"], self.max_length - 1)
            prompts.append(self.tok_encode(context)[-(self.max_length - budget) :] or [self.prefix_token_id])
            stops.append([stop for stop in kwargs["until"] if stop])
            budgets.append(budget)
        answers = [""] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(prompts[i]))
        with tqdm(total=len(requests), desc="generations", disable=not self.show_progress) as progress:
            for start in range(0, len(order), self.rows_per_call):
                batch = order[start : start + self.rows_per_call]
                texts = self._greedy(
                    [prompts[i] for i in batch], [stops[i] for i in batch], [budgets[i] for i in batch]
                )
                for i, text in zip(batch, texts):
                    answers[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                progress.update(len(batch))
        return answers

    def _greedy(self, prompts: list[list[int]], stops: list[list[str]], budgets: list[int]) -> list[str]:
        """Each prompt's greedy continuation, cut before its first stop sequence."""
        generated: list[list[int]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        active = list(range(len(prompts)))
        while active:
            # Each row is scored at its last position (a placeholder target after it): the next token's there.
            rows = [np.asarray([*prompts[i], *generated[i], 0], dtype=np.int64) for i in active]
            inputs, targets = scoring_rows(rows, [1] * len(rows), self.max_length)
            with self._scoring_call():
                tokens = score_rows(self.model, inputs, targets, self.micro_batch_size, NEXT_TOKENS)
            still = []
            for i, token in zip(active, tokens[:, 0].long().tolist()):
                if token != self.eot_token_id:
                    generated[i].append(token)
                texts[i] = self.tok_decode(generated[i])
                stopped = any(stop in texts[i] for stop in stops[i])
                if not stopped and token != self.eot_token_id and len(generated[i]) < budgets[i]:
                    still.append(i)
            active = still
        for i, text in enumerate(texts):
            for stop in stops[i]:
                text = text.split(stop)[0]
            texts[i] = text
        return texts
