"""llmtrain: a Hydra-configured training harness for GPT language models."""

from llmtrain.releases import refuse_unsupported_torch

refuse_unsupported_torch()

__version__ = "0.1.0"
