"""llmtrain: a Hydra-configured training harness for GPT language models."""

__version__ = "0.1.0"
