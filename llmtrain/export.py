"""Export a checkpoint as a Hugging Face GPT-2, Llama (LlamaForCausalLM, for model.norm=rmsnorm, position=rope,
mlp=swiglu, bias=false) or Mixtral (the Llama family with a mixture of experts in every block): safetensors
weights, config.json and the tokenizer files, which
`transformers.AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)` load.

    python -m llmtrain.export outputs/<run>/checkpoints/step-00000300 exported/
    python -m llmtrain.export outputs/<run> exported/        # the run's latest complete checkpoint

The reverse: train from GPT-2, Llama or Mixtral weights in this format with `model.init_from=<directory or hub name>`.
"""

from __future__ import annotations

import argparse
import os

from llmtrain.checkpoint.offline import find_checkpoint, load_checkpoint_model
from llmtrain.model.hf import hf_config, to_hf_state_dict
from llmtrain.model.hf_llama import is_llama, llama_hf_config, to_llama_state_dict
from llmtrain.model.hf_mixtral import check_mixtral, mixtral_hf_config, to_mixtral_state_dict


def export(checkpoint: str, out_dir: str) -> None:
    from transformers import AutoTokenizer, GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, PreTrainedModel

    model = load_checkpoint_model(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint, "tokenizer"))
    cfg = model.cfg
    hf_model: PreTrainedModel
    if cfg.moe.num_experts:
        check_mixtral(cfg)
        hf_model = MixtralForCausalLM(mixtral_hf_config(cfg, tokenizer.eos_token_id))
        hf_model.load_state_dict(to_mixtral_state_dict(model))
    elif is_llama(cfg):
        hf_model = LlamaForCausalLM(llama_hf_config(cfg, tokenizer.eos_token_id))
        hf_model.load_state_dict(to_llama_state_dict(model))
    elif cfg.norm == "layernorm" and cfg.position == "learned" and cfg.mlp == "gelu" and cfg.tie_embeddings:
        hf_model = GPT2LMHeadModel(hf_config(cfg, tokenizer.eos_token_id))
        hf_model.load_state_dict(to_hf_state_dict(model))
    else:
        raise SystemExit(
            f"error: {checkpoint} mixes the GPT-2 and Llama families (norm={cfg.norm}, position={cfg.position}, "
            f"mlp={cfg.mlp}, bias={cfg.bias}, tie_embeddings={cfg.tie_embeddings}): neither transformers class holds it"
        )
    hf_model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step-* checkpoint, a checkpoint directory, or a run directory")
    parser.add_argument("out_dir")
    args = parser.parse_args()
    checkpoint = find_checkpoint(args.checkpoint)
    export(checkpoint, args.out_dir)
    print(f"exported {checkpoint} -> {args.out_dir}")


if __name__ == "__main__":
    main()
