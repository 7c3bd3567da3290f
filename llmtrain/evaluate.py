"""Evaluate a trained model with EleutherAI's lm-evaluation-harness, on the live model laid out as training lays it
out: no export step, and a model that only fits sharded is evaluated sharded.

    python -m llmtrain.evaluate outputs/<run> tasks=[hellaswag] limit=500
    python -m llmtrain.evaluate outputs/<run>/checkpoints/step-00001000 tasks=[my_tasks/quiz.yaml] output=quiz.json
    torchrun --nproc_per_node=4 -m llmtrain.evaluate outputs/<run> tasks=[lambada_openai] parallel=fsdp

The first argument is a checkpoint (step-*), a checkpoint directory or a run directory (its latest complete
checkpoint); the model's shape and weights and its tokenizer are the checkpoint's. Then keys, as for train.py:
tasks, limit, num_fewshot, bootstrap_iters, output, and training's layout keys (parallel=..., train.micro_batch_size
= rows per forward, train.precision, train.device, hardware). A task is an lm-eval task name (its data from the
Hugging Face hub) or a task yaml file (local: a jsonl beside it works offline). Needs the `eval` extra:
pip install -e ".[eval]".
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, cast

from omegaconf import OmegaConf

from llmtrain.config import EvaluateRootConfig, check_domains, evaluation_keys, keys_help
from llmtrain.errors import ConfigError, RunError, closed_pipe_is_quiet, exit_for, first_line
from llmtrain.process.launch_env import launch_rank

if TYPE_CHECKING:
    from llmtrain.process.runtime import Runtime


def _composed(overrides: list[str]):
    """The evaluation config of these overrides; a composition error is one line and exit 2, like train.py's."""
    from llmtrain.config.composition import compose_or_refuse

    return compose_or_refuse("evaluate", overrides, EvaluateRootConfig)


def _checked(cfg) -> EvaluateRootConfig:
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "llmtrain.evaluate runs lm-evaluation-harness, which is not installed: pip install -e '.[eval]'"
        )
    check_domains(cfg, EvaluateRootConfig)
    if not cfg.tasks:
        raise ConfigError("tasks is not set: name lm-eval tasks or task yaml files, e.g. tasks=[hellaswag]")
    return cast(EvaluateRootConfig, OmegaConf.to_object(cfg))


def _task_yaml_loader():
    import yaml

    class TaskYamlLoader(yaml.SafeLoader):
        """Reads a task yaml's plain keys; its tags (`!function utils.process_docs`) are lm-eval's to resolve."""

    TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return TaskYamlLoader


def is_task_file(task: str) -> bool:
    return task.endswith((".yaml", ".yml"))


def task_names(tasks: list[str]) -> tuple[list[str], list[str]]:
    """(names, directories to search): a task yaml file is named by its `task:` and searched for in its directory
    (with the tasks beside it), any other entry is a name lm-eval knows."""
    import yaml

    names, directories = [], []
    for task in tasks:
        path = os.path.expanduser(task)
        if not is_task_file(task):
            names.append(task)
            continue
        if not os.path.isfile(path):
            raise ConfigError(f"tasks: {task} is not a file: give a task yaml file that exists, or a task name")
        with open(path, encoding="utf-8") as f:
            config = yaml.load(f, Loader=_task_yaml_loader())
        if not isinstance(config, dict) or not config.get("task"):
            raise ConfigError(f"tasks: {task} has no `task:` name: an lm-eval task yaml names its task")
        names.append(str(config["task"]))
        directories.append(os.path.dirname(os.path.abspath(path)))
    return names, sorted(set(directories))


def run_harness(lm, config: EvaluateRootConfig) -> dict:
    """lm-eval's results of `lm` on config.tasks (every rank runs it alike, `lm` dealing the rows out; {} but on
    the first local rank)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = config.tasks or []
    names, directories = task_names(tasks)
    # lm-eval's own ~15,000 task configs are indexed (seconds) only when a task is named rather than given as a file
    by_name = not all(map(is_task_file, tasks))
    manager = TaskManager(include_path=directories or None, include_defaults=by_name)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"tasks: {', '.join(unknown)} is not a task lm-eval knows: check the name (python -m lm_eval ls tasks) "
            f"or give the task's yaml file"
        )
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            task_manager=manager,
            limit=config.limit,
            num_fewshot=config.num_fewshot,
            bootstrap_iters=config.bootstrap_iters,
            log_samples=False,
        )
    except OSError as error:  # the task's data is on the hub, which cannot be reached (ConnectionError, offline)
        raise ConfigError(
            f"tasks: the data of {', '.join(names)} cannot be fetched from the Hugging Face hub ({first_line(error)}): "
            f"run where the hub is reachable (then it is cached), or give a task yaml file whose data is local "
            f"(dataset_path: json)"
        ) from None
    return results or {}  # lm-eval answers on the first local rank only


def live_model(checkpoint: str, config: EvaluateRootConfig, runtime: Runtime, observers: tuple = ()):
    """Collective: the checkpoint's model laid out by `config` on this rank, its weights loaded, as an lm-eval model
    (llmtrain/lm_eval_model.py: LiveModel) whose scoring calls `observers` watch."""
    from llmtrain.data.tokenizers import FastTokenizer
    from llmtrain.lm_eval_model import LiveModel
    from llmtrain.run.laid_out import laid_out_checkpoint

    model, hf_tokenizer = laid_out_checkpoint(checkpoint, config, runtime)
    tokenizer = FastTokenizer(hf_tokenizer, eos_id=hf_tokenizer.eos_token_id, vocab_size=len(hf_tokenizer))
    return LiveModel(
        model,
        tokenizer,
        model.plan.train.seq_len,
        config.train.micro_batch_size,
        show_progress=runtime.is_main,
        rank=runtime.rank,
        observers=observers,
    )


def evaluate(checkpoint: str, config: EvaluateRootConfig) -> dict:
    """Collective: lm-eval's results of the checkpoint's model laid out by `config` over this process group (on
    rank 0; {} on the others). Under training's rules: the hang watchdog (train.hang_timeout; its stacks in the
    checkpoint directory's evaluate/hang/), and a peer's death one line and exit 77, not a wait for the group's
    timeout."""
    from llmtrain.process.runtime import init_runtime
    from llmtrain.train.peer_loss import is_peer_loss, peer_lost
    from llmtrain.train.watchdog import StepWatchdog

    runtime = init_runtime(config.train.device)
    hang_dir = os.path.join(os.path.dirname(checkpoint), "evaluate")  # the watchdog's stacks go to its hang/
    watchdog = StepWatchdog.for_run(config.train.hang_timeout, runtime, hang_dir)
    observers = (watchdog,) if watchdog is not None else ()
    try:
        if not runtime.is_main:
            logging.getLogger().setLevel(logging.WARNING)
            os.environ["TQDM_DISABLE"] = "1"
        results = run_harness(live_model(checkpoint, config, runtime, observers), config)
    except BaseException as error:
        if isinstance(error, Exception) and runtime.distributed and is_peer_loss(error):
            lost, speaks = peer_lost(error, runtime)
            exit_for(lost, speaks, lambda _: runtime.abort())
        runtime.shutdown()
        raise
    finally:
        if watchdog is not None:
            watchdog.close()
    runtime.shutdown(synchronize=True)
    return results if runtime.is_main else {}


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Keys (key=default and what it accepts; below it, what it does):")
        print(keys_help(_composed([]), EvaluateRootConfig, only=evaluation_keys()))
        print("Training's keys: python train.py --help")
        return
    from llmtrain.checkpoint.offline import find_checkpoint

    path, overrides = argv[0], argv[1:]
    started = time.perf_counter()
    try:
        config = _checked(_composed(overrides))
        checkpoint = find_checkpoint(path)
        results = evaluate(checkpoint, config)
    except RunError as error:
        if launch_rank() == 0 or not error.main_rank_speaks:
            print(f"{error.prefix}{error}", file=sys.stderr)
        sys.exit(error.exit_code)
    if not results:  # not rank 0
        return
    from lm_eval.utils import make_table

    print(make_table(results))
    print(f"evaluated {checkpoint} on {', '.join(results['results'])} in {time.perf_counter() - started:.1f} s")
    if config.output:
        from llmtrain.files import write_json_atomic

        write_json_atomic(config.output, results, default=str)  # lm-eval's task configs hold functions
        print(f"results: {config.output}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with closed_pipe_is_quiet():
        main(sys.argv[1:])
