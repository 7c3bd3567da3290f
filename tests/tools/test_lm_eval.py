"""lm-evaluation-harness on the live model (llmtrain.evaluate, llmtrain/lm_eval_model.py), held against lm-eval's own
Hugging Face backend (HFLM) on the same checkpoint exported: the same per-request log-likelihoods, greedy flags,
rolling log-likelihoods and greedy generations, also where a context is longer than the model and is cut, the same
metrics on local multiple-choice, perplexity and generation tasks, the in-loop scorer's log-likelihoods, acc and
acc_norm equal to HFLM's, and the same results from two tensor-parallel ranks through the command line. (The other
layouts answer the adapter's requests as one process does in test_downstream's layout group.)"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from harness.paths import REPO
from harness.processes import free_port, python, rank_slots, torchrun, warm_interpreter

from llmtrain.checkpoint.offline import find_checkpoint
from llmtrain.data.tasks import read_task, request_tokens
from llmtrain.data.tokenizers import ByteTokenizer, FastTokenizer, train_bpe
from llmtrain.errors import ConfigError
from llmtrain.export import export
from llmtrain.faults import arm
from llmtrain.process.runtime import Runtime
from llmtrain.train.downstream import score_rows, task_accuracy

pytest.importorskip("lm_eval", reason="the eval extra: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402

from llmtrain.evaluate import _checked, _composed, live_model, run_harness, task_names  # noqa: E402

LOGLIKELIHOOD_ATOL = 1e-4  # fp32 on CPU, our kernels against transformers'; measured ~1e-5 on sums of 2-40 tokens
WORDS = "the cat dog sat on a mat ran to his house blue red big small then it was quick slow".split()
GENERATION = {"until": ["."], "max_gen_toks": 8, "do_sample": False}


def _task_yaml(name: str, data: str, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{body}"
    )


MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PERPLEXITY = """output_type: loglikelihood_rolling
doc_to_text: "{{text}}"
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
COMPLETION = f"""output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs: {json.dumps(GENERATION)}
metric_list:
  - metric: exact_match
"""


def _lengths_examples(rng: random.Random) -> list[dict]:
    """Examples on which acc_norm per character and per token disagree: each has a choice of one to three
    characters beside three of 35-80, so the delimiter's token (scored with the choice, not counted in its
    characters) weighs on the short choice's mean per character alone. Some choices carry a leading space of their
    own (then scored after two), some contexts end in a space (which lm-eval moves to the continuation), and two
    contexts are longer than the model (the row keeps its end)."""
    examples = []
    for i in range(16):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(70, 90) if i in (5, 11) else rng.randint(3, 8)))
        choices = [
            rng.choice(["a", "it", "to", "on"]),
            *(" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 16))) for _ in range(3)),
        ]
        if i % 3 == 0:
            choices = [" " + choice for choice in choices]
        rng.shuffle(choices)
        examples.append({"context": context + " " * (i % 4 == 1), "choices": choices, "label": rng.randrange(4)})
    return examples


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Local task files: 24 four-way examples, 5 documents of 40-900 bytes (the longer span several 256-token
    windows), 16 examples whose choices' lengths differ tenfold (lengths.jsonl), and their task yamls (multiple
    choice, perplexity, completion)."""
    folder = tmp_path_factory.mktemp("tasks")
    rng = random.Random(1)
    examples = []
    for _ in range(24):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(4)]
        examples.append({"context": context, "choices": choices, "label": rng.randrange(4)})
    (folder / "words.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 220))) + "." for _ in range(5)]
    (folder / "prose.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "lengths.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _lengths_examples(rng)))
    for name, data, body in (
        ("words", "words.jsonl", MULTIPLE_CHOICE),
        ("lengths", "lengths.jsonl", MULTIPLE_CHOICE),
        ("prose", "prose.jsonl", PERPLEXITY),
        ("complete", "words.jsonl", COMPLETION),
    ):
        (folder / f"{name}.yaml").write_text(_task_yaml(name, str(folder / data), body))
    return folder, examples, texts


def _config(folder, *names: str, more: tuple[str, ...] = ()):
    paths = ",".join(str(folder / f"{name}.yaml") for name in names)
    return _checked(_composed([f"tasks=[{paths}]", "bootstrap_iters=0", "train.device=cpu", *more]))


@pytest.fixture(scope="module")
def models(reference, tasks, tmp_path_factory):
    """The reference run's last checkpoint as llmtrain's live model (one process) and, exported, as HFLM."""
    from lm_eval.models.huggingface import HFLM

    checkpoint = find_checkpoint(str(reference.run_dir))
    exported = tmp_path_factory.mktemp("exported")
    export(checkpoint, str(exported))
    alone = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), launcher="none")
    ours = live_model(checkpoint, _config(tasks[0], "words"), alone)
    theirs = HFLM(pretrained=str(exported), device="cpu", batch_size=1, dtype="float32")
    return checkpoint, ours, theirs


@pytest.mark.slow
def test_the_adapter_answers_every_request_as_hugging_face_does(models, tasks):
    _, ours, theirs = models
    _, examples, texts = tasks
    prompts = [Instance("generate_until", {}, (e["context"], dict(GENERATION)), i) for i, e in enumerate(examples)]
    generated = ours.generate_until(prompts)
    assert generated == theirs.generate_until(prompts) and any(generated)

    # The choices, a continuation from nothing, and each greedy generation (which is, token by token, greedy).
    pairs = [(e["context"], " " + choice) for e in examples for choice in e["choices"]] + [("", "the cat sat")]
    pairs += [(e["context"], text) for e, text in zip(examples, generated) if text]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    our_answers, their_answers = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    assert [greedy for _, greedy in our_answers] == [greedy for _, greedy in their_answers]
    assert all(greedy for _, greedy in our_answers[-sum(map(bool, generated)) :])
    for (ours_ll, _), (theirs_ll, _) in zip(our_answers, their_answers):
        assert ours_ll == pytest.approx(theirs_ll, abs=LOGLIKELIHOOD_ATOL)

    documents = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    assert max(len(text) for text in texts) > 2 * ours.max_length  # byte tokens: several windows
    # HFLM sums each window's log-probabilities in fp32 (ours in fp64), which at a document's thousands of nats
    # resolves no finer than 1e-4 (an fp32 step is 2.4e-4 at 2,048): its rounding, up to 2^-22 of the total over
    # the windows, is allowed where it is the larger. Measured: 1.4e-4 at 2,225 nats.
    assert ours.loglikelihood_rolling(documents) == pytest.approx(
        theirs.loglikelihood_rolling(documents), rel=2**-22, abs=LOGLIKELIHOOD_ATOL
    )


@pytest.mark.slow
def test_the_harness_scores_the_adapter_as_its_own_backend(models, tasks):
    import lm_eval
    from lm_eval.tasks import TaskManager

    _, ours, theirs = models
    folder = tasks[0]
    config = _config(folder, "words", "prose")
    results = run_harness(ours, config)["results"]
    theirs_results = lm_eval.simple_evaluate(
        model=theirs,
        tasks=["words", "prose"],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
    )["results"]
    for metric in ("acc,none", "acc_norm,none"):
        assert results["words"][metric] == theirs_results["words"][metric], metric
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert results["prose"][metric] == pytest.approx(theirs_results["prose"][metric], rel=1e-6), metric


@pytest.mark.slow
def test_the_in_loop_scorer_gives_hugging_face_s_log_likelihoods_acc_and_acc_norm(models, tasks):
    """The in-loop scorer (llmtrain/data/tasks.py, llmtrain/train/downstream.py) on a task file, against lm-eval
    with HFLM on the same file and the run's export: each choice's log-likelihood (choices with and without a
    leading space, contexts ending in a space or longer than the model), and acc and acc_norm."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    _, ours, theirs = models
    folder = tasks[0]
    task = read_task(str(folder / "lengths.jsonl"), ByteTokenizer(), theirs.max_length, None)
    sums = score_rows(ours.model, task.inputs, task.targets, ours.micro_batch_size)
    in_loop = task_accuracy(task, sums)

    examples = [json.loads(line) for line in (folder / "lengths.jsonl").read_text().splitlines()]
    requests = [(e["context"], " " + choice) for e in examples for choice in e["choices"]]
    answers = theirs.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)])
    for (context, _), (loglikelihood, _), loss in zip(requests, answers, sums[:, 0].tolist()):
        assert -loss == pytest.approx(loglikelihood, abs=LOGLIKELIHOOD_ATOL), context

    results = lm_eval.simple_evaluate(
        model=theirs,
        tasks=["lengths"],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
    )["results"]["lengths"]
    assert in_loop == {"acc": results["acc,none"], "acc_norm": results["acc_norm,none"]}
    # The file tells acc_norm's conventions apart: per token of " " + choice (build-nanogpt's) it would differ.
    per_token = (sums[:, 0] / sums[:, 1]).view(-1, 4).argmin(1).numpy()
    assert (per_token == task.labels).mean() != in_loop["acc_norm"]


@pytest.mark.slow
def test_contexts_longer_than_the_model_are_cut_as_hugging_face_cuts_them(models, tasks):
    """lm-eval's requests whose context and continuation pass max_length tokens: HFLM keeps the last max_length + 1
    of them (the last predicts nothing), and a generation's prompt its last max_length - max_gen_toks."""
    _, ours, theirs = models
    _, examples, texts = tasks
    assert ours.max_length == theirs.max_length == 256
    long_context = " ".join(texts)[:700]  # byte tokens: a token a character
    # " the cat" is 8 tokens: rows of 256 (whole), 257 (whole: the last token predicts nothing), 258 and more (cut)
    pairs = [(long_context[:n], " the cat") for n in (248, 249, 250, 400, 700)]
    pairs.append((long_context[:300], " " + long_context[300:450]))  # a long continuation
    pairs += [(e["context"] + " " + long_context, " it") for e in examples[:2]]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    our_answers, their_answers = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    assert [greedy for _, greedy in our_answers] == [greedy for _, greedy in their_answers]
    for pair, (ours_ll, _), (theirs_ll, _) in zip(pairs, our_answers, their_answers):
        assert ours_ll == pytest.approx(theirs_ll, abs=LOGLIKELIHOOD_ATOL), len(pair[0])

    contexts = [long_context[:300], long_context]
    prompts = [Instance("generate_until", {}, (context, dict(GENERATION)), i) for i, context in enumerate(contexts)]
    generated = ours.generate_until(prompts)
    assert generated == theirs.generate_until(prompts) and all(generated)


def test_a_task_list_that_cannot_run_is_one_line_naming_it(tmp_path):
    """(A name lm-eval does not know is refused the same way, after indexing its ~15,000 tasks: seconds, not here.)"""
    with pytest.raises(ConfigError, match="tasks is not set"):
        _checked(_composed([]))
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\nprocess_docs: !function utils.process\n")
    with pytest.raises(ConfigError, match="has no `task:` name"):
        task_names([str(tmp_path / "nameless.yaml")])
    with pytest.raises(ConfigError, match="is not a file"):
        task_names([str(tmp_path / "absent.yaml")])
    (tmp_path / "quiz.yml").write_text("task: quiz\nprocess_docs: !function utils.process\n")
    assert task_names(["hellaswag", str(tmp_path / "quiz.yml")]) == (["hellaswag", "quiz"], [str(tmp_path)])


def test_the_in_loop_requests_are_split_into_tokens_as_lm_eval_splits_them():
    """With a byte-level BPE (where a context's trailing space and a merge across the boundary change tokens), the
    in-loop reader's (context, continuation) tokens are those lm-eval's own request encoding hands its backends
    (TemplateLM.loglikelihood, which HFLM uses)."""
    from lm_eval.api.model import TemplateLM

    backend = train_bpe([" ".join(WORDS) * 50, "the cat's hat (then) it was"], 320)
    bpe = FastTokenizer(backend, eos_id=backend.token_to_id("<|endoftext|>"), vocab_size=backend.get_vocab_size())

    class Recorded(TemplateLM):
        """lm-eval's request encoding, its token pairs recorded instead of scored."""

        eot_token_id = bpe.eos_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return bpe.encode_batch([string])[0].tolist()

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            self.pairs = [(context, continuation) for _, context, continuation in requests]
            return [(0.0, False)] * len(requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError

    requests = [
        (context, continuation)
        for context in ("the cat sat", "the cat sat ", "the cat sat \n ", "a (", "then", "the ca", "")
        for continuation in (" on a mat", "  on a mat", "'s hat", "n it was", "t sat")
    ]
    lm_eval_side = Recorded()
    lm_eval_side.loglikelihood([Instance("loglikelihood", {}, request, i) for i, request in enumerate(requests)])
    ours = request_tokens(bpe, requests)
    assert ours == lm_eval_side.pairs
    # the requests do tell a split apart: each side encoded alone gives other tokens for some of them
    alone = [(bpe.encode_batch([c])[0].tolist(), bpe.encode_batch([k])[0].tolist()) for c, k in requests]
    assert sum(pair != split for pair, split, (context, _) in zip(alone, ours, requests) if context) >= 4


def test_a_directory_that_is_not_a_run_exits_2_with_one_line(tmp_path, capsys):
    from llmtrain.evaluate import main

    with pytest.raises(SystemExit) as exit_code:
        main([str(tmp_path), "tasks=[hellaswag]"])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: no complete checkpoint in {tmp_path}: pass a step-* directory, a checkpoint directory or a run "
        f"directory"
    ]


@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_one_process_results_through_the_command(models, tasks, tmp_path):
    checkpoint, ours, _ = models
    folder = tasks[0]
    names = ("words", "complete")
    alone = run_harness(ours, _config(folder, *names))["results"]
    paths = ",".join(str(folder / f"{name}.yaml") for name in names)
    out = tmp_path / "results.json"
    done = torchrun(
        2,
        "-m",
        "llmtrain.evaluate",
        checkpoint,
        f"tasks=[{paths}]",
        "parallel=tp",
        "train.device=cpu",
        "bootstrap_iters=0",
        f"output={out}",
    )
    assert "|words" in done.stdout and "evaluated" in done.stdout
    split = json.loads(out.read_text())["results"]
    for task in names:
        for metric, value in alone[task].items():
            if isinstance(value, float):
                assert split[task][metric] == pytest.approx(value, rel=1e-6), (task, metric)


@pytest.mark.slow
def test_a_hung_rank_ends_an_evaluation_in_seconds_as_it_ends_training(models, tasks, tmp_path):
    """Two tensor-parallel ranks evaluating, rank 1 hung as its second scoring call starts: the hang watchdog
    (train.hang_timeout=3) names it and writes every rank's stacks beside the checkpoint, and the evaluation ends
    (exit 76; torchrun exits 1 whatever its workers exit with) in seconds, where the group's timeout would have
    waited 30 minutes."""
    checkpoint = tmp_path / "checkpoints" / Path(models[0]).name
    shutil.copytree(models[0], checkpoint)
    hang = arm(hang_at_step="2", hang_on_rank="1", hang_in_phase="evaluating")
    command = ["llmtrain.evaluate", str(checkpoint), f"tasks=[{tasks[0] / 'words.yaml'}]", "parallel=tp"]
    started = time.monotonic()
    with rank_slots(2):
        done = subprocess.run(
            [python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", *command]
            + ["train.device=cpu", "bootstrap_iters=0", "train.hang_timeout=3"],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, **warm_interpreter(), **hang},
            cwd=REPO,
        )
    assert done.returncode != 0 and time.monotonic() - started < 120, done.stderr[-3000:]
    assert "hang: no progress for" in done.stderr and "rank 1 in step 2 (evaluating)" in done.stderr, done.stderr[
        -3000:
    ]
    stacks = sorted(p.name for p in (checkpoint.parent / "evaluate" / "hang").iterdir())
    assert stacks == ["rank-0.txt", "rank-1.txt"]


@pytest.mark.slow
def test_a_rank_lost_mid_evaluation_is_named_by_the_rank_left_in_one_line(models, tasks, tmp_path):
    """Two tensor-parallel ranks started without an agent (as srun starts them: nothing stops the survivor), rank 1
    killed (SIGKILL) as its second scoring call starts: rank 0 names it in one line and exits 77 within seconds,
    where it would have waited out the process group's timeout."""
    port = free_port()
    command = [python(), "-m", "llmtrain.evaluate", models[0], f"tasks=[{tasks[0] / 'words.yaml'}]", "parallel=tp"]
    command += ["train.device=cpu", "bootstrap_iters=0"]
    ranks = []
    with rank_slots(2):
        for rank in range(2):
            env = {**os.environ, **warm_interpreter(), **arm(kill_at_step="2", kill_on_rank="1")}
            env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
            env["MASTER_PORT"] = str(port)
            ranks.append(subprocess.Popen(command, env=env, cwd=REPO, stderr=subprocess.PIPE, text=True))
        survivor_stderr = ranks[0].communicate(timeout=240)[1]
        ranks[1].wait(timeout=60)
    errors = [line for line in survivor_stderr.splitlines() if line.startswith("error: ")]
    assert ranks[0].returncode == 77 and ranks[1].returncode == -9, survivor_stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 ended mid-run"), survivor_stderr[-3000:]
