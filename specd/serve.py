"""`specd serve target|draft|coordinator` and `specd up`: the three services as processes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

from specd.config import CoordinatorConfig, DraftConfig, ServiceConfig, TargetConfig, format_config
from specd.grpc_server import ServerHandle, build_server, wait_healthy

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
    return 0


def start_target(cfg: TargetConfig) -> ServerHandle:
    from specd.models import load_model
    from target_service.server import SERVICE_NAME, TargetServicer, register

    model = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    servicer = TargetServicer(model, cfg.max_sessions, cfg.max_batch_size, cfg.batch_wait_ms, cfg.session_ttl_s)
    handle = build_server(cfg, register(servicer), [SERVICE_NAME])
    handle.add_drain_hook(servicer.drain)
    handle.servicer = servicer  # type: ignore[attr-defined]
    return handle


def start_draft(cfg: DraftConfig) -> ServerHandle:
    from draft_service.server import SERVICE_NAME, DraftServicer, register
    from specd.models import load_model

    draft = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype) if cfg.model else None
    servicer = DraftServicer(cfg.method, draft)
    handle = build_server(cfg, register(servicer), [SERVICE_NAME])
    handle.servicer = servicer  # type: ignore[attr-defined]
    return handle


def start_coordinator(cfg: CoordinatorConfig) -> ServerHandle:
    from coordinator.remote import ReplicaPool, fetch_model_info
    from coordinator.server import SERVICE_NAME, CoordinatorServicer, register
    from coordinator.service import GenerationService
    from specd.models import load_tokenizer

    targets = ReplicaPool(cfg.target)
    drafts = ReplicaPool(cfg.draft) if cfg.draft and cfg.method != "none" else None
    info = fetch_model_info(targets)
    service = GenerationService(targets, drafts, load_tokenizer(cfg.tokenizer_model), info.name,
                                frozenset(info.eos_token_ids), cfg.method, cfg.k)
    handle = build_server(cfg, register(CoordinatorServicer(service)), [SERVICE_NAME])
    handle.servicer = service  # type: ignore[attr-defined]
    if cfg.http_port is not None:
        from coordinator.http_api import HttpServer

        http = HttpServer(service, cfg.host, cfg.http_port, grace_seconds=cfg.grace_seconds)
        http.start()
        handle.add_drain_hook(http.drain)
        handle.http = http  # type: ignore[attr-defined]
        print(f"specd coordinator HTTP (OpenAI-compatible) on http://{cfg.host}:{http.port}/v1", file=sys.stderr, flush=True)
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


def up(port: int = 50050, target_port: int = 50052, draft_port: int = 50051, method: str = "ngram", k: int = 8,
       target_model: str | None = None, http_port: int | None = 8000, timeout: float = 300.0) -> int:
    """Start target, draft and coordinator as separate processes on loopback; stop them on Ctrl-C/SIGTERM."""
    from specd.models import resolve_model_path

    resolve_model_path(target_model)  # convert the bundled GGUF once here, not in two processes at once
    exe = [sys.executable, "-m", "specd.cli", "serve"]
    model_flags = ["--model", target_model] if target_model else []
    specs = [
        ("target", exe + ["target", "--port", str(target_port)] + model_flags, target_port),
        ("draft", exe + ["draft", "--port", str(draft_port), "--method", method if method != "none" else "ngram"], draft_port),
        ("coordinator", exe + ["coordinator", "--port", str(port), "--target", f"127.0.0.1:{target_port}",
                               "--draft", f"127.0.0.1:{draft_port}", "--method", method, "--k", str(k)]
         + (["--tokenizer-model", target_model] if target_model else [])
         + (["--http-port", str(http_port)] if http_port else []), port),
    ]
    busy = [p for _, _, p in specs if not _port_free(p)] + ([http_port] if http_port and not _port_free(http_port) else [])
    if busy:
        print(f"specd up: port(s) {', '.join(map(str, busy))} already in use; stop what holds them or pass "
              f"--port/--target-port/--draft-port", file=sys.stderr)
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
