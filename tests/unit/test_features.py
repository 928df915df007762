"""The target's features on the wire and in a request's log (method head)."""

from __future__ import annotations

import pytest
import torch

from specd.errors import InvalidArgument
from specd.features import FeatureLog, features_from_proto, features_to_proto


def test_proto_round_trip_keeps_float16_values():
    rows = torch.randn(3, 8)
    start, back = features_from_proto(features_to_proto(5, rows))
    assert start == 5 and back.shape == (3, 8)
    assert torch.allclose(back, rows.half().float())


def test_bytes_that_do_not_fit_the_shape_name_the_field():
    msg = features_to_proto(0, torch.randn(2, 4))
    msg.rows = 3
    with pytest.raises(InvalidArgument, match="target_features"):
        features_from_proto(msg)


def test_log_appends_in_order_and_restarts_at_zero():
    log = FeatureLog()
    log.add(0, torch.zeros(4, 2))
    log.add(4, torch.ones(2, 2))
    assert log.length == 6 and log.rows(3, 5).tolist() == [[0, 0], [1, 1]]
    log.add(0, torch.full((1, 2), 7.0))  # a new prefill (after a failover) replaces everything
    assert log.length == 1 and log.rows().tolist() == [[7, 7]]


@pytest.mark.parametrize("start", [2, 9])
def test_log_refuses_a_gap_or_an_overlap(start):
    log = FeatureLog()
    log.add(0, torch.zeros(5, 2))
    with pytest.raises(ValueError, match=f"position {start}"):
        log.add(start, torch.zeros(1, 2))

