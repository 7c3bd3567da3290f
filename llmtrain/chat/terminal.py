"""The chat in a terminal: each message answered by each model in turn, its text printed as it is drawn."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from llmtrain.chat import api
from llmtrain.chat.engine import Engine, RequestError

COMMANDS = """/reset            forget the conversation (the system text stays)
/system TEXT      the system text (/system alone: none); the conversation starts again
/set KEY=VALUE    a sampling setting: temperature, top_k, top_p, max_tokens, seed
/settings         the settings now
/help             this list
/quit             the end (so is Ctrl-D; Ctrl-C stops an answer)"""


@dataclasses.dataclass
class Conversation:
    """One model's side of the chat: its system text and the turns so far."""

    model: str
    system: str = ""
    turns: list[dict[str, str]] = dataclasses.field(default_factory=list)

    def messages(self, question: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.turns, {"role": "user", "content": question}]


class TerminalChat:
    """A conversation with each of `models` (one, or two side by side: each answers every message), read from
    `read` (input(), a prompt in, a line out) and printed to `out`."""

    def __init__(
        self, engine: Engine, models: list[str], settings: api.Defaults, read: Callable[[str], str], out: TextIO
    ):
        self.engine, self.settings, self.read, self.out = engine, settings, read, out
        self.conversations = [Conversation(model) for model in models]

    def run(self) -> None:
        self._say(f"chatting with {' and '.join(c.model for c in self.conversations)}; /help lists the commands")
        while True:
            try:
                line = self.read("you> ").strip()
            except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: the end
                self._say("")
                return
            if not line:
                continue
            if line.startswith("/"):
                if not self._command(line):
                    return
                continue
            for conversation in self.conversations:
                self._answer(conversation, line)

    def _command(self, line: str) -> bool:
        """Carry out a command; False where it ends the chat."""
        name, _, argument = line.partition(" ")
        if name == "/quit":
            return False
        if name == "/reset":
            for conversation in self.conversations:
                conversation.turns.clear()
            self._say("(the conversation starts again)")
        elif name == "/system":
            for conversation in self.conversations:
                conversation.system, conversation.turns = argument.strip(), []
            self._say(f"(system: {argument.strip() or 'none'}; the conversation starts again)")
        elif name == "/set":
            self._set(argument)
        elif name == "/settings":
            self._say(", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.settings).items()))
        elif name == "/help":
            self._say(COMMANDS)
        else:
            self._say(f"{name} is not a command: /help lists them")
        return True

    def _set(self, assignment: str) -> None:
        key, _, value = assignment.partition("=")
        key, fields = key.strip(), {f.name: f for f in dataclasses.fields(api.Defaults)}
        if key not in fields or not value.strip():
            self._say(f"/set KEY=VALUE: KEY one of {', '.join(fields)}")
            return
        try:
            number: float = float(value) if key in ("temperature", "top_p") else int(value)
            changed: dict[str, Any] = {key: number}
            self.settings = dataclasses.replace(self.settings, **changed)
        except ValueError:
            self._say(f"{key} takes a number, not {value.strip()!r}")
            return
        self._say(f"({key}={number})")

    def _answer(self, conversation: Conversation, question: str) -> None:
        label = f"{conversation.model}> " if len(self.conversations) > 1 else "assistant> "
        body = {"model": conversation.model, "messages": conversation.messages(question)}
        try:
            request = api.parse(self.engine, body, chat=True, defaults=self.settings)
        except RequestError as error:
            self._say(f"error: {error}")
            return
        answer = api.streamed(self.engine, request, request.prompts[0])
        self.out.write(label)
        started = time.perf_counter()
        try:
            for piece in answer:
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:  # Ctrl-C mid-answer: that answer stops (its decoding too), the chat goes on
            self._say("\n  (stopped; the turn is forgotten)")
            return
        seconds = time.perf_counter() - started
        self.out.write(
            f"\n  ({answer.finish_reason}, {len(answer.ids)} tokens, {len(answer.ids) / seconds:.1f} tokens/s)\n"
        )
        self.out.flush()
        conversation.turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer.text}]

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def chat_in_terminal(engine: Engine, models: list[str], settings: api.Defaults) -> None:
    """The chat on this process's standard input and output (readline's line editing where it is there)."""
    try:
        import readline  # noqa: F401  (input() edits lines and keeps a history once it is imported)
    except ImportError:
        pass
    TerminalChat(engine, models, settings, input, sys.stdout).run()
