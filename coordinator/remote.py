"""The gRPC transport: draft and target sessions on remote replicas, behind the engine's interfaces.

Each session is one bidirectional stream, driven in lockstep: send one request, read its one
reply. The stream pins the session to the replica that holds its state, and closing or cancelling
it frees that state on the replica.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import grpc

from draft_service.proposers.base import Proposal
from specd.grpc_server import make_channel
from specd.sampling import SamplingParams
from specd.wire import METHOD_TO_PROTO, probs_from_proto, probs_to_proto, sampling_to_proto
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.rejection_sampler import VerifyOutcome


def _drain_queue(q: "queue.SimpleQueue[Any]") -> Iterator[Any]:
    while True:
        item = q.get()
        if item is None:
            return
        yield item


class LockstepStream:
    """A bidi stream used as a sequence of request/reply pairs."""

    def __init__(self, method: Callable[..., Iterator[Any]], timeout: float | None, metadata: Sequence[tuple[str, str]] = ()):
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._replies = method(_drain_queue(self._requests), timeout=timeout, metadata=tuple(metadata))
        self.closed = False

    def call(self, request: Any) -> Any:
        self._requests.put(request)
        return next(self._replies)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._requests.put(None)
            self._replies.cancel()  # type: ignore[attr-defined]


@dataclass
class Replica:
    """One replica of a pool, with the sessions this coordinator has open on it."""

    address: str
    channel: grpc.Channel
    open_sessions: int = 0

    @classmethod
    def connect(cls, address: str) -> "Replica":
        return cls(address, make_channel(address))


@dataclass
class CallTimes:
    """Wall time of the calls a request made, and what the services said they spent."""

    draft_wall_ms: float = 0.0
    draft_ms: float = 0.0
    verify_wall_ms: float = 0.0
    verify_ms: float = 0.0

    @property
    def rpc_overhead_ms(self) -> float:
        return (self.draft_wall_ms - self.draft_ms) + (self.verify_wall_ms - self.verify_ms)


class ReplicaPool:
    """Replicas of one service; new sessions go to the one with the fewest open sessions."""

    def __init__(self, addresses: Sequence[str]):
        if not addresses:
            raise ValueError("a replica pool needs at least one address")
        self.replicas = [Replica.connect(a) for a in addresses]
        self._lock = threading.Lock()
        self._rr = itertools.count()

    def acquire(self) -> Replica:
        with self._lock:
            start = next(self._rr) % len(self.replicas)  # rotate among equally loaded replicas
            ordered = self.replicas[start:] + self.replicas[:start]
            replica = min(ordered, key=lambda r: r.open_sessions)
            replica.open_sessions += 1
            return replica

    def release(self, replica: Replica) -> None:
        with self._lock:
            replica.open_sessions -= 1

    def close(self) -> None:
        for r in self.replicas:
            r.channel.close()


class RemoteTargetSession:
    def __init__(self, pool: ReplicaPool, prompt_ids: Sequence[int], params: SamplingParams, request_id: str,
                 timeout: float | None, times: CallTimes):
        self.pool = pool
        self.replica = pool.acquire()
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.request_id = request_id
        self.times = times
        self._room = 0
        stub = target_pb2_grpc.TargetServiceStub(self.replica.channel)
        self.stream = LockstepStream(stub.Session, timeout)

    @property
    def room(self) -> int:
        return self._room

    def prefill(self) -> int:
        reply = self.stream.call(target_pb2.TargetRequest(open=target_pb2.OpenTargetSession(
            prompt_token_ids=self.prompt_ids, params=sampling_to_proto(self.params), request_id=self.request_id)))
        self._room = reply.opened.context_room
        return reply.opened.first_token_id

    def verify(self, proposal: Proposal) -> VerifyOutcome:
        block = target_pb2.VerifyBlock(draft_token_ids=proposal.tokens)
        probs = probs_to_proto(proposal.probs)
        if probs is not None:
            block.draft_probs.CopyFrom(probs)
        start = time.perf_counter()
        reply = self.stream.call(target_pb2.TargetRequest(verify=block)).verified
        self.times.verify_wall_ms += (time.perf_counter() - start) * 1000
        self.times.verify_ms += reply.verify_ms
        self._room = reply.context_room
        return VerifyOutcome(num_accepted=reply.num_accepted, tokens=list(reply.token_ids))

    def close(self) -> None:
        if not self.stream.closed:
            self.stream.close()
            self.pool.release(self.replica)


class RemoteVerifier:
    """The target pool as the engine's verifier."""

    def __init__(self, pool: ReplicaPool, request_id: str = "", timeout: float | None = None, times: CallTimes | None = None):
        self.pool = pool
        self.request_id = request_id
        self.timeout = timeout
        self.times = times or CallTimes()

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> RemoteTargetSession:
        return RemoteTargetSession(self.pool, prompt_ids, params, self.request_id, self.timeout, self.times)


class RemoteDraftSession:
    """Feedback is buffered and travels with the next propose request: one round trip a step."""

    def __init__(self, pool: ReplicaPool, method: str, prompt_ids: Sequence[int], params: SamplingParams,
                 request_id: str, timeout: float | None, times: CallTimes):
        self.pool = pool
        self.replica = pool.acquire()
        self.times = times
        self._appended: list[int] = []
        stub = draft_pb2_grpc.DraftServiceStub(self.replica.channel)
        self.stream = LockstepStream(stub.Session, timeout)
        try:
            self.stream.call(draft_pb2.DraftRequest(open=draft_pb2.OpenDraftSession(
                prompt_token_ids=list(prompt_ids), params=sampling_to_proto(params),
                method=METHOD_TO_PROTO[method], request_id=request_id)))
        except BaseException:
            self.close()
            raise

    def propose(self, k: int) -> Proposal:
        start = time.perf_counter()
        block = self.stream.call(draft_pb2.DraftRequest(step=draft_pb2.DraftStep(appended_token_ids=self._appended, k=k)))
        self.times.draft_wall_ms += (time.perf_counter() - start) * 1000
        self.times.draft_ms += block.draft_ms
        self._appended = []
        tokens = list(block.token_ids)
        probs = probs_from_proto(block.probs, len(tokens), block.probs.vocab_size) if tokens else None
        return Proposal(tokens, probs)

    def append(self, tokens: Sequence[int]) -> None:
        self._appended.extend(tokens)

    def close(self) -> None:
        if not self.stream.closed:
            self.stream.close()
            self.pool.release(self.replica)


class RemoteProposer:
    """The draft pool as the engine's proposer, for one method."""

    def __init__(self, pool: ReplicaPool, method: str, request_id: str = "", timeout: float | None = None,
                 times: CallTimes | None = None):
        self.pool = pool
        self.name = method
        self.request_id = request_id
        self.timeout = timeout
        self.times = times or CallTimes()

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> RemoteDraftSession:
        return RemoteDraftSession(self.pool, self.name, prompt_ids, params, self.request_id, self.timeout, self.times)


def fetch_model_info(pool: ReplicaPool, timeout: float = 30.0) -> common_pb2.ModelInfo:
    stub = target_pb2_grpc.TargetServiceStub(pool.replicas[0].channel)
    return stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout, wait_for_ready=True)
