"""Small corpora and tokenizers the tests train on: short packed documents, and conversations with a chat template."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from llmtrain.config import RootConfig

# Short documents (the first lines of the standard library's docstrings, 47 characters on average), so that most
# windows of the layout tests hold several packed documents, and the overrides that train on them within each one
# (train.attention=document; tests/model/test_documents.py).
DOCUMENT_CORPUS = Path(__file__).with_name("short_documents.jsonl")


DOCUMENTS = f"data=local data.path={DOCUMENT_CORPUS} data.tokenizer.kind=byte train.attention=document"


# ... with the predictions at end-of-text unscored and every second block attending to a sliding window of 8 keys
UNSCORED_WINDOWED = "train.score_after_eos=false model.sliding_window=[8,0]"


# A ChatML template, as SmolLM2's: each turn between <|im_start|>role and <|im_end|>; the assistant's prompt opens
# one more. As in SmolLM2-Instruct, the tokenizer's end-of-text is <|im_end|>, which ends every turn: packed
# conversations are separated by another special token, <|endoftext|> (data/sft.py, packing_separator).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# Released chat templates, as their models' tokenizer_config.json carry them (the Jinja files inference projects
# keep, e.g. llama.cpp's models/templates): Qwen3's (Qwen3-0.6B; the dense releases share it) and Gemma 3's (its
# instruction-tuned releases).
RELEASED_TEMPLATES = Path(__file__).with_name("chat_templates")


def chat_tokenizer(template: str, specials: list[str], eos: str, bos: str | None = None):
    """A transformers tokenizer (a small BPE of the document corpus) with `template` and its special tokens."""
    from transformers import PreTrainedTokenizerFast

    from llmtrain.data.tokenizers import train_bpe

    lines = [json.loads(line)["text"] for line in DOCUMENT_CORPUS.read_text().splitlines()]
    backend = train_bpe(lines, 512)
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, bos_token=bos)
    tokenizer.chat_template = template
    return tokenizer


def write_chat_data(directory: Path, conversations: int = 240) -> tuple[Path, Path]:
    """A transformers tokenizer with CHAT_TEMPLATE (a small BPE of the document corpus) and a .jsonl of
    conversations made of the corpus's lines: one to three user/assistant turns, some with a system turn, some
    written as prompt/response pairs. (tokenizer directory, conversations file)."""
    tokenizer = chat_tokenizer(CHAT_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>")
    tokenizer.save_pretrained(directory / "tokenizer")
    lines = [json.loads(line)["text"] for line in DOCUMENT_CORPUS.read_text().splitlines()]
    records = []
    for i in range(conversations):
        turns = 1 + i % 3
        said = [lines[(7 * i + j) % len(lines)] for j in range(2 * turns)]
        messages = [{"role": "system", "content": "Answer in one line."}] if i % 4 == 0 else []
        for question, answer in zip(said[::2], said[1::2]):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"prompt": said[0], "response": said[1]} if i % 5 == 0 else {"messages": messages})
    path = directory / "conversations.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return directory / "tokenizer", path


def write_preference_data(directory: Path, pairs: int = 120) -> tuple[Path, Path]:
    """CHAT_TEMPLATE's tokenizer (write_chat_data's) and a .jsonl of preference pairs made of the corpus's lines: a
    prompt and two answers, as text, or as messages (every third pair, some with a system turn). (tokenizer
    directory, pairs file)."""
    tokenizer, _ = write_chat_data(directory, conversations=0)
    lines = [json.loads(line)["text"] for line in DOCUMENT_CORPUS.read_text().splitlines()]
    records = []
    for i in range(pairs):
        prompt, chosen, rejected = (lines[(11 * i + j) % len(lines)] for j in range(3))
        if i % 3:
            records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
            continue
        system = [{"role": "system", "content": "Answer in one line."}] if i % 2 else []
        records.append(
            {
                "prompt": [*system, {"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    path = directory / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return tokenizer, path


# data=rl's test task: continue a line of the corpus, rewarded where the completion holds a digit (`regex`), a
# verifiable reward a tiny random model earns at first now and then (a byte among 257, a few tries a completion).
DIGIT_REWARD = ["data.reward=[regex]", "data.reward_pattern='[0-9]'"]


def write_prompt_data(directory: Path, prompts: int = 200) -> Path:
    """A .jsonl of text prompts made of the corpus's lines, each with an `answer` column (the line's length's last
    digit) for a reward to read."""
    lines = [json.loads(line)["text"] for line in DOCUMENT_CORPUS.read_text().splitlines()]
    records = [{"prompt": lines[(13 * i) % len(lines)][:40], "answer": str(len(lines[i % len(lines)]) % 10)}
               for i in range(prompts)]  # fmt: skip
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def job_reading(data_cfg, seq_len: int, seed: int, steps: int = 0) -> RootConfig:
    """The root config of a job that reads `data_cfg` in windows of seq_len + 1 tokens with `seed`: what a data
    source's reader is given."""
    base = RootConfig(data=OmegaConf.to_object(data_cfg) if isinstance(data_cfg, DictConfig) else data_cfg)
    return dataclasses.replace(base, train=dataclasses.replace(base.train, seq_len=seq_len, steps=steps), seed=seed)
