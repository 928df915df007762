"""Each kind of bad input gets INVALID_ARGUMENT with a message naming the field, and nothing else
breaks: the three services in-process on a tiny model (context 128), through the coordinator's
API and straight at the internal services.

Sessions on the internal services are streams: the server assigns the session id and the stream
itself is the handle, so a client cannot name a session, malformed or unknown. What a client can
get wrong there, and what is tested: a verify or step before `open`, a second `open`, a message
with neither, ids outside the vocabulary, blocks that do not fit, malformed draft probabilities.
"""

from __future__ import annotations

import json
import queue
import struct

import grpc
import httpx
import pytest

from coordinator.admission import Admission

from coordinator.client import CoordinatorClient, build_request
from specd.grpc_server import RETRY_AFTER_KEY, make_channel
from specd.sampling import MAX_STOP_STRINGS, SamplingParams
from specd.wire import sampling_to_proto
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.integration.inprocess_stack import TINY_CONTEXT, save_tiny_model, start_inprocess_stack

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_inprocess_stack(save_tiny_model(tmp_path_factory.mktemp("tiny")), coordinator_overrides={"http_port": 0})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with CoordinatorClient(stack.address("coordinator")) as c:
        yield c


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def assert_invalid(client, request: coordinator_pb2.GenerateRequest, message: str) -> None:
    """Refused on both RPCs with INVALID_ARGUMENT and `message` in the details."""
    for call in (lambda: client.generate(request, timeout=30), lambda: list(client.stream(request, timeout=30))):
        err = refusal(call)
        assert err.code() == INVALID, err.details()
        assert message in err.details()


def assert_still_serving(client) -> None:
    result = client.generate(build_request("Hello there", SamplingParams(max_tokens=3, ignore_eos=True)), timeout=30)
    assert result.usage.completion_tokens == 3


def req(**fields) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(**fields)


def params(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=4, **fields)


# --- the coordinator's API --------------------------------------------------------------------------


@pytest.mark.parametrize("request_, message", [
    (req(prompt="", params=params()), "prompt: the prompt is empty"),
    (req(prompt_token_ids=coordinator_pb2.TokenIds(ids=[]), params=params()), "prompt: the prompt is empty"),
    (req(params=params()), "prompt: send a prompt, messages or prompt_token_ids"),
    (req(messages=coordinator_pb2.ChatMessages(), params=params()), "messages: no messages"),
], ids=["empty-text", "empty-ids", "no-input", "no-messages"])
def test_empty_prompt(client, request_, message):
    assert_invalid(client, request_, message)


def test_prompt_over_the_context(client):
    ids = list(range(10, 10 + TINY_CONTEXT))
    assert_invalid(client, req(prompt_token_ids=coordinator_pb2.TokenIds(ids=ids), params=params()),
                   f"prompt: the prompt has {TINY_CONTEXT} tokens but the model's context holds {TINY_CONTEXT}")
    assert_invalid(client, req(prompt="word " * 400, params=params()), "prompt: the prompt has")


def test_max_tokens_out_of_range(client):
    assert_invalid(client, req(prompt="hi", params=common_pb2.SamplingParams(max_tokens=TINY_CONTEXT + 1)),
                   f"max_tokens: must be at most the model's context of {TINY_CONTEXT} tokens")
    assert_invalid(client, req(prompt="hi", params=common_pb2.SamplingParams(max_tokens=2**32 - 1)), "max_tokens")


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf")])
def test_bad_temperature(client, value):
    assert_invalid(client, req(prompt="hi", params=params(temperature=value)), "temperature: must be a finite number >= 0")


@pytest.mark.parametrize("value", [1.5, -0.1, float("nan")])
def test_top_p_outside_0_1(client, value):
    assert_invalid(client, req(prompt="hi", params=params(top_p=value)), "top_p: must be in (0, 1]")


def test_negative_top_k(client):
    assert_invalid(client, req(prompt="hi", params=params(top_k=-3)), "top_k: must be >= 0")


def test_unknown_method(client):
    assert_invalid(client, req(prompt="hi", params=params(), speculation=coordinator_pb2.SpeculationOverride(method=42)),
                   "method: unknown draft method 42")


def test_k_out_of_range(client):
    assert_invalid(client, req(prompt="hi", params=params(), speculation=coordinator_pb2.SpeculationOverride(k=10_000)),
                   "k")


def test_stop_lists_too_long(client):
    assert_invalid(client, req(prompt="hi", params=params(stop=["x"] * (MAX_STOP_STRINGS + 1))),
                   f"stop: at most {MAX_STOP_STRINGS} stop strings")
    assert_invalid(client, req(prompt="hi", params=params(stop=["y" * 1000])), "stop: stop strings must be at most")
    assert_invalid(client, req(prompt="hi", params=params(stop_token_ids=list(range(100)))), "stop_token_ids: at most")


def test_token_ids_outside_the_vocabulary(client):
    assert_invalid(client, req(prompt_token_ids=coordinator_pb2.TokenIds(ids=[1, 10**9]), params=params()),
                   "prompt_token_ids: token id 1000000000 is outside the vocabulary")
    assert_invalid(client, req(prompt="hi", params=params(stop_token_ids=[10**9])), "stop_token_ids: token id")


def test_unknown_chat_role_and_bad_request_id(client):
    chat = coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(role="wizard", content="hi")])
    assert_invalid(client, req(messages=chat, params=params()), "messages.role: unknown role 'wizard'")
    assert_invalid(client, req(prompt="hi", params=params(), request_id="r" * 500), "request_id: at most 128")


def raw_call(address: str, method: str, payload: bytes, streaming: bool = False) -> grpc.RpcError:
    """Sends `payload` as the request bytes, as a client with another protobuf library could."""
    with make_channel(address) as ch:
        if streaming:
            call = ch.unary_stream(method, request_serializer=None, response_deserializer=None)
            return refusal(lambda: list(call(payload, timeout=10)))
        return refusal(lambda: ch.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=10))


def test_invalid_utf8_names_the_field(stack, client):
    address = stack.address("coordinator")
    text = req(prompt="hi!", params=params()).SerializeToString()
    for method, streaming in (("/specdec.v1.Coordinator/GenerateUnary", False), ("/specdec.v1.Coordinator/Generate", True)):
        err = raw_call(address, method, text.replace(b"hi!", b"h\xff!"), streaming)
        assert err.code() == INVALID and err.details() == "prompt: is not valid UTF-8"
    chat = req(messages=coordinator_pb2.ChatMessages(messages=[coordinator_pb2.ChatMessage(role="user", content="abc")]),
               params=params(stop=["zz"])).SerializeToString()
    err = raw_call(address, "/specdec.v1.Coordinator/GenerateUnary", chat.replace(b"abc", b"a\xc0c"))
    assert err.code() == INVALID and err.details() == "messages.messages.content: is not valid UTF-8"
    err = raw_call(address, "/specdec.v1.Coordinator/GenerateUnary", chat.replace(b"zz", b"\xed\xa0\x80"))  # a surrogate
    assert err.code() == INVALID and err.details() == "params.stop: is not valid UTF-8"
    err = raw_call(address, "/specdec.v1.Coordinator/GenerateUnary", b"\x0a\xff\xff\xff\xff")  # not a message at all
    assert err.code() == INVALID and "not a valid specdec.v1.GenerateRequest" in err.details()
    assert_still_serving(client)


# --- the internal services ------------------------------------------------------------------------


class Stream:
    """A lockstep client of a Session stream."""

    def __init__(self, method):
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = method(iter(self.requests.get, None), timeout=30)

    def send(self, message):
        self.requests.put(message)
        return next(self.replies)

    def close(self):
        self.requests.put(None)


def target_open(ids=(1, 2, 3), **fields) -> target_pb2.TargetRequest:
    return target_pb2.TargetRequest(open=target_pb2.OpenTargetSession(
        prompt_token_ids=list(ids), params=sampling_to_proto(SamplingParams(max_tokens=8)), **fields))


def verify(ids, probs: common_pb2.DraftProbs | None = None) -> target_pb2.TargetRequest:
    return target_pb2.TargetRequest(verify=target_pb2.VerifyBlock(draft_token_ids=ids, draft_probs=probs))


def dense(values: list[float], vocab: int) -> common_pb2.DraftProbs:
    return common_pb2.DraftProbs(vocab_size=vocab, dense=struct.pack(f"<{len(values)}f", *values))


@pytest.fixture(scope="module")
def target(stack):
    with make_channel(stack.address("target")) as ch:
        yield target_pb2_grpc.TargetServiceStub(ch)


@pytest.fixture(scope="module")
def draft(stack):
    with make_channel(stack.address("draft")) as ch:
        yield draft_pb2_grpc.DraftServiceStub(ch)


def target_refusal(target, *messages) -> grpc.RpcError:
    """Sends `messages` on a fresh session; the last must be refused."""
    s = Stream(target.Session)
    for m in messages[:-1]:
        s.send(m)
    err = refusal(lambda: s.send(messages[-1]))
    s.close()
    return err


def test_target_session_protocol_errors(target):
    vocab = target.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5).vocab_size
    cases = [
        ((verify([1]),), "verify: the first message of a session must be `open`"),
        ((target_open(), target_open()), "open: the session is already open"),
        ((target_pb2.TargetRequest(),), "kind: a session message must be `open` or `verify`"),
        ((target_open(ids=()),), "prompt: the prompt is empty"),
        ((target_open(ids=[vocab]),), f"prompt: token id {vocab} is outside the vocabulary"),
        ((target_open(ids=range(TINY_CONTEXT)),), "prompt: the prompt has"),
        ((target_open(request_id="x" * 200),), "request_id: at most 128"),
        ((target_open(), verify([vocab + 5])), "draft_tokens: token ids must be below the vocabulary size"),
        ((target_open(), verify([1] * TINY_CONTEXT)), "draft_tokens: 128 draft tokens do not fit"),
        ((target_open(), verify([4], dense([float("nan")] * vocab, vocab))), "draft_probs.dense: probabilities must be finite"),
        ((target_open(), verify([4], dense([0.0] * vocab, vocab))), "draft_probs.dense: every row needs a positive"),
        ((target_open(), verify([4], common_pb2.DraftProbs(vocab_size=vocab, sparse=[
            common_pb2.SparseProbRow(token_ids=[4], probs=[-1.0])]))), "draft_probs.sparse: probabilities must be finite"),
        ((target_open(), verify([4], common_pb2.DraftProbs(vocab_size=7, dense=b"\0" * 28))), "draft_probs.vocab_size"),
    ]
    for messages, message in cases:
        err = target_refusal(target, *messages)
        assert err.code() == INVALID and message in err.details(), (message, err.details())
    stats = target.GetStats(target_pb2.GetStatsRequest(), timeout=5)
    assert stats.open_sessions == 0 and stats.serving


def draft_open(ids=(1, 2, 3), method=common_pb2.DRAFT_METHOD_NGRAM, **fields) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(open=draft_pb2.OpenDraftSession(prompt_token_ids=list(ids), method=method, **fields))


def step(k: int, appended=()) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(step=draft_pb2.DraftStep(k=k, appended_token_ids=list(appended)))


def test_draft_session_protocol_errors(stack, draft, target):
    vocab = target.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5).vocab_size
    model = common_pb2.DRAFT_METHOD_DRAFT_MODEL
    cases = [
        ((step(2),), "step: the first message of a session must be `open`"),
        ((draft_open(), draft_open()), "open: the session is already open"),
        ((draft_pb2.DraftRequest(),), "kind: a draft session message must be `open` or `step`"),
        ((draft_open(method=77),), "method: unknown draft method 77"),
        ((draft_open(method=common_pb2.DRAFT_METHOD_NONE),), "method: method none needs no draft session"),
        ((draft_open(ids=()),), "prompt_token_ids: the prompt is empty"),
        ((draft_open(request_id="\x00"),), "request_id: must be printable"),
        ((draft_open(), step(1000)), "k: at most 64 draft tokens per step"),
        ((draft_open(ids=[vocab], method=model),), f"prompt_token_ids: token id {vocab} is outside"),
        ((draft_open(method=model), step(2, appended=[vocab + 1])), "appended_token_ids: token id"),
    ]
    for messages, message in cases:
        s = Stream(draft.Session)
        for m in messages[:-1]:
            s.send(m)
        err = refusal(lambda: s.send(messages[-1]))
        s.close()
        assert err.code() == INVALID and message in err.details(), (message, err.details())
    raw = draft_open(request_id="rq").SerializeToString().replace(b"rq", b"\xff\xfe")
    with make_channel(stack.address("draft")) as ch:
        call = ch.stream_stream("/specdec.v1.DraftService/Session", request_serializer=None, response_deserializer=None)
        err = refusal(lambda: list(call(iter([raw]), timeout=10)))
    assert err.code() == INVALID and err.details() == "open.request_id: is not valid UTF-8"
    assert draft.GetStats(draft_pb2.GetDraftStatsRequest(), timeout=5).open_sessions == 0


def test_messages_over_the_size_limit_are_resource_exhausted(client):
    err = refusal(lambda: client.generate(req(prompt="x" * (5 * 1024 * 1024), params=params()), timeout=30))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the coordinator takes 4 MiB by default
    assert_still_serving(client)


# --- the HTTP API -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=f"http://127.0.0.1:{stack.coordinator.http.port}", timeout=30) as c:
        yield c


def test_http_bad_bodies(http):
    reply = http.post("/v1/completions", content=b'{"prompt": "x' + b"y" * (5 * 1024 * 1024) + b'"}',
                      headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["param"] == "body"
    reply = http.post("/v1/completions", content=b'{"prompt": "h\xff"}', headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON (UTF-8)" in reply.json()["error"]["message"]
    surrogate = json.dumps({"prompt": "\ud800 hi", "max_tokens": 2}).encode()  # valid JSON, not valid text
    reply = http.post("/v1/completions", content=surrogate, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert "not valid UTF-8" in reply.json()["error"]["message"]
    reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_full_admission_is_429_and_resource_exhausted_with_a_retry_hint(stack, http, client):
    service = stack.coordinator.servicer
    saved, service.admission = service.admission, Admission(max_running=1, max_queue=0)
    held = service.admission.acquire()
    try:
        reply = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert reply.status_code == 429 and reply.headers["Retry-After"] == "1"
        assert int(reply.headers["retry-after-ms"]) >= 100 and "retry in" in reply.json()["error"]["message"]
        with pytest.raises(grpc.RpcError) as err:
            client.stub.GenerateUnary.with_call(req(prompt="hi", params=params()), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry in" in err.value.details()
        assert int(dict(err.value.trailing_metadata())[RETRY_AFTER_KEY]) >= 100
        held.release()
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert_still_serving(client)
        assert service.admission.stats.running == 0
    finally:
        held.release()
        service.admission = saved
