"""OpenAI request parsing and response shapes, as pure functions over dicts.

Every parse error is an InvalidArgument naming the offending parameter, which the HTTP layer
returns in OpenAI's error shape with status 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from coordinator.service import PromptInput
from specd.errors import InvalidArgument
from specd.sampling import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256


def _number(body: dict, name: str, default: float, lo: float | None = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(name, f"must be a number, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise InvalidArgument(name, f"must be >= {lo}, got {value}")
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an integer, got {type(value).__name__}")
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(name, f"must be true or false, got {value!r}")
    return value


def parse_sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    n = _integer(body, "n", 1)
    if n != 1:
        raise InvalidArgument("n", f"only n = 1 is supported, got {n}")
    for unsupported in ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions"):
        if body.get(unsupported) not in (None, False, 1 if unsupported == "best_of" else None):
            raise InvalidArgument(unsupported, "is not supported by specd")
    max_tokens = _integer(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", default_max_tokens)
    stop = body.get("stop")
    if stop is None:
        stop_list: list[str] = []
    elif isinstance(stop, str):
        stop_list = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_list = stop
    else:
        raise InvalidArgument("stop", "must be a string or a list of strings")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise InvalidArgument("stop_token_ids", "must be a list of integers")
    top_k = _integer(body, "top_k", 0)
    return SamplingParams(
        max_tokens=max_tokens,  # type: ignore[arg-type]
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # type: ignore[arg-type]  # vLLM spells "disabled" as -1
        seed=_integer(body, "seed", None),
        stop=tuple(stop_list),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_boolean(body, "ignore_eos"),
    ).validate()


def parse_speculation(body: dict) -> tuple[str | None, int | str | None]:
    """`speculative`: {"method": ..., "k": 4 | "auto" | "schedule:..."}; a string k is a depth policy."""
    spec = body.get("speculative")
    if spec is None:
        return None, None
    if not isinstance(spec, dict):
        raise InvalidArgument("speculative", "must be an object with `method` and/or `k`")
    method = spec.get("method")
    if method is not None and method not in ("none", "ngram", "suffix", "draft_model"):
        raise InvalidArgument("speculative.method", f"unknown method {method!r}; use none, ngram, suffix or draft_model")
    k = spec.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, str))):
        raise InvalidArgument("speculative.k", "must be an integer or a depth policy (\"auto\", \"schedule:1=8,8=0\")")
    return method, k


def parse_stream(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options", "must be an object")
    return stream, bool(options.get("include_usage", False))


def parse_completion_prompt(body: dict) -> PromptInput:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return PromptInput(text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return PromptInput(token_ids=prompt)
    if prompt is None:
        raise InvalidArgument("prompt", "is required")
    raise InvalidArgument("prompt", "must be a string, a list of token ids, or a list of one of those (batches are not supported)")


def parse_messages(body: dict) -> PromptInput:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"messages[{i}]", "must be an object")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidArgument(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content", "must be a string")
        out.append({"role": m.get("role"), "content": content})
    return PromptInput(messages=out)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def speculation(handle: Any) -> dict:
    s = handle.generation.stats
    return {"method": handle.method, "k": handle.k, "num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens, "acceptance_rate": round(s.acceptance_rate, 4),
            "mean_acceptance_length": round(s.mean_acceptance_length, 4), "target_forward_passes": s.target_forward_passes}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def now() -> int:
    return int(time.time())
