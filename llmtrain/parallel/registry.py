"""`parallel.strategy` name -> Strategy class, from the table in llmtrain/catalog.py. A new layout is one class, one
line in that table and one `conf/parallel/<name>.yaml`; the trainer does not change. A class is imported only when
a run asks for it."""

from __future__ import annotations

import importlib

from llmtrain.catalog import layout_spec
from llmtrain.parallel.strategy import Strategy


def get_strategy(name: str) -> type[Strategy]:
    module, _, class_name = layout_spec(name).implementation.partition(":")
    return getattr(importlib.import_module(module), class_name)
