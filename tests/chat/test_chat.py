"""The chat in one process: a small Llama with adapters and a ChatML tokenizer behind the engine, the terminal's chat
read from a script, and the server on a thread of this process, spoken to by OpenAI's own client and by plain HTTP.
Every answer is held against the KV-cached sampler's for the same tokens, settings and seed."""

from __future__ import annotations

import dataclasses
import http.client
import io
import json
import os
import re
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from harness.corpora import CHAT_TEMPLATE, chat_tokenizer

from llmtrain.chat import api
from llmtrain.chat.api import Defaults
from llmtrain.chat.engine import Answerer, Engine, Peers, RequestError, measured_cache_bytes
from llmtrain.chat.server import ChatServer
from llmtrain.chat.terminal import TerminalChat
from llmtrain.chat.text import StreamedAnswer
from llmtrain.data.chat_prompt import NEXT_USER_TURN, PromptFormat
from llmtrain.model import GPT, GPTConfig
from llmtrain.model.lora import LoRAConfig, adapters_disabled
from llmtrain.model.sampling import SamplingSettings, sample

CPU = torch.device("cpu")
QUESTION = [{"role": "user", "content": "Return the name of the module."}]


class CountedAnswerer(Answerer):
    """An Answerer counting its decoding steps (a test's view of how far an answer was decoded)."""

    steps = 0

    def decode(self, tokens, cache):
        type(self).steps += 1
        return super().decode(tokens, cache)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(CHAT_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>")


@pytest.fixture(scope="module")
def model(tokenizer) -> GPT:
    """Llama-shaped, 2 blocks, adapters on two projections with B drawn (so adapters on and off answer apart),
    logits sharpened so answers end on the end-of-turn token now and then."""
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "fc_out"))
    cfg = GPTConfig(
        vocab_size=len(tokenizer), n_layer=2, n_head=4, d_model=32, max_seq_len=96, norm="rmsnorm", position="rope",
        mlp="swiglu", bias=False, lora=lora,
    )  # fmt: skip
    model = GPT(cfg)
    model.init_weights(0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def engine(model, tokenizer) -> Engine:
    adapted = CountedAnswerer("tiny", model, PromptFormat.of(tokenizer), CPU)
    return Engine([adapted, dataclasses.replace(adapted, name="tiny:base", adapters=False)], Peers())


@pytest.fixture(scope="module")
def server(engine) -> Iterator[ChatServer]:
    served = ChatServer(("127.0.0.1", 0), engine, Defaults(), ["tiny", "tiny:base"])
    thread = threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield served
    served.shutdown()
    served.server_close()


@pytest.fixture(scope="module")
def client(server):
    import openai  # imported here, not when the fast tier collects every file

    client = openai.OpenAI(base_url=f"{server.url}v1", api_key="unused", max_retries=0)
    client.models.list()  # the client's first request reads the platform (`uname -p`): here, before the tests
    return client


def sampled_text(model, tokenizer, messages, settings: SamplingSettings, seed: int, adapters: bool = True) -> str:
    """What the sampler draws for the rendered conversation, as text (the stop token left out)."""
    form = PromptFormat.of(tokenizer)
    answerer = Answerer("referee", model, form, CPU)
    settings = dataclasses.replace(settings, stop_ids=form.stop_ids)
    with adapters_disabled(model) if not adapters else torch.no_grad():
        (drawn,) = sample(answerer.decode, [form.ids(messages)], [0], 1, settings, seed, CPU).rows()
    return tokenizer.decode([t for t in drawn if t not in form.stop_ids], skip_special_tokens=True)


def test_streamed_text_is_the_whole_rows_text_and_ends_before_a_stop_text(tokenizer):
    """Token by token, multi-byte characters split over byte tokens come out whole, and the pieces join to the
    decoding of the whole row; a stop text split over tokens is held back and never shown."""
    text = "Café ☃ naïve — 数据 ok.\nUser: never shown"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # characters split over tokens
    answer = StreamedAnswer((t for t in ids), tokenizer, stop_ids=(), stop_texts=())
    pieces = list(answer)
    assert "".join(pieces) == tokenizer.decode(ids) == answer.text
    assert not any("\ufffd" in piece for piece in pieces)
    cut = StreamedAnswer((t for t in ids), tokenizer, stop_ids=(), stop_texts=(NEXT_USER_TURN,))
    assert "".join(cut) == "Café ☃ naïve — 数据 ok." and cut.finish_reason == "stop"
    assert len(cut.ids) < len(ids)  # the tokens after the stop text were never drawn


def test_the_api_answers_what_the_sampler_draws(client, model, tokenizer):
    """Through OpenAI's client: the chat answer, whole or streamed, is the sampler's for the same conversation,
    settings and seed; the base model (adapters off) answers as the sampler does with them off, and otherwise."""
    settings = SamplingSettings(24, temperature=0.9, top_k=40, top_p=0.95)
    options = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=5, extra_body={"top_k": 40})
    whole = client.chat.completions.create(model="tiny", messages=QUESTION, **options)
    expected = sampled_text(model, tokenizer, QUESTION, settings, seed=5)
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(PromptFormat.of(tokenizer).ids(QUESTION))
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, stream=True, **options)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    base = client.chat.completions.create(model="tiny:base", messages=QUESTION, **options).choices[0].message.content
    assert base == sampled_text(model, tokenizer, QUESTION, settings, seed=5, adapters=False) != expected
    listed = [m.id for m in client.models.list().data]
    assert listed == ["tiny", "tiny:base"]


def test_echoed_log_probabilities_are_the_models(client, model, tokenizer):
    """/v1/completions as lm-eval's local-completions asks it (token ids, echo, logprobs, one new token): each
    prompt token's log-probability is the model's log-softmax at the position before it, the top one the most
    likely; the drawn token's text follows the echoed prompt."""
    prompt = tokenizer("Return the name of the module.", add_special_tokens=False)["input_ids"]
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0)
    logprobs = answer.choices[0].logprobs
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(prompt) + 1
    for position in range(1, len(prompt)):
        assert logprobs.token_logprobs[position] == pytest.approx(
            float(expected[position - 1, prompt[position]]), abs=1e-5
        )
        assert max(logprobs.top_logprobs[position].values()) == pytest.approx(
            float(expected[position - 1].max()), abs=1e-5
        )
    assert answer.choices[0].text.startswith(tokenizer.decode(prompt))
    assert logprobs.token_logprobs[-1] == pytest.approx(float(expected[-1].max()), abs=1e-5)  # greedy: the likeliest


def _post(server: ChatServer, path: str, body: bytes | dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(server.server_address[0], server.server_address[1], timeout=60)
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, payload, {"Content-Type": "application/json"})
    response = connection.getresponse()
    status, text = response.status, response.read()
    connection.close()
    return status, json.loads(text)


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        ({"model": "other", "messages": QUESTION}, 404, "model"),
        ({"messages": QUESTION, "n": 2}, 400, "n"),
        ({"messages": QUESTION, "temperature": 5}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),
        ({"messages": [*QUESTION, {"role": "assistant", "content": "Yes."}]}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        ({"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"messages": QUESTION, "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"messages": QUESTION, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
        ({"model": ["tiny"], "messages": QUESTION}, 400, "model"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}, 400, "messages"),
        (b"[" * 100_000 + b"]" * 100_000, 400, None),
        (b'{"seed": ' + b"9" * 5_000 + b"}", 400, None),
        ({"messages": QUESTION, "stream": "false"}, 400, "stream"),
    ],
)
def test_a_request_it_cannot_answer_gets_a_4xx_naming_the_field_and_the_server_goes_on(server, body, status, param):
    got, reason = _post(server, "/v1/chat/completions", body)
    assert got == status and reason["error"]["param"] == param and reason["error"]["message"]
    fine, answer = _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})
    assert fine == 200 and answer["choices"][0]["message"]["role"] == "assistant"


def test_a_reader_that_goes_away_ends_its_answers_decoding(server, engine):
    """A streamed request whose reader closes the connection after the first piece: the decoding stops there (not
    at max_tokens), and the next request is answered."""
    import socket

    whole = {"model": "tiny:base", "messages": QUESTION, "max_tokens": 80, "temperature": 0}
    CountedAnswerer.steps = 0
    assert _post(server, "/v1/chat/completions", whole)[1]["choices"][0]["finish_reason"] == "length"
    steps = CountedAnswerer.steps  # the prefill and 79 steps
    body = json.dumps({**whole, "stream": True})
    request = (
        f"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        f"{body}"
    )
    CountedAnswerer.steps = 0
    with socket.create_connection(server.server_address[:2], timeout=30) as connection:
        connection.sendall(request.encode())
        received = b""
        while b"data: " not in received:  # the headers, then the first event
            received += connection.recv(4096)
        connection.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + 30
    while engine._one_at_a_time.locked() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine._one_at_a_time.locked()
    assert CountedAnswerer.steps <= steps  # drawn at the engine's pace, ended once the reader was found gone
    assert _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})[0] == 200


def test_a_client_that_stalls_never_holds_the_engine_or_a_thread(engine):
    """A client that sends half a request, and one that opens a stream and reads nothing: the first's connection
    is closed after the server's client timeout, the second's answer is drawn at the engine's pace (the engine is
    free once it is drawn, whatever the reader does), and a third client is answered meanwhile."""
    import socket

    served = ChatServer(("127.0.0.1", 0), engine, Defaults(), None, client_timeout=0.5)
    threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        address = served.server_address[:2]
        half = socket.create_connection(address, timeout=10)
        half.sendall(b'POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 500\r\n\r\n{"mess')
        body = json.dumps({"messages": QUESTION, "max_tokens": 40, "stream": True, "ignore_eos": True})
        unread = socket.create_connection(address, timeout=10)
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        unread.sendall(f"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        started = time.monotonic()
        fine, answer = _post(served, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})
        assert fine == 200 and answer["choices"][0]["message"]["role"] == "assistant"
        deadline = time.monotonic() + 10
        while engine._one_at_a_time.locked() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine._one_at_a_time.locked() and time.monotonic() - started < 10
        assert half.recv(100) == b""  # closed by the server once its timeout passed, never answered
        half.close()
        unread.close()
    finally:
        served.shutdown()
        served.server_close()


def test_the_terminal_chat_keeps_each_models_conversation(engine, model, tokenizer):
    """Scripted lines through the terminal's chat, side by side: /system and /set take effect, each model's answer
    is the sampler's for its own conversation so far, /reset forgets the turns."""
    lines = iter(["/system Be brief.", "/set temperature=0", "/set max_tokens=12", "Hello", "Name a file.", "/reset"])

    def read(prompt: str) -> str:
        line = next(lines, None)
        if line is None:
            raise KeyboardInterrupt  # Ctrl-C at the prompt: the chat ends, quietly
        return line

    out = io.StringIO()
    chat = TerminalChat(engine, ["tiny", "tiny:base"], Defaults(), read, out)
    chat.run()
    printed = out.getvalue()
    settings = SamplingSettings(12, temperature=0.0, top_k=Defaults.top_k)
    system = {"role": "system", "content": "Be brief."}
    first = [system, {"role": "user", "content": "Hello"}]
    for name, adapters in (("tiny", True), ("tiny:base", False)):
        hello = sampled_text(model, tokenizer, first, settings, 0, adapters)
        second = [*first, {"role": "assistant", "content": hello}, {"role": "user", "content": "Name a file."}]
        assert f"{name}> {hello}\n" in printed
        assert f"{name}> {sampled_text(model, tokenizer, second, settings, 0, adapters)}\n" in printed
    assert all(not conversation.turns for conversation in chat.conversations)
    assert "(temperature=0.0)" in printed and "(system: Be brief.;" in printed


@pytest.mark.slow  # seconds: a config composed, a tokenizer trained, four ways timed
def test_the_serving_benchmark_draws_the_same_tokens_every_way(capsys):
    """gpu_check's chat row, rehearsed: a seeded model's answer drawn by the sampler alone, the engine, and the
    server streamed and whole, each the same tokens (the benchmark checks it), each with its ratio."""
    from llmtrain.bench import chat_serving

    chat_serving.main(["--new-tokens", "6", "--rounds", "1", "--device", "cpu", "model=tiny"])
    printed = capsys.readouterr().out
    assert "6 tokens drawn" in printed
    for way in ("sampler alone", "engine, text streamed", "server, streamed (SSE)", "server, whole answer"):
        assert re.search(rf"{re.escape(way)} +[\d,.]+ tokens/s +\([\d.]+x the sampler's", printed), printed


@pytest.mark.slow  # seconds: lm-eval's import
def test_lm_evals_local_completions_model_scores_and_generates_through_the_server(server, model, tokenizer, tmp_path):
    """lm-evaluation-harness's own `local-completions` model pointed at the server: its log-likelihoods are the
    model's (summed log-softmax of the continuation given the context), and its greedy generation is the sampler's
    at temperature 0, cut at the task's stop text."""
    pytest.importorskip("lm_eval", reason="the eval extra: pip install -e '.[eval]'")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    lm = LocalCompletionsAPI(
        base_url=f"{server.url}v1/completions", model="tiny", tokenizer_backend="huggingface",
        tokenizer=str(tmp_path / "tokenizer"), max_length=model.cfg.max_seq_len, max_retries=1,
    )  # fmt: skip
    pairs = [("Return the name of", " the module."), ("Open a file", " and read it.")]
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    for (context, continuation), (scored, _) in zip(pairs, lm.loglikelihood(requests)):
        context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        whole = context_ids + tokenizer(continuation, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([whole]))[0].float(), dim=-1)
        expected = sum(float(log_probs[i - 1, whole[i]]) for i in range(len(context_ids), len(whole)))
        assert scored == pytest.approx(expected, abs=1e-4)
    until = {"until": ["\n"], "max_gen_toks": 12, "temperature": 0}
    (generated,) = lm.generate_until([Instance("generate_until", {}, ("Return the name of", until), 0)])
    prompt = tokenizer("Return the name of", add_special_tokens=False)["input_ids"]
    form = PromptFormat.of(tokenizer)
    (drawn,) = sample(
        Answerer("referee", model, form, CPU).decode,
        [prompt],
        [0],
        1,
        SamplingSettings(12, 0.0, stop_ids=form.stop_ids),
        1234,
        CPU,
    ).rows()
    assert (
        generated
        == tokenizer.decode([t for t in drawn if t not in form.stop_ids], skip_special_tokens=True).split("\n")[0]
    )


def test_the_cache_an_answer_needs_is_held_to_the_devices_memory_not_the_context(model, tokenizer):
    """A model of a 2^40-token context: a chat answer by default holds what the free memory holds (not the context),
    and an answer asked for beyond it is a 400 naming max_tokens before anything is drawn (never an out-of-memory).
    What one position holds is measured by decoding a token: 2 blocks x keys and values x 4 heads x 8 x fp32."""
    huge = GPT(dataclasses.replace(model.cfg, max_seq_len=2**40))
    huge.load_state_dict(model.state_dict())
    answerer = Answerer(
        "huge", huge.eval(), PromptFormat.of(tokenizer), CPU, cache_bytes=measured_cache_bytes(huge, CPU)
    )
    assert answerer.cache_bytes == 2 * 2 * 4 * 8 * 4
    prompt = answerer.prompts.ids(QUESTION)
    held = answerer.room(prompt, None)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < held <= physical / (2 * answerer.cache_bytes) < 2**40
    assert answerer.room(prompt, 12) == 12
    engine = Engine([answerer], Peers())
    with pytest.raises(
        RequestError, match=r"^max_tokens=10000000000000: the KV cache of a \d+-token prompt and its"
    ) as refused:
        api.parse(engine, {"messages": QUESTION, "max_tokens": 10**13}, True, Defaults())
    assert refused.value.param == "max_tokens" and refused.value.status == 400
    default = api.parse(engine, {"messages": QUESTION}, True, Defaults()).settings.max_new_tokens
    assert 0 < default <= physical / (2 * answerer.cache_bytes)


# -- strangers' requests -------------------------------------------------------------------------------------------
def _request_bodies():
    """JSON request bodies, from well-formed to nonsense: a conversation with the API's fields at values it takes,
    the same fields (and a few others) holding anything JSON holds, or a body that is not an object at all."""
    from hypothesis import strategies as st

    anything = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=12,
    )
    part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)})
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=40) | st.lists(part)}
    )
    taken = {
        "model": st.sampled_from(["tiny", "tiny:base"]),
        "max_tokens": st.integers(min_value=0, max_value=4),
        "temperature": st.floats(min_value=0, max_value=2),
        "top_p": st.floats(min_value=0.01, max_value=1),
        "top_k": st.integers(min_value=0, max_value=50),
        "seed": st.integers(min_value=0, max_value=2**70),
        "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=4),
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "prompt": st.text(max_size=30) | st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=5),
    }
    wellformed = st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}, optional=taken)
    fields = [*taken, "messages", "max_completion_tokens", "n", "echo", "logprobs", "response_format", "tools"]
    wild = st.dictionaries(st.sampled_from(fields), anything, max_size=5)
    return wellformed | wild | anything


@pytest.mark.slow  # seconds: 1,500 bodies parsed at both endpoints, 240 served
def test_no_request_body_gets_a_500_and_the_server_answers_after_each_batch(engine, server):
    """Thousands of generated bodies (hypothesis), each checked as both endpoints check it: a request or a
    RequestError (a 4xx naming its field), never another exception; then 240 of them sent to the server, each a
    2xx or 4xx, the server answering a good request after each batch of 40."""
    from hypothesis import HealthCheck, given, settings

    counts = {"parsed": 0, "refused": 0}

    @settings(max_examples=1500, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_request_bodies())
    def parsed(body):
        for chat in (True, False):
            try:
                api.parse(engine, body, chat, Defaults())
                counts["parsed"] += 1
            except RequestError as error:
                assert 400 <= error.status < 500 and str(error)
                counts["refused"] += 1

    parsed()
    assert counts["parsed"] > 150 and counts["refused"] > 1500, counts
    sent: list[bytes] = []

    @settings(max_examples=240, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_request_bodies())
    def collected(body):
        if isinstance(body, dict):
            body = {**body, "max_tokens": 1}  # an accepted one answers quickly
        sent.append(json.dumps(body).encode())

    collected()
    for first in range(0, len(sent), 40):
        for body in sent[first : first + 40]:
            for path in ("/v1/chat/completions", "/v1/completions"):
                connection = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
                connection.request("POST", path, body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                status, text = response.status, response.read()  # an answer whole, streamed, or an error
                connection.close()
                assert status < 500 and b'"server_error"' not in text, (body, text[-300:])
        fine, answer = _post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})
        assert fine == 200 and answer["choices"][0]["message"]["role"] == "assistant"


def test_strangers_are_refused_a_page_elsewhere_a_wrong_host_no_key_and_a_full_queue(engine):
    """With --api-key the API answers its Bearer key alone; a page of another site (its Origin, as a browser sends
    it even on a text/plain POST) and a Host that is not this machine's (DNS rebinding) get a 403 unless
    --allow-origin names the site; past MOST_WAITING requests in hand a request gets a 503 with Retry-After."""
    from llmtrain.chat.server import MOST_WAITING, Guard

    served = ChatServer(("127.0.0.1", 0), engine, Defaults(), None, Guard("s3cret", ("https://ok.example",)))
    threading.Thread(target=served.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    host = f"127.0.0.1:{served.server_address[1]}"
    body = json.dumps({"messages": QUESTION, "max_tokens": 2})

    def status(headers: dict[str, str]) -> tuple[int, dict[str, str]]:
        connection = http.client.HTTPConnection(*served.server_address[:2], timeout=60)
        connection.request("POST", "/v1/chat/completions", body, headers)
        response = connection.getresponse()
        response.read()
        connection.close()
        return response.status, dict(response.getheaders())

    key = {"Authorization": "Bearer s3cret"}
    try:
        assert status({})[0] == 401 and status({"Authorization": "Bearer guess"})[0] == 401
        assert status(key)[0] == 200
        assert status({**key, "Content-Type": "text/plain", "Origin": "http://evil.example"})[0] == 403
        assert status({**key, "Origin": f"http://{host}", "Host": host})[0] == 200  # the page served here
        assert status({**key, "Origin": "https://ok.example"})[0] == 200
        assert status({**key, "Host": f"evil.example:{served.server_address[1]}"})[0] == 403
        for _ in range(MOST_WAITING):
            served.admitted.acquire()
        try:
            full, headers = status(key)
            assert full == 503 and headers["Retry-After"] == "1"
        finally:
            for _ in range(MOST_WAITING):
                served.admitted.release()
        assert status(key)[0] == 200
    finally:
        served.shutdown()
        served.server_close()
