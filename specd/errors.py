"""Errors that carry a field name, so every transport (CLI, gRPC, HTTP) can report them alike."""

from __future__ import annotations


class SpecdError(Exception):
    """Base class for errors specd reports to its callers."""


class InvalidArgument(SpecdError, ValueError):
    """A request parameter is out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class PromptTooLong(InvalidArgument):
    """The prompt (plus at least one generated token) does not fit the model's context."""

    def __init__(self, prompt_tokens: int, max_context: int) -> None:
        super().__init__(
            "prompt",
            f"the prompt has {prompt_tokens} tokens but the model's context holds {max_context} "
            f"(prompt plus at least one new token); shorten the prompt",
        )
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


class FailedPrecondition(SpecdError):
    """The request is valid but the system is not in a state to serve it (e.g. a session not opened)."""


class ResourceExhausted(SpecdError):
    """A capacity limit is reached (sessions, queue slots); the caller may retry later or elsewhere,
    after `retry_after_ms` when given (sent as the `retry-after-ms` trailer / `Retry-After` header)."""

    def __init__(self, message: str = "", retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Unavailable(SpecdError):
    """The service cannot serve now (draining, a dependency down); the caller may retry."""


class NotFound(SpecdError):
    """A named entity (session, model) does not exist."""


class CallTimeout(SpecdError, TimeoutError):
    """One call to a replica outlived its budget (a hung or overloaded replica): the session on it
    was given up. The coordinator treats it like a replica failure (fall back, or fail over)."""
