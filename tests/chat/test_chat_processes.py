"""`python -m llmtrain.chat` as a person uses it, on a short fine-tune with adapters (SFT on ChatML conversations):
in a pseudo-terminal under torchrun, the model laid out over two ranks; served to headless Chromium, which types a
message into the page and reads the two models' streamed answers. Each answer is held against the KV-cached sampler's
on the checkpoint in this process, adapters on and off."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from harness.corpora import write_chat_data
from harness.paths import REPO
from harness.processes import free_port, kill_hard, python, rank_slots, warm_interpreter
from harness.runs import run_train

from llmtrain.chat.engine import Answerer
from llmtrain.checkpoint.offline import find_checkpoint, load_model_and_tokenizer
from llmtrain.data.chat_prompt import PromptFormat
from llmtrain.model.lora import adapters_disabled
from llmtrain.model.sampling import SamplingSettings, sample

SETTINGS = ["--temperature", "0.7", "--top-k", "20", "--seed", "3", "--max-new-tokens", "16"]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, cache_dir) -> Path:
    """A run directory: 12 steps of SFT with rank-4 adapters on a 2-block Llama, its final checkpoint written."""
    workdir = tmp_path_factory.mktemp("chat-run")
    tokenizer, conversations = write_chat_data(workdir)
    run = run_train(
        workdir, cache_dir,
        "data=sft", f"data.path={conversations}", "data.tokenizer.kind=hf", f"data.tokenizer.name={tokenizer}",
        "data.val_fraction=0.1", "model=llama-tiny", "model.n_layer=2", "model.lora.rank=4",
        "train.attention=document", "train.seq_len=128", "train.batch_size=8", "train.micro_batch_size=4",
        "train.steps=12", "train.eval_every=12", "optim.lr=3e-3",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.run_dir


def expected_answers(run_dir: Path, conversation: list[dict]) -> tuple[str, str]:
    """The sampler's answers (adapters on, then off) to `conversation` under SETTINGS, as text."""
    model, tokenizer = load_model_and_tokenizer(str(run_dir))
    form = PromptFormat.of(tokenizer)
    answerer = Answerer("referee", model, form, torch.device("cpu"))
    settings = SamplingSettings(16, temperature=0.7, top_k=20, stop_ids=form.stop_ids)
    texts = []
    for adapters in (True, False):
        with torch.no_grad() if adapters else adapters_disabled(model):
            (drawn,) = sample(
                answerer.decode, [form.ids(conversation)], [0], 1, settings, 3, torch.device("cpu")
            ).rows()
        texts.append(tokenizer.decode([t for t in drawn if t not in form.stop_ids], skip_special_tokens=True))
    return texts[0], texts[1]


def started_server(command: list[str]) -> subprocess.Popen:
    """`command` started, once it prints that it serves (its output read meanwhile, so that it never blocks)."""
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **warm_interpreter()}
    )
    assert server.stdout is not None
    shown = b""
    while b"serving " not in (line := server.stdout.readline()):
        shown += line
        assert line, f"the server ended ({server.wait()}):\n{shown.decode(errors='replace')[-3000:]}"
    return server


def read_until(fd: int, marker: bytes, seen: bytearray, timeout: float = 120) -> None:
    """Read the terminal into `seen` until `marker` appears once more than it had."""
    deadline, before = time.monotonic() + timeout, seen.count(marker)
    while seen.count(marker) == before:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            raise AssertionError(
                f"no {marker!r} within {timeout:.0f} s; the terminal shows:\n{seen.decode(errors='replace')}"
            )
        seen += os.read(fd, 65536)


@pytest.mark.slow
def test_the_terminal_chat_laid_out_over_two_ranks_answers_as_one_process(fine_tuned):
    """torchrun with two ranks (parallel=tp: each rank holds half of every head's projections and cache), its rank 0
    on a pseudo-terminal: each message is answered by the adapted model and its base, as the sampler in this
    process answers; /quit ends every rank."""
    primary, replica = pty.openpty()
    command = [
        python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "llmtrain.chat",
        str(fine_tuned), "--compare", *SETTINGS, "parallel=tp", "train.device=cpu",
    ]  # fmt: skip
    with rank_slots(2):
        env = {**os.environ, **warm_interpreter()}
        process = subprocess.Popen(command, stdin=replica, stdout=replica, stderr=subprocess.PIPE, cwd=REPO, env=env)
        os.close(replica)
        seen = bytearray()
        try:
            read_until(primary, b"you> ", seen)
            os.write(primary, b"Name a file.\n")
            read_until(primary, b"you> ", seen)
            os.write(primary, b"/quit\n")
            assert process.wait(timeout=60) == 0, process.stderr.read().decode()[-3000:] if process.stderr else ""
        finally:
            kill_hard(process)
            os.close(primary)
    shown = seen.decode().replace("\r\n", "\n")
    assert "(2 process(es))" in shown
    adapted, base = expected_answers(fine_tuned, [{"role": "user", "content": "Name a file."}])
    name = f"{fine_tuned.name}/{find_checkpoint(str(fine_tuned)).rsplit('/', 1)[1]}"
    assert f"{name}> {adapted}\n" in shown
    assert f"{name}:base> {base}\n" in shown


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)",
)
def test_the_page_in_a_browser_streams_the_samplers_answers_side_by_side(fine_tuned):
    """The server in its own process and headless Chromium driving the page: settings typed in, a message sent,
    both columns stream to an end; each column's text is the sampler's answer. LLMTRAIN_CHAT_SCREENSHOT=<png> keeps
    a screenshot of the page (docs/chat.md's)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    command = [python(), "-m", "llmtrain.chat", str(fine_tuned), "--compare", "--serve", "--port", str(port)]
    server = subprocess.Popen(
        [*command, "train.device=cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO
    )
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,720"):
        options.add_argument(argument)
    browser = None
    try:
        assert server.stdout is not None
        while b"serving " not in (line := server.stdout.readline()):
            assert line, f"the server ended: {server.wait()}"
        browser = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        browser.get(f"http://127.0.0.1:{port}/")
        WebDriverWait(browser, 30).until(lambda b: b.find_element("tag name", "body").get_attribute("data-ready"))
        for key, value in (("temperature", "0.7"), ("top_k", "20"), ("seed", "3"), ("max_tokens", "16")):
            field = browser.find_element("id", key)
            field.clear()
            field.send_keys(value)
        browser.find_element("id", "prompt").send_keys("Name a file.")
        browser.find_element("id", "send").click()
        done = ".message[data-state=done]"
        WebDriverWait(browser, 120).until(lambda b: len(b.find_elements("css selector", done)) == 2)
        answers = [e.get_attribute("textContent") for e in browser.find_elements("css selector", done)]
        pieces = [int(re.search(r"(\d+) pieces", m.text).group(1)) for m in browser.find_elements("class name", "meta")]
        assert len(pieces) == 2 and max(pieces) > 1  # the answers arrived in pieces, as drawn
        assert [e.get_attribute("class") for e in browser.find_elements("css selector", done)] == [
            "message assistant"
        ] * 2
        assert answers == list(expected_answers(fine_tuned, [{"role": "user", "content": "Name a file."}]))
        if os.environ.get("LLMTRAIN_CHAT_SCREENSHOT"):
            browser.save_screenshot(os.environ["LLMTRAIN_CHAT_SCREENSHOT"])
    finally:
        if browser is not None:
            browser.quit()
        kill_hard(server)


@pytest.mark.slow
def test_the_api_of_a_model_sharded_over_two_ranks_answers_as_one_process(fine_tuned):
    """torchrun with two ranks, parallel=fsdp (each rank holds half of every weight and gathers a block's for its
    forward pass), --serve, spoken to by OpenAI's client: the streamed answer is one process's sampler's; an answer
    cut by a stop text ends the decoding on both ranks, which then answer the next request alike; echoed
    log-probabilities are the whole model's."""
    import openai

    port = free_port()
    command = [
        python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "llmtrain.chat",
        str(fine_tuned), "--serve", "--port", str(port), "parallel=fsdp", "train.device=cpu",
    ]  # fmt: skip
    question = [{"role": "user", "content": "Name a file."}]
    expected, _ = expected_answers(fine_tuned, question)
    model, tokenizer = load_model_and_tokenizer(str(fine_tuned))
    with rank_slots(2):
        server = started_server(command)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
            options = dict(messages=question, max_tokens=16, temperature=0.7, seed=3, extra_body={"top_k": 20})
            (name,) = [m.id for m in client.models.list().data]
            streamed = client.chat.completions.create(model=name, stream=True, **options)
            assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == expected
            stop = expected[len(expected) // 2 :][:2]
            assert stop.strip(), f"the answer {expected!r} has no text to stop at"
            cut = client.chat.completions.create(model=name, stop=[stop], **options).choices[0]
            assert (cut.message.content, cut.finish_reason) == (expected[: expected.index(stop)], "stop")
            again = client.chat.completions.create(model=name, **options).choices[0].message.content
            assert again == expected
            prompt = tokenizer("Return the name of the module.", add_special_tokens=False)["input_ids"]
            scored = client.completions.create(model=name, prompt=prompt, max_tokens=1, echo=True, logprobs=1)
            with torch.no_grad():
                whole = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), dim=-1)
            given = scored.choices[0].logprobs.token_logprobs[1 : len(prompt)]
            assert given == pytest.approx([float(whole[i - 1, prompt[i]]) for i in range(1, len(prompt))], abs=1e-4)
        finally:
            kill_hard(server)
