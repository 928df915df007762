"""Self-distillation batches on a tiny random target: what a batch keeps is what the target,
run alone on each whole sequence, computes."""

from __future__ import annotations

import pytest
import torch

from specd.models import load_model, save_tiny_random_model
from specd.train_draft.selfdistill import generate_batch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("t"), vocab_size=40, hidden_size=32, seed=2)))


@torch.inference_mode()
def _features_alone(tiny, tokens: torch.Tensor) -> torch.Tensor:
    return tiny.model.get_decoder()(input_ids=tokens[None]).last_hidden_state[0]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_batch_features_are_the_targets_own_states_per_sequence(tiny, temperature):
    prompts = [[3, 5, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9]]  # different lengths: left padding must not leak in
    generator = torch.Generator().manual_seed(0)
    examples = generate_batch(tiny, prompts, max_new_tokens=12, temperature=temperature, generator=generator)
    assert len(examples) == 3
    lm_head = tiny.model.get_output_embeddings()
    for prompt, ex in zip(prompts, examples):
        assert ex.tokens[: len(prompt)].tolist() == prompt
        assert ex.tokens.shape[0] == ex.features.shape[0] > len(prompt)
        alone = _features_alone(tiny, ex.tokens)
        torch.testing.assert_close(ex.features.float(), alone, atol=2e-3, rtol=2e-3)
        if temperature == 0:  # each answer token is the target's greedy token after the one before
            with torch.inference_mode():
                greedy = lm_head(alone[len(prompt) - 1: -1]).argmax(-1)
            assert ex.tokens[len(prompt):].tolist() == greedy.tolist()


def test_a_row_stops_at_its_eos_and_keeps_it(tiny):
    generator = torch.Generator().manual_seed(0)
    prompts = [[3, 5, 7], [11, 13]]
    free = generate_batch(tiny, prompts, max_new_tokens=6, temperature=0.0, generator=generator)
    eos = int(free[0].tokens[4])  # row 0's second answer token, made the end of sequence
    assert eos not in free[1].tokens[2:].tolist(), "pick prompts whose second row never emits it"
    tiny.eos_token_ids, saved = frozenset({eos}), tiny.eos_token_ids
    try:
        stopped = generate_batch(tiny, prompts, max_new_tokens=6, temperature=0.0, generator=generator)
    finally:
        tiny.eos_token_ids = saved
    assert stopped[0].tokens.tolist() == free[0].tokens[:5].tolist()  # prompt, two answer tokens, the last the eos
    assert stopped[1].tokens.tolist() == free[1].tokens.tolist()  # the other row runs on

