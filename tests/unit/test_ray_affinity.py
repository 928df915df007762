"""Session affinity and the autoscaling policy for Ray Serve, as pure functions (no Ray needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specd.ray_serve.affinity import make_session_id, owner_of, rank_for_new_session, route
from specd.ray_serve.autoscaling import desired_replicas, session_load_policy

IDS = ["r0", "r1", "r2"]


def test_session_id_names_its_replica():
    sid = make_session_id("abc123", 7)
    assert sid == "abc123/7" and owner_of(sid) == "abc123"
    assert owner_of("") is None and owner_of("abc") is None and owner_of("abc/") is None
    with pytest.raises(ValueError):
        make_session_id("a/b", 1)


def test_a_sessions_calls_go_only_to_its_owner_whatever_the_loads():
    assert route("r2/5", IDS, [0, 0, 99], [True, True, False]) == [[2]]


def test_a_session_whose_owner_is_gone_may_go_anywhere_to_be_refused():
    assert route("gone/5", IDS, [0, 0, 0], [True] * 3) == [[0, 1, 2]]
    assert route("gone/5", [], [], []) == []


def test_new_sessions_rank_serving_replicas_least_loaded_first():
    assert route("", IDS, [3, 1, 2], [True, True, True]) == [[1], [2], [0]]
    assert route("", IDS, [3, 0, 2], [True, False, True]) == [[2], [0]]


def test_with_no_serving_replica_all_are_ranked_so_the_request_fails_cleanly():
    assert rank_for_new_session([1, 0], [False, False]) == [1, 0]


def test_desired_replicas_follows_sessions_plus_queue():
    assert desired_replicas(0, 0, 16, 0) == 0
    assert desired_replicas(0, 0, 16, 2) == 1
    assert desired_replicas(16, 0, 16, 1) == 1
    assert desired_replicas(30, 3, 16, 1) == 3
    with pytest.raises(ValueError):
        desired_replicas(1, 0, 0, 1)


def test_session_load_policy_reads_the_replicas_reports():
    config = SimpleNamespace(get_target_ongoing_requests=lambda: 8)
    ctx = SimpleNamespace(aggregated_metrics={"open_sessions": {"a": 10, "b": 7}, "queue_depth": {"a": 2, "b": 1}},
                          config=config, current_num_replicas=2, target_num_replicas=2, policy_state={})
    assert session_load_policy(ctx) == (3, {})
    ctx.aggregated_metrics = None  # nothing reported yet: keep the current target
    assert session_load_policy(ctx) == (2, {})
