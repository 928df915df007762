"""The Ray Serve application: target, draft and coordinator deployments.

    serve run deploy/ray/serve_config.yaml          # or: serve run specd.ray_serve.app:build_app

The coordinator is the gRPC ingress (Serve's gRPC proxy with the generated
`add_CoordinatorServicer_to_server`); it runs the same servicer, GenerationService and engine as
`specd serve coordinator`, with the Ray transport (specd.ray_serve.sessions) in place of gRPC
streams. Target and draft replicas hold session state, so both route with
SessionAffinityRouter; the target reports its open sessions and queue depth for autoscaling
(`record_autoscaling_stats`, used by specd.ray_serve.autoscaling:session_load_policy).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import grpc
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from coordinator.remote import CallTimes, StepTelemetry
from coordinator.server import CoordinatorServicer
from coordinator.service import GenerationService
from draft_service.proposers import make_proposer
from draft_service.proposers.base import DraftSession, Proposal
from specd.errors import InvalidArgument, NotFound, ResourceExhausted
from specd.ray_serve.affinity import make_session_id
from specd.ray_serve.sessions import RayProposer, RayVerifier, call
from specd.sampling import SamplingParams
from specdec.v1 import coordinator_pb2

log = logging.getLogger(__name__)

ROUTER = RequestRouterConfig(request_router_class="specd.ray_serve.router:SessionAffinityRouter",
                             request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0)
MAX_DRAFT_K = 64


def _replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


class SessionTable:
    """Sessions of one replica by id, with last-use times, so abandoned ones can be expired."""

    def __init__(self, ttl_s: float, close: Callable[[Any], None]):
        self.replica = _replica_id()
        self.ttl_s = ttl_s
        self._close = close
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._items: dict[str, tuple[Any, float]] = {}
        if ttl_s > 0:
            threading.Thread(target=self._expire, daemon=True, name="specd-ray-session-ttl").start()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Any) -> str:
        session_id = make_session_id(self.replica, next(self._ids))
        with self._lock:
            self._items[session_id] = (item, time.monotonic())
        return session_id

    def get(self, session_id: str) -> Any:
        with self._lock:
            entry = self._items.get(session_id)
            if entry is None:
                raise NotFound(f"no session {session_id} on replica {self.replica} (closed, expired, or its "
                               f"replica was stopped)")
            self._items[session_id] = (entry[0], time.monotonic())
        return entry[0]

    def pop(self, session_id: str) -> None:
        with self._lock:
            entry = self._items.pop(session_id, None)
        if entry is not None:
            self._close(entry[0])

    def _expire(self) -> None:
        while True:
            time.sleep(min(1.0, self.ttl_s / 4))
            now = time.monotonic()
            stale = [sid for sid, (_, last) in list(self._items.items()) if now - last > self.ttl_s]
            for sid in stale:
                log.warning("session %s idle for over %.0f s: closing it", sid, self.ttl_s)
                self.pop(sid)


@serve.deployment(name="target", max_ongoing_requests=256, request_router_config=ROUTER,
                  ray_actor_options={"num_cpus": 1})
class TargetDeployment:
    """Verifier sessions on a slot KV pool, verify calls of different sessions batched into one
    forward pass by the same scheduler as the gRPC target service."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str | None = None,
                 max_sessions: int = 64, max_batch_size: int = 16, batch_wait_ms: float = 2.0,
                 session_ttl_s: float = 600.0, straggler_wait_ms: float = 40.0, linear_kernel: str = "onednn"):
        from specd.cpu_kernels import use_linear_kernel
        from specd.models import load_model
        from specd.openmp import serial_until_model_thread
        from specd.vocab import vocab_hash
        from target_service.scheduler import VerifyScheduler
        from target_service.verifier import TargetModel

        # as in `specd serve target`: the scheduler's thread owns the process's only OpenMP team
        torch_threads = serial_until_model_thread(device)
        self.model = load_model(model, device=device, dtype=dtype)
        use_linear_kernel(self.model.model, linear_kernel)
        self.target = TargetModel(self.model)
        self.scheduler = VerifyScheduler(self.target, max_batch_size, batch_wait_ms,
                                         straggler_wait_ms=straggler_wait_ms, torch_threads=torch_threads)
        self.max_sessions = max_sessions
        self.sessions = SessionTable(session_ttl_s, lambda s: s.close())
        self._admission = threading.Lock()
        # Verify calls block until their batch has run: one thread each, so they can batch.
        self._executor = ThreadPoolExecutor(max_workers=max_sessions + 4, thread_name_prefix="specd-target")
        self._info = {"name": self.model.name, "vocab_size": self.model.vocab_size,
                      "max_context": self.model.max_context, "eos_token_ids": sorted(self.model.eos_token_ids),
                      "vocab_hash": vocab_hash(self.model.tokenizer, self.model.vocab_size)}

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def info(self) -> dict[str, Any]:
        return self._info

    def _open(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> dict[str, Any]:
        params.validate()
        with self._admission:
            if len(self.target.sessions) >= self.max_sessions:
                raise ResourceExhausted(f"this target replica holds its limit of {self.max_sessions} sessions")
            session = self.target.open_session(prompt_ids, params)
        try:
            token, timing = self.scheduler.prefill(session)
        except BaseException:
            session.close()
            raise
        session_id = self.sessions.add(session)
        return {"session_id": session_id, "first_token": token, "room": max(session.room, 0),
                "prefill_ms": timing.compute_ms, "queue_ms": timing.queue_ms}

    async def open(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "") -> dict[str, Any]:
        """Opens a session on this replica and prefills it; the session id names this replica."""
        return await self._run(self._open, list(prompt_ids), params, request_id)

    def _verify(self, session_id: str, tokens: list[int], probs: Any) -> dict[str, Any]:
        session = self.sessions.get(session_id)
        outcome, timing = self.scheduler.verify(session, Proposal(tokens, probs))
        return {"num_accepted": outcome.num_accepted, "tokens": list(outcome.tokens), "room": max(session.room, 0),
                "verify_ms": timing.compute_ms, "queue_ms": timing.queue_ms, "batch_size": timing.batch_size,
                "pass_block_length": timing.block_length, "pass_positions": timing.positions, "packed": timing.packed,
                "pass_id": timing.pass_id}

    async def verify(self, session_id: str, tokens: list[int], probs: Any = None) -> dict[str, Any]:
        return await self._run(self._verify, session_id, list(tokens), probs)

    async def close(self, session_id: str) -> None:
        await self._run(self.sessions.pop, session_id)

    def stats(self) -> dict[str, Any]:
        return {"replica": self.sessions.replica, "open_sessions": len(self.target.sessions),
                "queue_depth": self.scheduler.queue_depth, "forward_passes": self.target.forward_passes}

    def record_routing_stats(self) -> dict[str, float]:
        """For SessionAffinityRouter: new sessions go to the replica with the fewest."""
        return {"open_sessions": len(self.target.sessions), "serving": 1, "reported_at": time.time()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For session_load_policy: the load that holds KV rows and the work waiting for the model."""
        return {"open_sessions": float(len(self.target.sessions)), "queue_depth": float(self.scheduler.queue_depth)}


@serve.deployment(name="draft", max_ongoing_requests=256, request_router_config=ROUTER,
                  ray_actor_options={"num_cpus": 0.5})
class DraftDeployment:
    """The proposers (n-gram and suffix always, a draft model when `model` is given)."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str | None = None,
                 session_ttl_s: float = 600.0, linear_kernel: str = "onednn"):
        self.proposers = {m: make_proposer(m) for m in ("ngram", "suffix")}
        if model:
            from specd.cpu_kernels import use_linear_kernel
            from specd.models import load_model

            draft = load_model(model, device=device, dtype=dtype)
            use_linear_kernel(draft.model, linear_kernel)
            self.proposers["draft_model"] = make_proposer("draft_model", draft)
        self.sessions = SessionTable(session_ttl_s, lambda s: s.close())

    def open(self, prompt_ids: list[int], params: SamplingParams, method: str) -> str:
        if method not in self.proposers:
            raise InvalidArgument("speculation.method", f"the draft deployment serves {', '.join(sorted(self.proposers))}")
        if not prompt_ids:
            raise InvalidArgument("prompt_token_ids", "the prompt is empty")
        return self.sessions.add(self.proposers[method].open_session(list(prompt_ids), params))  # type: ignore[union-attr]

    def step(self, session_id: str, appended: list[int], k: int) -> tuple[list[int], Any, float]:
        if not 0 <= k <= MAX_DRAFT_K:
            raise InvalidArgument("k", f"at most {MAX_DRAFT_K} draft tokens per step, got {k}")
        session: DraftSession = self.sessions.get(session_id)
        start = time.perf_counter()
        if appended:
            session.append(list(appended))
        proposal = session.propose(k) if k else Proposal()
        return list(proposal.tokens), proposal.probs, (time.perf_counter() - start) * 1000

    def close(self, session_id: str) -> None:
        self.sessions.pop(session_id)

    def record_routing_stats(self) -> dict[str, float]:
        return {"open_sessions": len(self.sessions), "serving": 1, "reported_at": time.time()}


class RayGenerationService(GenerationService):
    """GenerationService with the Ray transport: `targets` and `drafts` are deployment handles."""

    def open_verifier(self, request_id: str, timeout: float | None, times: CallTimes,
                      steps: StepTelemetry | None) -> RayVerifier:
        return RayVerifier(self.targets, request_id, timeout, times)

    def open_proposer(self, method: str, request_id: str, timeout: float | None, times: CallTimes,
                      steps: StepTelemetry | None) -> RayProposer:
        return RayProposer(self.drafts, method, timeout, times)


class ServeContext:
    """The parts of grpc.ServicerContext that CoordinatorServicer uses, over Ray Serve's
    RayServegRPCContext: a status set here reaches the client through Serve's gRPC proxy."""

    def __init__(self, grpc_context: Any):
        self._ctx = grpc_context
        self._code: grpc.StatusCode | None = None
        self.cancelled = False

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self._ctx.invocation_metadata()) if self._ctx is not None else []

    def time_remaining(self) -> float | None:
        return None  # Serve's proxy applies grpc_options.request_timeout_s itself

    def is_active(self) -> bool:
        return not self.cancelled

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        """Sets the status and raises a bare Exception, as grpc's own abort does (grpc_errors
        lets that through untouched)."""
        self._code = code
        if self._ctx is not None:
            self._ctx.set_code(code)
            self._ctx.set_details(details)
        raise Exception(details)


_DONE = object()


@serve.deployment(name="coordinator", max_ongoing_requests=128, ray_actor_options={"num_cpus": 0.5})
class CoordinatorDeployment:
    """The gRPC ingress: specdec.v1.Coordinator's Generate and GenerateUnary."""

    def __init__(self, target: DeploymentHandle, draft: DeploymentHandle | None, method: str = "ngram", k: int = 8,
                 tokenizer_model: str | None = None, step_timeout_s: float = 30.0, max_concurrency: int = 64):
        self.target = target
        self.draft = draft
        self.method = method
        self.k = k
        self.tokenizer_model = tokenizer_model
        self.step_timeout_s = step_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="specd-coordinator")
        self._servicer: CoordinatorServicer | None = None
        self._lock = threading.Lock()

    def _get_servicer(self) -> CoordinatorServicer:
        """Built on first use: it asks a target replica for the model (not in __init__, which
        must not wait on another deployment)."""
        with self._lock:
            if self._servicer is None:
                from specd.models import load_tokenizer

                info = call(self.target.info, 120.0)
                service = RayGenerationService(self.target, self.draft, load_tokenizer(self.tokenizer_model), info["name"],
                                               frozenset(info["eos_token_ids"]), method=self.method, k=self.k,
                                               vocab_hash=info["vocab_hash"])
                self._servicer = CoordinatorServicer(service)
            return self._servicer

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def Generate(self, request: coordinator_pb2.GenerateRequest,
                       grpc_context: Any = None) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        ctx = ServeContext(grpc_context)
        servicer = await self._in_thread(self._get_servicer)
        stream = servicer.Generate(request, ctx)
        try:
            while True:
                item = await self._in_thread(next, stream, _DONE)
                if item is _DONE:
                    return
                yield item
        finally:
            ctx.cancelled = True  # the client went away, or we are done: the servicer closes its sessions
            await self._in_thread(stream.close)

    async def GenerateUnary(self, request: coordinator_pb2.GenerateRequest,
                            grpc_context: Any = None) -> coordinator_pb2.GenerateResult:
        ctx = ServeContext(grpc_context)
        servicer = await self._in_thread(self._get_servicer)
        return await self._in_thread(servicer.GenerateUnary, request, ctx)


def build_app(args: dict[str, Any]) -> Any:
    """The application, for `serve run` and the config file's `import_path`.

    args: target_model, draft_model, device ("cpu", "cuda"), dtype, method, k, max_sessions,
    max_batch_size, batch_wait_ms, straggler_wait_ms, session_ttl_s. With a GPU in the cluster and no
    `ray_actor_options` in the config file, target and draft each ask for one.
    """
    import ray

    device = args.get("device", "cpu")
    target = TargetDeployment
    draft = DraftDeployment
    if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1:
        device = args.get("device", "cuda")
        target = target.options(ray_actor_options={"num_cpus": 1, "num_gpus": 1})
        if args.get("draft_model"):
            draft = draft.options(ray_actor_options={"num_cpus": 1, "num_gpus": 1})
    ttl = float(args.get("session_ttl_s", 600.0))
    target_app = target.bind(args.get("target_model"), device, args.get("dtype"), int(args.get("max_sessions", 64)),
                             int(args.get("max_batch_size", 16)), float(args.get("batch_wait_ms", 2.0)), ttl,
                             float(args.get("straggler_wait_ms", 40.0)))
    method = args.get("method", "ngram")
    draft_app = draft.bind(args.get("draft_model"), device, args.get("dtype"), ttl) if method != "none" else None
    return CoordinatorDeployment.bind(target_app, draft_app, method, int(args.get("k", 8)), args.get("target_model"),
                                      float(args.get("step_timeout_s", 30.0)))
