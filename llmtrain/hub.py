"""Reaching the Hugging Face hub for a key that names a model, tokenizer or dataset: what is wrong is said in one
line (a hub that cannot be reached, a name the hub does not have), not with the hub client's traceback.

A value that is a local directory never reaches these functions' hub path: config domains
(llmtrain/domains.py, DirectoryOrHub) have already refused a path that does not exist.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from llmtrain.errors import ConfigError, first_line

T = TypeVar("T")


def from_hub(key: str, name: str, load: Callable[[], T], repo_type: str = "model") -> T:
    """`load()`, which fetches hub id `name` (the value of `key`); a ConfigError naming the key when the hub cannot
    be reached or has no such repository."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        return load()
    except GatedRepoError:
        raise ConfigError(
            f"{key}={name!r} is gated on the hub: accept its licence on huggingface.co and log in "
            f"(huggingface-cli login), or download it and set {key}=<directory>"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}={name!r} is not a {repo_type} on the hub (or is private: huggingface-cli login): check the name"
        ) from None
    except (OSError, ValueError) as error:  # no network, offline mode, nothing cached
        if type(error).__name__ == "DatasetNotFoundError":  # datasets' own, raised when the hub answered
            raise ConfigError(f"{key}={name!r} is not a dataset on the hub (or is private): check the name") from None
        raise ConfigError(_unreachable(key, name, error, repo_type)) from None


def _unreachable(key: str, name: str, error: BaseException, repo_type: str = "model") -> str:
    why = "HF_HUB_OFFLINE=1" if os.environ.get("HF_HUB_OFFLINE") == "1" else first_line(error)
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    return (
        f"{key}={name!r} is not a local directory and the Hugging Face hub cannot be reached ({why}): download it "
        f"where the hub is reachable (huggingface-cli download {name}{kind} --local-dir <dir>) and set {key}=<dir>"
    )
