"""lm-evaluation-harness on the live model (llmtrain.evaluate, llmtrain/harness.py), held against lm-eval's own
Hugging Face backend (HFLM) on the same checkpoint exported: the same per-request log-likelihoods, greedy flags,
rolling log-likelihoods and greedy generations, the same metrics on local multiple-choice, perplexity and
generation tasks, the in-loop scorer's accuracies equal to the harness's, and the same results from two
tensor-parallel ranks through the command line. (The other layouts answer the adapter's requests as one process
does in test_downstream's layout group.)"""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import torchrun

from llmtrain.checkpoint.offline import find_checkpoint
from llmtrain.data.tasks import read_task
from llmtrain.data.tokenizers import ByteTokenizer
from llmtrain.errors import ConfigError
from llmtrain.export import export
from llmtrain.runtime import Runtime
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
# The in-loop scorer's acc_norm divides by the tokens of " " + choice; the harness divides by the characters of
# each choice string. With byte tokens they agree once the choices carry their leading space themselves (and the
# continuations, " " + choice either way, are those of MULTIPLE_CHOICE).
SPACED_CHOICES = MULTIPLE_CHOICE + 'target_delimiter: ""\nprocess_docs: !function spaced.choices\n'
SPACED_PY = (
    'def choices(dataset):\n    return dataset.map(lambda doc: {"choices": [" " + c for c in doc["choices"]]})\n'
)
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


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Local task files: 24 four-way examples, 5 documents of 40-900 bytes (the longer span several 256-token
    windows), and their task yamls (multiple choice, the same with spaced choices, perplexity, completion)."""
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
    (folder / "spaced.py").write_text(SPACED_PY)
    for name, data, body in (
        ("words", "words.jsonl", MULTIPLE_CHOICE),
        ("words_spaced", "words.jsonl", SPACED_CHOICES),
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
def test_the_harness_scores_the_adapter_as_its_own_backend_and_the_in_loop_scorer_agrees(models, tasks):
    import lm_eval
    from lm_eval.tasks import TaskManager

    _, ours, theirs = models
    folder = tasks[0]
    config = _config(folder, "words_spaced", "prose")
    results = run_harness(ours, config)["results"]
    theirs_results = lm_eval.simple_evaluate(
        model=theirs,
        tasks=["words_spaced", "prose"],
        task_manager=TaskManager(include_path=str(folder)),
        bootstrap_iters=0,
        log_samples=False,
    )["results"]
    for metric in ("acc,none", "acc_norm,none"):
        assert results["words_spaced"][metric] == theirs_results["words_spaced"][metric], metric
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert results["prose"][metric] == pytest.approx(theirs_results["prose"][metric], rel=1e-6), metric

    # The in-loop scorer (build-nanogpt's protocol) on the same file: acc as the harness's, and with byte tokens
    # its per-token acc_norm as the harness's per-character one once the choices carry their space.
    task = read_task(str(folder / "words.jsonl"), ByteTokenizer(), ours.max_length, None)
    in_loop = task_accuracy(task, score_rows(ours.model, task.inputs, task.targets, ours.micro_batch_size))
    assert in_loop["acc"] == results["words_spaced"]["acc,none"]
    assert in_loop["acc_norm"] == results["words_spaced"]["acc_norm,none"]


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
