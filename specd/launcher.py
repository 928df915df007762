"""Start specd's services as real OS processes on loopback (end-to-end tests, the stack bench)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specd.grpc_server import wait_healthy
from specd.tls import ClientTLS

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    port: int
    proc: subprocess.Popen
    log: Path
    metrics_port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        """The Prometheus endpoint, when the service was started with one."""
        return None if self.metrics_port is None else f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def wait_healthy(self, timeout: float = 180.0, tls: ClientTLS | None = None) -> "Service":
        """Waits until the service reports SERVING; kills it and raises with its log's tail if it
        does not within `timeout` seconds or exits."""
        try:
            wait_healthy(self.address, timeout, tls=tls)
        except TimeoutError:
            self.proc.kill()
            raise RuntimeError(f"{self.name} did not become healthy; its log:\n{self.log.read_text()[-3000:]}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited during start-up; its log:\n{self.log.read_text()[-3000:]}")
        return self

    def peak_rss_mb(self) -> float:
        """VmHWM of the process (its peak resident memory), while it runs."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0


def launch_service(service: str, args: list[str], log_dir: Path, metrics_port: int | None = None,
                   port: int | None = None) -> Service:
    """Starts `specd serve SERVICE` and returns at once; `Service.wait_healthy` waits for it.
    `metrics_port`: serve Prometheus metrics there (0: a free port; None: no endpoint). `port`:
    the gRPC port (default: a free one; give a stopped service's port to restart it where clients
    look)."""
    if metrics_port == 0:
        metrics_port = free_port()
    if metrics_port is not None:
        args = [*args, "--metrics-port", str(metrics_port)]
    port = port or free_port()
    log = log_dir / f"{service}-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specd.cli", "serve", service, "--port", str(port), *args],
                            cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return Service(service, port, proc, log, metrics_port)


def start_service(service: str, args: list[str], log_dir: Path, timeout: float = 180.0,
                  metrics_port: int | None = None, tls: ClientTLS | None = None, port: int | None = None) -> Service:
    """`launch_service`, then waits until it is healthy (`tls`: how to reach its health check
    when it serves TLS)."""
    return launch_service(service, args, log_dir, metrics_port, port).wait_healthy(timeout, tls)


@dataclass
class Stack:
    target: Service
    draft: Service
    coordinator: Service
    http_port: int | None = None
    extra: list[Service] = field(default_factory=list)

    def stop(self) -> None:
        for s in [*self.extra, self.coordinator, self.draft, self.target]:
            s.stop()


def start_stack(log_dir: Path, draft_model: str | None = None, method: str = "ngram", k: int | str = 4,
                target_args: list[str] | None = None, http_port: int | None = None,
                metrics_ports: Mapping[str, int] | None = None, coordinator_args: list[str] | None = None) -> Stack:
    """`metrics_ports`: service name ("target", "draft", "coordinator") -> Prometheus port
    (0: a free one); services left out serve no metrics."""
    mp = metrics_ports or {}
    # Started together: most of a service's start-up is importing torch and loading models, and
    # the coordinator waits for a target replica itself (`fetch_model_info`, 30 s); launched as
    # soon as the draft is up, it imports while the target loads. On the 2-core CI machine a stack
    # came up in 38 s one by one, 20 s so. A target slower than that wait (a large model, a first
    # GGUF conversion) leaves a coordinator that gave up: it is launched again once the target is up.
    def launch_coordinator() -> Service:
        return launch_service("coordinator", ["--target", target.address, "--draft", draft.address,
                                              "--method", method, "--k", str(k)]
                              + (["--http-port", str(http_port)] if http_port is not None else [])
                              + list(coordinator_args or []), log_dir, metrics_port=mp.get("coordinator"))

    target = launch_service("target", target_args or [], log_dir, metrics_port=mp.get("target"))
    draft = launch_service("draft", ["--method", method] + (["--model", draft_model] if draft_model else []), log_dir,
                           metrics_port=mp.get("draft"))
    started = [target, draft]
    try:
        draft.wait_healthy()
        started.append(launch_coordinator())
        target.wait_healthy()
        if started[-1].proc.poll() is not None:
            started[-1] = launch_coordinator()
        coordinator = started[-1].wait_healthy()
    except BaseException:
        for s in reversed(started):
            s.stop()
        raise
    return Stack(target, draft, coordinator, http_port)
