"""`specd serve target|draft|coordinator` and `specd up`: the three services as processes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable

from specd.config import CoordinatorConfig, DraftConfig, ServiceConfig, TargetConfig, format_config
from specd.grpc_server import ServerHandle, build_server, wait_healthy
from specd.telemetry import Telemetry, setup_telemetry

if TYPE_CHECKING:  # torch loads with the model, not with this module
    from torch import nn

log = logging.getLogger(__name__)


def _setup_logging(cfg: ServiceConfig) -> None:
    logging.getLogger().setLevel(cfg.log_level)
    print(format_config(cfg), file=sys.stderr, flush=True)


def _run(handle: ServerHandle, service: str) -> int:
    handle.install_signal_handlers()
    print(f"specd {service} serving on {handle.port}", file=sys.stderr, flush=True)
    handle.wait()
    http = getattr(handle, "http", None)
    if http is not None:  # HTTP requests in flight get the same grace period as gRPC ones
        http.thread.join(timeout=handle.grace_seconds + 5)
    telemetry = getattr(handle, "telemetry", None)
    if telemetry is not None:  # flush the spans and metrics still batched for OTLP
        telemetry.shutdown()
    return 0


def _telemetry(service: str, cfg: ServiceConfig, model: str | None, telemetry: Telemetry | None) -> Telemetry:
    """The service's Telemetry: the one passed in (tests), else from the config and OTEL_* env."""
    if telemetry is None:
        telemetry = setup_telemetry(service, cfg.metrics_port, model, metrics_host=cfg.host)
    if telemetry.metrics_port is not None:
        print(f"specd {service} metrics (Prometheus) on http://{cfg.host}:{telemetry.metrics_port}/metrics",
              file=sys.stderr, flush=True)
    return telemetry


def _attach(handle: ServerHandle, telemetry: Telemetry) -> None:
    handle.telemetry = telemetry  # type: ignore[attr-defined]


def _use_linear_kernel(service: str, model: "nn.Module", kernel: str) -> None:
    """The kernel of a CPU model's linear layers (specd/cpu_kernels.py), said in the service's log."""
    from specd.cpu_kernels import use_linear_kernel

    swapped = use_linear_kernel(model, kernel)
    print(f"specd {service} linear layers: " + (f"oneDNN ({swapped} layers)" if swapped else "torch default"),
          file=sys.stderr, flush=True)


def start_target(cfg: TargetConfig, telemetry: Telemetry | None = None) -> ServerHandle:
    """`telemetry`: tests pass their own; by default it comes from cfg.metrics_port and OTEL_* env."""
    from specd.models import load_model
    from specd.openmp import serial_until_model_thread
    from target_service.server import SERVICE_NAME, TargetServicer, register

    # Passes run on the scheduler's thread; on a CPU it must own the process's only OpenMP team.
    torch_threads = serial_until_model_thread(cfg.device)
    model = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    _use_linear_kernel("target", model.model, cfg.linear_kernel)
    telemetry = _telemetry("target", cfg, model.name, telemetry)
    servicer = TargetServicer(model, cfg.max_sessions, cfg.max_batch_size, cfg.batch_wait_ms, cfg.session_ttl_s,
                              telemetry=telemetry, kv_budget_mb=cfg.kv_budget_mb,
                              straggler_wait_ms=cfg.straggler_wait_ms, packed_passes=cfg.packed_passes,
                              torch_threads=torch_threads)
    print(f"specd target session limit: {servicer.session_limit.describe()}", file=sys.stderr, flush=True)
    handle = build_server(cfg, register(servicer), [SERVICE_NAME])
    handle.add_drain_hook(servicer.drain)
    handle.servicer = servicer  # type: ignore[attr-defined]
    _attach(handle, telemetry)
    return handle


def start_draft(cfg: DraftConfig, telemetry: Telemetry | None = None) -> ServerHandle:
    from draft_service.server import SERVICE_NAME, DraftServicer, register
    from specd.models import load_model

    draft = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype) if cfg.model else None
    if draft is not None:
        _use_linear_kernel("draft", draft.model, cfg.linear_kernel)
    telemetry = _telemetry("draft", cfg, draft.name if draft is not None else None, telemetry)
    # With a draft model, GetModelInfo names it (a metric attribute) and carries its vocab_hash,
    # which the coordinator and every draft_model session open are checked against.
    head, max_context = _load_head(cfg)
    servicer = DraftServicer(cfg.method, draft, telemetry=telemetry, head=head, max_context=max_context)
    handle = build_server(cfg, register(servicer), [SERVICE_NAME])
    handle.servicer = servicer  # type: ignore[attr-defined]
    _attach(handle, telemetry)
    return handle


def _load_head(cfg: DraftConfig):
    """The draft head (and its target's context) when method head is served: --head, or the head
    shipped for the bundled target. The target's weights are loaded for its embedding and LM
    head; the rest is dropped."""
    if cfg.method != "head" and not cfg.head:
        return None, 0
    from draft_service.head.checkpoint import default_head_dir, load_head_for
    from specd.models import load_model

    path = cfg.head or default_head_dir(cfg.target_model)
    target = load_model(cfg.target_model, device="cpu")
    head = load_head_for(target, path)
    _use_linear_kernel("draft head", head.modules(), cfg.linear_kernel)
    print(f"specd draft head: {path} (draft vocabulary {head.draft_vocab.numel()}, trained for "
          f"{head.meta.get('target_model')})", file=sys.stderr, flush=True)
    return head, target.max_context


def start_coordinator(cfg: CoordinatorConfig, telemetry: Telemetry | None = None) -> ServerHandle:
    from specd.security import coordinator_security

    security = coordinator_security(cfg)  # first: the replica channels opened below use its TLS
    from coordinator.remote import fetch_model_info
    from coordinator.replicas import PoolOptions, ReplicaPool
    from coordinator.server import SERVICE_NAME, CoordinatorServicer, register
    from coordinator.depth import CostModels, LoadMonitor
    from coordinator.service import GenerationService
    from specd.models import load_tokenizer
    from specdec.v1.target_pb2_grpc import TargetServiceStub

    pool_options = PoolOptions(health_interval_s=cfg.health_check_interval_s, refresh_s=cfg.dns_refresh_s)
    targets = ReplicaPool(cfg.target, pool_options, name="target")
    drafts = ReplicaPool(cfg.draft, pool_options, name="draft") if cfg.draft and cfg.method != "none" else None
    info = fetch_model_info(targets)
    telemetry = _telemetry("coordinator", cfg, info.name, telemetry)
    costs = CostModels()
    monitor = LoadMonitor(lambda: [(r.address, TargetServiceStub(r.channel)) for r in targets.replicas], costs).start()
    service = GenerationService(targets, drafts, load_tokenizer(cfg.tokenizer_model), info.name,
                                frozenset(info.eos_token_ids), cfg.method, cfg.k, telemetry=telemetry,
                                vocab_hash=info.vocab_hash, k_max=cfg.k_max, pipeline=cfg.pipeline,
                                monitor=monitor, draft_budget_ms=cfg.draft_budget_ms, step_timeout_s=cfg.step_timeout_s)
    if drafts is not None:  # logs (and counts) draft replicas whose draft model has another vocabulary
        from coordinator.compat import check_draft_pool

        check_draft_pool(service.compat, drafts)
    from coordinator.admission import Admission
    from specd.auth import BearerTokenInterceptor
    from specd.validation import RequestLimits

    service.limits = RequestLimits(vocab_size=info.vocab_size, max_context=info.max_context)
    service.admission = Admission(cfg.max_running, cfg.max_queue, cfg.queue_timeout_s)
    # Every admitted or queued request holds a handler thread, plus some for health and reflection.
    workers = max(cfg.max_workers, cfg.max_running + cfg.max_queue + 16)
    handle = build_server(cfg, register(CoordinatorServicer(service)), [SERVICE_NAME], max_workers=workers,
                          interceptors=[BearerTokenInterceptor(security.token)] if security.token else [])
    print(f"specd coordinator security: {security.describe()}; admission: {cfg.max_running} running, "
          f"{cfg.max_queue} queued", file=sys.stderr, flush=True)
    handle.servicer = service  # type: ignore[attr-defined]
    _attach(handle, telemetry)
    if cfg.http_port is not None:
        from coordinator.http_api import HttpServer

        http = HttpServer(service, cfg.host, cfg.http_port, grace_seconds=cfg.grace_seconds, token=security.token,
                          tls=security.server, max_body_bytes=cfg.max_message_mb * 1024 * 1024)
        http.start()
        handle.add_drain_hook(http.drain)
        handle.http = http  # type: ignore[attr-defined]
        scheme = "https" if security.server is not None else "http"
        print(f"specd coordinator HTTP (OpenAI-compatible) on {scheme}://{cfg.host}:{http.port}/v1", file=sys.stderr, flush=True)
    return handle


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


STARTERS: dict[str, Callable[..., ServerHandle]] = {
    "target": start_target,
    "draft": start_draft,
    "coordinator": start_coordinator,
}


def serve(service: str, cfg: ServiceConfig) -> int:
    _setup_logging(cfg)
    return _run(STARTERS[service](cfg), service)


METRICS_OFFSETS = {"coordinator": 0, "draft": 1, "target": 2}


def up(port: int = 50050, target_port: int = 50052, draft_port: int = 50051, method: str = "ngram", k: int | str = "auto",
       target_model: str | None = None, http_port: int | None = 8000, timeout: float = 300.0,
       metrics_base_port: int | None = 9460) -> int:
    """Start target, draft and coordinator as separate processes on loopback; stop them on Ctrl-C/SIGTERM.

    With `metrics_base_port` (None or 0: off) each serves Prometheus metrics: the coordinator on
    the base port, the draft on base + 1, the target on base + 2."""
    from specd.models import resolve_model_path

    resolve_model_path(target_model)  # convert the bundled GGUF once here, not in two processes at once
    exe = [sys.executable, "-m", "specd.cli", "serve"]
    model_flags = ["--model", target_model] if target_model else []
    specs = [
        ("target", exe + ["target", "--port", str(target_port)] + model_flags, target_port),
        ("draft", exe + ["draft", "--port", str(draft_port), "--method", method if method != "none" else "ngram"]
         + (["--target-model", target_model] if target_model else []), draft_port),
        ("coordinator", exe + ["coordinator", "--port", str(port), "--target", f"127.0.0.1:{target_port}",
                               "--draft", f"127.0.0.1:{draft_port}", "--method", method, "--k", str(k)]
         + (["--tokenizer-model", target_model] if target_model else [])
         + (["--http-port", str(http_port)] if http_port else []), port),
    ]
    metrics_ports = {name: metrics_base_port + off for name, off in METRICS_OFFSETS.items()} if metrics_base_port else {}
    for name, cmd, _ in specs:
        if name in metrics_ports:
            cmd += ["--metrics-port", str(metrics_ports[name])]
    busy = [p for _, _, p in specs if not _port_free(p)] + ([http_port] if http_port and not _port_free(http_port) else [])
    busy += [p for p in metrics_ports.values() if not _port_free(p)]
    if busy:
        print(f"specd up: port(s) {', '.join(map(str, busy))} already in use; stop what holds them or pass "
              f"--port/--target-port/--draft-port/--http-port/--metrics-base-port", file=sys.stderr)
        return 2
    procs: list[tuple[str, subprocess.Popen]] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for name, cmd, p in specs:
            procs.append((name, subprocess.Popen(cmd, env=os.environ.copy())))
            wait_healthy(f"127.0.0.1:{p}", timeout)
            if procs[-1][1].poll() is not None:
                raise RuntimeError(f"{name} exited with status {procs[-1][1].returncode} during start-up")
            print(f"specd up: {name} healthy on 127.0.0.1:{p}", file=sys.stderr, flush=True)
        print(f"specd up: coordinator at 127.0.0.1:{port}  (try: specd generate --address 127.0.0.1:{port} \"Hello\")", flush=True)
        if http_port:
            print(f"specd up: OpenAI-compatible HTTP API at http://127.0.0.1:{http_port}/v1", flush=True)
        for name, mport in metrics_ports.items():
            print(f"specd up: {name} metrics at http://127.0.0.1:{mport}/metrics", flush=True)
        while not stopping:
            for name, proc in procs:
                if proc.poll() is not None:
                    print(f"specd up: {name} exited with {proc.returncode}; stopping the others", file=sys.stderr)
                    stopping = True
            time.sleep(0.2)
    finally:
        for _, proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0
