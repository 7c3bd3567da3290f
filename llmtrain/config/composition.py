"""What the Hydra entry points (train.py, llmtrain.data.prepare) share: a config that cannot be composed ends in
one `error:` line naming the key and exit code 2, like every other bad input, instead of Hydra's multi-line report.

Hydra reports composition errors itself unless HYDRA_FULL_ERROR=1, when it raises them; `run_entry` sets it so that
the error reaches here, and re-raises anything from inside the job (a bug there keeps its traceback). A user who
sets HYDRA_FULL_ERROR=1 gets Hydra's full report as before.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from llmtrain.errors import ConfigError, closed_pipe_is_quiet, first_line
from llmtrain.process.launch_env import launch_rank
from llmtrain.process.run_dir import exit_quietly_after_the_main_rank

_FULL_ERROR = "HYDRA_FULL_ERROR"


class _JobState:
    failed = False  # the task function raised: its error is the job's, not the composition's


def job(task: Callable[[Any], None]) -> Callable[[Any], None]:
    """Marks `task` (the function under @hydra.main) so that run_entry tells its errors from Hydra's."""

    @functools.wraps(task)
    def marked(cfg: Any) -> None:
        try:
            task(cfg)
        except BaseException:
            _JobState.failed = True
            raise

    return marked


def run_entry(main: Callable[[], None], schema: type) -> None:
    """Call a @hydra.main function; a composition error becomes one line and exit 2 (keys named from `schema`)."""
    user_wants_report = os.environ.get(_FULL_ERROR) == "1"
    os.environ[_FULL_ERROR] = "1"
    try:
        with closed_pipe_is_quiet():
            main()
    except Exception as error:
        if user_wants_report or _JobState.failed:
            raise
        if _written_file_failed(error) is not None and launch_rank() != 0:
            # The main rank owns the run directory and deletes it when its config is refused: a rank that starts
            # later can meet that deletion while Hydra makes the directory. The main rank says why the run ended.
            exit_quietly_after_the_main_rank()
        print(f"error: {composition_error_line(error, schema)}", file=sys.stderr)
        sys.exit(ConfigError.exit_code)


def compose_or_refuse(name: str, overrides: list[str], schema: type) -> Any:
    """The config conf/<name>.yaml composed with `overrides`, for a command that is not a @hydra.main entry point
    (python -m llmtrain.evaluate, llmtrain.tools.dry_run); a composition error is a ConfigError of one line, its
    keys named from `schema`."""
    from hydra import compose, initialize_config_dir

    from llmtrain.config import CONF_DIR, register_schemas

    register_schemas()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return compose(name, overrides=overrides)
    except Exception as error:
        raise ConfigError(composition_error_line(error, schema)) from None


def composition_error_line(error: BaseException, schema: type) -> str:
    """One line for an error raised while Hydra composed the config or created the run directory."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    from llmtrain.config import schema_keys, unknown_key_line

    domains = dict(schema_keys(schema))
    cause = error.__cause__
    if isinstance(error, MissingConfigException) and error.missing_cfg_file and error.options is not None:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option of {group}: choose one of {', '.join(error.options)}"
    if isinstance(error, OverrideParseException):
        return (
            f"cannot read the override {error.override!r}: {first_line(error.message or '')} (quote a value holding "
            f"spaces or brackets: key='a value')"
        )
    if isinstance(error, ConfigCompositionException) and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return unknown_key_line(cause.full_key or "?", list(domains))
    if isinstance(error, ConfigCompositionException) and isinstance(cause, ValidationError):
        name = re.sub(r"\[\d+\]$", "", cause.full_key or "?")  # an item of a list key: the key
        override = re.search(r"override (\S+=.*)$", str(error))
        shown = override.group(1) if override else name
        domain = domains.get(name)
        if domain is None:  # a whole section assigned a value
            return f"{shown}: {name} is a group of keys, not a value: set its keys ({name}.<key>=...)"
        message = cause.msg or ""
        kind = "is not allowed (the key has no null)" if "is not Optional" in message else _type_phrase(message)
        return f"{shown} {kind}: set {name} to {domain.accepts()}"
    if (failed := _written_file_failed(error)) is not None:  # Hydra making the run (or sweep) directory, or
        error = failed  # writing .hydra/ or the log file into it (logging's configuration wraps that one)
        return (
            f"the run directory cannot be written ({error.filename}: {error.strerror}): set hydra.run.dir (or "
            f"hydra.sweep.dir with -m) to a writable directory"
        )
    return " ".join(first_line(part) for part in (error, cause) if part is not None)


def _written_file_failed(error: BaseException) -> OSError | None:
    """The OSError behind `error`, itself or what raised it (logging.config wraps a log file that cannot be opened
    in a ValueError), or None."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _type_phrase(message: str) -> str:
    if "valid bool" in message:
        return "is not true or false"
    if "to Integer" in message:
        return "is not a whole number"
    if "to Float" in message:
        return "is not a number"
    return "has the wrong type"
