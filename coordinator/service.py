"""The coordinator's request handling, shared by its gRPC and HTTP front ends.

A front end turns its request into a `PromptInput` and `SamplingParams`, calls `start`, iterates
the returned `RequestHandle` for token chunks, and reads the outcome from it; both front ends
therefore run the same engine loop over the same replica pools.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from coordinator.compat import DraftCompat, speculation_state
from coordinator.admission import Admission
from coordinator.depth import DepthPolicy, LoadMonitor
from coordinator.engine import Generation, SpeculativeEngine
from coordinator.remote import CallTimes, RemoteProposer, RemoteVerifier, ReplicaPool, StepTelemetry, fetch_draft_model_info
from specd.errors import InvalidArgument
from specd.models import encode_chat
from specd.sampling import SamplingParams
from specd.telemetry import Telemetry, extract_from, noop_telemetry
from specd.text import TextStream, visible_text
from specd.validation import RequestLimits, check_text

log = logging.getLogger(__name__)

MAX_K = 32
CHAT_ROLES = ("system", "user", "assistant")


@dataclass
class PromptInput:
    """Exactly one of the three is set."""

    text: str | None = None
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None


def _error_type(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):  # a grpc.RpcError from a downstream call: its status code names it best
        try:
            return code().name
        except Exception:
            pass
    return type(exc).__name__


class RequestTelemetry:
    """One request's span and GenAI metrics on the coordinator; exists only when telemetry is on.

    The span ("<gen_ai.operation.name> <model>", kind SERVER) starts when the request arrives and
    ends when it finishes, fails or is abandoned; its context is the parent of the per-step spans
    (`StepTelemetry`). TTFT, TPOT and token usage are recorded for successful requests (as the
    GenAI conventions ask), the request duration and the request counter for all, with
    `error.type` on failures ("cancelled" for a client that went away).
    """

    def __init__(self, tel: Telemetry, model: str, operation: str, method: str, carrier: Any = None):
        self.tel = tel
        self.model = model
        self.operation = operation
        self.start = time.perf_counter()
        self.start_ns = time.time_ns()
        self.first_token_at: float | None = None
        self.parent_ctx = extract_from(carrier) if tel.tracing_on and carrier is not None else None
        self.attrs: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                                      "specd.method": method}
        self.span: trace.Span | None = None
        self.steps: StepTelemetry | None = None
        self.begun = False
        self.done = False

    def _start_span(self, attributes: dict[str, Any]) -> None:
        self.span = self.tel.tracer.start_span(f"{self.operation} {self.model}", context=self.parent_ctx,
                                               kind=SpanKind.SERVER, attributes=attributes, start_time=self.start_ns)

    def begin(self, method: str, k: int, params: SamplingParams, prompt_tokens: int, request_id: str,
              draft_model: str | None) -> StepTelemetry:
        """The request is valid: open its span and count it waiting; returns its step telemetry."""
        self.attrs["specd.method"] = method
        self.begun = True
        step_attrs = {"gen_ai.request.model": self.model, "specd.method": method}
        if draft_model:
            step_attrs["specd.draft.model"] = draft_model
        if self.tel.tracing_on:
            attributes: dict[str, Any] = {
                "gen_ai.operation.name": self.operation, "gen_ai.request.model": self.model,
                "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p, "gen_ai.request.top_k": params.top_k,
                "specd.request_id": request_id, "specd.method": method, "specd.k": k,
                "specd.prompt_tokens": prompt_tokens,
            }
            if params.seed is not None:
                attributes["gen_ai.request.seed"] = params.seed
            if params.stop:
                attributes["gen_ai.request.stop_sequences"] = list(params.stop)
            if draft_model:
                attributes["specd.draft.model"] = draft_model
            self._start_span(attributes)
        parent = trace.set_span_in_context(self.span) if self.span is not None else None
        self.steps = StepTelemetry(self.tel, parent, step_attrs)
        if self.tel.metrics_on:
            self.tel.coordinator.requests_waiting.add(1, self.attrs)
        return self.steps

    def first_token(self) -> None:
        self.first_token_at = time.perf_counter()
        if self.tel.metrics_on and self.begun:
            m = self.tel.coordinator
            m.requests_waiting.add(-1, self.attrs)
            m.requests_running.add(1, self.attrs)

    def finish(self, gen: Generation | None, error: BaseException | None = None) -> None:
        """Idempotent: the first call (normal end, failure, close or abandonment) records."""
        if self.done:
            return
        self.done = True
        end = time.perf_counter()
        reason = gen.finish_reason if gen is not None else None
        error_type = _error_type(error) if error is not None else (None if reason else "cancelled")
        if self.tel.metrics_on:
            self._record_metrics(gen, reason, error_type, end)
        if self.tel.tracing_on:
            if self.span is None:  # refused before it began (bad input)
                self._start_span({"gen_ai.operation.name": self.operation, "gen_ai.request.model": self.model})
            span = self.span
            assert span is not None
            if gen is not None:
                s = gen.stats
                span.set_attributes({
                    "gen_ai.usage.input_tokens": len(gen.prompt_ids), "gen_ai.usage.output_tokens": len(gen.token_ids),
                    "specd.num_drafts": s.num_drafts, "specd.num_draft_tokens": s.num_draft_tokens,
                    "specd.num_accepted_tokens": s.num_accepted_tokens,
                    "specd.target_forward_passes": s.target_forward_passes,
                })
            if reason:
                span.set_attribute("gen_ai.response.finish_reasons", [reason])
            if self.first_token_at is not None:
                span.set_attribute("specd.time_to_first_token_s", self.first_token_at - self.start)
            if error_type is not None:
                span.set_attribute("error.type", error_type)
                if error is not None:
                    span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, error_type))
            span.end()

    def _record_metrics(self, gen: Generation | None, reason: str | None, error_type: str | None, end: float) -> None:
        m = self.tel.coordinator
        if self.begun:
            (m.requests_running if self.first_token_at is not None else m.requests_waiting).add(-1, self.attrs)
        attrs = self.attrs if error_type is None else {**self.attrs, "error.type": error_type}
        m.request_duration.record(end - self.start, attrs)
        m.requests.add(1, {**attrs, "specd.finish_reason": reason or ("cancelled" if error_type == "cancelled" else "error")})
        if gen is not None and self.steps is not None:
            self._record_speculation(gen, self.steps)
        if error_type is not None or gen is None:
            return
        m.token_usage.record(len(gen.prompt_ids), {**attrs, "gen_ai.token.type": "input"})
        m.token_usage.record(len(gen.token_ids), {**attrs, "gen_ai.token.type": "output"})
        if self.first_token_at is not None:
            m.time_to_first_token.record(self.first_token_at - self.start, attrs)
            if len(gen.token_ids) > 1:
                m.time_per_output_token.record((end - self.first_token_at) / (len(gen.token_ids) - 1), attrs)

    def _record_speculation(self, gen: Generation, steps: StepTelemetry) -> None:
        """Counts the request as speculating or not (and why not): the "speculation off" alert's series."""
        s = gen.stats
        state, why = speculation_state(self.attrs["specd.method"], steps.off_reason, s.num_drafts, s.target_forward_passes)
        attrs = {**steps.attrs, "specd.speculation": state}
        if why:
            attrs["specd.speculation.reason"] = why
        self.tel.coordinator.speculation_requests.add(1, attrs)


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
    telemetry: RequestTelemetry | None = None
    depth: str = ""  # the depth policy the request ran under ("auto", "4", "schedule:...")

    def __iter__(self) -> Iterator[tuple[list[int], str]]:
        tel = self.telemetry
        if tel is None:
            for chunk in self.generation:
                yield chunk, self.text_stream.push(chunk)
        else:
            error: BaseException | None = None
            try:
                for chunk in self.generation:
                    if tel.first_token_at is None:
                        tel.first_token()
                    yield chunk, self.text_stream.push(chunk)
            except GeneratorExit:  # the front end stopped iterating: recorded as cancelled unless finished
                raise
            except BaseException as exc:
                error = exc
                raise
            finally:
                tel.finish(self.generation, error)
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
            if self.telemetry is not None:
                self.telemetry.finish(self.generation)


def parse_depth(spec: str, k_max: int, field: str = "speculation.depth") -> tuple[str, int | None]:
    """(spec, fixed k or None): a plain integer is a fixed k (0..MAX_K); anything else must be a
    controller spec ("auto", "schedule:...", "...,floor=A"). Raises InvalidArgument naming `field`."""
    spec = spec.strip()
    try:
        fixed = int(spec)
    except ValueError:
        fixed = None
    if fixed is not None:
        if not 0 <= fixed <= MAX_K:
            raise InvalidArgument(field, f"k must be in 0..{MAX_K}, got {fixed}")
        return spec, fixed
    try:
        DepthPolicy(spec, k_max)
    except ValueError as exc:
        raise InvalidArgument(field, str(exc)) from None
    return spec, None


class GenerationService:
    def __init__(self, targets: ReplicaPool, drafts: ReplicaPool | None, tokenizer: Any, model_name: str,
                 eos_token_ids: frozenset[int], method: str = "ngram", k: int | str = "auto", telemetry: Telemetry | None = None,
                 vocab_hash: str = "", k_max: int = 8, pipeline: bool = False, monitor: LoadMonitor | None = None,
                 draft_budget_ms: float = 1000.0, step_timeout_s: float = 30.0):
        """draft_budget_ms: the longest wait for one draft block before the step goes on without
        it; step_timeout_s: the longest wait for one prefill or verify before the session fails
        over to another target replica (0: no limit for either; coordinator/failover.py)."""
        self.targets = targets
        self.drafts = drafts
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_ids = eos_token_ids
        self.method = method if drafts is not None else "none"
        self.k = str(k)  # the default depth spec: "auto", "4", "schedule:...", ...
        self.k_max = k_max
        self.pipeline = pipeline
        self.draft_budget_s = draft_budget_ms / 1000 if draft_budget_ms > 0 else None
        self.step_timeout_s = step_timeout_s if step_timeout_s > 0 else None
        self.depth = DepthPolicy(self.k, k_max, monitor.costs if monitor is not None else None, monitor)  # raises ValueError on a bad spec
        self.active = 0
        self.draining = False
        self.telemetry = telemetry or noop_telemetry()
        # The served model's limits and the admission control, set by the server from the target's
        # ModelInfo and the config; the defaults check nothing and admit everything.
        self.limits = RequestLimits()
        self.admission = Admission(max_running=1 << 30, max_queue=0)
        self._draft_model: str | None = None
        self.compat = DraftCompat(model_name, vocab_hash, self.telemetry)  # the target's identity, sent on draft opens
        self._lock = threading.Lock()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, prompt: PromptInput) -> list[int]:
        if prompt.text is not None:
            if not prompt.text:
                raise InvalidArgument("prompt", "the prompt is empty")
            check_text("prompt", prompt.text)
            ids = list(self.tokenizer(prompt.text)["input_ids"])
        elif prompt.messages is not None:
            if not prompt.messages:
                raise InvalidArgument("messages", "no messages")
            bad = [m.get("role") for m in prompt.messages if m.get("role") not in CHAT_ROLES]
            if bad:
                raise InvalidArgument("messages.role", f"unknown role {bad[0]!r}; use system, user or assistant")
            for i, m in enumerate(prompt.messages):
                check_text(f"messages[{i}].content", m.get("content") or "")
            ids = encode_chat(self.tokenizer, prompt.messages)
        elif prompt.token_ids is not None:
            ids = list(prompt.token_ids)
        else:
            raise InvalidArgument("prompt", "send a prompt, messages or prompt token ids")
        if not ids:
            raise InvalidArgument("prompt", "the prompt is empty")
        return ids

    def resolve_speculation(self, method: str | None, k: int | None, depth: str = "") -> tuple[str, int, str | None]:
        """(method, k, depth spec): k is the fixed depth, or the deepest block a controller may
        choose; the spec is None for a plain fixed k (no controller needed)."""
        method = method or self.method
        if k is not None and not 0 <= k <= MAX_K:
            raise InvalidArgument("speculation.k", f"must be in 0..{MAX_K}, got {k}")
        if method != "none" and self.drafts is None:
            raise InvalidArgument("speculation.method", "this coordinator has no draft pool; use method none")
        field = "speculation.depth"
        if not depth:
            depth, field = (str(k), "speculation.k") if k is not None else (self.k, "k")
        spec, fixed = parse_depth(depth, self.k_max, field)
        if method == "none" or fixed == 0:
            return "none", 0, None
        return method, (fixed if fixed is not None else self.k_max), (None if fixed is not None else spec)

    def draft_model_name(self) -> str | None:
        """The draft replicas' model (for method draft_model's metric attributes), asked once."""
        if self._draft_model is None and self.drafts is not None:
            try:
                name = fetch_draft_model_info(self.drafts).name
            except Exception:  # not critical: ask again on the next draft_model request
                log.debug("could not fetch the draft model's name", exc_info=True)
                return None
            self._draft_model = "" if name == "model-free" else name
        return self._draft_model or None

    def start(self, prompt: PromptInput, params: SamplingParams, method: str | None = None, k: int | None = None,
              request_id: str = "", timeout: float | None = None, trace_carrier: Any = None, depth: str = "",
              pipeline: bool | None = None) -> RequestHandle:
        """Validates and starts a request. `trace_carrier` (gRPC metadata or HTTP headers) may
        carry the client's W3C trace context, which the request span then continues."""
        obs: RequestTelemetry | None = None
        if self.telemetry.enabled:
            operation = "chat" if prompt.messages is not None else "text_completion"
            obs = RequestTelemetry(self.telemetry, self.model_name, operation, method or self.method, trace_carrier)
        try:
            params.validate()
            ids = self.encode(prompt)
            self.limits.check(ids, params, request_id, from_ids=prompt.token_ids is not None)
            method, k, spec = self.resolve_speculation(method, k, depth)
            request_id = request_id or uuid.uuid4().hex
            steps = None
            if obs is not None:
                draft_model = self.draft_model_name() if method == "draft_model" else None
                steps = obs.begin(method, k, params, len(ids), request_id, draft_model)
            times = CallTimes()
            verifier = self.open_verifier(request_id, timeout, times, steps)
            proposer = self.open_proposer(method, request_id, timeout, times, steps) if method != "none" else None
            policy = self.depth.with_spec(spec) if spec is not None else None
            engine = SpeculativeEngine(verifier, proposer, k=k, eos_token_ids=self.eos_token_ids, decode=self.decode,
                                       depth=policy, pipeline=self.pipeline if pipeline is None else pipeline,
                                       on_fault=steps.record_fault if steps is not None else None,
                                       cost_models=self.depth if policy is None else None)
            if self.depth.monitor is not None:
                self.depth.monitor.requests.record()
            generation = engine.generate(ids, params)
        except BaseException as exc:
            if obs is not None:
                obs.finish(None, exc)
            raise
        return RequestHandle(generation, params, method, k, request_id, times, TextStream(self.decode, params.stop),
                             telemetry=obs, depth=spec if spec is not None else str(k))

    def open_verifier(self, request_id: str, timeout: float | None, times: CallTimes,
                      steps: StepTelemetry | None) -> Any:
        """One request's target side (the engine's verifier): the gRPC target pool. Another
        transport overrides this and `open_proposer` (Ray Serve: coordinator/ray_app.py)."""
        return RemoteVerifier(self.targets, request_id, timeout, times, steps, step_timeout=self.step_timeout_s)

    def open_proposer(self, method: str, request_id: str, timeout: float | None, times: CallTimes,
                      steps: StepTelemetry | None) -> Any:
        """One request's draft side (the engine's proposer) for `method`: the gRPC draft pool."""
        return RemoteProposer(self.drafts, method, request_id, timeout, times, steps, self.compat,  # type: ignore[arg-type]
                              budget=self.draft_budget_s)

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
