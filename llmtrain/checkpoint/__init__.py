"""Checkpoints: the final weights of a run (full state dict), whatever the layout that trained them."""

from llmtrain.checkpoint.final import load_final_model, save_final_model

__all__ = ["load_final_model", "save_final_model"]
