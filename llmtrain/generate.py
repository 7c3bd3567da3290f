"""Sample a continuation from a trained model: what did it learn?

    python -m llmtrain.generate outputs/<run> --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-k 50
    python -m llmtrain.generate exported/ --prompt "..."        # a Hugging Face GPT-2 directory (llmtrain.export)

Tokens are drawn one at a time from softmax(logits / temperature) restricted to the top-k (temperature 0: the
most likely token), from the last max_seq_len tokens of context, until max-new-tokens or the end-of-text token.
The continuation attends within its own document: a prompt holding end-of-text tokens (an empty one is one) is read
as packed documents are in training with train.attention=document (llmtrain/model/documents.py), so nothing before
the last one is seen and positions restart after it.
"""

from __future__ import annotations

import argparse
import os

import torch

from llmtrain.errors import closed_pipe_is_quiet, exits_on_run_error
from llmtrain.model import GPT, materialize
from llmtrain.model.documents import document_starts


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
def sample(
    model: GPT,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    eos_id: int | None,
    generator: torch.Generator,
) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-model.cfg.max_seq_len :]])
        documents = None if eos_id is None else document_starts(context, eos_id)
        logits = model(context, documents=documents)[0, -1, : model.cfg.vocab_size].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
            token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        if token == eos_id:
            break
        ids.append(token)
    return ids[len(prompt_ids) :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a checkpoint, checkpoint directory, run directory or exported HF directory")
    parser.add_argument("--prompt", default="", help="text to continue (empty: start from end-of-text)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load_for_sampling(args.path)
    prompt_ids = tokenizer(args.prompt)["input_ids"] if args.prompt else [tokenizer.eos_token_id]
    new = sample(
        model,
        prompt_ids,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        tokenizer.eos_token_id,
        torch.Generator().manual_seed(args.seed),
    )
    print(args.prompt + tokenizer.decode(new))


if __name__ == "__main__":
    with closed_pipe_is_quiet(), exits_on_run_error():
        main()
