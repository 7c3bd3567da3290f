"""An answer's text as its tokens arrive: decoded a token at a time, and cut before a stop text.

A token alone is not always text (a byte of a multi-byte character; a SentencePiece piece whose leading space shows
only after another piece), so each new token is decoded with the tokens since the last text given out, and its text
is the part that decoding adds (as inference servers stream text); a character still incomplete waits for its next
byte. Text that could begin a stop text ("\\nUser:" of a plain transcript, a request's `stop`) is held back until it
cannot, so a stop text never shows."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from contextlib import closing
from typing import Any

INCOMPLETE = "\ufffd"  # what a decoder gives for bytes that are not yet a whole character


class Detokenizer:
    """Text of a growing row of tokens, the new part at each push."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.ids: list[int] = []
        self._prefix = 0  # decoding starts here: the tokens before the last text given out, for their context
        self._read = 0  # the tokens up to here are given out as text

    def _text(self, end: int | None = None) -> str:
        return self.backend.decode(self.ids[self._prefix : end], skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The text `token` adds ("" while it does not make a whole character yet)."""
        self.ids.append(token)
        before, after = self._text(self._read), self._text()
        if len(after) <= len(before) or after.endswith(INCOMPLETE):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def rest(self) -> str:
        """What is left when the row ends: the text of tokens that had not made a whole character."""
        before, after = self._text(self._read), self._text()
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


class StreamedAnswer:
    """An answer's text, piece by piece, from its tokens as they are drawn: iterate it for the pieces; after, `ids`
    (the answer's tokens, a stop token included), `text` and `finish_reason` (`stop`: a stop token or stop text
    ended it; `length`: the room it had ran out). The tokens' iterator is closed at the end, so a stop text ends
    the decoding."""

    def __init__(
        self, tokens: Generator[int, None, None], backend: Any, stop_ids: Iterable[int], stop_texts: Sequence[str] = ()
    ):
        self._tokens, self._detokenizer = tokens, Detokenizer(backend)
        self._stop_ids, self._stop_texts = set(stop_ids), tuple(text for text in stop_texts if text)
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason = "length"

    def __iter__(self) -> Iterator[str]:
        held = ""  # text that may begin a stop text
        with closing(self._tokens):
            for token in self._tokens:
                self.ids.append(token)
                if token in self._stop_ids:
                    self.finish_reason = "stop"
                    break
                held += self._detokenizer.push(token)
                shown, held, stopped = self._cut(held)
                yield from self._given(shown)
                if stopped:
                    self.finish_reason = "stop"
                    return
            shown, _, stopped = self._cut(held + self._detokenizer.rest(), final=True)
            yield from self._given(shown)
            if stopped:
                self.finish_reason = "stop"

    def _given(self, piece: str) -> Iterator[str]:
        if piece:
            self.text += piece
            yield piece

    def _cut(self, text: str, final: bool = False) -> tuple[str, str, bool]:
        """(text to show, text held back, whether a stop text was reached) of `text` not shown yet."""
        found = [index for index in (text.find(stop) for stop in self._stop_texts) if index >= 0]
        if found:
            return text[: min(found)], "", True
        if final:
            return text, "", False
        keep = max((n for stop in self._stop_texts for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        return text[: len(text) - keep], text[len(text) - keep :], False
