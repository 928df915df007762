"""Choosing workload prompts by kind (specd/workloads.py)."""

from __future__ import annotations

import pytest

from specd.workloads import Prompt, prompts_of_kind

PROMPTS = [Prompt("a", "chat", True, "hi", 64), Prompt("b", "code", False, "def f():", 16),
           Prompt("c", "chat", True, "hello", 8)]


def test_prompts_of_a_kind_are_capped_at_max_tokens():
    chosen = prompts_of_kind(PROMPTS, "chat", 32)
    assert [(p.id, p.max_tokens) for p in chosen] == [("a", 32), ("c", 8)]


def test_an_unknown_kind_is_refused_with_the_kinds_there_are():
    with pytest.raises(ValueError, match="'extract'.*chat, code"):
        prompts_of_kind(PROMPTS, "extract", 32)
