"""Batched forward passes with rows in any slot order: each row's logits equal the row run alone,
and the cache view reads the batch's slots as one slice instead of gathering them."""

from __future__ import annotations

import random

import pytest
import torch

from specd.models import load_model, save_tiny_random_model
from target_service import kv_pool
from target_service.batch_forward import BatchedForward, RowInput, inverse_permutation, slot_order


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("tiny"), vocab_size=48, seed=3,
                                                 max_position_embeddings=256)))


def recorded_views(monkeypatch) -> list[kv_pool.BatchCacheView]:
    """The cache views the batched passes create from now on, in order."""
    views: list[kv_pool.BatchCacheView] = []
    real_view = kv_pool.BatchCacheView

    def recording_view(*args, **kwargs):
        views.append(real_view(*args, **kwargs))
        return views[-1]

    monkeypatch.setattr("target_service.batch_forward.BatchCacheView", recording_view)
    return views


def test_slot_order_sorts_and_inverts() -> None:
    rows = [RowInput(slot, 0, [1]) for slot in (5, 2, 9, 0)]
    order = slot_order(rows)
    assert order == [3, 1, 0, 2]
    assert [rows[b].slot for b in order] == [0, 2, 5, 9]
    assert [order[i] for i in inverse_permutation(order)] == [0, 1, 2, 3]
    assert slot_order(sorted(rows, key=lambda r: r.slot)) is None


def test_shuffled_rows_match_each_row_alone_and_read_a_slice(tiny, monkeypatch) -> None:
    forward = BatchedForward(tiny)
    rng = random.Random(0)
    slots = [forward.pool.allocate() for _ in range(6)]
    prompts = {slot: [rng.randrange(48) for _ in range(5 + 3 * slot)] for slot in slots}
    for slot, ids in prompts.items():  # each session's prefill, alone
        forward.run([RowInput(slot, 0, ids)], keep_last=1)
    blocks = {slot: [rng.randrange(48) for _ in range(3)] for slot in slots}
    alone = {slot: forward.run([RowInput(slot, len(prompts[slot]), blocks[slot])])[0] for slot in slots}

    views = recorded_views(monkeypatch)
    shuffled = slots[:]
    rng.shuffle(shuffled)
    assert shuffled != sorted(shuffled)
    batched = forward.run([RowInput(slot, len(prompts[slot]), blocks[slot]) for slot in shuffled])
    for slot, logits in zip(shuffled, batched):
        torch.testing.assert_close(logits, alone[slot], rtol=1e-4, atol=1e-4)
    assert len(views) == 1 and views[0].slots == sorted(shuffled) and views[0]._range is not None


def test_covering_rows_reads_a_slice_over_a_few_gaps_and_gathers_past_that() -> None:
    assert kv_pool.covering_rows([0, 1, 2, 3]) is None  # contiguous: the slice is the batch
    assert kv_pool.covering_rows([0, 1, 3, 4]) == [0, 1, 3, 4]
    assert kv_pool.covering_rows([2, 3, 5]) == [0, 1, 3]
    assert kv_pool.covering_rows([0, 5]) is None  # a slice of 6 rows for 2: gathered
    assert kv_pool.covering_rows([0, 1, 2, 3, 5]) == [0, 1, 2, 3, 5]  # 6 rows for 5: within 1.5x
    assert kv_pool.covering_rows([0, 1, 2, 6]) is None  # 7 rows for 4: past 1.5x


@pytest.mark.parametrize("packed,blocks", [(False, [1, 1, 1, 1, 1]), (True, [1, 4, 1, 2, 3]), (True, [3] * 5),
                                           (True, [1, 1, 6, 1, 1])])
def test_rows_with_gaps_between_their_slots_match_each_row_alone_without_a_gather(tiny, monkeypatch, packed,
                                                                                  blocks) -> None:
    """A batch missing the sessions in slots 1 and 4 (their requests just ended, or they came
    back late) reads slots 0..6 as one slice, the gaps included, and every row still gets what it
    gets alone: plain decoding (the model's own attention), packed blocks of several lengths
    (first tokens, then rows), a uniform grid, and one long block's rest in a call of its own."""
    forward = BatchedForward(tiny, packed=packed)
    rng = random.Random(len(blocks) + sum(blocks))
    slots = [forward.pool.allocate() for _ in range(7)]
    prompts = {slot: [rng.randrange(48) for _ in range(4 + 3 * slot)] for slot in slots}
    for slot, ids in prompts.items():  # every slot holds a session's keys, the gaps' too
        forward.run([RowInput(slot, 0, ids)], keep_last=1)
    present = [0, 2, 3, 5, 6]
    new = {slot: [rng.randrange(48) for _ in range(n)] for slot, n in zip(present, blocks)}
    rows = [RowInput(slot, len(prompts[slot]), new[slot]) for slot in present]
    alone = {row.slot: forward.run([row])[0] for row in rows}

    views = recorded_views(monkeypatch)
    batched = forward.run(rows)
    assert len(views) == 1 and views[0]._range == slice(0, 7) and views[0]._index is None
    assert views[0].cover_rows == present
    for row, logits in zip(rows, batched):
        assert logits.shape == (len(row.tokens), 48)
        torch.testing.assert_close(logits, alone[row.slot], rtol=1e-4, atol=1e-4)
