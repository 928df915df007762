"""Streaming detokenization: text deltas that never split a character or show a stop string."""

from __future__ import annotations

from typing import Callable, Sequence


def visible_text(text: str, stop: Sequence[str], final: bool = False) -> str:
    """What may be shown of `text` under stop strings.

    The text is cut before the first stop string. While generation goes on (final=False), a tail
    that could still grow into a stop string is held back too, so that a stream never shows text
    that the final answer drops.
    """
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut]
    if final:
        return text
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold]


class TextStream:
    """Turns growing token lists into text deltas.

    Byte-level BPE tokens can end in the middle of a UTF-8 character; decoding then ends in
    U+FFFD, which is held back until a later token completes the character.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.shown = ""

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        return self._advance(visible_text(self.decode(self.ids), self.stop).rstrip("\ufffd"))

    def flush(self) -> str:
        """The rest of the text once generation has ended."""
        return self._advance(visible_text(self.decode(self.ids), self.stop, final=True))

    def _advance(self, visible: str) -> str:
        if not visible.startswith(self.shown):  # a later token re-decoded earlier text; wait
            return ""
        delta = visible[len(self.shown):]
        self.shown = visible
        return delta
