"""Bounds and security end to end: target, draft and coordinator as three real processes on a tiny
random model, every hop over mutual TLS, the client API behind a bearer token.

- churn: 1,000 requests, a third of them cancelled or timed out at random points; afterwards no
  session is open anywhere and the target's resident memory is within 10 % of its level after
  warm-up;
- overload: twice the admitted concurrency at once; the excess is refused quickly with
  RESOURCE_EXHAUSTED and a retry hint, the admitted requests are exact, and the server recovers;
- TLS: no client certificate, a certificate of another CA, or no token is refused, on gRPC and
  HTTPS alike.
"""

from __future__ import annotations

import random
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from coordinator.client import CoordinatorClient, build_request
from specd.certs import CertFiles, make_dev_certs
from specd.grpc_server import RETRY_AFTER_KEY, make_channel
from specd.launcher import Service, free_port, start_service
from specd.models import load_model
from specd.sampling import SamplingParams
from specd.tls import ClientTLS
from specdec.v1 import target_pb2, target_pb2_grpc
from tests.conftest import hf_greedy
from tests.probes import wait_no_sessions
from tests.integration.inprocess_stack import save_tiny_model

TOKEN = "e2e-token"
MAX_RUNNING, MAX_QUEUE = 4, 4
ADMITTED = MAX_RUNNING + MAX_QUEUE
# Below the admitted concurrency: a cancelled request's handler lingers a moment on the
# coordinator, and a client's next request may overlap it; refusals are retried after the hint.
CHURN_REQUESTS, WARMUP_REQUESTS, CHURN_CONCURRENCY = 1000, 100, ADMITTED - 2
MAX_RETRIES = 5


@dataclass
class SecureStack:
    target: Service
    draft: Service
    coordinator: Service
    http_port: int
    certs: CertFiles
    model_dir: Path
    tls: ClientTLS  # our client certificate
    services: list[Service] = field(default_factory=list)

    def client(self, token: str | None = TOKEN, tls: ClientTLS | None = None) -> CoordinatorClient:
        return CoordinatorClient(self.coordinator.address, token=token, tls=tls or self.tls)

    def open_sessions(self, within: float = 2.0) -> tuple[int, int]:
        return wait_no_sessions(self.target.address, self.draft.address, within, tls=self.tls)

    def coordinator_in_flight(self) -> float:
        """Requests running or waiting on the coordinator, from its Prometheus endpoint."""
        text = httpx.get(self.coordinator.metrics_url, timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("specd_coordinator_requests_running", "specd_coordinator_requests_waiting")))


def rss_mb(service: Service) -> float:
    for line in Path(f"/proc/{service.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> SecureStack:
    root = tmp_path_factory.mktemp("limits")
    certs = make_dev_certs(root / "certs")
    model_dir = save_tiny_model(root / "tiny")
    (root / "token").write_text(TOKEN)
    tls = ClientTLS(certs.ca, certs.client_cert, certs.client_key)
    mtls = ["--tls-cert", certs.server_cert, "--tls-key", certs.server_key, "--tls-ca", certs.ca, "--require-client-cert"]
    logs = root / "logs"
    logs.mkdir()
    with ThreadPoolExecutor(2) as pool:  # target and draft start side by side
        target_f = pool.submit(start_service, "target", ["--model", str(model_dir), "--max-sessions", "16", *mtls], logs,
                               tls=tls)
        draft_f = pool.submit(start_service, "draft", ["--model", str(model_dir), "--method", "ngram", *mtls], logs, tls=tls)
        target, draft = target_f.result(), draft_f.result()
    http_port = free_port()
    coordinator = start_service("coordinator", [
        "--target", target.address, "--draft", draft.address, "--tokenizer-model", str(model_dir), "--method", "ngram",
        "--k", "4", *mtls, "--upstream-ca", certs.ca, "--api-token-file", str(root / "token"),
        "--max-running", str(MAX_RUNNING), "--max-queue", str(MAX_QUEUE), "--http-port", str(http_port)],
        logs, tls=tls, metrics_port=0)
    s = SecureStack(target, draft, coordinator, http_port, certs, model_dir, tls)
    yield s
    for service in (coordinator, draft, target):
        service.stop()


@pytest.fixture(scope="module")
def tiny(stack):
    return load_model(str(stack.model_dir))


# --- security ------------------------------------------------------------------------------------


def test_grpc_refuses_clients_without_certificate_or_token(stack, tmp_path):
    theirs = make_dev_certs(tmp_path / "theirs", ca_name="another CA")
    request = build_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    refused = {
        "no client certificate": (ClientTLS(stack.certs.ca), TOKEN),
        "another CA's certificate": (ClientTLS(stack.certs.ca, theirs.client_cert, theirs.client_key), TOKEN),
        "no token": (stack.tls, None),
        "wrong token": (stack.tls, "guess"),
    }
    for why, (tls, token) in refused.items():
        with stack.client(token, tls) as client, pytest.raises(grpc.RpcError) as err:
            client.generate(request, timeout=10)
        expected = grpc.StatusCode.UNAUTHENTICATED if "token" in why else grpc.StatusCode.UNAVAILABLE
        assert err.value.code() == expected, why
    for internal in (stack.target, stack.draft):  # the replicas take only our certificates too
        with make_channel(internal.address, tls=ClientTLS(stack.certs.ca)) as ch, pytest.raises(grpc.RpcError):
            target_pb2_grpc.TargetServiceStub(ch).GetStats(target_pb2.GetStatsRequest(), timeout=5)
    with stack.client() as client:
        assert client.generate(request, timeout=30).usage.completion_tokens == 2


def test_https_api_refuses_clients_without_certificate_or_token(stack):
    url = f"https://127.0.0.1:{stack.http_port}/v1/completions"
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    ours = ssl.create_default_context(cafile=stack.certs.ca)
    ours.load_cert_chain(stack.certs.client_cert, stack.certs.client_key)
    ok = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(verify=ours, timeout=30) as http:
        assert http.post(url, json=body).status_code == 401
        reply = http.post(url, json=body, headers={"Authorization": "Bearer nope"})
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        assert http.get(f"https://127.0.0.1:{stack.http_port}/health").status_code == 200  # probes stay open
        reply = http.post(url, json=body, headers=ok)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    without_cert = ssl.create_default_context(cafile=stack.certs.ca)
    with httpx.Client(verify=without_cert, timeout=10) as http, pytest.raises(httpx.TransportError):
        http.post(url, json=body, headers=ok)  # no client certificate: the handshake fails


# --- overload ------------------------------------------------------------------------------------


def test_overload_refuses_the_excess_quickly_and_the_admitted_are_exact(stack, tiny):
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 30))] for _ in range(2 * ADMITTED)]
    max_tokens = 40
    expected = [hf_greedy(tiny, p, max_tokens, exact_length=True) for p in prompts]
    barrier = threading.Barrier(len(prompts))

    def call(i: int):
        request = build_request(prompts[i], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        with stack.client() as client:
            barrier.wait()
            start = time.monotonic()
            try:
                call_ = client.stub.GenerateUnary.with_call(request, timeout=120, metadata=client.metadata)
                return i, "ok", list(call_[0].token_ids), time.monotonic() - start, None
            except grpc.RpcError as exc:
                trailers = dict(exc.trailing_metadata() or ())
                return i, exc.code(), exc.details(), time.monotonic() - start, trailers.get(RETRY_AFTER_KEY)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(call, range(len(prompts))))
    admitted = [r for r in results if r[1] == "ok"]
    refused = [r for r in results if r[1] != "ok"]
    assert {r[1] for r in refused} <= {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused
    assert len(admitted) >= ADMITTED and len(refused) >= ADMITTED // 2, (len(admitted), len(refused))
    for i, _, details, seconds, retry in refused:
        assert seconds < 1.0 and "retry in" in details and retry is not None and int(retry) >= 100
    slowest_admitted = max(r[3] for r in admitted)
    for i, _, ids, _, _ in admitted:
        assert ids == expected[i], f"request {i} differs from target-only decoding under overload"
    print(f"\noverload: {len(prompts)} at once against {ADMITTED} admitted: {len(admitted)} served exact "
          f"(slowest {slowest_admitted:.2f} s), {len(refused)} refused in at most {max(r[3] for r in refused):.3f} s")
    # Recovery: when load falls, everything is served again, a full admitted burst included.
    with ThreadPoolExecutor(ADMITTED) as pool:
        again = list(pool.map(lambda i: stack.client().generate(build_request(
            prompts[i], SamplingParams(max_tokens=8, ignore_eos=True)), timeout=60), range(ADMITTED)))
    assert [list(r.token_ids) for r in again] == [e[:8] for e in expected[:ADMITTED]]
    assert stack.open_sessions() == (0, 0)


# --- churn ---------------------------------------------------------------------------------------


@dataclass
class ChurnTally:
    completed: int = 0
    cancelled: int = 0
    timed_out: int = 0
    retries: int = 0  # RESOURCE_EXHAUSTED answers retried after their hint
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def retry_hint_s(details: str) -> float:
    """The "retry in N ms" of a refusal, in seconds."""
    try:
        return int(details.rsplit("retry in ", 1)[1].split()[0]) / 1000
    except (IndexError, ValueError):
        return 0.1


def churn(stack: SecureStack, n: int, seed: int) -> ChurnTally:
    """`n` requests from CHURN_CONCURRENCY clients: two thirds run to the end, one sixth is
    cancelled after a random number of chunks, one sixth gets a deadline of 5 to 150 ms."""
    tally = ChurnTally()
    counter = iter(range(n))
    counter_lock = threading.Lock()

    def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        with stack.client() as client:
            while True:
                with counter_lock:
                    i = next(counter, None)
                if i is None:
                    return
                prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 60))]
                params = SamplingParams(max_tokens=rng.randrange(2, 13), ignore_eos=True,
                                        temperature=rng.choice([0.0, 0.0, 0.8]))
                method = rng.choice(["ngram", "ngram", "none"])  # a third never opens a draft session
                request = build_request(prompt, params, method=method, k=rng.choice([2, 4]) if method != "none" else None)
                fate = rng.random()
                for attempt in range(MAX_RETRIES + 1):
                    outcome = one_request(client, request, fate, rng)
                    if not outcome.startswith("RESOURCE_EXHAUSTED") or attempt == MAX_RETRIES:
                        break
                    with tally.lock:
                        tally.retries += 1
                    time.sleep(retry_hint_s(outcome))
                with tally.lock:
                    if outcome in ("completed", "cancelled", "timed_out"):
                        setattr(tally, outcome, getattr(tally, outcome) + 1)
                    else:
                        tally.failures.append(outcome)

    def one_request(client: CoordinatorClient, request, fate: float, rng: random.Random) -> str:
        try:
            if fate < 2 / 3:
                result = client.generate(request, timeout=60)
                return "completed" if result.usage.completion_tokens > 0 else "no tokens"
            if fate < 5 / 6:
                call = client.stream(request, timeout=60)
                for _ in range(rng.randrange(0, 4)):
                    if next(call, None) is None:
                        break
                call.cancel()
                return "cancelled"
            list(client.stream(request, timeout=rng.uniform(0.005, 0.15)))
            return "completed"  # finished within its deadline
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and fate >= 5 / 6:
                return "timed_out"
            if exc.code() == grpc.StatusCode.CANCELLED and 2 / 3 <= fate < 5 / 6:
                return "cancelled"
            return f"{exc.code().name}: {exc.details()}"

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(CHURN_CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return tally


def test_churn_with_cancels_and_deadlines_leaks_no_session_and_no_memory(stack):
    warm = churn(stack, WARMUP_REQUESTS, seed=1)
    assert warm.failures == [] and stack.open_sessions() == (0, 0)
    rss_warm = rss_mb(stack.target)
    start = time.monotonic()
    tally = churn(stack, CHURN_REQUESTS, seed=2)
    seconds = time.monotonic() - start
    sessions = stack.open_sessions()
    rss_after = rss_mb(stack.target)
    faults = tally.cancelled + tally.timed_out
    print(f"\nchurn: {CHURN_REQUESTS} requests in {seconds:.1f} s at concurrency {CHURN_CONCURRENCY}: "
          f"{tally.completed} completed, {tally.cancelled} cancelled, {tally.timed_out} timed out "
          f"({faults} faults injected), {len(tally.failures)} failures, {tally.retries} refusals retried; "
          f"open sessions (target, draft) {sessions}; "
          f"target RSS {rss_warm:.0f} MiB after warm-up, {rss_after:.0f} MiB after ({rss_after / rss_warm - 1:+.1%})")
    assert tally.failures == []
    assert tally.completed + faults == CHURN_REQUESTS and faults >= CHURN_REQUESTS // 4
    assert tally.cancelled > 100 and tally.timed_out > 50  # both kinds of fault, at many points
    assert sessions == (0, 0)
    assert stack.coordinator_in_flight() == 0
    assert rss_after <= 1.10 * rss_warm
