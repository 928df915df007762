"""Streaming detokenization: turn growing token lists into text deltas that never split a character."""

from __future__ import annotations

from typing import Callable, Sequence


class TextStream:
    """Yields the text each new chunk of tokens adds.

    Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding then shows U+FFFD.
    Such a tail is held back until a later token completes it.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self.emitted:]
        self.emitted = len(text)
        return delta

    def flush(self) -> str:
        text = self.decode(self.ids)
        delta = text[self.emitted:]
        self.emitted = len(text)
        return delta
