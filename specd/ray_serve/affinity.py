"""Session affinity on Ray Serve, as pure functions over replica ids and loads.

A session's state (a target KV row, a draft model cache) lives on the replica that opened it, so
the session id names that replica: "<replica unique id>/<n>". Every later call of the session
carries the id (as the request's `session_id` metadata) and goes to exactly that replica; a new
session goes to the least loaded replica that is serving. No table is shared between routers:
any coordinator replica's router can route any session, and a replica that joins later changes
nothing for sessions already open (consistent hashing would remap some of them).
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.replicas import least_loaded

SEPARATOR = "/"


def make_session_id(replica_id: str, n: int) -> str:
    if SEPARATOR in replica_id:
        raise ValueError(f"replica id {replica_id!r} contains {SEPARATOR!r}")
    return f"{replica_id}{SEPARATOR}{n}"


def owner_of(session_id: str) -> str | None:
    """The replica id a session id names; None for an empty or malformed id (a new session)."""
    replica, sep, n = session_id.rpartition(SEPARATOR)
    return replica if sep and replica and n else None


def rank_for_new_session(loads: Sequence[float], serving: Sequence[bool]) -> list[int]:
    """Indices of the serving replicas, least loaded first (ties: lower index first). When none is
    serving, all of them, least loaded first: the replica then refuses with a clear error rather
    than the request waiting for ever."""
    eligible = list(serving) if any(serving) else [True] * len(loads)
    order: list[int] = []
    taken = [not e for e in eligible]
    while True:
        i = least_loaded(list(loads), [not t for t in taken])
        if i is None:
            return order
        order.append(i)
        taken[i] = True


def route(session_id: str, replica_ids: Sequence[str], loads: Sequence[float], serving: Sequence[bool]) -> list[list[int]]:
    """Ranks of candidate indices for one request, most preferred first (a RequestRouter's answer).

    A call of an open session: only its owner. If the owner is no longer a replica of the
    deployment (it died or was scaled down), any replica: it answers NOT_FOUND for the unknown
    session, which fails the request cleanly instead of leaving it queued.
    """
    owner = owner_of(session_id)
    if owner is not None:
        if owner in replica_ids:
            return [[replica_ids.index(owner)]]
        return [list(range(len(replica_ids)))] if replica_ids else []
    return [[i] for i in rank_for_new_session(loads, serving)]
