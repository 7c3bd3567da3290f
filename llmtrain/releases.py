"""The torch releases llmtrain runs on, and what differs between them, in one place.

pyproject admits torch from TORCH_FLOOR on (the GPU images ship 2.11); CI runs the suite on the release it pins and
a short tier on the floor and on the newest release `pip install torch` picks (`.ci/run`, the tests marked
`releases`). An older torch is refused when llmtrain is imported, in one line, before anything fails on an API it
lacks. Read from the installed package's metadata: the check costs no torch import.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

TORCH_FLOOR = (2, 11)


def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch that `import torch` loads here (e.g. (2, 11) for 2.11.0+cu130)."""
    major, minor = version("torch").split(".")[:2]
    return int(major), int(minor)


def refuse_unsupported_torch() -> None:
    """Exit 2 with one line where the installed torch is older than the floor (a missing torch is left to the
    import that needs it, whose error names it)."""
    try:
        found = torch_release()
    except PackageNotFoundError:
        return
    if found < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        print(
            f"error: llmtrain needs torch >= {floor}, found {version('torch')}: pip install 'torch>={floor}'",
            file=sys.stderr,
        )
        raise SystemExit(2)


def stager_outlives_a_save() -> bool:
    """Whether DCP's DefaultStager serves more than one async save: torch 2.11 and 2.12's closes its copier after
    each staging (its dispatch table and its cache of host buffers cleared), so a second save through the same
    stager fails (KeyError: <class 'type'>); from 2.13 it keeps both for the next save."""
    return torch_release() >= (2, 13)
