"""A conversation as the tokens a model's answer continues, and where that answer ends (llmtrain.chat,
llmtrain.generate).

With a chat template (an instruct model's tokenizer, or one fine-tuned with data=sft) the messages are rendered by
it with the assistant's turn opened, as SFT rendered them in training, and an answer ends at the tokenizer's end of
text or the template's end of turn. Without one (a model pretrained here on plain text) the conversation is a plain
transcript, "User: ..." and "Assistant: ..." lines after the system text, and an answer also ends where the model
starts the user's next line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmtrain.data.rl import end_of_turn

ROLES = ("system", "user", "assistant")
# The plain transcript's speakers, and the text that opens the user's next turn (an answer ends before it).
TRANSCRIPT = {"user": "User: ", "assistant": "Assistant: "}
NEXT_USER_TURN = "\nUser:"


@dataclass(frozen=True)
class PromptFormat:
    """How `backend` (a transformers tokenizer) renders a conversation: by its chat template or as a plain
    transcript, and what ends an answer: `stop_ids` (tokens the sampler stops at) and `stop_texts` (text an answer
    ends before)."""

    backend: Any
    templated: bool
    stop_ids: tuple[int, ...]
    stop_texts: tuple[str, ...]

    @classmethod
    def of(cls, backend: Any, raw: bool = False) -> PromptFormat:
        """The tokenizer's chat template where it has one (and not `raw`), else the plain transcript."""
        ends = [backend.eos_token_id]
        if not raw and getattr(backend, "chat_template", None):
            ends.append(end_of_turn(backend))
            return cls(backend, True, tuple(dict.fromkeys(t for t in ends if t is not None)), ())
        return cls(backend, False, tuple(t for t in ends if t is not None), (NEXT_USER_TURN,))

    def ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The tokens of `messages` (role and content each; the last the user's) with the assistant's turn opened."""
        if self.templated:
            opened = self.backend.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            return list(self.backend(opened, add_special_tokens=False)["input_ids"])
        return list(self.backend(self.transcript(messages))["input_ids"])

    def text_ids(self, text: str) -> list[int]:
        """A raw prompt's tokens (an empty one: end of text, which a document starts after)."""
        return list(self.backend(text)["input_ids"]) if text else [self.backend.eos_token_id]

    @staticmethod
    def transcript(messages: Sequence[dict[str, str]]) -> str:
        lines = [
            m["content"] + "\n" if m["role"] == "system" else TRANSCRIPT[m["role"]] + m["content"] for m in messages
        ]
        return "\n".join(lines) + "\n" + TRANSCRIPT["assistant"].rstrip()


def checked_messages(messages: object) -> list[dict[str, str]]:
    """`messages` as a list of {role, content} dicts, roles among ROLES and the last the user's; ValueError with the
    reason where it is not one."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"messages[{index}] needs a role among {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text ones, joined
            if not all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in content):
                raise ValueError(f"messages[{index}].content's parts must each be {{type: text, text: <text>}}")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{index}].content must be text")
        checked.append({"role": message["role"], "content": content})
    if checked[-1]["role"] != "user":
        raise ValueError("the last message must be the user's: the model answers it")
    return checked
