"""The draft head's model, its drafting session and its checkpoint, on a tiny random target."""

from __future__ import annotations

import pytest
import torch

from draft_service.head.checkpoint import bind_head, load_head, save_head
from draft_service.head.model import DraftHead, HeadConfig, KVCache, apply_rotary, rotary_tables
from draft_service.proposers.head import HeadSession
from specd.cpu_kernels import OneDnnLinear, use_linear_kernel
from specd.models import load_model, save_tiny_random_model
from specd.sampling import SamplingParams
from specd.train_draft.train_head import estimated_acceptance_length


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny_random_model(tmp_path_factory.mktemp("t"), vocab_size=40, hidden_size=32, seed=1)))


def make_head(tiny, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig.of_target(tiny.model.config))
    head.init_from_target_layer(tiny.model.get_decoder().layers[-1], tiny.model.get_decoder().norm)
    return head.eval()


def test_rotation_preserves_norms_and_position_zero_is_identity():
    x = torch.randn(1, 2, 3, 8)
    cos, sin = rotary_tables(torch.arange(3), 8, 10000.0)
    y = apply_rotary(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(y[:, :, 0], x[:, :, 0])


def test_cached_steps_equal_one_causal_pass(tiny):
    """Drafting feeds pairs a few at a time through the cache; training runs them all at once."""
    head = make_head(tiny)
    d = head.config.hidden_size
    feats, embeds = torch.randn(1, 7, d), torch.randn(1, 7, d)
    with torch.no_grad():
        full = head(embeds, feats, torch.arange(7))
        cache = KVCache()
        parts = [head(embeds[:, a:b], feats[:, a:b], torch.arange(a, b), cache) for a, b in ((0, 3), (3, 4), (4, 7))]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)
    cache.crop(4)
    assert cache.length == 4


def test_session_drafts_from_features_and_keeps_only_true_pairs(tiny):
    loaded = bind_head(make_head(tiny), tiny.model, torch.arange(30))
    session = HeadSession(loaded, max_context=64, prompt_ids=[1, 2, 3, 4], params=SamplingParams())
    assert session.propose(3).tokens == []  # no features yet: nothing to draft from
    session.add_features(0, torch.randn(4, 32))  # the prompt's
    session.append([5])  # the first token: its feature comes with the next verify
    proposal = session.propose(3)
    assert len(proposal.tokens) == 3 and all(t < 30 for t in proposal.tokens)  # only draft-vocabulary tokens
    assert session.true_pairs == 4 and session.cache.length == 4  # the drafted pairs were cropped away
    assert session.propose(3).tokens == proposal.tokens  # deterministic for greedy
    ahead = session.propose_ahead(proposal.tokens, 2)  # tokens without features: the head's own features carry them
    assert len(ahead.tokens) == 2 and session.cache.length == 4


def test_onednn_layers_draft_what_torchs_do(tiny):
    loaded = bind_head(make_head(tiny), tiny.model, torch.arange(30))
    features = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))

    def drafts() -> list[int]:
        session = HeadSession(loaded, max_context=64, prompt_ids=[1, 2, 3, 4, 5, 6], params=SamplingParams())
        session.add_features(0, features)
        session.append([7])
        return session.propose(4).tokens

    on_aten = drafts()
    assert use_linear_kernel(loaded.modules(), "onednn") == 9  # fc, q, k, v, o, gate, up, down and the LM head
    assert type(loaded.lm_head) is OneDnnLinear
    assert drafts() == on_aten
    use_linear_kernel(loaded.modules(), "aten")


def test_sampled_drafts_send_q_over_the_whole_vocabulary(tiny):
    loaded = bind_head(make_head(tiny), tiny.model, torch.arange(10))
    session = HeadSession(loaded, 64, [1, 2, 3], SamplingParams(temperature=1.0, seed=3))
    session.add_features(0, torch.randn(2, 32))
    proposal = session.propose(2)
    assert proposal.probs is not None and proposal.probs.shape == (2, 40)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(2))
    assert float(proposal.probs[:, 10:].sum()) == 0.0  # tokens outside the draft vocabulary are never proposed


def test_checkpoint_round_trip_and_wrong_target_refused(tiny, tmp_path):
    head = make_head(tiny, seed=4)
    save_head(tmp_path, head, torch.arange(20), {"target_model": "tiny", "target_vocab_hash": "abc"})
    loaded = load_head(tmp_path, tiny.model, "abc")
    for name, value in head.state_dict().items():
        assert torch.allclose(loaded.head.state_dict()[name], value.half().float())
    assert loaded.draft_vocab.tolist() == list(range(20))
    with pytest.raises(ValueError, match="train-draft"):
        load_head(tmp_path, tiny.model, "another-hash")


def test_estimated_acceptance_length():
    assert estimated_acceptance_length(0.0, 0.9) == 1.0
    assert estimated_acceptance_length(1.0, 1.0) == 5.0
    assert estimated_acceptance_length(0.5, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
