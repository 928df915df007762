"""Pure pieces of the bounds and input checks: admission control, the KV budget, the retry hint,
the UTF-8 field finder, request checks, bearer tokens."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.admission import (MAX_RETRY_MS, MIN_RETRY_MS, Admission, Overloaded, QueueDeadline, Ticket,
                                  retry_after_ms)
from specd.auth import bearer_token, load_token, token_matches
from specd.errors import InvalidArgument, PromptTooLong
from specd.input_guard import describe_parse_failure, invalid_utf8_field
from specd.sampling import MAX_STOP_TOKEN_IDS, SamplingParams
from specd.validation import RequestLimits, check_request_id, check_text
from specdec.v1 import common_pb2, coordinator_pb2, draft_pb2
from target_service.kv_budget import MIB, session_limit

# --- admission ---------------------------------------------------------------------------------


def test_admits_up_to_max_running_then_queues_then_refuses_with_a_hint():
    adm = Admission(max_running=2, max_queue=1, queue_timeout_s=5)
    a, b = adm.acquire(), adm.acquire()
    waiter = adm.enter()
    assert not isinstance(waiter, Ticket) and adm.stats.waiting == 1
    with pytest.raises(Overloaded) as err:
        adm.enter()
    assert err.value.retry_after_ms == 1000 and "retry in 1000 ms" in str(err.value)
    a.release()  # hands its slot to the waiter
    assert isinstance(adm.wait(waiter, timeout=0.1), Ticket)
    assert adm.stats.running == 2 and adm.stats.waiting == 0 and adm.stats.refused == 1
    b.release()
    assert adm.stats.running == 1


def test_queue_is_first_come_first_served():
    adm = Admission(max_running=1, max_queue=3)
    first = adm.acquire()
    order: list[int] = []

    def wait(i: int) -> None:
        with adm.acquire():
            order.append(i)
            time.sleep(0.01)

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        while adm.stats.waiting < i + 1:
            time.sleep(0.001)
    first.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2] and adm.stats.running == 0


def test_a_new_arrival_does_not_overtake_the_queue():
    adm = Admission(max_running=1, max_queue=2)
    held = adm.acquire()
    waiter = adm.enter()
    held.release()  # the slot goes to the waiter, not to whoever asks next
    assert not isinstance(adm.enter(), Ticket)
    assert isinstance(adm.wait(waiter), Ticket)


def test_queue_timeout_and_caller_deadline_refuse():
    adm = Admission(max_running=1, max_queue=4, queue_timeout_s=0.1)
    adm.acquire()
    start = time.monotonic()
    with pytest.raises(Overloaded, match="no capacity within 0.1 s"):
        adm.acquire()
    with pytest.raises(QueueDeadline, match="deadline passed"):  # DEADLINE_EXCEEDED, not a refusal
        adm.acquire(timeout=0.02)
    assert time.monotonic() - start < 1 and adm.stats.waiting == 0 and adm.stats.refused == 1


def test_a_caller_that_goes_away_leaves_the_queue():
    adm = Admission(max_running=1, max_queue=1, queue_timeout_s=10)
    adm.acquire()
    start = time.monotonic()
    with pytest.raises(Overloaded, match="went away"):
        adm.acquire(alive=lambda: False)
    assert time.monotonic() - start < 1 and adm.stats.waiting == 0


def test_retry_hint_follows_the_mean_duration_and_is_clamped():
    assert retry_after_ms(None, 8) == 1000
    assert retry_after_ms(2.0, 4) == 500
    assert retry_after_ms(0.001, 64) == MIN_RETRY_MS
    assert retry_after_ms(1e6, 1) == MAX_RETRY_MS
    adm = Admission(max_running=1, max_queue=0)
    ticket = adm.acquire()
    time.sleep(0.3)
    ticket.release()
    assert 250 <= adm.retry_hint_ms() <= 1000


# --- KV budget ---------------------------------------------------------------------------------


def test_kv_budget_caps_the_session_limit():
    per_token, context = 46_080, 8192  # SmolLM2-135M in float32: 2 x 30 layers x 3 heads x 64 x 4 bytes
    assert session_limit(64, per_token, context, None).max_sessions == 64
    limit = session_limit(64, per_token, context, 1024)
    assert limit.max_sessions == 1024 * MIB // (per_token * context) == 2 and limit.source == "kv_budget_mb"
    assert session_limit(4, per_token, context, 10_000).max_sessions == 4  # max_sessions still caps
    with pytest.raises(ValueError, match="kv_budget_mb: 100 MiB holds no session"):
        session_limit(64, per_token, context, 100)


# --- input checks ------------------------------------------------------------------------------


def test_invalid_utf8_field_names_the_nested_field():
    ok = coordinator_pb2.GenerateRequest(prompt="hé").SerializeToString()
    assert invalid_utf8_field(ok, coordinator_pb2.GenerateRequest.DESCRIPTOR) is None
    bad_prompt = ok.replace("hé".encode(), b"h\xff\xfe")
    assert invalid_utf8_field(bad_prompt, coordinator_pb2.GenerateRequest.DESCRIPTOR) == "prompt"
    chat = coordinator_pb2.GenerateRequest(messages=coordinator_pb2.ChatMessages(
        messages=[coordinator_pb2.ChatMessage(role="user", content="zz")])).SerializeToString()
    assert invalid_utf8_field(chat.replace(b"zz", b"z\xc3"), coordinator_pb2.GenerateRequest.DESCRIPTOR) == \
        "messages.messages.content"
    opened = draft_pb2.DraftRequest(open=draft_pb2.OpenDraftSession(request_id="rq")).SerializeToString()
    assert describe_parse_failure(opened.replace(b"rq", b"\x80q"), draft_pb2.DraftRequest.DESCRIPTOR) == \
        "open.request_id: is not valid UTF-8"
    assert describe_parse_failure(b"\xff\xff\xff", common_pb2.SamplingParams.DESCRIPTOR).startswith("request: not a valid")


def test_request_checks_name_their_fields():
    limits = RequestLimits(vocab_size=100, max_context=16)
    limits.check([1, 2, 3], SamplingParams(max_tokens=16))
    with pytest.raises(InvalidArgument, match="prompt_token_ids: token id 100 is outside"):
        limits.check([1, 100], SamplingParams(max_tokens=1), from_ids=True)
    with pytest.raises(PromptTooLong):
        limits.check(list(range(16)), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidArgument, match="max_tokens: must be at most"):
        limits.check([1], SamplingParams(max_tokens=17))
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        limits.check([1], SamplingParams(max_tokens=1, stop_token_ids=(100,)))
    with pytest.raises(InvalidArgument, match="request_id"):
        check_request_id("x" * 129)
    with pytest.raises(InvalidArgument, match="request_id"):
        check_request_id("a\nb")
    with pytest.raises(InvalidArgument, match="prompt: is not valid UTF-8"):
        check_text("prompt", "bad \ud800")


@pytest.mark.parametrize("params, field", [
    (SamplingParams(temperature=float("inf")), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(stop=("x" * 257,)), "stop"),
    (SamplingParams(stop=("\udc80",)), "stop"),
    (SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
])
def test_sampling_params_refuse_more_bad_values(params, field):
    with pytest.raises(InvalidArgument) as err:
        params.validate()
    assert err.value.field == field


# --- bearer tokens -----------------------------------------------------------------------------


def test_bearer_token_parsing_and_loading(tmp_path):
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None and bearer_token("Bearer") is None
    assert token_matches("abc", "abc") and not token_matches("abc", "abd") and not token_matches("abc", None)
    (tmp_path / "token").write_text("s3cret\n")
    assert load_token(None, str(tmp_path / "token")) == "s3cret"
    assert load_token("direct", str(tmp_path / "token")) == "direct"
    assert load_token(None, None) is None
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_token(None, str(tmp_path / "empty"))
