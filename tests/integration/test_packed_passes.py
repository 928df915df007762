"""Packed verify passes (target_service/packed_attention.py): rows with blocks of different
lengths computed as one sequence of their real tokens give each row what it gets alone and what
a padded pass gives, write the same KV entries, and compute only the rows' own positions."""

from __future__ import annotations

import random

import pytest
import torch

from specd.models import load_model, save_tiny_random_model
from target_service.batch_forward import BatchedForward, RowInput
from target_service.packed_attention import PREFIX, Packing, grid_length

VOCAB = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 4 query heads over 2 key/value heads: the grouped-query folding is exercised
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("tiny"), vocab_size=VOCAB, seed=5,
                                                 max_position_embeddings=256)))


def prefilled(model, prompts: list[list[int]], packed: bool) -> tuple[BatchedForward, list[int]]:
    forward = BatchedForward(model, packed=packed)
    slots = [forward.pool.allocate() for _ in prompts]
    for slot, ids in zip(slots, prompts):
        forward.run([RowInput(slot, 0, ids)], keep_last=1)
    return forward, slots


def test_packing_offsets() -> None:
    packing = Packing.of([1, 4, 1, 2], torch.device("cpu"))
    assert packing.offsets == (0, 1, 5, 6)
    assert packing.firsts.tolist() == [0, 1, 5, 6]


def test_the_grid_covers_most_rows_blocks_and_leaves_an_outlier_to_its_own_call() -> None:
    assert grid_length([9] + [1] * 15) == 1  # 16 x 9 queries for 24 real ones
    assert grid_length([4, 5, 6, 7] * 4) == 7  # one call for all, 24 padded queries
    assert grid_length([5, 5, 3, 5, 1, 5, 12, 2, 5, 5, 4, 1, 5, 5, 5, 5]) == 5  # the 12's rest alone
    assert grid_length([2, 7, 4, 1, 1, 6], row_call=0.0) == 1  # free calls: nothing padded


@pytest.mark.parametrize("blocks", [[1, 5, 1, 1, 3, 1], [9, 1, 1, 1, 1, 1], [3, 3, 3, 3, 3, 3], [2, 7, 4, 1, 1, 6],
                                    [5, 5, 3, 5, 1, 12], [4, 5, 6, 7, 4, 5]])
def test_packed_rows_match_each_row_alone_and_the_padded_pass(tiny, blocks) -> None:
    # grids of 1 (first tokens, then rows), 2, 5 (the 12's rest alone) and 6 (the 7's)
    rng = random.Random(sum(blocks))
    prompts = [[rng.randrange(VOCAB) for _ in range(4 + 5 * i)] for i in range(len(blocks))]
    new = [[rng.randrange(VOCAB) for _ in range(n)] for n in blocks]
    packed, slots = prefilled(tiny, prompts, packed=True)
    padded, _ = prefilled(tiny, prompts, packed=False)
    rows = [RowInput(slot, len(p), ids) for slot, p, ids in zip(slots, prompts, new)]

    out_packed = packed.run(rows)
    assert tiny.model.config._attn_implementation.startswith(PREFIX)
    assert packed.last_positions == sum(blocks)
    out_padded = padded.run(rows)
    assert padded.last_positions == len(blocks) * max(blocks)

    alone, _ = prefilled(tiny, prompts, packed=False)
    for b, row in enumerate(rows):
        single = alone.run([row])[0]
        assert out_packed[b].shape == (blocks[b], VOCAB)
        torch.testing.assert_close(out_packed[b], single, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out_packed[b], out_padded[b], rtol=1e-4, atol=1e-4)
    for b, row in enumerate(rows):  # the KV entries written for each row's new tokens are the same
        end = row.start + blocks[b]
        torch.testing.assert_close(packed.pool.k[:, row.slot, :, :end], padded.pool.k[:, row.slot, :, :end],
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(packed.pool.v[:, row.slot, :, :end], padded.pool.v[:, row.slot, :, :end],
                                   rtol=1e-4, atol=1e-4)


def test_features_of_a_packed_pass_match_the_padded_pass(tiny) -> None:
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    new = [[13], [14, 15, 16, 17], [18, 19]]
    packed, slots = prefilled(tiny, prompts, packed=True)
    padded, _ = prefilled(tiny, prompts, packed=False)
    rows = [RowInput(slot, len(p), ids) for slot, p, ids in zip(slots, prompts, new)]
    logits_a, feats_a = packed.run_with_features(rows)
    logits_b, feats_b = padded.run_with_features(rows)
    assert feats_a is not None and feats_b is not None
    for b, ids in enumerate(new):
        assert feats_a[b].shape[0] == len(ids)
        torch.testing.assert_close(feats_a[b], feats_b[b], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits_a[b], logits_b[b], rtol=1e-4, atol=1e-4)


def test_plain_and_single_row_passes_are_not_packed(tiny) -> None:
    forward, slots = prefilled(tiny, [[1, 2, 3 + i] for i in range(5)], packed=True)
    forward.run([RowInput(slot, 3, [8]) for slot in slots])
    assert forward.last_positions == 5  # plain decoding, five rows of one position
    forward.run([RowInput(slots[0], 4, [8, 9, 10, 11, 12])])
    assert forward.last_positions == 5  # one row: the padded path (nothing to pack)
    forward.run([RowInput(slots[1], 4, [8, 9]), RowInput(slots[2], 4, [8])])
    assert forward.last_positions == 6  # 3 tokens on a CPU: padded to the fast row count, 2 x 3
