"""Sampling parameters, named as vLLM and OpenAI name them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specd.errors import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy decoding. top_k <= 0 and top_p == 1 disable those filters.
    seed fixes the random stream of a sampled request (per request, not global).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Raise InvalidArgument naming the first bad field; return self when all are fine."""
        if self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):  # also rejects NaN and inf
            raise InvalidArgument("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop", "stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidArgument("stop", f"stop strings must be at most {MAX_STOP_CHARS} characters")
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgument("stop", "stop strings must be valid UTF-8 text") from None
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids", "token ids must be >= 0")
        return self
