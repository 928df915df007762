"""How many sessions a KV memory budget holds.

A session's KV row can grow to the model's whole context, and the pool gives every slot the same
capacity, so the worst case per session is bytes per token x max context, where bytes per token
= 2 (K and V) x layers x KV heads x head dim x dtype size. The session limit is the budget divided
by that (and never above `max_sessions`); the pool is capped at that many slots, so the KV cache
stays within the budget whatever the sessions do.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True)
class SessionLimit:
    max_sessions: int
    bytes_per_session: int
    source: str  # "max_sessions" or "kv_budget_mb"

    def describe(self) -> str:
        return (f"{self.max_sessions} sessions (from {self.source}; KV cache up to "
                f"{self.bytes_per_session / MIB:.1f} MiB per session)")


def session_limit(max_sessions: int, bytes_per_token: int, max_context: int, kv_budget_mb: float | None) -> SessionLimit:
    """The session limit from `max_sessions` and an optional KV budget in MiB.

    Raises ValueError when the budget does not hold a single session.
    """
    per_session = bytes_per_token * max_context
    if kv_budget_mb is None:
        return SessionLimit(max_sessions, per_session, "max_sessions")
    fits = int(kv_budget_mb * MIB // per_session) if per_session else max_sessions
    if fits < 1:
        raise ValueError(f"kv_budget_mb: {kv_budget_mb:g} MiB holds no session: one needs "
                         f"{per_session / MIB:.1f} MiB ({bytes_per_token} bytes per token x {max_context} tokens of context)")
    if fits >= max_sessions:
        return SessionLimit(max_sessions, per_session, "max_sessions")
    return SessionLimit(fits, per_session, "kv_budget_mb")
