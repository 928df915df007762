"""specd.grpc_server against tiny servicers of the real services: health, reflection, error
mapping, draining, and SIGTERM in a subprocess. Loopback only, port 0, no models."""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specd.config import TargetConfig
from specd.grpc_server import (
    HEALTH_SERVICE_NAME,
    REFLECTION_SERVICE_NAME,
    ServerHandle,
    build_server,
    make_channel,
    wait_healthy,
)
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, target_pb2, target_pb2_grpc
from tests.integration.grpc_servicers import (
    COORDINATOR_SERVICE,
    MODEL_INFO,
    SECRET,
    TARGET_SERVICE,
    EchoTarget,
    ProxyCoordinator,
)

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CONFIG = TargetConfig(host="127.0.0.1", port=0, max_workers=8, grace_seconds=5.0)


def start(target: EchoTarget, coordinator: ProxyCoordinator | None = None) -> ServerHandle:
    def register(server: grpc.Server) -> None:
        target_pb2_grpc.add_TargetServiceServicer_to_server(target, server)
        if coordinator is not None:
            coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)

    names = [TARGET_SERVICE] + ([COORDINATOR_SERVICE] if coordinator is not None else [])
    handle = build_server(CONFIG, register, names)
    if coordinator is not None:
        coordinator.target_address = f"127.0.0.1:{handle.port}"
    return handle


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = start(EchoTarget(), ProxyCoordinator())
    yield handle
    handle.drain(0)


@pytest.fixture(scope="module")
def channel(server: ServerHandle) -> Iterator[grpc.Channel]:
    with make_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def model_info(channel: grpc.Channel, mode: str, **kwargs) -> common_pb2.ModelInfo:
    return target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
        common_pb2.GetModelInfoRequest(), metadata=(("mode", mode),), timeout=10, **kwargs)


def open_request(ids: list[int], request_id: str = "") -> target_pb2.TargetRequest:
    return target_pb2.TargetRequest(open=target_pb2.OpenTargetSession(prompt_token_ids=ids, request_id=request_id))


def verify_request(ids: list[int]) -> target_pb2.TargetRequest:
    return target_pb2.TargetRequest(verify=target_pb2.VerifyBlock(draft_token_ids=ids))


# --- health and reflection -------------------------------------------------------------------


def test_health_serving_overall_and_per_service(server, channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", TARGET_SERVICE, COORDINATOR_SERVICE):
        assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="specdec.v1.Nope"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    wait_healthy(f"127.0.0.1:{server.port}", timeout=5, service=TARGET_SERVICE)


def test_wait_healthy_times_out_naming_the_address():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=address):
        wait_healthy(address, timeout=0.5)
    assert time.monotonic() - started < 3


def test_reflection_lists_the_services(channel):
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {TARGET_SERVICE, COORDINATOR_SERVICE, HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME} <= services


def test_binding_a_taken_port_fails(server):
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{server.port}"):
        build_server(TargetConfig(port=server.port, max_workers=1), lambda s: None, [TARGET_SERVICE])


def test_message_size_limit_is_64_mib(channel):
    big = target_pb2.TargetRequest(verify=target_pb2.VerifyBlock(
        draft_token_ids=[9], draft_probs=common_pb2.DraftProbs(vocab_size=1, dense=bytes(8 << 20))))
    responses = session(channel, [open_request([1]), big])  # 8 MiB: over grpc's 4 MiB default
    assert list(responses[1].verified.token_ids) == [9, 0]


# --- error mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode, code, text", [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "params.top_k: must not be negative"),
    ("too_long", grpc.StatusCode.INVALID_ARGUMENT, "prompt: the prompt has 100 tokens"),
    ("failed_precondition", grpc.StatusCode.FAILED_PRECONDITION, "the session is not open"),
    ("resource_exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED, "all 64 sessions"),
    ("unavailable", grpc.StatusCode.UNAVAILABLE, "draining"),
    ("not_found", grpc.StatusCode.NOT_FOUND, "no session s9"),
    ("timeout", grpc.StatusCode.DEADLINE_EXCEEDED, "the forward pass took too long"),
    ("abort", grpc.StatusCode.PERMISSION_DENIED, "no entry"),  # the servicer's own abort passes through
])
def test_unary_errors_map_to_status_codes(channel, mode, code, text):
    with pytest.raises(grpc.RpcError) as err:
        model_info(channel, mode)
    assert err.value.code() == code
    assert text in err.value.details()


def test_unary_success(channel):
    assert model_info(channel, "ok") == MODEL_INFO


def test_unexpected_error_is_internal_without_traceback(channel, caplog):
    with caplog.at_level(logging.ERROR, logger="specd.grpc_server"):
        with pytest.raises(grpc.RpcError) as err:
            model_info(channel, "boom")
    details = err.value.details()
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "GetModelInfo" in details and "RuntimeError" in details
    assert SECRET not in details and "Traceback" not in details
    assert any(r.exc_info and SECRET in str(r.exc_info[1]) for r in caplog.records)  # logged, not sent


def session(channel: grpc.Channel, requests: list[target_pb2.TargetRequest]) -> list[target_pb2.TargetResponse]:
    return list(target_pb2_grpc.TargetServiceStub(channel).Session(iter(requests), timeout=10))


def test_stream_stream_success(channel):
    responses = session(channel, [open_request([5, 6]), verify_request([7, 8]), verify_request([])])
    assert responses[0].opened.first_token_id == 6
    assert list(responses[1].verified.token_ids) == [7, 8, 0] and responses[1].verified.num_accepted == 2
    assert list(responses[2].verified.token_ids) == [0]


@pytest.mark.parametrize("requests, code, text", [
    ([verify_request([1])], grpc.StatusCode.INVALID_ARGUMENT, "open: the first message"),
    ([open_request([])], grpc.StatusCode.INVALID_ARGUMENT, "open.prompt_token_ids: must not be empty"),
    ([open_request([1]), open_request([1])], grpc.StatusCode.FAILED_PRECONDITION, "already open"),
])
def test_stream_stream_errors(channel, requests, code, text):
    with pytest.raises(grpc.RpcError) as err:
        session(channel, requests)
    assert err.value.code() == code and text in err.value.details()


def test_stream_stream_unexpected_error_is_internal(channel):
    with pytest.raises(grpc.RpcError) as err:
        session(channel, [open_request([1], request_id="boom")])
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert SECRET not in err.value.details() and "Traceback" not in err.value.details()


def test_unary_stream_error_after_a_chunk(channel):
    stream = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
        coordinator_pb2.GenerateRequest(prompt="bad"), timeout=10)
    first = next(stream)
    assert list(first.chunk.token_ids) == [1]
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.max_tokens" in err.value.details()


def test_downstream_errors_keep_their_code_with_upstream_prefix(channel):
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    assert stub.GenerateUnary(coordinator_pb2.GenerateRequest(prompt="ok"), timeout=10).text == "echo"
    with pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(coordinator_pb2.GenerateRequest(prompt="invalid"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("upstream: ") and "params.top_k" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(coordinator_pb2.GenerateRequest(prompt="resource_exhausted"), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_client_cancel_is_not_logged_as_an_error(caplog):
    """A cancelled call raises a bare RpcError from the request iterator; it must not become an
    "unexpected error" log (nor a status: there is no client left to send one to)."""
    target = EchoTarget()
    handle = start(target)
    requests: queue.Queue = queue.Queue()
    requests.put(open_request([1]))
    with make_channel(f"127.0.0.1:{handle.port}") as own:
        stream = target_pb2_grpc.TargetServiceStub(own).Session(iter(requests.get, None), timeout=10)
        with caplog.at_level(logging.ERROR):
            next(stream)
            time.sleep(0.1)  # the handler is now blocked reading the next request
            stream.cancel()
            assert target.session_ended.wait(5)
            time.sleep(0.1)  # the wrapper logs right after the handler's finally
        requests.put(None)
    handle.drain(0)
    assert not [r for r in caplog.records if r.name.startswith(("specd", "grpc"))]


# --- draining --------------------------------------------------------------------------------


def test_drain_lets_in_flight_rpcs_finish(caplog):
    target = EchoTarget()
    handle = start(target)
    hook_calls: list[float] = []
    handle.add_drain_hook(lambda: hook_calls.append(time.monotonic()))
    address = f"127.0.0.1:{handle.port}"
    with make_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == SERVING
        slow = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo.future(
            common_pb2.GetModelInfoRequest(), metadata=(("mode", "slow"),), timeout=10)
        assert target.entered.wait(5)

        started = time.monotonic()
        drainer = threading.Thread(target=handle.drain, args=(5.0,))
        drainer.start()
        assert next(watch).status == NOT_SERVING  # watchers hear about it before the stop
        watch.cancel()
        assert slow.result(timeout=5) == MODEL_INFO  # the in-flight RPC completed during the drain
        drainer.join(timeout=5)
        assert not drainer.is_alive()
        assert time.monotonic() - started < 4  # done when the RPC finished, not at the grace's end

        assert len(hook_calls) == 1
        for name in ("", TARGET_SERVICE):
            assert handle.health.Check(health_pb2.HealthCheckRequest(service=name), None).status == NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            model_info(channel, "ok", wait_for_ready=False)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert handle.wait(timeout=1)
    handle.drain(1.0)  # a second drain is a no-op
    assert len(hook_calls) == 1


def test_sigterm_drains_and_exits_zero():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.grpc_servicers"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read_stdout() -> None:
        for line in proc.stdout:
            lines.put(line.strip())
        lines.put(None)  # EOF

    threading.Thread(target=read_stdout, daemon=True).start()
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    try:
        first = lines.get(timeout=30)
        assert first.startswith("PORT "), first
        address = f"127.0.0.1:{int(first.split()[1])}"
        wait_healthy(address, timeout=10)

        requests: queue.Queue = queue.Queue()
        with make_channel(address) as channel:
            stream = target_pb2_grpc.TargetServiceStub(channel).Session(iter(requests.get, None), timeout=20)
            requests.put(open_request([1, 2, 3], request_id="slow"))
            assert next(stream).opened.first_token_id == 3
            requests.put(verify_request([4, 5]))  # the server sleeps 0.5 s on it
            time.sleep(0.1)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert list(next(stream).verified.token_ids) == [4, 5, 0]
            requests.put(verify_request([6]))  # the open stream keeps working while draining
            assert list(next(stream).verified.token_ids) == [6, 0]
            requests.put(None)
            assert list(stream) == []  # ends with OK
        assert proc.wait(timeout=10) == 0, "".join(stderr)
        assert time.monotonic() - started < 5
        rest = list(iter(lambda: lines.get(timeout=5), None))
        assert "drain hook called" in rest and "exited cleanly" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
