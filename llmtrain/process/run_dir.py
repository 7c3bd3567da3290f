"""The run directory Hydra made before the job started: a run that ends before it wrote any result leaves none
behind (a config error must not litter outputs/ with empty runs)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import time
from typing import NoReturn

from llmtrain.errors import ConfigError

# Every rank finds the same config error; the others wait this long before exiting, because a launcher that sees a
# worker exit stops the rest, and the main rank must have printed the one line the user reads by then.
_MAIN_RANK_REPORTS_WITHIN_S = 10.0
# Files Hydra writes into a run directory before the job starts; a directory holding only these has no results.
HYDRA_ONLY = {".hydra", "train.log"}
_DATE_FOLDER = re.compile(r"^\d{4}-\d{2}-\d{2}$")  # the default run directory's parent (resolvers.STAMP_FORMAT)


def remove_if_empty_run(run_dir: str) -> None:
    """Delete a run directory that holds nothing but what Hydra wrote, and the date folder above it when that is
    now empty (no other folder: one that was empty before the run may be the user's)."""
    if os.path.isdir(run_dir) and set(os.listdir(run_dir)) <= HYDRA_ONLY:
        shutil.rmtree(run_dir, ignore_errors=True)
        parent = os.path.dirname(os.path.abspath(run_dir))
        if _DATE_FOLDER.match(os.path.basename(parent)):
            with contextlib.suppress(OSError):  # not empty: another run's
                os.rmdir(parent)


def exit_with_config_error(error: Exception, run_dir: str, is_main: bool) -> NoReturn:
    """Exit 2 after one `error:` line (from the main rank only) and no run directory left behind (the main rank
    removes it: another rank doing so could pull it from under the main rank's Hydra as that starts)."""
    if is_main:
        print(f"error: {error}", file=sys.stderr)
        remove_if_empty_run(run_dir)
        sys.exit(ConfigError.exit_code)
    exit_quietly_after_the_main_rank()


def exit_quietly_after_the_main_rank() -> NoReturn:
    """Exit 2 on a rank other than the main one, which reports the config error: late enough for its line, or as
    soon as the launcher stops this rank (torchrun does once the main rank has exited, i.e. after its line)."""

    def stopped(signum: int, frame: object) -> NoReturn:
        sys.exit(ConfigError.exit_code)

    for stop in (signal.SIGTERM, signal.SIGINT):  # replacing the preemption watch's: there is no step to save
        signal.signal(stop, stopped)
    time.sleep(_MAIN_RANK_REPORTS_WITHIN_S)
    sys.exit(ConfigError.exit_code)
