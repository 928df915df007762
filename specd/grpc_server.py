"""The gRPC plumbing every specd service shares: server lifecycle, error mapping, client channels.

A service supplies a function that adds its servicers and the names of its services;
`build_server` adds health checking and reflection, binds and starts, and returns a handle whose
`drain` takes the server down gracefully (health NOT_SERVING, drain hooks, in-flight RPCs finish
within the grace period). Servicer methods wrap themselves in `grpc_errors`, the one place that
turns specd exceptions into status codes.
"""

from __future__ import annotations

import functools
import inspect
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd import errors
from specd.input_guard import InputGuardInterceptor
from specd.tls import ClientTLS, ServerTLS, server_tls

log = logging.getLogger(__name__)

# The default limit on one message, both ways. Internal messages can be large (a block's dense
# draft probabilities: k x vocabulary float32 values); services set their own with
# `max_message_mb`, and a message over the limit is refused with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def message_limits(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """The gRPC options that cap a message's size at `max_bytes`, sent and received."""
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


_MESSAGE_LIMITS: list[tuple[str, Any]] = message_limits()

SERVER_OPTIONS: list[tuple[str, Any]] = _MESSAGE_LIMITS + [
    # Ping idle clients now and then so connections to vanished peers are closed.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Accept client pings as often as CHANNEL_OPTIONS sends them (the default would answer
    # them with GOAWAY "too_many_pings").
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    # A second server on a taken port must fail to bind, not share the port silently.
    ("grpc.so_reuseport", 0),
]

CHANNEL_OPTIONS: list[tuple[str, Any]] = _MESSAGE_LIMITS + [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Each channel its own connections. gRPC otherwise shares subchannels, process-wide, among
    # channels with the same address and options: a new channel to a replica restarted at an
    # address where an old channel is still backing off (up to a replica pool's 5 s) failed
    # with UNAVAILABLE until that backoff ran out, and its pool marked the replica unhealthy.
    ("grpc.use_local_subchannel_pool", 1),
]

HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_SERVICE_NAME: str = reflection.SERVICE_NAME


class ServerConfig(Protocol):
    """The fields of a specd.config service config that the server uses."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def max_workers(self) -> int: ...
    @property
    def grace_seconds(self) -> float: ...


# --- errors ----------------------------------------------------------------------------------

# specd (and builtin) exceptions -> status codes. Order matters: the first match wins.
_STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (grpc.FutureTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status code and client-safe message for an expected exception; None for a bug."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        details = exc.details() if callable(getattr(exc, "details", None)) else ""
        return exc.code(), f"upstream: {details or exc.code().name}"
    for exc_type, code in _STATUS_OF:
        if isinstance(exc, exc_type):
            return code, str(exc) or type(exc).__name__
    return None


def _is_grpc_own(exc: BaseException, context: grpc.ServicerContext) -> bool:
    """True for exceptions the gRPC runtime raises to end the RPC itself: `context.abort()` raises a
    bare Exception after setting the code, and a cancelled call raises a bare RpcError (no
    code()) from the request iterator. Both must propagate untouched."""
    if isinstance(exc, grpc.RpcError) and not callable(getattr(exc, "code", None)):
        return True
    if type(exc) is Exception:
        code = getattr(context, "code", None)
        return callable(code) and code() is not None
    return False


def _abort_for(exc: Exception, context: grpc.ServicerContext, method: str) -> None:
    """Aborts the RPC with the status `exc` maps to (always raises)."""
    mapped = status_for(exc)
    if mapped is None:
        log.exception("unexpected error in %s", method)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method} ({type(exc).__name__}); see the server log")
    code, message = mapped
    log.debug("%s failed with %s: %s", method, code.name, message)
    retry_ms = getattr(exc, "retry_after_ms", None)
    if retry_ms is not None:  # a machine-readable retry hint beside the message's
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(int(retry_ms))),))
    context.abort(code, message)


F = TypeVar("F", bound=Callable[..., Any])

# Trailing metadata key of RESOURCE_EXHAUSTED refusals: milliseconds to wait before retrying.
RETRY_AFTER_KEY = "retry-after-ms"


def grpc_errors(method: F) -> F:
    """Maps exceptions raised by a servicer method to gRPC status codes (see `_STATUS_OF`).

    Works for plain methods (unary responses) and generator methods (streaming responses), for
    both request kinds. Unexpected exceptions become INTERNAL with the traceback logged, not sent.
    A grpc.RpcError from a downstream call keeps its code, with details prefixed "upstream: ".
    """
    name = method.__qualname__

    def context_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> grpc.ServicerContext:
        return kwargs["context"] if "context" in kwargs else args[-1]

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(*args: Any, **kwargs: Any) -> Iterable[Any]:
            try:
                yield from method(*args, **kwargs)
            except Exception as exc:
                context = context_of(args, kwargs)
                if _is_grpc_own(exc, context):
                    raise
                _abort_for(exc, context, name)

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    def unary_wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            context = context_of(args, kwargs)
            if _is_grpc_own(exc, context):
                raise
            _abort_for(exc, context, name)

    return unary_wrapper  # type: ignore[return-value]


# --- server ----------------------------------------------------------------------------------


class ServerHandle:
    """A started server, with its health servicer, and its graceful shutdown."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 grace_seconds: float) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer
        self.grace_seconds = grace_seconds
        self._drain_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._draining = False
        self._stopped = threading.Event()
        self._signal_received = False

    def add_drain_hook(self, fn: Callable[[], None]) -> None:
        """Registers `fn` to run when draining starts, before the server stops taking RPCs: e.g.
        the target refusing new sessions. Hooks must not block for long."""
        self._drain_hooks.append(fn)

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, grace: float | None = None) -> None:
        """Stops gracefully: every health status NOT_SERVING, the drain hooks, then no new RPCs and
        `grace` seconds (default: the config's) for in-flight ones, after which they are cancelled.
        Blocks until the server has stopped; later and concurrent calls just wait for that."""
        with self._lock:
            first = not self._draining
            self._draining = True
        if not first:
            self._stopped.wait()
            return
        grace = self.grace_seconds if grace is None else grace
        log.info("draining: grace period %.1fs", grace)
        self.health.enter_graceful_shutdown()
        for hook in self._drain_hooks:
            try:
                hook()
            except Exception:
                log.exception("drain hook %r failed", hook)
        try:
            self.server.stop(grace).wait()
            log.info("server stopped")
        finally:
            self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the server has terminated and a started drain has finished (True), or
        `timeout` passed (False). Stays responsive to signals when called from the main thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.server.wait_for_termination(timeout):  # grpc returns True on timeout
            return False
        while self._draining and not self._stopped.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._stopped.wait(0.1)
        return True

    def install_signal_handlers(self) -> None:
        """Makes the first SIGTERM or SIGINT start `drain(grace_seconds)` in a thread; later ones are
        logged and ignored. Must be called from the main thread (a Python rule for signals)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_signal_handlers must be called from the main thread")

        def on_signal(signum: int, _frame: Any) -> None:
            # Runs between bytecodes of the main thread: only start the drain, never block here.
            if self._signal_received:
                log.warning("%s received while draining; still waiting for in-flight RPCs",
                            signal.Signals(signum).name)
                return
            self._signal_received = True
            log.info("%s received: draining", signal.Signals(signum).name)
            threading.Thread(target=self.drain, args=(self.grace_seconds,), name="specd-drain").start()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)


def server_tls_of(config: Any) -> ServerTLS | None:
    """The TLS settings of a service config (`tls_cert`, `tls_key`, `tls_ca`,
    `require_client_cert`; absent fields mean plaintext)."""
    return server_tls(getattr(config, "tls_cert", None), getattr(config, "tls_key", None),
                      getattr(config, "tls_ca", None), bool(getattr(config, "require_client_cert", False)))


def max_message_bytes_of(config: Any) -> int:
    mb = getattr(config, "max_message_mb", None)
    return int(mb * 1024 * 1024) if mb else MAX_MESSAGE_BYTES


def build_server(config: ServerConfig, register: Callable[[grpc.Server], None],
                 service_names: Sequence[str], *, interceptors: Sequence[grpc.ServerInterceptor] = (),
                 tls: ServerTLS | None | bool = True, max_workers: int | None = None) -> ServerHandle:
    """Creates, binds and starts a server with `register`'s servicers, health and reflection.

    Health reports SERVING for "" and each of `service_names`. Port 0 binds a free port, which the
    handle's `port` tells. Raises RuntimeError when the address cannot be bound.

    TLS, mutual TLS and the message size limit come from the config's `tls_*`,
    `require_client_cert` and `max_message_mb` fields when it has them; `tls` overrides the
    config's TLS (None: plaintext). `interceptors` run first, then the input guard, which turns
    requests that do not parse into INVALID_ARGUMENT. `max_workers` overrides the config's.
    """
    credentials = server_tls_of(config) if tls is True else (tls or None)
    options = list({**dict(SERVER_OPTIONS), **dict(message_limits(max_message_bytes_of(config)))}.items())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers or config.max_workers,
                                                    thread_name_prefix="specd-grpc"),
                         options=options, interceptors=[*interceptors, InputGuardInterceptor()])
    register(server)

    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    reflection.enable_server_reflection((*service_names, HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME), server)

    address = f"{config.host}:{config.port}"
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials.credentials())
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:  # older grpcio reports a failed bind this way
        raise RuntimeError(f"cannot listen on {address}")
    server.start()
    security = "plaintext" if credentials is None else ("mutual TLS" if credentials.require_client_cert else "TLS")
    log.info("serving %s on %s:%d (%s)", ", ".join(service_names), config.host, port, security)
    return ServerHandle(server, port, health_servicer, config.grace_seconds)


# --- clients ---------------------------------------------------------------------------------


# The process's default for channels made without an explicit `tls`: the coordinator sets it
# once at start from its upstream_* settings, so every channel to a target or draft replica
# (whoever opens it) uses TLS when the deployment does.
_default_client_tls: ClientTLS | None = None


def set_default_client_tls(tls: ClientTLS | None) -> None:
    """Makes `make_channel` use `tls` (None: plaintext) when not told otherwise."""
    global _default_client_tls
    _default_client_tls = tls


def default_client_tls() -> ClientTLS | None:
    return _default_client_tls


# Pass as `tls` to force a plaintext channel whatever the process default.
PLAINTEXT = object()


def make_channel(address: str, options: Sequence[tuple[str, Any]] = (), tls: ClientTLS | None | object = None) -> grpc.Channel:
    """A channel with the servers' message size limits and keepalive; `options` add to or override
    CHANNEL_OPTIONS. `tls`: a ClientTLS for TLS, `PLAINTEXT` to force plaintext, None for the
    process default (`set_default_client_tls`; plaintext unless set)."""
    if tls is None:
        tls = _default_client_tls
    merged = dict(CHANNEL_OPTIONS)
    if isinstance(tls, ClientTLS):
        merged.update(tls.channel_options())
        merged.update(options)
        return grpc.secure_channel(address, tls.credentials(), options=list(merged.items()))
    merged.update(options)
    return grpc.insecure_channel(address, options=list(merged.items()))



def wait_healthy(address: str, timeout: float, service: str = "", tls: ClientTLS | None | object = None) -> None:
    """Polls the health service at `address` until `service` reports SERVING (`tls` as in
    `make_channel`).

    Raises TimeoutError naming the address and the last status or error seen.
    """
    deadline = time.monotonic() + timeout
    last = "no answer"
    request = health_pb2.HealthCheckRequest(service=service)
    with make_channel(address, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                response = stub.Check(request, timeout=min(remaining, 1.0))
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    label = f"service {service!r}" if service else "the server"
    raise TimeoutError(f"{address}: {label} did not report SERVING within {timeout:g}s (last: {last})")
