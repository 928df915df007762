"""Fuzzing every RPC of the three services with hypothesis: request messages built from the
protobuf descriptors (every field, present or not, in range or not, unknown enum values, NaN and
infinite floats, empty and odd strings) and raw bytes that may not parse at all.

Whatever comes in, a call ends with OK or a client-error status, never INTERNAL or UNKNOWN, and
afterwards the services still serve and hold no sessions. Deterministic (derandomized) so CI
runs the same cases every time; raise FUZZ_EXAMPLES to search longer.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.client import CoordinatorClient, build_request
from specd.grpc_server import make_channel
from specd.sampling import SamplingParams
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2, target_pb2
from tests.probes import wait_no_sessions
from tests.integration.inprocess_stack import TINY_CONTEXT, save_tiny_model, start_inprocess_stack

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "50"))
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
OUTCOMES: Counter[str] = Counter()  # status per call, printed at the end (the docs quote it)

F = FieldDescriptor
U32_EDGES = [0, 1, 2, 3, 4, 7, 8, 9, 31, 32, 33, 63, 64, 65, TINY_CONTEXT - 1, TINY_CONTEXT, TINY_CONTEXT + 1,
             49151, 49152, 2**31 - 1, 2**32 - 1]
I32_EDGES = [-(2**31), -1, 0, 1, 5, 40, 2**31 - 1]
FLOAT_EDGES = [0.0, 1e-9, 0.5, 0.9, 1.0, 1.5, 2.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf")]
TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=24)
WORDS = st.sampled_from(["", "user", "system", "assistant", "hi", "Hello there, how are you?", "\x00", "def f(x):"])
# Fields whose generic range would mostly waste examples (a huge max_tokens runs to the context).
OVERRIDES: dict[str, st.SearchStrategy] = {
    "max_tokens": st.sampled_from([0, 1, 2, 3, 5, 8, TINY_CONTEXT + 1, 2**32 - 1]),
    "k": st.sampled_from([0, 1, 2, 4, 8, 32, 33, 64, 65, 2**32 - 1]),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.name in OVERRIDES:
        return OVERRIDES[field.name]
    t = field.type
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.sampled_from(U32_EDGES) | st.integers(0, 300) | st.integers(0, 2**32 - 1)
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return st.sampled_from(I32_EDGES) | st.integers(-(2**31), 2**31 - 1)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.sampled_from([0, 1, 7, 2**63 - 1, 2**64 - 1]) | st.integers(0, 2**64 - 1)
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return st.integers(-(2**63), 2**63 - 1)
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.sampled_from(FLOAT_EDGES) | st.floats(width=32)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return WORDS | TEXT
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64) | st.just(b"\0" * 4 * 49152)
    if t == F.TYPE_ENUM:
        return st.integers(-2, 8)  # unknown values too: proto3 enums are open
    raise TypeError(f"no strategy for {field.full_name}")


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of `descriptor` with any subset of fields set, to any values of their type."""
    cls = message_factory.GetMessageClass(descriptor)

    @st.composite
    def build(draw):
        msg = cls()
        fields = [f for f in descriptor.fields if f.containing_oneof is None]
        for oneof in descriptor.oneofs:
            chosen = draw(st.sampled_from([None, *oneof.fields]))
            if chosen is not None:
                fields.append(chosen)
        for field in fields:
            if field.containing_oneof is None and not draw(st.booleans()):
                continue
            _set(draw, msg, field, depth)
        return msg

    return build()


def _set(draw, msg, field: FieldDescriptor, depth: int) -> None:
    value = getattr(msg, field.name)
    if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        value.update(draw(st.dictionaries(TEXT, TEXT, max_size=2)))
    elif field.type == F.TYPE_MESSAGE:
        if depth >= 3:
            return
        inner = messages(field.message_type, depth + 1)
        if field.is_repeated:
            value.extend(draw(st.lists(inner, max_size=3)))
        else:
            value.CopyFrom(draw(inner))
    elif field.is_repeated:
        value.extend(draw(st.lists(_scalar(field), max_size=TINY_CONTEXT + 2) if field.name.endswith("ids")
                          else st.lists(_scalar(field), max_size=20)))
    else:
        setattr(msg, field.name, draw(_scalar(field)))


# --- plausible requests: mostly valid, so that fuzzing reaches generation, verify and draft steps ---

VOCAB = 49152  # the default tokenizer's, which the tiny model shares
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
SMALL_IDS = st.lists(st.integers(0, VOCAB - 1), max_size=5)


@st.composite
def plausible_params(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=draw(st.integers(1, 6)), temperature=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7])),
        top_p=draw(st.sampled_from([0.0, 0.3, 0.9, 1.0])), top_k=draw(st.sampled_from([0, 0, 1, 5, 50])),
        stop=draw(st.lists(st.sampled_from(["\n", "the", ".", "zz"]), max_size=2)),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)), ignore_eos=draw(st.booleans()))
    if draw(st.booleans()):
        msg.seed = draw(st.integers(0, 2**64 - 1))
    return msg


@st.composite
def plausible_generate(draw) -> coordinator_pb2.GenerateRequest:
    msg = coordinator_pb2.GenerateRequest(params=draw(plausible_params()))
    which = draw(st.sampled_from(["prompt", "ids", "messages"]))
    if which == "prompt":
        msg.prompt = draw(st.sampled_from(["Hello there", "1, 2, 3,", "def f(x):"]) | TEXT.filter(bool))
    elif which == "ids":
        msg.prompt_token_ids.ids.extend(draw(IDS))
    else:
        for role in draw(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=3)):
            msg.messages.messages.add(role=role, content=draw(TEXT))
    if draw(st.booleans()):
        msg.speculation.method = draw(st.integers(0, 4))
        if draw(st.booleans()):
            msg.speculation.k = draw(st.integers(0, 8))
    return msg


@st.composite
def plausible_target_session(draw) -> list[target_pb2.TargetRequest]:
    first = target_pb2.TargetRequest(open=target_pb2.OpenTargetSession(
        prompt_token_ids=draw(IDS), params=draw(plausible_params()), request_id=draw(st.sampled_from(["", "r1"]))))
    steps = []
    for ids in draw(st.lists(SMALL_IDS, max_size=3)):
        block = target_pb2.VerifyBlock(draft_token_ids=ids)
        if ids and draw(st.booleans()):  # sparse q rows, as a sampled draft model sends them
            for t in ids:
                block.draft_probs.sparse.add(token_ids=[t, (t + 1) % VOCAB], probs=[draw(st.floats(0.01, 1)), 0.1])
            block.draft_probs.vocab_size = VOCAB
        steps.append(target_pb2.TargetRequest(verify=block))
    return [first, *steps]


@st.composite
def plausible_draft_session(draw) -> list[draft_pb2.DraftRequest]:
    first = draft_pb2.DraftRequest(open=draft_pb2.OpenDraftSession(
        prompt_token_ids=draw(IDS), params=draw(plausible_params()), method=draw(st.integers(2, 4))))
    steps = [draft_pb2.DraftRequest(step=draft_pb2.DraftStep(appended_token_ids=draw(SMALL_IDS), k=draw(st.integers(0, 8))))
             for _ in range(draw(st.integers(0, 3)))]
    return [first, *steps]


PLAUSIBLE = {
    coordinator_pb2.GenerateRequest.DESCRIPTOR.full_name: plausible_generate().map(lambda m: [m]),
    target_pb2.TargetRequest.DESCRIPTOR.full_name: plausible_target_session(),
    draft_pb2.DraftRequest.DESCRIPTOR.full_name: plausible_draft_session(),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_inprocess_stack(save_tiny_model(tmp_path_factory.mktemp("tiny")), target_overrides={"max_sessions": 8})
    yield s
    s.stop()
    print("\nfuzz outcomes:", dict(sorted(OUTCOMES.items())))


def outcome(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert code not in FORBIDDEN, f"{code.name}: {exc.details()}"
    OUTCOMES[code.name] += 1
    return code


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])

# (service address name, method path, request descriptor, client streaming, server streaming)
RPCS = [
    ("coordinator", "/specdec.v1.Coordinator/Generate", coordinator_pb2.GenerateRequest.DESCRIPTOR, False, True),
    ("coordinator", "/specdec.v1.Coordinator/GenerateUnary", coordinator_pb2.GenerateRequest.DESCRIPTOR, False, False),
    ("target", "/specdec.v1.TargetService/Session", target_pb2.TargetRequest.DESCRIPTOR, True, True),
    ("target", "/specdec.v1.TargetService/GetStats", target_pb2.GetStatsRequest.DESCRIPTOR, False, False),
    ("target", "/specdec.v1.TargetService/GetModelInfo", common_pb2.GetModelInfoRequest.DESCRIPTOR, False, False),
    ("draft", "/specdec.v1.DraftService/Session", draft_pb2.DraftRequest.DESCRIPTOR, True, True),
    ("draft", "/specdec.v1.DraftService/GetStats", draft_pb2.GetDraftStatsRequest.DESCRIPTOR, False, False),
    ("draft", "/specdec.v1.DraftService/GetModelInfo", common_pb2.GetModelInfoRequest.DESCRIPTOR, False, False),
]


def invoke(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool, payloads: list[bytes]):
    """Calls `path` with serialized request(s), reading every reply."""
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[(client_streaming, server_streaming)]
    call = kind(path, request_serializer=None, response_deserializer=None)
    request = iter(payloads) if client_streaming else payloads[0]
    if server_streaming:
        return lambda: list(call(request, timeout=30))
    return lambda: call(request, timeout=30)


@pytest.mark.parametrize("service, path, descriptor, client_streaming, server_streaming", RPCS,
                         ids=[r[1].rsplit(".", 1)[1] for r in RPCS])
def test_fuzz_messages(stack, service, path, descriptor, client_streaming, server_streaming):
    n = 4 if client_streaming else 1
    strategy = st.lists(messages(descriptor), min_size=1, max_size=n)
    if descriptor.full_name in PLAUSIBLE:  # as many valid requests (or streams) as arbitrary ones
        plausible = PLAUSIBLE[descriptor.full_name]
        strategy = st.one_of(strategy, plausible, plausible.flatmap(lambda ms: strategy.map(lambda extra: ms + extra)))
    with make_channel(stack.address(service)) as channel:
        @FUZZ
        @given(requests=strategy)
        def run(requests):
            outcome(invoke(channel, path, client_streaming, server_streaming, [m.SerializeToString() for m in requests]))

        run()
    assert_healthy(stack)


@pytest.mark.parametrize("service, path, descriptor, client_streaming, server_streaming", RPCS,
                         ids=[r[1].rsplit(".", 1)[1] for r in RPCS])
def test_fuzz_raw_bytes(stack, service, path, descriptor, client_streaming, server_streaming):
    with make_channel(stack.address(service)) as channel:
        @settings(FUZZ, max_examples=max(EXAMPLES // 3, 5))
        @given(payloads=st.lists(st.binary(max_size=200), min_size=1, max_size=3 if client_streaming else 1))
        def run(payloads):
            outcome(invoke(channel, path, client_streaming, server_streaming, payloads))

        run()
    assert_healthy(stack)


def assert_healthy(stack) -> None:
    """The services still serve a valid request and, soon after it is done, hold no sessions
    (a session ends when its stream's cancellation reaches the replica, a moment later)."""
    with CoordinatorClient(stack.address("coordinator")) as client:
        result = client.generate(build_request("Hello there", SamplingParams(max_tokens=4, ignore_eos=True)), timeout=30)
    assert result.usage.completion_tokens == 4
    assert open_sessions(stack, within=2.0) == (0, 0)


def open_sessions(stack, within: float) -> tuple[int, int]:
    """(target, draft) open sessions once both are zero, or when `within` seconds have passed."""
    return wait_no_sessions(stack.address("target"), stack.address("draft"), within, poll_s=0.02)
