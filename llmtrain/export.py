"""Export a checkpoint of the GPT class (model.family=gpt) as a Hugging Face GPT-2, Llama (LlamaForCausalLM, for
model.norm=rmsnorm, position=rope, mlp=swiglu, bias=false), Qwen3 (the Llama family with query and key norms),
Mixtral (the Llama family with a mixture of experts in every block) or Gemma 3 (Gemma3ForCausalLM: its norms,
GeGLU, sliding windows; llmtrain/model/hf.py picks the family): safetensors weights, config.json and the tokenizer
files, which `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`
load.

    python -m llmtrain.export outputs/<run>/checkpoints/step-00000300 exported/
    python -m llmtrain.export outputs/<run> exported/        # the run's latest complete checkpoint

A model fine-tuned with low-rank adapters (model.lora) is exported merged (each adapted weight W + alpha/rank BA),
and its adapters alone in PEFT's format in exported/adapter/ (Llama, Qwen3 and Mixtral: GPT-2's and Gemma 3's are
merged only), for
`peft.PeftModel.from_pretrained(<the base>, "exported/adapter")`.

The reverse: train from such weights with `model.init_from=<directory or hub name>`.
"""

from __future__ import annotations

import argparse
import os

from llmtrain.checkpoint.manager import read_meta
from llmtrain.checkpoint.offline import find_checkpoint, load_checkpoint_model
from llmtrain.errors import ConfigError, closed_pipe_is_quiet, exits_on_run_error
from llmtrain.model import GPT
from llmtrain.model.hf import hf_format_of
from llmtrain.model.hf_peft import PEFT_FAMILIES, merged, save_peft_adapter


def export(checkpoint: str, out_dir: str) -> None:
    from transformers import AutoTokenizer

    model = load_checkpoint_model(checkpoint)
    family = hf_format_of(model.cfg)  # a ConfigError where no transformers class computes the model
    if model.cfg.lora.enabled:
        if family.model_type in PEFT_FAMILIES:
            save_peft_adapter(model, read_meta(checkpoint)["base"]["init_from"], os.path.join(out_dir, "adapter"))
        model = merged(model)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint, "tokenizer"))
    hf_model_of(model, tokenizer.eos_token_id).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def hf_model_of(model: GPT, eos_id: int):
    """The transformers model of our whole model (without adapters), holding its weights: what export saves."""
    import transformers

    family = hf_format_of(model.cfg)
    hf_model = getattr(transformers, family.transformers_class)(family.hf_config(model.cfg, eos_id))
    hf_model.load_state_dict(family.state_dict(model))
    return hf_model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step-* checkpoint, a checkpoint directory, or a run directory")
    parser.add_argument("out_dir")
    args = parser.parse_args()
    checkpoint = find_checkpoint(args.checkpoint)
    try:
        export(checkpoint, args.out_dir)
    except ConfigError as error:
        raise ConfigError(f"{checkpoint} cannot be exported: {error}") from None
    print(f"exported {checkpoint} -> {args.out_dir}")


if __name__ == "__main__":
    with closed_pipe_is_quiet(), exits_on_run_error():
        main()
