"""`python -m llmtrain.generate`: a prompt continued as it is given (vLLM's `generate`) whatever the tokenizer,
and as a user's turn in its chat template with `--chat` (vLLM's `chat`), each greedy continuation transformers'."""

from __future__ import annotations

import sys

import pytest
import torch
from harness.corpora import CHAT_TEMPLATE, chat_tokenizer
from harness.hf_families import hf_model

PROMPT = "The river"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def templated_export(tmp_path_factory):
    """A Llama in Hugging Face format whose tokenizer has a chat template, as an instruct release's has."""
    directory = tmp_path_factory.mktemp("export")
    tokenizer = chat_tokenizer(CHAT_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>")
    tokenizer.save_pretrained(directory)
    model = hf_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(directory)
    return directory, model, tokenizer


def generated(directory, monkeypatch, capsys, *flags: str) -> str:
    from llmtrain.generate import main

    argv = ["generate", str(directory), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0"]
    monkeypatch.setattr(sys, "argv", [*argv, *flags])
    main()
    return capsys.readouterr().out


def greedy(model, tokenizer, ids: list[int]) -> str:
    with torch.no_grad():
        drawn = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode([t for t in drawn[0, len(ids) :].tolist() if t != tokenizer.eos_token_id])


@pytest.mark.slow  # writes and reads a model directory
@pytest.mark.parametrize("flags", [(), ("--raw",)])
def test_generate_continues_the_prompt_as_given_though_the_tokenizer_has_a_template(
    templated_export, monkeypatch, capsys, flags
):
    directory, model, tokenizer = templated_export
    continued = greedy(model, tokenizer, tokenizer(PROMPT)["input_ids"])
    assert generated(directory, monkeypatch, capsys, *flags) == f"{PROMPT}{continued}\n"


@pytest.mark.slow  # writes and reads a model directory
def test_generate_with_chat_answers_the_prompt_as_a_users_turn(templated_export, monkeypatch, capsys):
    directory, model, tokenizer = templated_export
    turn = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    answer = greedy(model, tokenizer, tokenizer(turn, add_special_tokens=False)["input_ids"])
    assert generated(directory, monkeypatch, capsys, "--chat") == f"{PROMPT}\n{answer}\n"


@pytest.mark.slow  # writes and reads a model directory
def test_chat_and_raw_together_are_refused(templated_export, monkeypatch, capsys):
    directory, _, _ = templated_export
    with pytest.raises(SystemExit) as refused:
        generated(directory, monkeypatch, capsys, "--chat", "--raw")
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
