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

    views: list[kv_pool.BatchCacheView] = []
    real_view = kv_pool.BatchCacheView

    def recording_view(*args, **kwargs):
        views.append(real_view(*args, **kwargs))
        return views[-1]

    monkeypatch.setattr("target_service.batch_forward.BatchCacheView", recording_view)
    shuffled = slots[:]
    rng.shuffle(shuffled)
    assert shuffled != sorted(shuffled)
    batched = forward.run([RowInput(slot, len(prompts[slot]), blocks[slot]) for slot in shuffled])
    for slot, logits in zip(shuffled, batched):
        torch.testing.assert_close(logits, alone[slot], rtol=1e-4, atol=1e-4)
    assert len(views) == 1 and views[0].slots == sorted(shuffled) and views[0]._range is not None
