"""Sample continuations from a trained model: what did it learn?

    python -m llmtrain.generate outputs/<run> --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-k 50
    python -m llmtrain.generate exported/ --prompt "What is 7 x 6?" --prompt "Name a prime." --samples 2 --chat
    python -m llmtrain.generate exported/ --prompt "..."        # a Hugging Face directory (llmtrain.export)

Each prompt is continued as it is given, as vLLM's `generate` does; --chat wraps it as a user's turn instead, as
vLLM's `chat` does (the tokenizer's chat template where it has one, else a plain transcript) and ends the answer
with the assistant's turn. The prompts are decoded together by the KV-cached sampler (llmtrain/model/sampling.py):
one prefill each, then one batched forward pass per new token, drawn from softmax(logits / temperature) within the
top-k and top-p (temperature 0: the most likely token), until --max-new-tokens, the model's max_seq_len or a stop
token. The same --seed draws the same continuations, one prompt alone or many together. A prompt continued as given
attends within its own document: one holding end-of-text tokens (an empty one is one) is read as packed documents are
in training with train.attention=document (llmtrain/model/documents.py), so nothing before the last one is seen and
positions restart after it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import torch

from llmtrain.checkpoint.offline import load_model_and_tokenizer
from llmtrain.data.chat_prompt import PromptFormat
from llmtrain.errors import closed_pipe_is_quiet, exits_on_run_error
from llmtrain.model.base import LayeredModel
from llmtrain.model.sampling import SamplingSettings, sample
from llmtrain.parallel.sampling import laid_out_decode


@torch.no_grad()
def continuations(
    model: LayeredModel,
    prompts: Sequence[Sequence[int]],
    settings: SamplingSettings,
    seed: int,
    eos_id: int | None,
    samples: int = 1,
) -> list[list[int]]:
    """`samples` continuations of each prompt (its own consecutively), each prompt read from its last document and
    the continuation held within the model's max_seq_len."""
    contexts = [last_document(prompt, eos_id)[-(model.context_length - 1) :] for prompt in prompts]
    room = model.context_length - max(len(context) for context in contexts)
    bounded = dataclasses.replace(settings, max_new_tokens=min(settings.max_new_tokens, room))
    device = next(model.parameters()).device
    drawn = sample(laid_out_decode(model.eval()), contexts, range(len(contexts)), samples, bounded, seed, device)
    return drawn.rows()


def last_document(prompt: Sequence[int], eos_id: int | None) -> list[int]:
    """The tokens the prompt's last position attends to when packed documents are kept apart: from after its last
    end-of-text token before that position."""
    ends = [i for i, token in enumerate(prompt[:-1]) if token == eos_id]
    return list(prompt[ends[-1] + 1 :] if ends else prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a checkpoint, checkpoint directory, run directory or exported HF directory")
    parser.add_argument("--prompt", action="append", help="text to continue, repeatable (none: from end-of-text)")
    parser.add_argument("--samples", type=int, default=1, help="continuations of each prompt")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the fewest tokens whose probability reaches p")
    asked = parser.add_mutually_exclusive_group()
    asked.add_argument("--chat", action="store_true", help="each prompt a user's turn, answered as the assistant")
    asked.add_argument("--raw", action="store_true", help="each prompt continued as it is (the default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load_model_and_tokenizer(args.path)
    prompts = args.prompt or [""]
    form = PromptFormat.of(tokenizer, raw=not args.chat)
    settings = SamplingSettings(args.max_new_tokens, args.temperature, args.top_k, args.top_p, form.stop_ids)
    encoded = [prompt_ids(form, prompt, args.chat) for prompt in prompts]
    # A chat template may hold the end-of-text token inside a turn (Qwen's <|im_end|>): a turn is one document
    documents_end_at = None if args.chat else tokenizer.eos_token_id
    drawn = continuations(model, encoded, settings, args.seed, documents_end_at, args.samples)
    for index, new in enumerate(drawn):
        prompt = prompts[index // args.samples]
        if args.samples > 1 or len(prompts) > 1:
            print(f"--- {index // args.samples + 1}.{index % args.samples + 1}")
        answer = answer_text(form, new)
        print(f"{prompt}\n{answer}" if args.chat else prompt + answer)  # a turn's answer on a line of its own


def prompt_ids(form: PromptFormat, prompt: str, chat: bool) -> list[int]:
    """The tokens `prompt` is continued from: as it is, or (`chat`) as a user's turn with the assistant's opened."""
    return form.ids([{"role": "user", "content": prompt}]) if chat else form.text_ids(prompt)


def answer_text(form: PromptFormat, new: Sequence[int]) -> str:
    """The text of the drawn tokens `new`, up to where the format says an answer ends."""
    text = form.backend.decode([token for token in new if token not in form.stop_ids])
    for stop in form.stop_texts:
        text = text.split(stop)[0]
    return text


if __name__ == "__main__":
    with closed_pipe_is_quiet(), exits_on_run_error():
        main()
