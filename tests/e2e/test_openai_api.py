"""The OpenAI-compatible HTTP API, driven by the official `openai` client against real processes."""

from __future__ import annotations

import time

import httpx
import openai
import pytest


from tests.conftest import EXACTNESS_MAX_TOKENS, hf_greedy
from tests.e2e.conftest import target_stats, wait_sessions_closed

pytestmark = pytest.mark.slow

CHAT_PROMPT = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_name(oai):
    return oai.models.list().data[0].id


def test_models_lists_the_served_model(oai, model_name):
    assert model_name == "SmolLM2-135M-Instruct"


def test_health(stack):
    r = httpx.get(f"http://127.0.0.1:{stack.http_port}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_greedy_equals_target_only(oai, model_name, target, references, workload_prompts):
    for p in [q for q in workload_prompts if not q.chat]:
        ids, expected = references[p.id]
        n = min(p.max_tokens, EXACTNESS_MAX_TOKENS)
        res = oai.completions.create(model=model_name, prompt=p.prompt, max_tokens=n, temperature=0)
        assert res.choices[0].text == target.decode(expected), p.id
        assert res.usage.completion_tokens == len(expected) and res.usage.prompt_tokens == len(ids)
        assert res.usage.total_tokens == len(ids) + len(expected)
        assert res.choices[0].finish_reason in ("stop", "length")
        assert res.model_extra["speculation"]["num_draft_tokens"] >= 0


def test_chat_greedy_streamed_and_not_equal_target_only(oai, model_name, target):
    ids = target.encode(CHAT_PROMPT, chat=True)
    expected = target.decode(hf_greedy(target, ids, 24))
    whole = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": CHAT_PROMPT}],
                                        max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    stream = oai.chat.completions.create(model=model_name, messages=[{"role": "user", "content": CHAT_PROMPT}],
                                         max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_stream_matches_non_stream(oai, model_name):
    kwargs = dict(model=model_name, prompt="The three primary colors are", max_tokens=20, temperature=0)
    whole = oai.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole.choices[0].text


def test_stop_strings_and_extras(oai, model_name):
    res = oai.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"],
                                 extra_body={"top_k": 5, "ignore_eos": True, "speculative": {"method": "suffix", "k": 3}})
    assert " 7" not in res.choices[0].text and res.choices[0].finish_reason == "stop"
    assert res.model_extra["speculation"]["method"] == "suffix" and res.model_extra["speculation"]["k"] == 3


@pytest.mark.parametrize("kwargs,param", [
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"extra_body": {"top_k": -3}}, "top_k"),
    ({"extra_body": {"speculative": {"method": "magic"}}}, "speculative.method"),
    ({"extra_body": {"speculative": {"k": "sometimes"}}}, "speculation.depth"),
])
def test_bad_parameters_are_400_naming_the_parameter(oai, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model_name, prompt="hi", **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_prompt_over_the_context_is_400(oai, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model_name, prompt=list(range(100, 9000)), max_tokens=2)
    assert "context" in err.value.body["message"]


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-17", prompt="hi", max_tokens=2)


def test_disconnect_mid_stream_frees_the_sessions(stack, model_name):
    url = f"http://127.0.0.1:{stack.http_port}/v1/completions"
    body = {"model": model_name, "prompt": "Write a long story about a dragon.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in seen)
        assert target_stats(stack).open_sessions == 1
    # leaving the block closes the connection mid-stream
    assert wait_sessions_closed(stack, within=2.0) == (0, 0)


def test_server_keeps_serving_after_errors(oai, model_name):
    assert oai.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_429_at_the_session_limit_and_503_while_draining(stack, tmp_path):
    """A second target limited to one session, and a coordinator of its own that we drain."""
    from specd.launcher import free_port, launch_service

    target = launch_service("target", ["--max-sessions", "1"], tmp_path)
    http_port = free_port()
    # launched together: the coordinator imports while the target loads, then waits for it
    coordinator = launch_service("coordinator", ["--target", target.address, "--draft", stack.draft.address,
                                                 "--http-port", str(http_port), "--grace-seconds", "20"], tmp_path)
    try:
        target.wait_healthy()
        coordinator.wait_healthy()
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=120)
        model = oai.models.list().data[0].id
        long_stream = oai.completions.create(model=model, prompt="Tell a long story.", max_tokens=60, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        first = next(iter(long_stream))  # holds the target's only session
        with pytest.raises(openai.RateLimitError) as err:
            oai.completions.create(model=model, prompt="hi", max_tokens=2)
        assert err.value.status_code == 429
        coordinator.proc.send_signal(15)  # drain: new requests get 503, the running stream finishes
        deadline = time.monotonic() + 10
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
            except httpx.HTTPError:
                r = None
            if (r is not None and r.status_code == 503) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r is not None and r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        rest = list(long_stream)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
        assert rest[-1].choices[0].finish_reason == "length" and text
        assert coordinator.proc.wait(30) == 0
    finally:
        coordinator.stop()
        target.stop()
