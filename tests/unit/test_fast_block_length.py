"""Verify passes of 2 to 4 token rows are padded to 5 on CPU with torch's MKL kernels, not with oneDNN
(target_service/batch_forward.py)."""

from __future__ import annotations

import pytest

from target_service.batch_forward import fast_block_length, should_pack


@pytest.mark.parametrize("batch,n_new,expected", [
    (1, 1, 1),  # plain decoding: one row is the fast matrix-vector path
    (1, 2, 5), (1, 3, 5), (1, 4, 5),  # k = 1..3 run as 5 rows
    (1, 5, 5), (1, 9, 9),  # already fast
    (2, 1, 3), (2, 2, 3),  # two sessions: 6 rows in all
    (3, 1, 2), (5, 1, 1),
])
def test_padding_reaches_the_fast_row_count(batch, n_new, expected):
    assert fast_block_length(batch, n_new, room=100) == expected


def test_no_padding_past_the_context():
    assert fast_block_length(1, 3, room=4) == 3
    assert fast_block_length(1, 3, room=5) == 5


@pytest.mark.parametrize("lengths,cpu,expected", [
    ([1, 1, 1, 1, 1, 1], True, False),  # plain decoding: nothing to pack
    ([3, 1, 1, 1, 1, 1], True, True),  # one block among decode rows
    ([3, 3, 3], True, True),  # equal blocks: packed attention reads the keys in place
    ([9], True, False),  # one row
    ([2, 1], True, False),  # 3 tokens on a CPU: padded to the fast row count instead
    ([2, 1], False, True),
])
def test_which_passes_are_packed(lengths, cpu, expected):
    assert should_pack(lengths, cpu) is expected


@pytest.mark.parametrize("batch,n_new", [(1, 2), (1, 4), (2, 1), (3, 1), (2, 2)])
def test_with_onednn_kernels_nothing_is_padded(batch, n_new):
    """oneDNN's linear layers (specd/cpu_kernels.py) have no slow 2-4 row shapes: min_rows 1."""
    assert fast_block_length(batch, n_new, room=100, min_rows=1) == n_new


def test_with_onednn_kernels_a_small_mixed_pass_is_packed():
    assert should_pack([2, 1], cpu=True, min_rows=1) is True
