"""Sample continuations from a trained model: what did it learn?

    python -m llmtrain.generate outputs/<run> --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-k 50
    python -m llmtrain.generate exported/ --prompt "What is 7 x 6?" --prompt "Name a prime." --samples 2
    python -m llmtrain.generate exported/ --prompt "..."        # a Hugging Face directory (llmtrain.export)

The prompts are decoded together by the KV-cached sampler (llmtrain/model/sampling.py): one prefill each, then one
batched forward pass per new token, drawn from softmax(logits / temperature) within the top-k and top-p (temperature
0: the most likely token), until --max-new-tokens, the model's max_seq_len or a stop token. A tokenizer with a chat
template (an instruct model's) wraps each prompt as a user's turn and stops at the end of the assistant's (--raw: the
prompt as it is). The same --seed draws the same continuations, one prompt alone or many together. The
continuation attends within its own document: a prompt holding end-of-text tokens (an empty one is one) is read as
packed documents are in training with train.attention=document (llmtrain/model/documents.py), so nothing before the
last one is seen and positions restart after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence

import torch

from llmtrain.data.rl import end_of_turn
from llmtrain.errors import closed_pipe_is_quiet, exits_on_run_error
from llmtrain.model import GPT, materialize
from llmtrain.model.sampling import SamplingSettings, decode_step, sample


def load_for_sampling(path: str):
    """(model, tokenizer) from an exported Hugging Face directory or from a checkpoint / run directory."""
    from transformers import AutoTokenizer

    if os.path.isfile(os.path.join(path, "config.json")):
        from llmtrain.model.hf import hf_config_of, hf_weights

        with torch.device("meta"):
            model = GPT(hf_config_of(path))
        materialize(model, torch.device("cpu"), hf_weights(path, model.cfg))
        return model.eval(), AutoTokenizer.from_pretrained(path)
    from llmtrain.checkpoint.offline import find_checkpoint, load_checkpoint_model

    checkpoint = find_checkpoint(path)
    return load_checkpoint_model(checkpoint), AutoTokenizer.from_pretrained(os.path.join(checkpoint, "tokenizer"))


@torch.no_grad()
def continuations(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    settings: SamplingSettings,
    seed: int,
    eos_id: int | None,
    samples: int = 1,
) -> list[list[int]]:
    """`samples` continuations of each prompt (its own consecutively), each prompt read from its last document and
    the continuation held within the model's max_seq_len."""
    contexts = [last_document(prompt, eos_id)[-(model.cfg.max_seq_len - 1) :] for prompt in prompts]
    room = model.cfg.max_seq_len - max(len(context) for context in contexts)
    bounded = dataclasses.replace(settings, max_new_tokens=min(settings.max_new_tokens, room))
    device = next(model.parameters()).device
    drawn = sample(decode_step(model.eval()), contexts, range(len(contexts)), samples, bounded, seed, device)
    return drawn.rows()


def last_document(prompt: Sequence[int], eos_id: int | None) -> list[int]:
    """The tokens the prompt's last position attends to when packed documents are kept apart: from after its last
    end-of-text token before that position."""
    ends = [i for i, token in enumerate(prompt[:-1]) if token == eos_id]
    return list(prompt[ends[-1] + 1 :] if ends else prompt)


def _prompt_ids(tokenizer, prompt: str, raw: bool) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's tokens (with a chat template: the user's turn and the assistant's opening) and the tokens that
    end a continuation."""
    stops = [tokenizer.eos_token_id]
    if not raw and getattr(tokenizer, "chat_template", None):
        user = [{"role": "user", "content": prompt}]
        opened = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(opened, add_special_tokens=False)["input_ids"]
        return ids, tuple(token for token in (*stops, end_of_turn(tokenizer)) if token is not None)
    ids = tokenizer(prompt)["input_ids"] if prompt else [tokenizer.eos_token_id]
    return ids, tuple(token for token in stops if token is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a checkpoint, checkpoint directory, run directory or exported HF directory")
    parser.add_argument("--prompt", action="append", help="text to continue, repeatable (none: from end-of-text)")
    parser.add_argument("--samples", type=int, default=1, help="continuations of each prompt")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the fewest tokens whose probability reaches p")
    parser.add_argument("--raw", action="store_true", help="the prompt as it is, no chat template")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load_for_sampling(args.path)
    prompts = args.prompt or [""]
    encoded = [_prompt_ids(tokenizer, prompt, args.raw) for prompt in prompts]
    stops = encoded[0][1]
    settings = SamplingSettings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, stops)
    drawn = continuations(model, [ids for ids, _ in encoded], settings, args.seed, tokenizer.eos_token_id, args.samples)
    for index, new in enumerate(drawn):
        prompt = prompts[index // args.samples]
        if args.samples > 1 or len(prompts) > 1:
            print(f"--- {index // args.samples + 1}.{index % args.samples + 1}")
        print(prompt + tokenizer.decode([token for token in new if token not in stops]))


if __name__ == "__main__":
    with closed_pipe_is_quiet(), exits_on_run_error():
        main()
