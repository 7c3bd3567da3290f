"""Supervised fine-tuning (data=sft, llmtrain/data/sft.py): what is trained of a conversation, how conversations
fill windows, the loss that never sees a prompt's target, and the errors that name the record; then fine-tuning
with low-rank adapters under the layouts, resumed, and exported for PEFT."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.corpora import write_chat_data
from harness.layouts import BF16, LORA, QLORA, TWO_BLOCKS, assert_matches_single, layout_groups

from llmtrain.data import RankSlice
from llmtrain.data.packing import window_tokens
from llmtrain.data.sft import (
    ConversationBatches,
    Conversations,
    chat_template_of,
    packing_separator,
    read_conversations,
    special_tokens,
    tokenized,
)
from llmtrain.data.tokenizers import load_tokenizer
from llmtrain.errors import ConfigError
from llmtrain.model import GPT, GPTConfig, summed_cross_entropy
from llmtrain.model.scoring import UNSCORED
from llmtrain.tools import compose_config
from llmtrain.tools.stdlib_conversations import conversations as stdlib_conversations


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(data config, tokenizer, its chat template's tokenizer) of write_chat_data's files."""
    tokenizer_dir, conversations = write_chat_data(tmp_path_factory.mktemp("chat"))
    cfg = compose_config(["data=sft", f"data.path={conversations}", f"data.tokenizer.name={tokenizer_dir}"]).data
    tokenizer = load_tokenizer(cfg)
    return cfg, tokenizer, chat_template_of(tokenizer, str(tokenizer_dir))


def test_the_assistants_turns_are_trained_and_nothing_else(chat):
    cfg, tokenizer, backend = chat
    conversations = read_conversations(cfg, "train")
    marked = tokenized(conversations, tokenizer, backend, "train")
    assert len(marked) == len(conversations) > 100
    for messages, tokens in zip(conversations, marked):
        # the whole conversation is the template's render ...
        assert tokenizer.decode(window_tokens(tokens)) == backend.apply_chat_template(messages, tokenize=False)
        # ... and its trained tokens are the assistant's turns, each with the template's end of turn
        answers = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert tokenizer.decode(tokens[tokens >= 0]) == answers


def test_conversations_fill_windows_whole_and_resume_where_they_were(chat):
    cfg, tokenizer, backend = chat
    marked = tokenized(read_conversations(cfg, "train"), tokenizer, backend, "train")
    separator = packing_separator(marked, special_tokens(tokenizer, backend))
    assert backend.convert_ids_to_tokens(separator) == "<|endoftext|>"  # end-of-text, <|im_end|>, ends every turn
    packed = Conversations.of(marked, 257, separator, packed=True)
    windows = packed.epoch(seed=3, epoch=0)
    tokens = window_tokens(windows)
    # every conversation once, whole, each ended by the separator; the rest padding, never trained
    ends = (tokens == separator) & (windows < 0)
    starts = sorted(tuple(window_tokens(t[:-1])) for t in packed.tokens)
    found = []
    for row, row_ends in zip(tokens, ends):
        start = 0
        for end in np.flatnonzero(row_ends):
            if end > start:
                found.append(tuple(row[start:end]))
            start = end + 1
    assert sorted(found) == starts and packed.cut == 0
    assert len(windows) < len(marked) / 1.5  # several to a window
    one_each = Conversations.of(marked, 257, separator, packed=False).epoch(seed=3, epoch=0)
    assert len(one_each) == len(marked)
    # batch k is the same whether the run got there or resumed there, across an epoch's end
    rank_slice = RankSlice(batch_size=32, micro_batch_size=4, dp_rank=1, dp_size=2)
    through = ConversationBatches(packed, 3, rank_slice, None)
    batches = [through.next() for _ in range(5)]
    resumed = ConversationBatches(packed, 3, rank_slice, None)
    resumed.next()
    again = ConversationBatches(packed, 3, rank_slice, resumed.state_dict())
    assert all(np.array_equal(a, b) for a, b in zip(batches[1:], [again.next() for _ in range(4)]))
    assert through.state_dict()["epoch"] >= 1


def test_a_prompt_tokens_target_never_contributes(chat):
    """Through the micro-batches the trainer gets: the loss's gradient is zero at every position whose target is a
    prompt's (or padding), non-zero at every assistant target."""
    cfg, tokenizer, backend = chat
    marked = tokenized(read_conversations(cfg, "train")[:40], tokenizer, backend, "train")
    separator = packing_separator(marked, special_tokens(tokenizer, backend))
    windows = Conversations.of(marked, 129, separator, packed=True).windows(range(len(marked)))[:4]
    [(inputs, targets)] = RankSlice(4, 4, 0, 1).micro_batches(windows)
    assert torch.equal(inputs, torch.from_numpy(window_tokens(windows[:, :-1])))
    trained = torch.from_numpy(windows[:, 1:] >= 0)
    assert torch.equal(targets != UNSCORED, trained) and 0 < trained.float().mean() < 0.7
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, d_model=32, max_seq_len=128))
    model.init_weights(0)
    logits = model(inputs)
    logits.retain_grad()
    summed_cross_entropy(logits, targets).backward()
    touched = logits.grad.abs().sum(-1) > 0
    assert torch.equal(touched, trained)


def _jsonl(path: Path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_bad_conversations_are_named_by_file_and_line(chat, tmp_path):
    cfg, tokenizer, backend = chat
    cfg = copy.deepcopy(cfg)
    good = {"prompt": "Hi", "response": "Hello"}
    cases = {
        "has no assistant turn, so nothing of it would be trained": {"messages": [{"role": "user", "content": "Hi"}]},
        "is not a conversation \\(fields: text\\)": {"text": "plain"},
        "is not a JSON object": "{not json",
        "each message needs a `role` and a text `content`": {"messages": [{"role": "assistant", "content": 3}]},
    }
    for error, record in cases.items():
        cfg.path = _jsonl(tmp_path / "c.jsonl", good, record)
        with pytest.raises(ConfigError, match=f"c.jsonl, line 2 {error}|c.jsonl, line 2: {error}"):
            read_conversations(cfg, "train")
    backend.chat_template, template = None, backend.chat_template
    try:
        with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
            chat_template_of(tokenizer, "chat")
    finally:
        backend.chat_template = template


def test_packed_conversations_are_separated_by_a_special_token_none_of_them_holds(chat):
    """The tokenizer's end-of-text when no conversation holds it; else the next special token (SmolLM2-Instruct's
    and Llama 3 Instruct's templates end every turn with their end-of-text, and leave <|endoftext|> or
    <|end_of_text|> free); else one line."""
    cfg, tokenizer, backend = chat
    marked = tokenized(read_conversations(cfg, "train")[:5], tokenizer, backend, "train")
    eos, endoftext = tokenizer.eos_id, backend.convert_tokens_to_ids("<|endoftext|>")
    specials = special_tokens(tokenizer, backend)
    assert specials[0] == eos and packing_separator(marked, specials) == endoftext
    assert packing_separator(marked[:0], specials) == eos
    marked[2] = np.append(marked[2], endoftext)  # held by a conversation too
    unused = min(set(range(tokenizer.vocab_size)) - set(np.concatenate([window_tokens(t) for t in marked]).tolist()))
    assert packing_separator(marked, [eos, endoftext, unused]) == unused
    with pytest.raises(ConfigError, match=r"every special token of the tokenizer \(2, end-of-text id \d+ first\)"):
        packing_separator(marked, [eos, endoftext])
    rows = [row.tolist() for row in Conversations.of(marked, 1025, unused, packed=True).windows(range(5))]
    for tokens in marked:  # each whole in a window, ended by the separator (untrained)
        run = [*tokens.tolist(), ~unused]
        assert any(row[i : i + len(run)] == run for row in rows for i in range(len(row)))


# -- fine-tuning with low-rank adapters under the layouts -----------------------------------------------------------
# Fine-tuning a Llama, a Qwen3 or a Gemma 3 with adapters on every projection, against one process: adapters split
# as their base matrix under tensor and sequence parallelism beside Qwen3's head norms (adapter dropout, whose masks
# are the unsplit tensor's, there: one data-parallel replica), Gemma 3's frozen base held in bf16 by FSDP and split
# three ways (3d), a base held in NF4 (QLoRA) left out of DDP's broadcast and gathered in NF4 by FSDP, a frozen tied
# embedding across pipeline stages (no gradient to sum), packed conversations split over a context-parallel ring,
# and full fine-tuning on the same masked targets; packed under document masking, and one conversation to a window
# under causal attention.
QWEN3, GEMMA3 = "model=qwen3-tiny", "model=gemma3-tiny"
SFT_LAYOUTS = {
    2: [
        f"{QLORA} parallel=ddp",
        f"{QLORA} parallel=fsdp",
        f"{QWEN3} {LORA} model.lora.dropout=0.1 parallel=tp parallel.sequence_parallel=true",
        f"{GEMMA3} {LORA} {BF16} parallel=fsdp",
        f"{LORA} model.tie_embeddings=true parallel=pp parallel.pp_schedule=1f1b parallel.microbatches=4",
        f"{LORA} train.attention=causal parallel=zero1",
        "parallel=ddp",
    ],
    4: [f"{GEMMA3} {LORA} parallel=3d", f"{LORA} parallel=fsdp parallel.cp=2"],
}


@pytest.fixture(scope="module")
def sft_results(tmp_path_factory) -> dict:
    tokenizer, conversations = write_chat_data(tmp_path_factory.mktemp("chat-layouts"))
    common = (
        f"data=sft data.path={conversations} data.tokenizer.kind=hf data.tokenizer.name={tokenizer} "
        f"data.val_fraction=0.1 "
        f"model=llama-tiny {TWO_BLOCKS} train.attention=document train.seq_len=128 train.batch_size=8 "
        f"train.micro_batch_size=2 optim.warmup_steps=1 optim.lr=3e-3"
    )
    return layout_groups(tmp_path_factory, common, SFT_LAYOUTS)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [*SFT_LAYOUTS[2], *SFT_LAYOUTS[4]])
def test_fine_tuning_under_a_layout_matches_one_process(layout, sft_results):
    assert_matches_single(sft_results, layout)


def _hf_llama_base(directory: Path, vocab_size: int, seed: int) -> str:
    """A random LlamaForCausalLM of llama-tiny's shape: the base a fine-tuning run adapts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.mark.slow
def test_adapters_resume_exactly_name_their_base_and_load_into_peft(train, tmp_path):
    """A run that fine-tunes a Hugging Face Llama with adapters: resumed from its checkpoint it repeats itself;
    resumed on another base it stops in one line; exported, its adapters put onto the base by PEFT (the referee)
    and its merged model compute llmtrain's logits."""
    peft_module = pytest.importorskip("peft")  # the `peft` extra: installed by CI
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from llmtrain.checkpoint.offline import load_checkpoint_model
    from llmtrain.data.tokenizers import load_saved_tokenizer

    tokenizer, conversations = write_chat_data(tmp_path / "chat")
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]) + 2  # + the chat tokens
    base = _hf_llama_base(tmp_path / "base", vocab, seed=0)
    run = [
        "data=sft", f"data.path={conversations}", "data.tokenizer.kind=hf", f"data.tokenizer.name={tokenizer}",
        "data.val_fraction=0.1",
        "model=llama-tiny", f"model.init_from={base}", "model.tie_embeddings=true", f"model.vocab_size={vocab}",
        "model.lora.rank=4", "model.lora.targets=[q_proj,v_proj,out_proj,fc_in,fc_out]", "train.attention=document",
        "train.seq_len=128", "train.batch_size=4", "train.micro_batch_size=2", "train.steps=4", "train.eval_every=4",
        "train.eval_batches=1", "optim.lr=1e-2", "checkpoint.every=2",
    ]  # fmt: skip
    whole = train(*run, name="whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "of them trained: low-rank adapters of rank 4" in whole.stderr + whole.stdout
    step2 = whole.run_dir / "checkpoints" / "step-00000002"
    resumed = train(*run, f"checkpoint.resume={step2}", name="resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in whole.metrics]
    assert all(0 < m["trained_tokens"] < 4 * 128 for m in whole.metrics)
    other = train(*run, f"checkpoint.resume={step2}", f"model.init_from={_hf_llama_base(tmp_path / 'other', vocab, 1)}")
    assert other.returncode != 0
    assert "holds low-rank adapters of another base" in other.stderr and "resume with model.init_from=" in other.stderr

    final = whole.run_dir / "checkpoints" / "step-00000004"
    out = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "llmtrain.export", str(final), str(out)], check=True, capture_output=True)
    ours = load_checkpoint_model(str(final))
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids)[..., :vocab]
        peft = peft_module.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), out / "adapter").eval()
        merged = AutoModelForCausalLM.from_pretrained(out).eval()
        for theirs in (peft, merged):
            torch.testing.assert_close(theirs(ids).logits, expected, atol=2e-5, rtol=1e-4)
    assert (expected - LlamaForCausalLM.from_pretrained(base).eval()(ids).logits).abs().max() > 1e-3  # they moved it
    assert load_saved_tokenizer(str(out), "hf", 0, vocab).decode([5]) != ""


def test_the_offline_conversation_file_is_one_sft_reads(chat, tmp_path):
    """llmtrain.tools.stdlib_conversations (the recipe's data): questions about the stdlib, answered by docstrings,
    some with a follow-up, every one a conversation data=sft renders and trains."""
    cfg, tokenizer, backend = chat
    cfg = copy.deepcopy(cfg)
    cfg.path, cfg.val_fraction = _jsonl(tmp_path / "chats.jsonl", *stdlib_conversations(60)), 0.01
    conversations = read_conversations(cfg, "train") + read_conversations(cfg, "validation")
    assert len(conversations) == 60 and sum(len(c) == 4 for c in conversations) == 20
    assert all(c[0]["content"].startswith("What does the ") for c in conversations)
    assert all((tokens >= 0).any() for tokens in tokenized(conversations, tokenizer, backend, "train"))


def _released(template: str, specials: list[str], eos: str, bos: str | None = None):
    """(our tokenizer, its transformers backend) with a released chat template (harness.corpora)."""
    from harness.corpora import RELEASED_TEMPLATES, chat_tokenizer

    from llmtrain.data.tokenizers import FastTokenizer

    backend = chat_tokenizer((RELEASED_TEMPLATES / template).read_text(), specials, eos, bos)
    return FastTokenizer(backend, backend.convert_tokens_to_ids(eos), len(backend)), backend


def test_qwen3s_template_trains_each_answer_as_the_model_is_asked_for_it():
    """Qwen3's released template keeps a last answer's reasoning in <think> (an empty block where there is none)
    and drops an earlier one's, so a two-turn conversation renders its first answer otherwise alone than within it:
    it becomes two samples, each the conversation up to an answer with that answer trained, reasoning and <think>
    block included, and nothing else (the system, the questions, the earlier answer as history, the headers)."""
    tokenizer, backend = _released("qwen3.jinja", ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>")
    messages = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Return the sum of a sequence of numbers."},
        {"role": "assistant", "content": "<think>\nAdd them in turn.\n</think>\n\nUse sum."},
        {"role": "user", "content": "And their product?"},
        {"role": "assistant", "content": "Use math.prod."},
    ]
    first, second = tokenized([messages], tokenizer, backend, "qwen3")
    assert tokenizer.decode(window_tokens(first)) == backend.apply_chat_template(messages[:3], tokenize=False)
    assert tokenizer.decode(window_tokens(second)) == backend.apply_chat_template(messages, tokenize=False)
    assert "Add them in turn" not in tokenizer.decode(window_tokens(second))  # the earlier reasoning, dropped
    trained = [tokenizer.decode(sample[sample >= 0]) for sample in (first, second)]
    assert trained == [
        "<think>\nAdd them in turn.\n</think>\n\nUse sum.<|im_end|>\n",
        "<think>\n\n</think>\n\nUse math.prod.<|im_end|>\n",
    ]


def test_gemma3s_template_folds_the_system_turn_and_names_the_assistant_model():
    """Gemma 3's released template has no system role (it opens the first user turn with the system text), names
    the assistant `model` and trims each turn: one sample, its answers trained with their end of turn, its
    beginning-of-text, headers, system text and questions not."""
    tokenizer, backend = _released(
        "gemma3.jinja", ["<bos>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", bos="<bos>"
    )
    messages = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Return the sum of a sequence of numbers."},
        {"role": "assistant", "content": " Use sum. "},
        {"role": "user", "content": "And their product?"},
        {"role": "assistant", "content": "Use math.prod."},
    ]
    (sample,) = tokenized([messages], tokenizer, backend, "gemma3")
    rendered = tokenizer.decode(window_tokens(sample))
    assert rendered == backend.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith("<bos><start_of_turn>user\nAnswer in one line.\n\nReturn the sum")
    assert tokenizer.decode(sample[sample >= 0]) == "Use sum.<end_of_turn>\nUse math.prod.<end_of_turn>\n"
