"""OpenAI's completions API over an Engine: `/v1/chat/completions` (messages) and `/v1/completions` (text or token
prompts, lm-evaluation-harness's `local-completions` included: `echo` and `logprobs` score a prompt's tokens).

A request's fields, as OpenAI names them: model, messages or prompt, max_tokens (or max_completion_tokens), temperature,
top_p, seed, stop (up to 4 texts), stream, n (1), logprobs and echo (completions); and top_k and ignore_eos (the model's
own stop tokens do not end the answer: a benchmark's fixed length), which vLLM's server also takes. What it cannot
answer is a RequestError naming the field (HTTP 4xx with OpenAI's error body), checked before any token is drawn."""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from llmtrain.chat.engine import Answerer, Engine, RequestError
from llmtrain.chat.text import StreamedAnswer
from llmtrain.data.chat_prompt import checked_messages
from llmtrain.model.sampling import SamplingSettings

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; a chat answer may fill the context
MOST_STOP_TEXTS = 4
MOST_LOGPROBS = 20


@dataclass(frozen=True)
class Defaults:
    """The sampling a request gets for the fields it leaves out (the command line's settings)."""

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    max_tokens: int | None = None  # None: chat answers fill what context and memory hold, completions get 16
    seed: int = 0


@dataclass(frozen=True)
class Request:
    """A checked request: `prompts` (token rows; a chat's one), their texts, how each is sampled, and what is
    returned (streamed; `logprobs` of the top tokens at each position; the prompt `echo`ed)."""

    chat: bool
    answerer: Answerer
    prompts: list[list[int]]
    texts: list[str]
    settings: SamplingSettings
    stop_texts: tuple[str, ...]
    seed: int
    stream: bool
    logprobs: int | None
    echo: bool


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(f"{key} must be a number from {low} to {high}, not {value!r}", key)
    return float(value)


def _integer(body: dict, key: str, default: int | None, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{key} must be a whole number of at least {low}, not {value!r}", key)
    return value


def _flag(body: dict, key: str) -> bool:
    """A true-or-false field: JSON's true or false (the text "false" is neither), absent: false."""
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, not {value!r}", key)
    return value


def _stop_texts(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    texts = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(texts, list) or len(texts) > MOST_STOP_TEXTS or not all(isinstance(t, str) for t in texts):
        raise RequestError(f"stop must be a text or a list of at most {MOST_STOP_TEXTS} texts", "stop")
    return tuple(texts)


def _prompts(body: dict, answerer: Answerer) -> tuple[list[list[int]], list[str]]:
    """A completions request's prompts: a text, a list of texts, a row of token ids, or a list of rows."""
    prompt = body.get("prompt")
    backend, vocabulary = answerer.prompts.backend, answerer.vocab_size
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]  # one row of token ids
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(
            "prompt must be a text, a list of texts, a list of token ids or a list of such lists", "prompt"
        )
    rows, texts = [], []
    for item in prompt:
        if isinstance(item, str):
            rows.append(answerer.prompts.text_ids(item))
            texts.append(item)
        elif isinstance(item, list) and item and all(_token_id(t, vocabulary) for t in item):
            rows.append(list(item))
            texts.append(backend.decode(item))
        else:
            raise RequestError(
                f"prompt: each prompt is a text or a non-empty list of token ids below {vocabulary}", "prompt"
            )
    return rows, texts


def _token_id(value: object, vocabulary: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocabulary


# Fields of OpenAI's API that would change the answer and that the chat does not do: refused, never ignored.
NOT_SERVED = ("tools", "functions", "tool_choice", "function_call", "response_format", "logit_bias")
PENALTIES = ("presence_penalty", "frequency_penalty")


def _refuse_what_is_not_served(body: dict, chat: bool) -> None:
    asked = [key for key in NOT_SERVED if body.get(key) not in (None, [], {}, "none", "auto")]
    asked += [key for key in PENALTIES if body.get(key) not in (None, 0, 0.0)]
    if chat and body.get("logprobs"):
        asked.append("logprobs")
    if asked:
        raise RequestError(
            f"{asked[0]} is not served by llmtrain.chat (it answers with the sampler's settings alone): leave it out"
            + (" or ask /v1/completions for logprobs" if asked[0] == "logprobs" else ""),
            asked[0],
        )


def parse(engine: Engine, body: Any, chat: bool, defaults: Defaults) -> Request:
    """The checked request of a JSON `body` sent to /v1/chat/completions (`chat`) or /v1/completions."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _refuse_what_is_not_served(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be the name of a served model, not {model!r}", "model")
    answerer = engine.answerer(model)
    if _integer(body, "n", 1, 1) != 1:
        raise RequestError("n must be 1: send the request again with another seed for another answer", "n")
    stream = _flag(body, "stream")
    prompts, texts, logprobs, echo = _asked(body, chat, answerer, stream)
    asked = _max_tokens(body, chat, defaults, echo)
    # a prompt that fills the context, or an answer whose cache would not fit, is refused before anything is drawn
    settings = _sampling(body, defaults, answerer, min(answerer.room(prompt, asked) for prompt in prompts))
    stop_texts = answerer.prompts.stop_texts + _stop_texts(body)
    seed = _integer(body, "seed", defaults.seed, 0)
    assert seed is not None
    return Request(chat, answerer, prompts, texts, settings, stop_texts, seed, stream, logprobs, echo)


def _asked(
    body: dict, chat: bool, answerer: Answerer, stream: bool
) -> tuple[list[list[int]], list[str], int | None, bool]:
    """What is to be answered: the prompts' tokens and texts (a chat's conversation rendered as its model's chat
    template renders it), and for completions the log-probabilities and echo asked for."""
    if chat:
        try:
            messages = checked_messages(body.get("messages"))
        except ValueError as reason:
            raise RequestError(str(reason), "messages") from None
        return [answerer.prompts.ids(messages)], [messages[-1]["content"]], None, False
    prompts, texts = _prompts(body, answerer)
    logprobs = _integer(body, "logprobs", None, 0)
    if logprobs is not None and logprobs > MOST_LOGPROBS:
        raise RequestError(f"logprobs must be at most {MOST_LOGPROBS}", "logprobs")
    echo = _flag(body, "echo")
    if stream and (logprobs is not None or echo):
        raise RequestError("logprobs and echo are answered whole: send them with stream=false", "stream")
    return prompts, texts, logprobs, echo


def _max_tokens(body: dict, chat: bool, defaults: Defaults, echo: bool) -> int | None:
    """The most tokens to draw: max_completion_tokens (OpenAI's newer name) or max_tokens, else the default (None:
    a chat's answer may fill what the context and the device's memory hold)."""
    default_tokens = defaults.max_tokens if chat else COMPLETIONS_MAX_TOKENS
    max_tokens = _integer(body, "max_completion_tokens", None, 0)
    max_tokens = _integer(body, "max_tokens", default_tokens if max_tokens is None else max_tokens, 0)
    if max_tokens == 0 and not echo:
        raise RequestError(
            "max_tokens=0 draws nothing: ask for at least 1 (or echo the prompt's logprobs)", "max_tokens"
        )
    return max_tokens


def _sampling(body: dict, defaults: Defaults, answerer: Answerer, max_tokens: int) -> SamplingSettings:
    """How the answer is drawn: temperature, top-k, top-p and the stop tokens (none with vLLM's ignore_eos)."""
    settings = SamplingSettings(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_k=int(_integer(body, "top_k", defaults.top_k, 0) or 0),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0),
        stop_ids=() if _flag(body, "ignore_eos") else answerer.prompts.stop_ids,
    )
    if settings.top_p == 0:
        raise RequestError("top_p must be above 0 (0.01 keeps the likeliest token alone)", "top_p")
    return settings


def streamed(engine: Engine, request: Request, prompt: list[int]) -> StreamedAnswer:
    """The answer to one of `request`'s prompts, streamed as it is drawn."""
    answerer = request.answerer
    settings = replace(request.settings, max_new_tokens=answerer.room(prompt, request.settings.max_new_tokens))
    tokens = engine.answer(answerer.name, prompt, settings, request.seed) if settings.max_new_tokens else _nothing()
    return StreamedAnswer(tokens, answerer.prompts.backend, settings.stop_ids, request.stop_texts)


def _nothing() -> Generator[int, None, None]:
    yield from ()


def _envelope(request: Request, chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion" if request.chat else "text_completion") + (".chunk" if chunk and request.chat else "")
    prefix = "chatcmpl" if request.chat else "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": request.answerer.name,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def answered(engine: Engine, request: Request) -> dict[str, Any]:
    """The whole response to a request that is not streamed."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, (prompt, text) in enumerate(zip(request.prompts, request.texts)):
        answer = streamed(engine, request, prompt)
        for _ in answer:
            pass
        prompt_tokens, completion_tokens = prompt_tokens + len(prompt), completion_tokens + len(answer.ids)
        if request.chat:
            message = {"role": "assistant", "content": answer.text}
            choices.append({"index": index, "message": message, "finish_reason": answer.finish_reason})
            continue
        choice = {"index": index, "text": (text if request.echo else "") + answer.text, "logprobs": None}
        if request.logprobs is not None:
            choice["logprobs"] = _logprobs(engine, request, prompt, answer.ids)
        choices.append({**choice, "finish_reason": answer.finish_reason})
    return {**_envelope(request, chunk=False), "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}


def _logprobs(engine: Engine, request: Request, prompt: list[int], answer: list[int]) -> dict[str, Any]:
    """OpenAI's logprobs of the answer's tokens (with `echo`, of the prompt's before them, the first None): each
    token's text, log-probability, the `logprobs` likeliest at its position, and its text's offset."""
    row = prompt + answer
    backend, top = request.answerer.prompts.backend, request.logprobs or 0
    scores = engine.log_probabilities(request.answerer.name, row)  # position i scores token i + 1
    first = 0 if request.echo else len(prompt)
    tokens = [backend.decode([token]) for token in row[first:]]
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for position in range(first, len(row)):
        if position == 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        scored = scores[position - 1]
        token_logprobs.append(float(scored[row[position]]))
        values, ids = torch.topk(scored, top) if top else (torch.empty(0), torch.empty(0, dtype=torch.long))
        top_logprobs.append({backend.decode([int(i)]): float(v) for v, i in zip(values, ids)})
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chunks(engine: Engine, request: Request) -> Iterator[dict[str, Any]]:
    """A streamed request's events: each piece of text as it is drawn, then one closing each answer with its
    finish_reason (and, for a chat, the role first, as OpenAI's stream opens)."""
    envelope = _envelope(request, chunk=True)
    for index, prompt in enumerate(request.prompts):
        answer = streamed(engine, request, prompt)
        if request.chat:
            yield {
                **envelope,
                "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        for piece in answer:
            if request.chat:
                yield {**envelope, "choices": [{"index": index, "delta": {"content": piece}, "finish_reason": None}]}
            else:
                yield {
                    **envelope,
                    "choices": [{"index": index, "text": piece, "logprobs": None, "finish_reason": None}],
                }
        closing: dict[str, Any] = {"delta": {}} if request.chat else {"text": "", "logprobs": None}
        yield {
            **envelope,
            "choices": [{"index": index, **closing, "finish_reason": answer.finish_reason}],
            "usage": _usage(len(prompt), len(answer.ids)),
        }
