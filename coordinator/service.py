"""The coordinator's request handling, shared by its gRPC and HTTP front ends.

A front end turns its request into a `PromptInput` and `SamplingParams`, calls `start`, iterates
the returned `RequestHandle` for token chunks, and reads the outcome from it; both front ends
therefore run the same engine loop over the same replica pools.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from coordinator.engine import Generation, SpeculativeEngine
from coordinator.remote import CallTimes, RemoteProposer, RemoteVerifier, ReplicaPool
from specd.errors import InvalidArgument
from specd.models import encode_chat
from specd.sampling import SamplingParams
from specd.text import TextStream, visible_text

MAX_K = 32
CHAT_ROLES = ("system", "user", "assistant")


@dataclass
class PromptInput:
    """Exactly one of the three is set."""

    text: str | None = None
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None


@dataclass
class RequestHandle:
    """A request in flight: iterate for (token ids, text delta) pairs; then read the outcome."""

    generation: Generation
    params: SamplingParams
    method: str
    k: int
    request_id: str
    times: CallTimes
    text_stream: TextStream
    closed: bool = field(default=False)

    def __iter__(self) -> Iterator[tuple[list[int], str]]:
        for chunk in self.generation:
            yield chunk, self.text_stream.push(chunk)
        rest = self.text_stream.flush()
        if rest:
            yield [], rest

    @property
    def text(self) -> str:
        return visible_text(self.text_stream.decode(self.generation.token_ids), self.params.stop, final=True)

    def close(self) -> None:
        """Free the sessions on both services (idempotent; safe after a normal finish)."""
        if not self.closed:
            self.closed = True
            self.generation.close()


class GenerationService:
    def __init__(self, targets: ReplicaPool, drafts: ReplicaPool | None, tokenizer: Any, model_name: str,
                 eos_token_ids: frozenset[int], method: str = "ngram", k: int = 8):
        self.targets = targets
        self.drafts = drafts
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_ids = eos_token_ids
        self.method = method if drafts is not None else "none"
        self.k = k
        self.active = 0
        self.draining = False
        self._lock = threading.Lock()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, prompt: PromptInput) -> list[int]:
        if prompt.text is not None:
            if not prompt.text:
                raise InvalidArgument("prompt", "the prompt is empty")
            ids = list(self.tokenizer(prompt.text)["input_ids"])
        elif prompt.messages is not None:
            if not prompt.messages:
                raise InvalidArgument("messages", "no messages")
            bad = [m.get("role") for m in prompt.messages if m.get("role") not in CHAT_ROLES]
            if bad:
                raise InvalidArgument("messages.role", f"unknown role {bad[0]!r}; use system, user or assistant")
            ids = encode_chat(self.tokenizer, prompt.messages)
        elif prompt.token_ids is not None:
            ids = list(prompt.token_ids)
        else:
            raise InvalidArgument("prompt", "send a prompt, messages or prompt token ids")
        if not ids:
            raise InvalidArgument("prompt", "the prompt is empty")
        return ids

    def resolve_speculation(self, method: str | None, k: int | None) -> tuple[str, int]:
        method = method or self.method
        if k is None:
            k = self.k
        if not 0 <= k <= MAX_K:
            raise InvalidArgument("speculation.k", f"must be in 0..{MAX_K}, got {k}")
        if method != "none" and self.drafts is None:
            raise InvalidArgument("speculation.method", "this coordinator has no draft pool; use method none")
        return ("none", 0) if method == "none" or k == 0 else (method, k)

    def start(self, prompt: PromptInput, params: SamplingParams, method: str | None = None, k: int | None = None,
              request_id: str = "", timeout: float | None = None) -> RequestHandle:
        params.validate()
        ids = self.encode(prompt)
        method, k = self.resolve_speculation(method, k)
        request_id = request_id or uuid.uuid4().hex
        times = CallTimes()
        verifier = RemoteVerifier(self.targets, request_id, timeout, times)
        proposer = RemoteProposer(self.drafts, method, request_id, timeout, times) if method != "none" else None  # type: ignore[arg-type]
        engine = SpeculativeEngine(verifier, proposer, k=k, eos_token_ids=self.eos_token_ids, decode=self.decode)
        generation = engine.generate(ids, params)
        return RequestHandle(generation, params, method, k, request_id, times, TextStream(self.decode, params.stop))

    def track(self) -> "_Active":
        return _Active(self)


class _Active:
    """Counts requests in flight (for health and draining)."""

    def __init__(self, service: GenerationService):
        self.service = service

    def __enter__(self) -> None:
        with self.service._lock:
            self.service.active += 1

    def __exit__(self, *exc: object) -> None:
        with self.service._lock:
            self.service.active -= 1
