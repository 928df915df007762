"""Shared fixtures: the real default target (loaded once per session) and tiny random models."""

from __future__ import annotations

import os

from specd.openmp import apply_openmp_defaults

# Before torch loads libgomp: the suite runs passes on servicer and scheduler threads as well as
# the main one, and with more OpenMP teams than cores libgomp throttles every parallel region
# (specd/openmp.py). Measured: a sampling-exactness case after the target-service tests took
# 22 s without these settings and 11 s with them, as long as it takes alone.
apply_openmp_defaults()

import pytest  # noqa: E402
import torch  # noqa: E402

from specd.workloads import Prompt, default_prompts_path, load_prompts

# Greedy generation length per workload prompt in the exactness tests. The property does not
# depend on length (every step is checked), and the full lengths would take CI past its budget
# across 16 prompts x 5 methods x 4 depths; `specd bench` checks full lengths on every run.
EXACTNESS_MAX_TOKENS = int(os.environ.get("SPECD_TEST_MAX_TOKENS", "20"))


@pytest.fixture(scope="session")
def target():
    from specd.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def served_target():
    """The default target as the target service runs it: its linear layers on oneDNN
    (`specd serve target`'s default kernel). The in-process exactness tests speculate with it and
    compare with transformers' stock generation on `target` (`references`), as the end-to-end
    tests compare the services; on this project's CPU machines its passes also take about a
    quarter less time, which CI's budget needs."""
    from specd.cpu_kernels import use_linear_kernel
    from specd.models import load_model

    model = load_model()
    use_linear_kernel(model.model, "onednn")
    return model


@pytest.fixture(scope="session")
def workload_prompts() -> list[Prompt]:
    return load_prompts(default_prompts_path())


@pytest.fixture(scope="session")
def tiny_shared_vocab_draft(target, tmp_path_factory):
    """A random 2-layer model with the target's vocabulary and tokenizer: a useless but valid draft."""
    from specd.models import load_model, save_tiny_random_model

    folder = save_tiny_random_model(tmp_path_factory.mktemp("tiny-draft"), vocab_size=target.vocab_size,
                                    hidden_size=64, tokenizer_from=target.tokenizer, max_position_embeddings=8192)
    return load_model(str(folder))


def one_prompt_per_kind(prompts: list[Prompt], rotate: int = 0) -> list[Prompt]:
    """One workload prompt of each kind: the `rotate`-th of that kind (modulo their number), so that
    tests sweeping a parameter over this subset cover different prompts at different values."""
    by_kind: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    return [group[rotate % len(group)] for group in by_kind.values()]


def hf_greedy(model, ids: list[int], n: int, exact_length: bool = False) -> list[int]:
    """transformers' own target-only greedy decoding: the reference every exactness test uses."""
    x = torch.tensor([ids])
    extra = {"min_new_tokens": n} if exact_length else {}
    with torch.inference_mode():
        out = model.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                   pad_token_id=min(model.eos_token_ids, default=0), **extra)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="session")
def references(target, workload_prompts) -> dict[str, tuple[list[int], list[int]]]:
    """Per workload prompt: (prompt ids, target-only greedy ids at EXACTNESS_MAX_TOKENS)."""
    refs = {}
    for p in workload_prompts:
        ids = target.encode(p.prompt, chat=p.chat)
        refs[p.id] = (ids, hf_greedy(target, ids, min(p.max_tokens, EXACTNESS_MAX_TOKENS)))
    return refs
