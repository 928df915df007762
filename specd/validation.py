"""Checks of a request against the served model, shared by the coordinator and the replicas.

`SamplingParams.validate` checks what needs no model; these checks need the target's vocabulary
and context (from its ModelInfo), so a bad request is refused with INVALID_ARGUMENT naming the
field at the coordinator rather than as an upstream error from a replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd.errors import InvalidArgument, PromptTooLong
from specd.sampling import SamplingParams

MAX_REQUEST_ID_CHARS = 128


def check_text(field: str, text: str) -> None:
    """Text must be valid Unicode that UTF-8 can carry: no lone surrogates (which JSON's \\ud800
    escapes can smuggle in, and tokenizers fail on)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(field, f"is not valid UTF-8 text (a lone surrogate at character {exc.start})") from None


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    if any(not ch.isprintable() for ch in request_id):
        raise InvalidArgument("request_id", "must be printable text")


@dataclass(frozen=True)
class RequestLimits:
    """What the served model allows (0: unknown, not checked)."""

    vocab_size: int = 0
    max_context: int = 0

    def check_prompt(self, ids: Sequence[int], field: str = "prompt_token_ids") -> None:
        if self.vocab_size:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(field, f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        if self.max_context and len(ids) + 1 > self.max_context:
            raise PromptTooLong(len(ids), self.max_context)

    def check_params(self, params: SamplingParams) -> None:
        if self.max_context and params.max_tokens > self.max_context:
            raise InvalidArgument("max_tokens", f"must be at most the model's context of {self.max_context} tokens, "
                                  f"got {params.max_tokens}")
        if self.vocab_size:
            bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
            if bad is not None:
                raise InvalidArgument("stop_token_ids", f"token id {bad} is outside the vocabulary "
                                      f"(0..{self.vocab_size - 1})")

    def check(self, ids: Sequence[int], params: SamplingParams, request_id: str = "", from_ids: bool = False) -> None:
        """All of the above; `from_ids`: the client sent token ids (names the field so)."""
        check_request_id(request_id)
        self.check_params(params)
        self.check_prompt(ids, "prompt_token_ids" if from_ids else "prompt")
