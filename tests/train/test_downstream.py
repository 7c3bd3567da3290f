"""Downstream evaluation: multiple-choice task files read into scoring rows, lm-eval's accuracies from summed choice
losses, bits per byte against a hand count, and the same task scores and lm-eval adapter answers under every layout
as in one process."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.layouts import TWO_BLOCKS, layout_group
from layout_worker import reference_name

from llmtrain.data.tasks import Task, read_task
from llmtrain.data.tokenizers import ByteTokenizer, FastTokenizer, token_byte_lengths, train_bpe
from llmtrain.errors import ConfigError
from llmtrain.model.scoring import UNSCORED
from llmtrain.train.downstream import task_accuracy

WORDS = "the cat dog sat on a mat ran to his house blue red big small then it was quick slow".split()


def write_task(path: Path, examples: int, seed: int = 0) -> Path:
    """`examples` four-way examples, alternately in llmtrain's fields and in HellaSwag's (label as a string)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(examples):
            context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
            choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(4)]
            label = rng.randrange(4)
            record = (
                {"context": context, "choices": choices, "label": label}
                if i % 2
                else {"ctx": context, "endings": choices, "label": str(label)}
            )
            f.write(json.dumps(record) + "\n")
    return path


def test_a_task_file_becomes_rows_that_score_only_each_choice(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_text(
        json.dumps({"ctx": "ab", "endings": ["c", "de"], "label": "1"})
        + "\n\n"
        + json.dumps({"context": "x" * 20, "choices": ["yz"], "label": 0})
        + "\n"
    )
    task = read_task(str(path), ByteTokenizer(), seq_len=8, limit=None)
    assert task.name == "task" and task.choices.tolist() == [2, 1] and task.labels.tolist() == [1, 0]
    assert task.lengths.tolist() == [1, 2, 2]  # the choices' characters: acc_norm's divisors
    # "ab" + " de": the targets are the choice's tokens, each predicted from the one before; the rest unscored
    assert task.inputs[1].tolist()[:5] == [*b"ab d", 0] and task.targets[1].tolist()[:4] == [UNSCORED, *b" de"]
    assert (task.targets[1][4:] == UNSCORED).all() and task.inputs.shape == (3, 8)
    # too long for 9 tokens: the context's beginning is cut, the choice kept whole at the end
    assert bytes(task.inputs[2].tolist()) == b"xxxxxx y" and task.targets[2].tolist()[5:] == list(b" yz")
    assert (task.targets[2][:5] == UNSCORED).all()
    assert read_task(str(path), ByteTokenizer(), seq_len=8, limit=1).choices.tolist() == [2]
    assert read_task(str(path), ByteTokenizer(), seq_len=1024, limit=None).inputs.shape == (3, 64)  # as long as needed
    path.write_text(json.dumps({"ctx": "a", "endings": ["b"], "label": 3}) + "\n")
    with pytest.raises(ConfigError, match="label 3 is not one of its 1 choices"):
        read_task(str(path), ByteTokenizer(), seq_len=8, limit=None)


def test_acc_takes_the_greatest_log_likelihood_and_acc_norm_the_greatest_per_character():
    """lm-eval's definitions. Example 0 (label 1): choice 0, 2 characters, sums a loss of 1.2 (0.6 a character);
    choice 1, 4 characters, 2.0 (0.5). Example 1 (label 0): choice 0, 6 characters, 3.0 (0.5); choice 1, 1
    character, 2.5. The least sums pick the wrong choices, the least per character the right ones; the token
    counts (second column), per which the wrong ones would win, are not read."""
    task = Task("t", np.zeros((4, 1)), np.zeros((4, 1)), np.array([2, 2]), np.array([1, 0]), np.array([2, 4, 6, 1]))
    sums = torch.tensor([[1.2, 4.0], [2.0, 2.0], [3.0, 2.0], [2.5, 5.0]], dtype=torch.float64)
    assert task_accuracy(task, sums) == {"acc": 0.0, "acc_norm": 1.0}


def test_token_byte_lengths_count_the_text_each_token_stands_for():
    """Bits per byte divides by these: over a text, the tokens' lengths sum to its UTF-8 length (end-of-text 0)."""
    text = "def größe(x):\n    return x  # 日本語 ✓\n" * 3
    byte = ByteTokenizer()
    ids = byte.encode_batch([text])[0]
    assert token_byte_lengths(byte)[ids].sum() == len(text.encode()) and token_byte_lengths(byte)[byte.eos_id] == 0
    backend = train_bpe([text * 20, "the quick brown fox"], 300)
    bpe = FastTokenizer(backend, eos_id=backend.token_to_id("<|endoftext|>"), vocab_size=backend.get_vocab_size())
    lengths = token_byte_lengths(bpe)
    ids = bpe.encode_batch([text])[0]
    assert len(ids) < len(text.encode()) and lengths[ids].sum() == len(text.encode())
    assert lengths[bpe.eos_id] == 0


# Every layout scores the task's rows through its own forward-only path; the rows are dealt to the data-parallel
# ranks (53 examples x 4 choices: 212 rows, padded to whole micro-batches per rank). The same accuracies as one
# process, and the same bits per byte (the experts' layout against moe-tiny in one process).
LAYOUTS = [
    "parallel=fsdp",
    "parallel=tp train.micro_batch_size=8",
    "parallel=pp parallel.pp_schedule=gpipe parallel.microbatches=4",
    "parallel=fsdp parallel.cp=2",
    "model=moe-tiny parallel=fsdp parallel.ep=2",
]


@pytest.mark.slow
def test_task_scores_are_the_same_under_every_layout(tmp_path_factory):
    task = write_task(tmp_path_factory.mktemp("task") / "words.jsonl", examples=53)
    common = (
        f"model=tiny {TWO_BLOCKS} train.seq_len=32 train.batch_size=16 train.micro_batch_size=2 "
        f"optim.warmup_steps=1 eval.tasks=[{task}]"
    )
    results = layout_group(tmp_path_factory, 2, common, LAYOUTS)
    single = results["single"]
    assert set(single["tasks"]) == {"eval/words/acc", "eval/words/acc_norm"}
    for layout in LAYOUTS:
        reference = results[reference_name(layout)]
        assert results[layout]["tasks"] == reference["tasks"], layout
        assert results[layout]["val_bpb"] == pytest.approx(reference["val_bpb"], rel=1e-5), layout
        # lm-eval's requests through the adapter (llmtrain/lm_eval_model.py): the same answers as one process
        adapter, alone = results[layout]["adapter"], reference["adapter"]
        assert adapter["generated"] == alone["generated"] and adapter["greedy"] == alone["greedy"], layout
        for kind in ("loglikelihoods", "rolling"):
            assert adapter[kind] == pytest.approx(alone[kind], rel=1e-6), (layout, kind)
    assert any(single["adapter"]["generated"]) and any(single["adapter"]["greedy"])
    # byte tokens on the embedded corpus, whose long documents hold few end-of-text tokens (bytes of no text): on the
    # short documents (harness/corpora.py) they are 2% of the tokens
    assert single["val_bpb"] == pytest.approx(single["val_losses"][-1] / math.log(2), rel=0.02)
