"""The depth controller against a simulated target: no model, no network, pure Python and numpy."""

from __future__ import annotations

import logging
import math
import random
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

from coordinator import controller as controller_module
from coordinator.acceptance import SessionRecord
from coordinator.controller import (
    CHEAP_PROBE,
    ECHO_STREAK,
    ECHO_STREAK_MAX,
    GATED_PROBE_BUDGET,
    PROBE_EPOCH_PASSES,
    AcceptanceEstimator,
    CostModel,
    DepthController,
    LoadSignal,
    PassPeers,
    SharedAcceptance,
    acceptance_lower_bound,
    batch_choice,
    best_depth,
    best_reading,
    depth_rates,
    expected_tokens,
    load_penalty,
    make_controller,
    mixture_tokens,
    pass_alphas,
    packed_rates,
    pass_rates,
    pass_sessions,
    probe_period,
    profile_tokens,
)
from coordinator.cost_model import STALE_PASSES, jump_reading_line, slope_by_precision
from coordinator.depth_math import MIXTURE_TRIALS, MixturePrior
from coordinator.echo import EchoLookup, ShadowDraft, echo_guess, echo_hit
from coordinator.running_mean import RunningMean
from coordinator.step_reuse import StepReuse
from draft_service.proposers.ngram import NgramProposer
from specd.sampling import SamplingParams

K_MAX = 8


def simulated_verify_ms(block_length: int, batch_size: int) -> float:
    """A compute-bound target: 30 ms per pass growing 1/7 per extra row, 4 ms per extra position and row."""
    return 30.0 * (1 + (batch_size - 1) / 7) + 4.0 * (block_length - 1) * batch_size


def simulated_cost_model() -> CostModel:
    cm = CostModel()
    for _ in range(16):  # enough samples that the prior's pseudo-samples hardly count
        for b in (1, 2, 4, 8, 16):
            for n in (1, 3, 5, 9):
                cm.observe_verify(b, n, simulated_verify_ms(n, b))
    return cm


def run_session(controller: DepthController, alphas, seed: int = 0, load: LoadSignal | None = None) -> list[int]:
    """Drive `controller` for len(alphas) steps with Bernoulli acceptance alphas[t] at step t."""
    rng = np.random.default_rng(seed)
    for a in alphas:
        k = controller.choose(load)
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        b = load.batch_size if load is not None else 1
        controller.observe(k, accepted, 0.0, simulated_verify_ms(k + 1, b), b)
    return controller.history


def changes(history: list[int]) -> int:
    return sum(1 for x, y in zip(history, history[1:]) if x != y)


# expected_tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_expected_tokens_closed_forms(k: int) -> None:
    assert expected_tokens(k, 0.0) == 1.0
    assert expected_tokens(k, 1.0) == k + 1
    assert expected_tokens(0, 0.7) == 1.0
    assert expected_tokens(k, 0.5) == pytest.approx(sum(0.5**i for i in range(k + 1)))


@pytest.mark.parametrize("k,alpha", [(3, 0.6), (8, 0.85), (5, 0.3)])
def test_expected_tokens_matches_monte_carlo(k: int, alpha: float) -> None:
    rng = np.random.default_rng(1)
    accepted = np.cumprod(rng.random((40_000, k)) < alpha, axis=1).sum(axis=1)
    assert expected_tokens(k, alpha) == pytest.approx(1 + accepted.mean(), rel=0.02)


def test_expected_tokens_rejects_negative_k() -> None:
    with pytest.raises(ValueError, match="k must be >= 0"):
        expected_tokens(-1, 0.5)


# best_depth ----------------------------------------------------------------------------------


def verify_b1(k: int) -> float:
    return 30.0 + 4.0 * k  # block of depth k = k + 1 positions


def test_best_depth_low_acceptance_is_zero() -> None:
    for alpha in (0.0, 0.05, 0.15):
        assert best_depth(alpha, lambda k: 0.0, verify_b1, K_MAX)[0] == 0


def test_best_depth_high_acceptance_goes_deep() -> None:
    assert best_depth(0.9, lambda k: 0.0, verify_b1, K_MAX)[0] == K_MAX
    # Reported in the hand-off note: alpha 0.3 / 0.6 / 0.9 at batch 1, free drafts.
    assert [best_depth(a, lambda k: 0.0, verify_b1, K_MAX)[0] for a in (0.3, 0.6, 0.9)] == [1, 3, 8]


def test_best_depth_sequences_match_callables_and_ignore_draft_cost_at_zero() -> None:
    draft = [99.0] + [2.0 * k for k in range(1, K_MAX + 1)]  # the 99 at k = 0 must not count
    verify = [verify_b1(k) for k in range(K_MAX + 1)]
    k, rate = best_depth(0.7, draft, verify, K_MAX)
    assert (k, rate) == best_depth(0.7, lambda j: 2.0 * j, verify_b1, K_MAX)
    assert rate == pytest.approx(max(depth_rates(0.7, draft, verify, K_MAX)))
    with pytest.raises(ValueError, match="need costs"):
        best_depth(0.7, draft[:3], verify, K_MAX)


def test_best_depth_margin_keeps_plain_decoding_on_a_near_tie() -> None:
    # alpha 0.2: k = 1 is 5.9% better than plain decoding.
    assert best_depth(0.2, lambda k: 0.0, verify_b1, K_MAX, margin=0.05)[0] == 1
    k, rate = best_depth(0.2, lambda k: 0.0, verify_b1, K_MAX, margin=0.10)
    assert k == 0 and rate == pytest.approx(1 / 30)


def test_expensive_draft_lowers_depth() -> None:
    free = best_depth(0.8, lambda k: 0.0, verify_b1, K_MAX)[0]
    costly = best_depth(0.8, lambda k: 8.0 * k, verify_b1, K_MAX)[0]
    assert 0 < costly < free


# load ----------------------------------------------------------------------------------------


def test_load_penalty() -> None:
    assert load_penalty(None) == 1.0
    assert load_penalty(LoadSignal(0, 16, 1.0, 16)) == 1.0
    assert load_penalty(LoadSignal(15, 16, 1.0, 16)) == 1.0  # the pass's other rows, queued for the next pass
    assert load_penalty(LoadSignal(23, 16, 1.0, 16)) == pytest.approx(1.5)
    assert load_penalty(LoadSignal(11, 4, 0.25, 16)) > load_penalty(LoadSignal(23, 16, 1.0, 16))
    assert LoadSignal(0, 40, 1.0, 16).batch_size == 16
    assert LoadSignal(0, 2, 0.5, 16).batch_size == 8
    stats = SimpleNamespace(queue_depth=3, open_sessions=5, batch_occupancy=0.25)
    assert LoadSignal.from_target_stats(stats, 8) == LoadSignal(3, 5, 0.25, 8)


@pytest.mark.parametrize("alpha", [0.6, 0.8, 0.9])
def test_rising_load_lowers_k(alpha: float) -> None:
    controller = DepthController(K_MAX, simulated_cost_model(), estimator=AcceptanceEstimator(alpha0=alpha))
    sweep = [LoadSignal(0, n, n / 16, 16) for n in (1, 2, 3, 4, 6, 8, 12, 16)]
    sweep += [LoadSignal(q, 16, 1.0, 16) for q in (1, 4, 8, 16, 32, 64)]
    ks = [controller.target(load) for load in sweep]
    assert all(a >= b for a, b in zip(ks, ks[1:])), ks
    assert ks[0] >= 3 and ks[-1] == 0, ks


def test_sustained_load_lowers_the_chosen_k() -> None:
    controller = DepthController(K_MAX, simulated_cost_model())
    history = run_session(controller, [0.9] * 150, load=LoadSignal(0, 1, 1 / 16, 16))
    assert history[-1] >= 6
    history = run_session(controller, [0.9] * 50, load=LoadSignal(0, 12, 0.75, 16))
    assert 0 < history[-1] <= 3


# acceptance ----------------------------------------------------------------------------------


def test_estimator_prior_and_conditional_rates() -> None:
    est = AcceptanceEstimator(alpha0=0.5, prior_weight=4, window=10_000)
    assert est.alpha == 0.5 and est.position_rates == []
    rng = np.random.default_rng(2)
    for _ in range(3000):
        accepted = int(np.cumprod(rng.random(6) < 0.7).sum())
        est.update(6, accepted)
    # accepted / drafted would say about 0.40 here; the conditional estimate recovers 0.7.
    assert est.alpha == pytest.approx(0.7, abs=0.02)
    assert len(est.position_rates) == 6
    assert all(r == pytest.approx(0.7, abs=0.06) for r in est.position_rates)


def test_estimator_tracks_and_ages() -> None:
    est = AcceptanceEstimator(window=16)
    for _ in range(100):
        est.update(4, 4)
    assert est.alpha > 0.95
    for _ in range(100):
        est.update(4, 0)
    assert est.alpha < 0.1
    before, weight = est.alpha, est.weight
    for _ in range(200):  # k = 0 steps: the estimate stays, its weight fades to the prior's
        est.update(0, 0)
    assert est.alpha == pytest.approx(before)
    assert est.weight < weight and est.weight == pytest.approx(est.prior_weight, rel=0.1)
    with pytest.raises(ValueError):
        est.update(2, 3)


# costs ---------------------------------------------------------------------------------------


def test_cost_model_prior() -> None:
    cm = CostModel(verify_ms=30, per_token_ms=5)
    assert cm.verify_ms(1, 1) == pytest.approx(30)
    assert cm.verify_ms(5, 1) == pytest.approx(50)
    assert cm.verify_ms(1, 8) == pytest.approx(60)  # a batch of 8 costs about twice one row
    assert cm.draft_ms(0) == 0.0 and cm.draft_ms(4) == 0.0
    assert CostModel(draft_per_token_ms=3).draft_ms(4) == pytest.approx(12)


def test_cost_model_fits_interpolates_extrapolates() -> None:
    cm = CostModel()
    for _ in range(32):
        for b, slope in ((1, 2.0), (4, 8.0)):
            for n in (1, 5):
                cm.observe_verify(b, n, 40.0 + slope * (n - 1))
    assert cm.verify_ms(3, 1) == pytest.approx(44.0, rel=0.02)
    assert cm.verify_ms(9, 4) == pytest.approx(104.0, rel=0.02)
    assert cm.verify_ms(9, 2) == pytest.approx(40.0 + 4.0 * 8, rel=0.02)  # between b = 1 and 4
    assert cm.verify_ms(9, 16) > cm.verify_ms(9, 4)  # beyond: the prior's growth on top of b = 4
    one = CostModel(verify_ms=30, per_token_ms=5)
    one.observe_verify(1, 1, 60.0)  # one cell: the prior's shape at the cell's level
    assert one.verify_ms(1, 1) == pytest.approx(60.0) and one.verify_ms(3, 1) == pytest.approx(80.0)


def test_cost_model_resists_one_outlier() -> None:
    """Two single-sample cells, one of them a pass slowed 7x by a neighbour: the prior's shape
    keeps the fitted cost per extra position far below what the two points alone would give."""
    cm = CostModel(verify_ms=30, per_token_ms=5)
    cm.observe_verify(1, 1, 250.0)
    cm.observe_verify(1, 3, 1900.0)  # the two points alone: 825 ms per extra position
    slope = cm.verify_ms(9, 1) - cm.verify_ms(8, 1)
    assert slope < 500.0


def _packed_passes_at_16(pass_ids: bool, slow: tuple[int, float]) -> CostModel:
    """A packed replica's passes at 16 rows, each reported by its 16 rows (as the engine does):
    plain 120 ms, 48 positions 180 ms, 64 positions 210 ms (1.875 ms a position), ten passes
    each, then one slow pass at a new total of positions."""
    cm = CostModel()
    number = 0

    def one_pass(positions: int, ms: float) -> None:
        nonlocal number
        number += 1
        for _ in range(16):
            cm.observe_verify(16, 1 if positions == 16 else 3, ms, positions=positions, packed=True,
                              pass_id=number if pass_ids else 0)

    for _ in range(20):
        one_pass(16, 120.0)
    for _ in range(10):
        one_pass(48, 180.0)
        one_pass(64, 210.0)
    one_pass(*slow)
    return cm


def test_a_pass_counts_once_and_one_slow_pass_does_not_tilt_the_line() -> None:
    """At 16 sessions one slow pass at a new block length, counted once per row, weighed as 16
    samples and priced a position at several times its cost (code edits stayed at k = 0)."""
    numbered = _packed_passes_at_16(True, (72, 400.0))
    assert numbered.position_ms(16) == pytest.approx(1.875, rel=0.1)
    # counted per row it settles a cell of its own and tilts the line (the chord's weight,
    # `slope_by_precision`, now holds it to under twice the slope, from over twice before)
    assert _packed_passes_at_16(False, (72, 400.0)).position_ms(16) > 1.5 * numbered.position_ms(16)
    # the rows of one pass are one sample: three passes settle a cell, not three rows of one
    assert sorted((positions, count) for _, _, count, _, positions in numbered.verify_table()) == [
        (16, 20), (48, 10), (64, 10), (72, 1)]


def packed_pass_recorder_at_16() -> tuple[CostModel, Callable[[int, float], None]]:
    """A cost model and `one_pass(extra, ms)`: one numbered packed pass of 16 rows with `extra`
    draft positions, reported once."""
    cm = CostModel()
    number = 0

    def one_pass(extra: int, ms: float) -> None:
        nonlocal number
        number += 1
        cm.observe_verify(16, 1 + -(-extra // 16), ms, positions=16 + extra, packed=True, pass_id=number)

    return cm, one_pass


def test_cells_within_a_position_a_row_price_a_position_by_the_chord_from_the_plain_pass() -> None:
    """Fixed k = 4 at 16 rows settles cells at 56-64 extra positions, half a position a row apart
    at most, with a few ms of noise on passes of 150. The line through them alone priced a position at
    0.06 ms on the AMD EPYC machine (its slope is the noise), and auto sessions after that cell
    drafted blocks of 16. Such cells tell no slope: a position is priced by the chord from the
    plain pass, jump and all, until passes spread over block lengths (auto's own) tell the slope."""
    cm, one_pass = packed_pass_recorder_at_16()
    for _ in range(3):
        one_pass(0, 80.0)
    for _ in range(8):
        for extra in (56, 60, 62, 63, 64):
            one_pass(extra, 80.0 + 1.1 * extra + 1.2 * (64 - extra))  # noise that tilts the cluster the other way
    assert cm.position_ms(16) == pytest.approx(1.2, rel=0.1)
    copiers = controllers_on_one_replica([0.9] * 16, cm)
    for session in copiers:  # every peer drafts: the jump is paid anyway
        session.peers.commit(session._peer, 4)
    assert 2 <= copiers[0].target(LoadSignal(0, 16)) <= 6
    for extra in range(20, 200, 9):  # auto's mixed blocks: 2 ms a position
        one_pass(extra, 80.0 + 2.0 * extra)
    assert 1.5 < cm.position_ms(16) < 3.0


def test_a_cold_replicas_first_few_draft_positions_do_not_price_a_position_at_the_jump() -> None:
    """A fresh stack at 16 code edits: the opening wave's drafted passes held 1-3 positions at
    142-148 ms against a plain pass's 80. The chord from the plain pass prices a position at 35 ms
    where one costs 2-3, and sessions whose shadows say 0.99 stayed at k = 0 to the end, so no
    pass ever told the slope. Read as a jump plus the prior's slope, those passes let the sessions
    that gain most draft together, sharing the jump, and the passes that follow tell which holds."""
    cm, one_pass = packed_pass_recorder_at_16()
    for _ in range(20):
        one_pass(0, 80.0)
    for extra, ms in [(1, 142.0), (2, 145.0), (3, 148.0)] * 2:
        one_pass(extra, ms)
    assert cm.position_ms(16) > 20.0 and cm.packed_jump_ms(16) == 0.0  # the chord: jump as slope
    position, jump = cm.jump_reading(16)
    assert 1.5 < position < 4.5 and 50.0 < jump < 66.0
    load = LoadSignal(0, 16)
    copiers = controllers_on_one_replica([0.99] * 16, cm)
    assert all(s.target(load) > 0 for s in copiers)
    assert all(s.target(load) == 0 for s in controllers_on_one_replica([0.5] * 16, cm))  # a jump of 60 is not free
    alone = controllers_on_one_replica([0.99] + [0.05] * 15, cm)
    assert alone[0].target(load) == 0  # nobody to share the jump with
    for extra in range(20, 200, 9):  # the passes that follow: 2 ms a position, a jump of 10
        one_pass(extra, 90.0 + 2.0 * extra)
    assert cm.jump_reading(16) is None and 1.5 < cm.position_ms(16) < 3.0


def test_the_jump_reading_is_offered_only_where_the_passes_hold_under_a_position_a_row() -> None:
    assert jump_reading_line(32.0, 0.125, 145.0, 3.0) == pytest.approx((145.0 - 0.375, 3.0))
    assert jump_reading_line(32.0, 1.0, 145.0, 3.0) is None  # a position a row: the chord holds
    assert jump_reading_line(2.0, 0.5, 145.0, 3.0) is None  # the chord is the kinder reading already
    assert best_reading([[1.0, 2.0, 0.5], [1.0, 1.5, 3.0]]) == [1.0, 2.0, 3.0]


def test_cells_a_position_or_two_a_row_apart_are_weighed_against_the_chord_by_their_noise() -> None:
    """Fixed k = 4 at 16 code edits: most rows bring 4 drafts, a few 0 or 1 where the n-gram found
    less, so its cells lie 36-64 extra positions apart (more than a position a row) at a pass time
    whose noise hides the positions' cost. Their line alone is flat (0.02 ms a position in the
    coordinator's log), and the auto sessions after that cell drafted blocks of 16 in passes of
    twice fixed k = 4's time. Each cell is off by the machine's drift, so the fit counts for what
    that spread can tell, and the chord from the plain pass carries the rest."""
    cm, one_pass = packed_pass_recorder_at_16()
    for _ in range(3):
        one_pass(0, 98.0)
    extras = range(36, 65, 4)
    for _ in range(4):
        for extra in extras:
            one_pass(extra, 157.0 + 0.3 * (50 - extra))  # the noise tilts the cluster the other way
    chord = (157.0 - 98.0) / 34.0  # ms a position from the plain pass to the cells' mean
    # the cells alone say 0 +- 0.6 ms a position (noise 10 % of the pass), the chord 1.7 +- 0.9
    assert slope_by_precision(0.0, chord * 16, [(1 + e / 16, 157.0, 4.0) for e in extras], 15.7) / 16 > 0.3 * chord
    assert 0.3 * chord < cm.position_ms(16) <= chord
    copier = controllers_on_one_replica([0.6] * 16, cm)
    for session in copier:  # every peer drafts: the jump is paid anyway
        session.peers.commit(session._peer, 4)
    assert copier[0].target(LoadSignal(0, 16)) <= 6  # not 16


def test_cost_model_tracks_drift_and_ignores_garbage() -> None:
    cm = CostModel(window=16)
    for _ in range(100):
        cm.observe_verify(1, 1, 30.0)
    for _ in range(100):
        cm.observe_verify(1, 1, 60.0)
    assert cm.verify_ms(1, 1) == pytest.approx(60.0, rel=0.01)
    cm.observe_verify(0, 1, 5.0)
    cm.observe_verify(1, 1, float("nan"))
    assert cm.verify_ms(1, 1) == pytest.approx(60.0, rel=0.01)


def test_cost_model_draft_fit() -> None:
    cm = CostModel()
    cm.observe_draft(4, 20.0)
    assert cm.draft_ms(2) == pytest.approx(10.0)  # one point: proportional to k
    cm.observe_draft(1, 8.0)
    assert cm.draft_ms(7) == pytest.approx(8.0 + 4.0 * 6)  # a line: 4 ms fixed + 4 ms a token
    cm.observe_draft(0, 100.0)
    assert cm.draft_ms(0) == 0.0


def test_cost_model_seed_from_stats() -> None:
    cm = CostModel()
    cm.seed_from_stats([(1, 1, 10, 25.0), (1, 5, 10, 45.0)])
    cm.seed_from_stats([SimpleNamespace(batch_size=8, block_length=1, count=3, mean_ms=50.0),
                        SimpleNamespace(batch_size=8, block_length=3, count=3, mean_ms=90.0)])
    # one-token blocks read their own cell; longer ones a line through the cells of 2 or more
    # positions (one here: block 5), with the slope another batch size measured, scaled by the
    # rows (batch 8: 20 ms a position over 8 rows, 2.5 at batch 1)
    assert cm.verify_ms(1, 1) == pytest.approx(25.0)
    assert cm.verify_ms(3, 1) == pytest.approx(40.0, rel=0.02)
    # and batch 8: its one long block (3) with batch 1's slope times 8 (5 x 8 = 40 ms a position)
    assert cm.verify_ms(5, 8) == pytest.approx(170.0, rel=0.02)
    cm.observe_verify(1, 1, 35.0)  # a live sample blends in as 1 of 11
    assert 25.0 < cm.verify_ms(1, 1) < 27.0


# the controller ------------------------------------------------------------------------------


def test_low_acceptance_gives_zero_and_high_gives_deep() -> None:
    low = run_session(DepthController(K_MAX, simulated_cost_model()), [0.05] * 100)
    assert low[-1] == 0 and low[50:].count(0) >= 45
    high = run_session(DepthController(K_MAX, simulated_cost_model()), [0.95] * 100)
    assert high[-1] >= 7


def test_k_does_not_flap_near_a_boundary() -> None:
    # alpha 0.6 sits on the k = 2 / k = 3 boundary at batch 1 (see the histogram in the note).
    steady = run_session(DepthController(K_MAX, simulated_cost_model()), [0.6] * 500, seed=3)
    naive = run_session(DepthController(K_MAX, simulated_cost_model(), switch_after=1, switch_margin=0.0),
                        [0.6] * 500, seed=3)
    # a depth visited after the warm-up is worth at least 0.95 of the best (alone, the session's
    # own per-position rates decide: noisier than the pooled rate, so a neighbour now and then)
    rates = depth_rates(0.6, lambda k: 0.0, lambda k: simulated_verify_ms(k + 1, 1), K_MAX)
    assert all(rates[k] >= 0.95 * max(rates) for k in set(steady[100:]))
    assert sum(k not in (2, 3) for k in steady[100:]) <= 0.05 * len(steady[100:])
    assert changes(steady) <= 10
    assert changes(naive) >= 3 * changes(steady)


def test_disabled_session_comes_back() -> None:
    controller = DepthController(K_MAX, simulated_cost_model())
    history = run_session(controller, [0.05] * 200 + [0.9] * 300, seed=4)
    low = history[:200]
    assert low.count(0) >= 150
    # at k = 0 only probes draft, and they are spaced by at least probe_interval steps
    probes = [t for t in range(40, 200) if low[t] > 0]
    assert all(b - a >= controller.probe_interval for a, b in zip(probes, probes[1:]))
    back = next(t for t in range(200, 500) if history[t] > 0 and history[t + 1] > 0)
    assert back - 200 <= controller.probe_max_interval + 16
    assert history[-1] >= 6


def test_no_probes_when_load_alone_rules_out_speculation() -> None:
    heavy = LoadSignal(32, 16, 1.0, 16)
    history = run_session(DepthController(K_MAX, simulated_cost_model()), [0.9] * 200, load=heavy)
    assert history.count(0) == 200


def test_fixed_mode() -> None:
    controller = DepthController(K_MAX, simulated_cost_model(), mode="fixed", fixed_k=4)
    history = run_session(controller, [0.05] * 50 + [0.9] * 50, load=LoadSignal(32, 16, 1.0, 16))
    assert history == [4] * 100


def test_schedule_mode_picks_by_batch_size() -> None:
    table = {1: 8, 4: 4, 8: 2, 16: 0}
    for open_sessions, expected in ((1, 8), (3, 8), (4, 4), (7, 4), (8, 2), (15, 2), (16, 0), (40, 0)):
        controller = DepthController(K_MAX, mode="schedule", schedule=table)
        load = LoadSignal(0, open_sessions, 0.0, 16)
        assert run_session(controller, [0.8] * 5, load=load) == [expected] * 5
    below_all = DepthController(K_MAX, mode="schedule", schedule={4: 3, 8: 1})
    assert below_all.choose(LoadSignal(0, 1, 0.0, 16)) == 3
    # batch size from the last observation when no load is given, switching after the hysteresis
    controller = DepthController(K_MAX, mode="schedule", schedule=table)
    assert controller.choose() == 8
    for _ in range(controller.switch_after):
        controller.observe(8, 8, 0.0, 30.0, batch_size=9)
        controller.choose()
    assert controller.history[-1] == 2


@pytest.mark.parametrize("mode,kwargs", [("auto", {}), ("fixed", {"fixed_k": 4}),
                                         ("schedule", {"schedule": {1: 6}})])
def test_floor_turns_speculation_off(mode: str, kwargs: dict) -> None:
    controller = DepthController(K_MAX, simulated_cost_model(), mode=mode, floor=0.5, **kwargs)
    history = run_session(controller, [0.9] * 30 + [0.3] * 200, seed=5)
    assert history[29] > 0
    assert history[-100:].count(0) >= 90  # off, apart from the probes


def test_k_max_zero_never_speculates() -> None:
    history = run_session(DepthController(0, simulated_cost_model()), [0.99] * 50)
    assert history == [0] * 50


# make_controller -----------------------------------------------------------------------------


def test_make_controller_forms() -> None:
    cm = simulated_cost_model()
    auto = make_controller("auto", K_MAX, cm)
    assert auto.mode == "auto" and auto.floor == 0.0 and auto.cost_model is cm
    assert make_controller(" auto, floor=0.2 ", K_MAX, cm).floor == pytest.approx(0.2)
    fixed = make_controller("4", K_MAX, cm)
    assert fixed.mode == "fixed" and fixed.fixed_k == 4 and fixed.choose() == 4
    assert make_controller("0", K_MAX, cm).choose() == 0
    sched = make_controller("schedule:1=8,4=4,8=2,16=0,floor=0.3", K_MAX, cm)
    assert sched.mode == "schedule" and sched.schedule == {1: 8, 4: 4, 8: 2, 16: 0}
    assert sched.floor == pytest.approx(0.3)


@pytest.mark.parametrize("spec,problem", [
    ("", "empty"),
    ("fast", "unknown mode 'fast'"),
    ("-1", "not in 0..8"),
    ("9", "not in 0..8"),
    ("auto,3", "unexpected '3'"),
    ("4,8", "unexpected '8'"),
    ("auto,floor=x", "floor 'x' is not a number"),
    ("auto,floor=1.5", "floor 1.5 is not in"),
    ("auto,floor=0.1,floor=0.2", "more than once"),
    ("floor=0.2,auto", "must come last"),
    ("schedule:", "is not BATCH=K"),
    ("schedule:1=8,4", "'4' is not BATCH=K"),
    ("schedule:1=8,1=4", "batch size 1 twice"),
    ("schedule:1=12", "k 12 for batch size 1 is not in 0..8"),
    ("schedule:-2=1", "BATCH >= 0"),
])
def test_make_controller_rejects_bad_specs(spec: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        make_controller(spec, K_MAX, CostModel())
    assert problem in str(info.value)


def test_one_stalled_pass_barely_moves_a_settled_cell() -> None:
    cm = CostModel()
    for _ in range(10):
        cm.observe_verify(1, 1, 30.0)
    cm.observe_verify(1, 1, 3000.0)  # a pass that waited for a neighbour process
    assert cm.verify_ms(1, 1) < 40.0


def test_new_sessions_start_from_the_shared_acceptance() -> None:
    """A useless draft seen by earlier sessions: the next session is off from its first step; a
    draft that earlier sessions found excellent: the next session starts deep."""
    cm = simulated_cost_model()
    useless, excellent = SharedAcceptance(), SharedAcceptance()
    for _ in range(200):
        useless.update(4, 0)
        excellent.update(8, 8)
    off = make_controller("auto", K_MAX, cm, useless)
    assert off.choose() == off.probe_k  # one probe: the shared rate came from other prompts
    off.observe(off.probe_k, 0, 0.0, simulated_verify_ms(off.probe_k + 1, 1), 1)
    assert [off.choose() for _ in range(3)] == [0] * 3  # then an early re-probe (the answer may start unlike its prompt)
    assert make_controller("auto", K_MAX, cm, excellent).choose() >= 6
    session = make_controller("auto", K_MAX, cm, useless)
    run_session(session, [0.0] * 20)
    assert useless.alpha < 0.05  # sessions feed the shared estimate back
    good_prompt = make_controller("auto", K_MAX, cm, useless)  # this prompt copies its input
    assert run_session(good_prompt, [0.95] * 16)[-1] >= 4


def test_a_session_record_reports_a_drafting_session_once_and_a_session_that_never_drafted_not_at_all() -> None:
    """`SessionRecord`, which a fixed k's session keeps as a controller does: every drafted
    step's trials go to the method's pooled rate and every step that asked for a draft to its
    fill; at its end a session that drafted joins the recent sessions (once, however often it is
    closed), and one that never drafted does not (it says nothing about what blocks accept)."""
    shared = SharedAcceptance()
    record = SessionRecord(shared)
    for _ in range(6):
        record.observe(4, 4, requested=4)
    record.observe(2, 0, requested=4)  # the proposer drafted half of what was asked: all rejected
    assert record.drafted and record.estimator.alpha > 0.8
    assert shared.fill < 1.0 and record.fill.mean < 1.0
    assert shared.recent_sessions() is None
    for _ in range(2):
        record.close()
    assert len(shared._sessions) == 1
    idle = SessionRecord(shared)
    idle.observe(0, 0)
    idle.close()
    assert len(shared._sessions) == 1
    for _ in range(3):
        other = SessionRecord(shared)
        other.observe(4, 4, requested=4)
        other.close()
    recent = shared.recent_sessions()
    assert recent is not None and len(recent) == 4 and all(alpha > 0.5 for alpha, _ in recent)


def test_a_probe_that_drafted_nothing_is_repeated() -> None:
    off = make_controller("auto", K_MAX, simulated_cost_model(), SharedAcceptance(alpha0=0.02))
    assert off.choose() == off.probe_k
    off.observe(0, 0, 0.0, 30.0, 1)  # the proposer had nothing to offer yet
    assert off.choose() == off.probe_k
    off.observe(off.probe_k, off.probe_k, 0.0, simulated_verify_ms(off.probe_k + 1, 1), 1)
    assert off.choose() > 0  # the prompt's drafts are accepted: speculation comes on


# the pass view --------------------------------------------------------------------------------


def test_pass_rates_one_session_is_depth_rates_and_mixed_sessions_take_the_geometric_mean() -> None:
    verify = [simulated_verify_ms(k + 1, 4) for k in range(K_MAX + 1)]
    assert pass_rates([0.7], lambda k: 1.0, verify, K_MAX) == depth_rates(0.7, lambda k: 1.0, verify, K_MAX)
    mixed = pass_rates([0.9, 0.1], lambda k: 0.0, verify, K_MAX)
    for k, rate in enumerate(mixed):
        assert rate == pytest.approx((expected_tokens(k, 0.9) * expected_tokens(k, 0.1)) ** 0.5 / verify[k])
    with pytest.raises(ValueError):
        pass_rates([], lambda k: 0.0, verify, K_MAX)


def test_pass_alphas_fill_unknown_peers_with_the_known_mean() -> None:
    assert pass_alphas(0.8, [0.2], 4) == [0.8, 0.2, 0.5, 0.5]
    assert pass_alphas(0.8, [0.2, 0.4, 0.6], 2) == [0.8, 0.2, 0.4, 0.6]  # the registry is fresher than the count


def test_peers_join_update_leave() -> None:
    peers = PassPeers()
    a, b = peers.join(0.5), peers.join(0.9)
    peers.update(a, 0.1)
    assert peers.others(b) == [0.1] and len(peers) == 2
    peers.leave(a)
    peers.update(a, 0.7)  # a session gone stays gone
    assert peers.others(b) == [] and len(peers) == 1


def controllers_on_one_replica(alphas: list[float], cm: CostModel) -> list[DepthController]:
    peers = PassPeers()
    return [DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=a, prior_weight=1000.0), peers=peers)
            for a in alphas]


def test_sessions_of_one_replica_agree_on_the_pass_depth() -> None:
    """Eight sessions in one batch, one with poor acceptance among good ones: the pass is deep
    anyway, so it drafts along (alone it would choose k = 0 at this batch size)."""
    cm = simulated_cost_model()
    load = LoadSignal(0, 8)
    sessions = controllers_on_one_replica([0.05] + [0.95] * 7, cm)
    ks = [s.target(load) for s in sessions]
    assert len(set(ks)) == 1 and ks[0] >= 3, ks
    alone = DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.05, prior_weight=1000.0))
    assert alone.target(load) == 0


def test_one_good_session_among_poor_ones_does_not_lengthen_the_pass_or_probe() -> None:
    cm = simulated_cost_model()
    load = LoadSignal(0, 16)
    sessions = controllers_on_one_replica([0.2] * 15 + [0.95], cm)
    for poor in sessions[:-1]:  # the poor ones have drafted: their acceptance is known
        poor.observe(2, 0, 0.0, simulated_verify_ms(3, 16), 16)
    good = sessions[-1]
    assert good.target(load) == 0
    alone = DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.95, prior_weight=1000.0))
    assert alone.target(load) > 0
    assert [good.choose(load) for _ in range(200)] == [0] * 200  # no probe could turn the pass's choice


def test_a_closed_session_no_longer_counts() -> None:
    cm = simulated_cost_model()
    load = LoadSignal(0, 2)
    poor, good = controllers_on_one_replica([0.05, 0.95], cm)
    shared = good.target(load)
    good.close()
    assert poor.target(LoadSignal(0, 1)) == 0 and shared > 0


def test_new_sessions_probe_together_and_a_known_batch_does_not() -> None:
    """Eight new sessions whose shared prior says "off": none knows more than the others, so each
    counts its unproven peers as optimistic and all probe at their first step (one long pass for
    all, instead of none ever probing). Once they have drafted, their acceptance is known."""
    cm = simulated_cost_model()
    load = LoadSignal(0, 8)
    shared = SharedAcceptance(alpha0=0.1)
    peers = PassPeers()
    sessions = [DepthController(K_MAX, cm, shared=shared, peers=peers) for _ in range(8)]
    assert all(s.choose(load) > 0 for s in sessions)
    for s in sessions:
        s.observe(s.history[-1], 0, 0.0, simulated_verify_ms(3, 8), 8)
    assert all(s.choose(load) == 0 for s in sessions)


def test_a_batch_size_seen_only_at_one_block_length_borrows_its_slope() -> None:
    """Batch 16 seen only without speculation: its cost per extra position comes from the batch
    size where several block lengths were seen, scaled by the rows, not from the prior's guess."""
    cm = CostModel()
    for _ in range(20):
        for n in range(1, 10):
            cm.observe_verify(1, n, 62.0 + 4.0 * (n - 1))
        cm.observe_verify(16, 1, 150.0)
    assert cm.verify_ms(1, 16) == pytest.approx(150.0, rel=0.01)
    assert cm.verify_ms(9, 16) == pytest.approx(150.0 + 8 * 4.0 * 16, rel=0.05)


def test_round_trip_time_goes_to_the_overhead_not_the_slope() -> None:
    """A long block seen once during a busy spell (a slow round trip): with the replica's pass
    time reported, the slope stays the pass's and the round trip lands in every estimate alike."""
    controller = DepthController(K_MAX, CostModel())
    for _ in range(30):
        controller.observe(0, 0, 0.0, 62.0 + 5.0, 1, pass_block_length=1, compute_ms=62.0)
    controller.observe(2, 2, 0.0, 70.0 + 45.0, 1, pass_block_length=3, compute_ms=70.0)
    cm = controller.cost_model
    assert cm.verify_ms(3, 1) - cm.verify_ms(1, 1) == pytest.approx(8.0, abs=2.0)
    assert cm.verify_ms(1, 1) > 62.0 + 5.0
    blind = DepthController(K_MAX, CostModel())  # the same steps timed only from the coordinator
    for _ in range(30):
        blind.observe(0, 0, 0.0, 62.0 + 5.0, 1)
    blind.observe(2, 2, 0.0, 70.0 + 45.0, 1)
    assert blind.cost_model.verify_ms(3, 1) - blind.cost_model.verify_ms(1, 1) > 20.0


def test_a_one_token_pass_is_priced_apart_from_longer_blocks() -> None:
    """Batch 1 on a CPU: one token 65 ms, two ~90, nine ~100 (the decode path is cheaper than the
    masked one). A line through all blocks would put nine at far more than it costs."""
    cm = CostModel()
    for _ in range(20):
        for n, ms in ((1, 65.0), (3, 92.0), (5, 95.0), (9, 101.0)):
            cm.observe_verify(1, n, ms)
    assert cm.verify_ms(1, 1) == pytest.approx(65.0)
    assert cm.verify_ms(9, 1) == pytest.approx(101.0, rel=0.03)
    assert cm.verify_ms(2, 1) == pytest.approx(90.5, rel=0.03)


def test_a_failed_first_probe_is_retried_soon_then_less_often() -> None:
    off = make_controller("auto", K_MAX, simulated_cost_model(), SharedAcceptance(alpha0=0.02))
    history = run_session(off, [0.0] * 80)
    probes = [t for t, k in enumerate(history) if k > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 0 and gaps[0] == 4, probes
    assert all(b >= a for a, b in zip(gaps, gaps[1:])), gaps


def draft_model_cost_model() -> CostModel:
    """The simulated target with a draft model that takes 6 ms a token: a probe of 2 costs 0.5
    of a plain step over it, not cheap (CHEAP_PROBE)."""
    cm = simulated_cost_model()
    for _ in range(8):
        cm.observe_draft(2, 12.0)
    return cm


def shared_after_sessions(alphas: list[float], fill: float = 1.0) -> SharedAcceptance:
    """A method's shared acceptance after sessions that drafted ended with these acceptances."""
    shared = SharedAcceptance(alpha0=0.02)
    for a in alphas:
        shared.report_session(a, fill)
    return shared


def test_recent_sessions_are_the_last_ones_that_drafted() -> None:
    assert shared_after_sessions([0.9] * 3).recent_sessions() is None  # too few sessions to say
    shared = shared_after_sessions([0.9] * 32 + [0.01] * 32, fill=0.5)
    assert shared.recent_sessions() == [(0.01, 0.5)] * 32  # only the last 32 are kept
    assert shared.version == 64


def test_early_probes_in_a_packed_batch_wait_for_prompts_that_would_pay() -> None:
    """At 16 rows a probe of 2 costs every row its positions (10 ms on a 130 ms pass). Recent
    completions (a third of their drafts accepted, a draft for a third of the asked tokens, the
    best at 0.6) would not have paid at this load: a new session does not spend a probe finding
    out, though the best recent prompt alone would have said yes. Where one recent prompt in
    four was a code edit it probes at its first step, unless the request has too few tokens left
    to pay the probe back."""
    load = LoadSignal(0, 16)
    completions = shared_after_sessions([0.33] * 28, fill=0.35)
    for _ in range(4):
        completions.report_session(0.6, 0.4)
    peers = PassPeers()
    new = [DepthController(K_MAX, packed_cost_model(), shared=completions, peers=peers) for _ in range(16)]
    assert not new[0]._early_probes_pay(load)
    assert [s.choose(load, remaining=31) for s in new] == [0] * 16
    some_edits = shared_after_sessions([0.02] * 24 + [0.95] * 8)
    peers = PassPeers()
    fresh = [DepthController(K_MAX, packed_cost_model(), shared=some_edits, peers=peers) for _ in range(16)]
    assert fresh[0].target(load) == 0  # the seed, the mean recent session, does not pay
    assert fresh[0].choose(load, remaining=31) > 0
    assert fresh[1].choose(load, remaining=8) == 0


def test_in_a_batch_a_session_that_hears_echoes_probes_on_echoes_not_on_recent_prompts() -> None:
    """After a run of code edits the method's recent prompts say an early probe pays; at 16 rows a
    session whose engine checks echoes waits for its output to echo the context instead (a probe
    lengthens every row's pass), and probes once it does. Alone, it probes at its first step."""
    load = LoadSignal(0, 16)
    edits = shared_after_sessions([0.02] * 24 + [0.95] * 8)
    peers = PassPeers()
    sessions = [DepthController(K_MAX, packed_cost_model(), shared=edits, peers=peers) for _ in range(16)]
    for s in sessions:
        s.echoes = True
    listener = sessions[0]
    for _ in range(6):
        assert listener.choose(load, remaining=31) == 0
        listener.observe(0, 0, 0.0, 0.0, 16, pass_positions=16, packed=True, compute_ms=130.0)
    for _ in range(ECHO_STREAK):
        listener.observe(0, 0, 0.0, 0.0, 16, pass_positions=16, packed=True, compute_ms=130.0, echo=True)
    assert listener.choose(load, remaining=23) > 0
    deaf_peers = PassPeers()
    deaf = [DepthController(K_MAX, packed_cost_model(), shared=edits, peers=deaf_peers) for _ in range(16)]
    assert deaf[0].choose(load, remaining=31) > 0  # without echoes: the early probe, as before
    alone = DepthController(K_MAX, packed_cost_model(), shared=edits)
    alone.echoes = True
    assert alone.choose(LoadSignal(0, 1), remaining=31) > 0


def test_a_draft_no_recent_prompt_accepted_probes_only_at_the_gated_interval() -> None:
    """A useless draft (every recent session ended near 0): a new session does not probe at its
    first step nor at the early re-probes, only every `_gated_interval` steps, which keeps the
    probes within GATED_PROBE_BUDGET of the time (a probe step from a slow draft costs more than
    16 plain steps' 1 %); a method some of whose recent prompts paid probes at the first step."""
    useless = shared_after_sessions([0.01] * 32)
    cm = draft_model_cost_model()
    off = make_controller("auto", K_MAX, cm, useless)
    interval = off._gated_interval(None)
    assert interval > off.probe_interval
    assert interval == probe_period(cm.verify_ms(1, 1), cm.verify_ms(3, 1) + cm.draft_ms(2), budget=GATED_PROBE_BUDGET)
    assert interval > probe_period(cm.verify_ms(1, 1), cm.verify_ms(3, 1) + cm.draft_ms(2))  # half PROBE_BUDGET's
    probes = [t for t, k in enumerate(run_session(off, [0.0] * 150)) if k > 0]
    assert probes and probes[0] == interval - 1, probes  # idle steps count from the first step
    # run_session's steps report free drafts, so the learnt probe cost and the interval fall
    assert all(b - a >= off.probe_interval for a, b in zip(probes, probes[1:])), probes
    mixed = shared_after_sessions([0.01] * 28 + [0.9] * 4)  # some prompts of this method pay
    assert make_controller("auto", K_MAX, simulated_cost_model(), mixed).choose() > 0


def test_a_closed_session_that_drafted_is_reported_once() -> None:
    shared = SharedAcceptance(alpha0=0.02)
    never = make_controller("auto", K_MAX, simulated_cost_model(), shared)
    never.close()  # it never drafted: it says nothing about the method
    sessions = [make_controller("auto", K_MAX, simulated_cost_model(), shared) for _ in range(3)]
    for s in sessions:
        run_session(s, [0.9] * 10)
        s.close()
        s.close()
    assert shared.recent_sessions() is None  # three sessions, each counted once: too few to say
    fourth = make_controller("auto", K_MAX, simulated_cost_model(), shared)
    run_session(fourth, [0.9] * 10)
    fourth.close()
    recent = shared.recent_sessions()
    assert recent is not None and len(recent) == 4 and all(a > 0.5 and f == 1.0 for a, f in recent)


def test_draft_costs_are_draft_ms_per_depth_until_the_next_draft() -> None:
    cm = CostModel(draft_per_token_ms=2.0)
    assert cm.draft_costs(4) == (0.0, 2.0, 4.0, 6.0, 8.0)
    cm.observe_draft(2, 10.0)  # one point: proportional to k through it
    assert cm.draft_costs(4) == tuple(cm.draft_ms(k) for k in range(5)) == (0.0, 5.0, 10.0, 15.0, 20.0)
    assert cm.draft_costs(2) == (0.0, 5.0, 10.0)


def test_the_draft_line_follows_new_observations() -> None:
    cm = CostModel()
    cm.observe_draft(2, 10.0)
    assert cm.draft_ms(4) == pytest.approx(20.0)
    for _ in range(20):
        cm.observe_draft(2, 30.0)  # the draft got slower (a busier machine)
    assert cm.draft_ms(4) > 40.0


# fills: proposers that draft only where their context matches ----------------------------------


def test_pass_rates_charge_a_pass_its_long_block_when_any_row_drafted() -> None:
    verify = [simulated_verify_ms(k + 1, 1) for k in range(K_MAX + 1)]
    assert pass_rates([0.7], lambda k: 1.0, verify, K_MAX, fills=[1.0]) == pass_rates([0.7], lambda k: 1.0, verify, K_MAX)
    half = pass_rates([0.7], lambda k: 0.0, verify, K_MAX, fills=[0.5])
    for k in range(1, K_MAX + 1):  # alone: an empty draft is free, a plain step's cost
        expected = (1 + 0.5 * (expected_tokens(k, 0.7) - 1)) / (0.5 * verify[k] + 0.5 * verify[0])
        assert half[k] == pytest.approx(expected)
    twelve = pass_rates([0.7] * 12, lambda k: 0.0, verify, K_MAX, fills=[0.5] * 12)
    for k in range(1, K_MAX + 1):  # twelve rows: the pass is nearly always padded
        expected = (1 + 0.5 * (expected_tokens(k, 0.7) - 1)) / ((1 - 0.5 ** 12) * verify[k] + 0.5 ** 12 * verify[0])
        assert twelve[k] == pytest.approx(expected)
    with pytest.raises(ValueError, match="fills"):
        pass_rates([0.7, 0.7], lambda k: 0.0, verify, K_MAX, fills=[1.0])


def test_pass_sessions_fill_unknown_peers_with_the_known_means() -> None:
    alphas, fills = pass_sessions((0.8, 1.0), [(0.2, 0.5)], 4)
    assert alphas == [0.8, 0.2, 0.5, 0.5] and fills == [1.0, 0.5, 0.75, 0.75]


def test_sessions_whose_proposer_often_has_nothing_stay_off_in_a_large_batch() -> None:
    """Twelve sessions accepting 95 % of what they draft: deep speculation pays if they always
    draft, not if their proposer finds a match at 40 % of the steps (chat with n-grams), since
    every row then pays for the padded pass while few rows gain."""
    cm = simulated_cost_model()
    load = LoadSignal(0, 12)
    always = controllers_on_one_replica([0.95] * 12, cm)
    rarely = controllers_on_one_replica([0.95] * 12, cm)
    for s in rarely:
        for step in range(20):  # asked for 2 each step; drafted 2 at 2 steps in 5, nothing otherwise
            drafted = 2 if step % 5 < 2 else 0
            s.observe(drafted, drafted, 0.0, simulated_verify_ms(3, 12), 12, pass_block_length=3, requested=2)
    assert rarely[0].fill.mean == pytest.approx(0.4, abs=0.1)
    assert always[0].target(load) > 0
    assert rarely[0].target(load) == 0


def test_half_the_batch_copying_does_not_lengthen_the_pass_for_the_other_half() -> None:
    """Sixteen sessions, eight copying their prompt (0.95) and eight not (0.05), where a block of
    k + 1 costs 1 + k/4 plain passes: the pool's tokens per ms would speculate (the copiers gain
    more than the others lose), but the others would run at a fraction of their speed, and a
    burst ends with its slowest request. The pass stays plain; sixteen copiers do speculate."""
    cm = CostModel()
    for _ in range(20):
        for n in (1, 3, 5, 9):
            cm.observe_verify(16, n, 100.0 + 25.0 * (n - 1))
    load = LoadSignal(0, 16)
    alphas = [0.95] * 8 + [0.05] * 8
    pool_tokens_per_ms = [sum(expected_tokens(k, a) for a in alphas) / 16 / cm.verify_ms(k + 1, 16) for k in range(K_MAX + 1)]
    assert max(pool_tokens_per_ms) > pool_tokens_per_ms[0] * 1.25  # the pool alone would say "on"
    mixed = controllers_on_one_replica(alphas, cm)
    assert all(s.target(load) == 0 for s in mixed)
    copiers = controllers_on_one_replica([0.95] * 16, cm)
    assert copiers[0].target(load) > 0


def test_probe_slot_opens_once_a_period_and_the_sessions_of_that_pass_join_it() -> None:
    now = [100.0]
    peers = PassPeers(clock=lambda: now[0])
    assert peers.probe_slot(0.2, 16)  # the first probe pass opens
    now[0] += 0.05
    assert peers.probe_slot(0.2, 16)  # a session stepping with it joins
    now[0] += 0.2
    assert not peers.probe_slot(0.2, 16)  # the next pass waits
    now[0] += 16 * 0.2
    assert peers.probe_slot(0.2, 16)


def steady_batch_probe_passes(epoch_passes: int, monkeypatch, passes: int = 240,
                              budget: float = 0.02) -> list[int]:
    """A replica kept at 8 sessions: every pass one session ends and a new one arrives. Each
    session accepts at 0.75, just short of paying at this batch size, so that a session that
    counts itself at the optimistic 0.9 sees a pass it could turn; the method's recent sessions
    include some that paid (so early probes are allowed). Returns, per pass that only probes
    made long (no session's committed k was above 0), how many sessions probed in it; 0 for the
    other passes."""
    import coordinator.controller as controller

    monkeypatch.setattr(controller, "PROBE_EPOCH_PASSES", epoch_passes)
    monkeypatch.setattr(controller, "PROBE_BUDGET", budget)
    now = [0.0]
    cm = simulated_cost_model()
    shared = shared_after_sessions([0.2] * 28 + [0.95] * 4)
    peers = PassPeers(clock=lambda: now[0])
    load = LoadSignal(0, 8)
    live = [DepthController(K_MAX, cm, shared=shared, peers=peers) for _ in range(8)]
    rng = np.random.default_rng(0)
    probing = []
    for step in range(passes):
        ks = [s.choose(load) for s in live]
        committed = any(s.k for s in live)
        probing.append(0 if committed else sum(k > 0 for k in ks))
        block = max(ks) + 1
        for s, k in zip(live, ks):
            accepted = 0
            while accepted < k and rng.random() < 0.75:
                accepted += 1
            s.observe(k, accepted, 0.0, simulated_verify_ms(block, 8), 8, pass_block_length=block, requested=k)
        now[0] += simulated_verify_ms(block, 8) / 1000
        live.pop(step % 8).close()
        live.insert(step % 8, DepthController(K_MAX, cm, shared=shared, peers=peers))
    return probing


def test_sessions_arriving_one_by_one_probe_together_in_few_passes(monkeypatch) -> None:
    """Unaligned, each new session probes in a pass of its own and most passes are lengthened;
    lined up, a probe pass comes once in `probe_period` passes and carries every waiting session."""
    unaligned = [n for n in steady_batch_probe_passes(1, monkeypatch, budget=1e9) if n > 0]
    lined_up = steady_batch_probe_passes(16, monkeypatch)
    long_passes = [n for n in lined_up if n > 0]
    # a probe pass costs about 1.07 plain ones at batch 8 in the simulation: the period is 54
    # one-token passes of time, and a probe pass is about two of them
    assert 0 < len(long_passes) <= len(lined_up) / 50 + 2, lined_up
    assert len(unaligned) > 2 * len(long_passes), (unaligned, long_passes)
    assert max(long_passes) >= 4  # the waiting sessions probed together


def test_a_new_session_starts_from_the_methods_recent_fill() -> None:
    """Acceptance is counted over drafted tokens only; where the proposer drafts one step in three,
    a new session that assumed full drafts would lengthen the batch's first passes for nothing."""
    load = LoadSignal(0, 4)
    cm = simulated_cost_model()

    def new_batch(fill: float) -> list[DepthController]:
        shared = SharedAcceptance(alpha0=0.8)
        for _ in range(64):
            shared.update(4, 3)  # three of four drafted tokens accepted
            shared.update_fill(fill)
        peers = PassPeers()
        return [DepthController(K_MAX, cm, shared=shared, peers=peers) for _ in range(4)]

    sparse, full = new_batch(0.3), new_batch(1.0)
    assert sparse[0].fill.mean == pytest.approx(0.3, abs=0.01) and full[0].fill.mean == pytest.approx(1.0)
    assert all(s.target(load) == 0 for s in sparse)
    assert all(s.target(load) > 0 for s in full)


def test_a_copying_prompt_after_a_run_of_poor_ones_finds_out_from_its_echoes() -> None:
    """After prompts that did not pay, a copying prompt's first step does not probe; its first two
    tokens echo its context, and from then on it drafts deep."""
    poor = shared_after_sessions([0.01] * 32)  # the mean and the upper tail both say "off"
    edit = make_controller("auto", K_MAX, draft_model_cost_model(), poor)
    for _ in range(16):
        k = edit.choose()
        edit.observe(k, k, 0.0, simulated_verify_ms(k + 1, 1), 1, echo=k == 0)
    history = edit.history
    assert history[:2] == [0, 0] and history[2] >= 4 and history[-1] >= 4, history


# per-position rates and echoes ---------------------------------------------------------------


def test_a_flat_profile_is_the_geometric_model_and_a_copying_one_goes_deeper() -> None:
    verify = [simulated_verify_ms(k + 1, 1) for k in range(K_MAX + 1)]
    flat = pass_rates([0.7], lambda k: 0.0, verify, K_MAX, profile=[0.7] * K_MAX)
    assert flat == pytest.approx(pass_rates([0.7], lambda k: 0.0, verify, K_MAX))
    # all or nothing: the first position accepts half the time, the rest nearly always
    copying = [0.5] + [0.97] * (K_MAX - 1)
    est = AcceptanceEstimator(alpha0=0.5, prior_weight=0.01)
    rng = np.random.default_rng(2)
    for _ in range(400):
        est.update(K_MAX, 0 if rng.random() > 0.5 else K_MAX - int(rng.random() > 0.97 ** (K_MAX - 1)))
    pooled = pass_rates([est.alpha], lambda k: 0.0, verify, K_MAX)
    own = pass_rates([est.alpha], lambda k: 0.0, verify, K_MAX, profile=copying)
    assert own.index(max(own)) == K_MAX > pooled.index(max(pooled))


def test_a_gated_session_alone_prices_a_depth_where_its_proposer_drafts() -> None:
    """Alone, an n-gram session whose context holds a match one step in three and whose blocks
    keep a fifth of their first tokens and half of the second (about what the n-gram does on the
    benchmark's chat prompts, `scripts/ngram_replay.py`): priced at its fill, every step pays the
    draft call and plain decoding wins; gated (the engine asks the proposer only where its lookup
    finds a match, so the other steps cost nothing), a depth is priced where it drafts, and there
    a block of 2 is worth about 1.2x a plain step."""
    cm = CostModel()
    for _ in range(16):
        cm.observe_verify(1, 1, 40.0)
        for n in (2, 3, 5):
            cm.observe_verify(1, n, 41.0 + 0.3 * (n - 1))
        cm.observe_draft(2, 2.0)
        cm.observe_draft(4, 2.1)

    def session(gated: bool) -> DepthController:
        controller = DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.3, prior_weight=1.0))
        for i in range(40):  # blocks of 4: 1 in 5 keeps its first token, half of those the second
            controller.estimator.update(4, 0 if i % 5 else (2 if i % 10 == 0 else 1))
        controller.fill = RunningMean(1.0 / 3.0, 16.0)
        controller.match_gated = gated
        return controller

    assert session(gated=False).target() == 0
    assert session(gated=True).target() >= 2


def test_a_session_alone_that_copies_chooses_deeper_than_its_pooled_rate_says() -> None:
    """Steps that accept all 8 tokens or none: alone, the session's per-position rates say go
    deep; the same estimator's pooled rate, as a what-if, settles shallower."""
    controller = DepthController(K_MAX, simulated_cost_model(), estimator=AcceptanceEstimator(alpha0=0.5))
    rng = np.random.default_rng(5)
    for _ in range(60):
        controller.estimator.update(K_MAX, K_MAX if rng.random() < 0.3 else 0)
    alpha = controller.estimator.alpha
    assert controller.target() > controller._policy(alpha, None, optimistic=alpha)


def test_echo_guess_reads_what_followed_the_last_three_tokens() -> None:
    context = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    assert echo_guess(context) == 4
    assert echo_guess([5, 2, 3, 4, 9, 1, 2, 3]) is None  # only two tokens recur: chance, not a copy
    assert echo_hit(4, [4, 7]) and not echo_hit(4, [5]) and not echo_hit(None, [4])


def test_an_echo_lookup_grown_step_by_step_guesses_as_the_whole_context() -> None:
    rng = random.Random(3)
    context = [rng.randrange(6) for _ in range(20)]  # a small vocabulary: 3-grams recur
    lookup = EchoLookup(context)
    for _ in range(60):  # past the initial buffer of 64: it grows
        assert lookup.guess() == echo_guess(context)
        new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        context += new
        lookup.extend(new)
    assert lookup.guess() == echo_guess(context)


def test_an_echo_lookups_n_gram_draft_is_the_n_gram_proposers() -> None:
    rng = random.Random(4)
    for _ in range(200):
        context = [rng.randrange(8) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 9)
        proposed = NgramProposer().open_session(context, SamplingParams()).propose(k).tokens
        assert EchoLookup(context).ngram_draft(k) == proposed, context


def test_a_shadow_draft_is_judged_as_the_target_would_have_judged_it() -> None:
    """Accepted up to the first token that disagrees, one produced token at a time; all agreeing
    is a whole block accepted. Each position is news as soon as its token comes, as (drafted,
    accepted, first): a matched one an accepted trial at once, the miss when it comes; positions
    a drafted block beside it covers are never news."""
    shadow = ShadowDraft()
    shadow.start([5, 6, 7, 8])
    assert shadow.feed([5]) == (1, 1, 0) and shadow.pending
    assert shadow.feed([]) is None
    assert shadow.feed([6]) == (2, 2, 1) and shadow.pending
    assert shadow.feed([9]) == (4, 2, 2) and not shadow.pending  # position 2 missed: done
    shadow.start([5, 6])
    assert shadow.feed([5, 6, 1]) == (2, 2, 0)  # decided at its last position: the rest is not its
    shadow.start([5, 6])
    assert shadow.feed([4]) == (2, 0, 0)
    shadow.start([5, 6, 7], covered=2)
    assert shadow.feed([5, 6, 7]) == (3, 3, 2) and not shadow.pending  # past the block: position 2 only
    shadow.start([5, 6, 7, 8], covered=2)
    assert shadow.feed([5, 9]) is None and not shadow.pending  # missed within the block: the block's news
    shadow.start([5, 6])
    shadow.drop()
    assert shadow.feed([5]) is None and not shadow.pending


def test_shadow_news_adds_up_to_the_verdict_of_the_whole_shadow() -> None:
    """Told position by position, a shadow's trials are the ones its whole verdict gives (aging
    left out: a window of 10^9 steps), and a step counts once, not once per piece of news."""
    step_by_step, at_once = AcceptanceEstimator(window=1e9), AcceptanceEstimator(window=1e9)
    shadow = ShadowDraft()
    shadow.start([1, 2, 3, 4, 5, 6])
    for token in [1, 2, 3, 9]:
        step_by_step.update(0, 0)
        news = shadow.feed([token])
        assert news is not None
        step_by_step.add(*news)
    for _ in range(3):
        at_once.update(0, 0)
    at_once.update(6, 3)
    assert step_by_step.trials == pytest.approx(at_once.trials)
    assert step_by_step.successes == pytest.approx(at_once.successes)
    assert step_by_step.steps == at_once.steps == 4


def test_a_gated_session_probes_as_soon_as_its_output_echoes_its_context() -> None:
    """A session of a method whose recent prompts did not pay waits `probe_interval` steps between
    probes; two k = 0 steps in a row whose tokens the context predicted make the next step one."""
    def drive(echo_from: int) -> list[int]:
        controller = make_controller("auto", K_MAX, draft_model_cost_model(), shared_after_sessions([0.01] * 32))
        for t in range(12):
            k = controller.choose()
            controller.observe(k, 0, 0.0, simulated_verify_ms(k + 1, 1), 1, echo=t >= echo_from)
        return controller.history
    quiet = drive(echo_from=99)
    assert [t for t, k in enumerate(quiet) if k > 0] == []  # gated: the first probe too
    echoing = drive(echo_from=4)
    # steps 4 and 5 echoed; the probe at 6 accepted nothing, so the next takes four echoes (7-10)
    assert [t for t, k in enumerate(echoing) if k > 0] == [6, 11]


def test_echo_probes_that_fail_need_longer_streaks_and_one_that_pays_resets_them() -> None:
    """Code echoes its context (names, indentation) while its drafts fail: each failed echo probe
    doubles the streak the next one needs, up to ECHO_STREAK_MAX; an accepted draft resets it."""
    controller = make_controller("auto", K_MAX, draft_model_cost_model(), shared_after_sessions([0.01] * 32))
    probes = []
    for t in range(50):
        k = controller.choose()
        if k > 0:
            probes.append(t)
        controller.observe(k, 0, 0.0, simulated_verify_ms(k + 1, 1), 1, echo=True)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 2 and gaps[:4] == [5, 9, 9, 9], probes  # a probe step, then 4, 8, 8, 8 echoes
    assert controller._echo_needed == ECHO_STREAK_MAX
    while (k := controller.choose()) == 0:
        controller.observe(k, 0, 0.0, simulated_verify_ms(1, 1), 1, echo=True)
    controller.observe(k, 1, 0.0, simulated_verify_ms(k + 1, 1), 1)
    assert controller._echo_needed == ECHO_STREAK


def test_probe_period_keeps_probing_within_its_budget() -> None:
    assert probe_period(100.0, 180.0) == 40  # batch 16 here: a probe pass is 1.8 plain ones
    assert probe_period(100.0, 110.0) == PROBE_EPOCH_PASSES  # cheap probes: the least period
    assert probe_period(100.0, 180.0, budget=0.05) == PROBE_EPOCH_PASSES
    assert probe_period(0.0, 10.0) == PROBE_EPOCH_PASSES  # no costs known yet


def test_a_new_session_in_a_batch_whose_method_did_not_pay_does_not_probe_first() -> None:
    """Alone, a new session probes at its first step whatever its method's recent sessions did;
    in a batch of 4, where prompts like them would not pay, it does not: its probe would lengthen
    every row's pass, and a copying prompt gets its probe from its echoes instead. A method whose
    recent prompts did pay there still probes at the first step."""
    cm = simulated_cost_model()
    load = LoadSignal(0, 4, 0.25, 16)
    poor = shared_after_sessions([0.5] * 32)
    assert make_controller("auto", K_MAX, cm, poor).choose(LoadSignal(0, 1)) > 0
    assert make_controller("auto", K_MAX, cm, poor).choose(load) == 0
    assert make_controller("auto", K_MAX, cm, shared_after_sessions([0.95] * 32)).choose(load) > 0


def test_unseen_positions_continue_at_the_later_positions_rate() -> None:
    """A copying draft seen only at depth 3 (all or nothing) prices deeper positions at the rate of
    its positions after the first, not at the pooled rate that its first position pulls down; a
    geometric draft's continuation is its pooled rate."""
    copying = AcceptanceEstimator(alpha0=0.5, prior_weight=2.0)
    rng = np.random.default_rng(3)
    for _ in range(20):
        copying.update(3, 3 if rng.random() < 0.3 else 0)
    assert copying.continuation_rate > 0.85 > copying.alpha
    profile = copying.profile(K_MAX)
    assert len(profile) == K_MAX and profile[3:] == [copying.continuation_rate] * (K_MAX - 3)
    geometric = AcceptanceEstimator(alpha0=0.5, prior_weight=4.0, window=10_000)
    for _ in range(2000):
        geometric.update(6, int(np.cumprod(rng.random(6) < 0.7).sum()))
    assert geometric.continuation_rate == pytest.approx(geometric.alpha, abs=0.03)
    assert AcceptanceEstimator().profile(K_MAX) == []  # nothing drafted: the pooled rate decides


def test_a_copying_session_alone_leaves_the_depth_it_started_at() -> None:
    """Alone, a session that drafted 3 at a time and got all or nothing goes deeper than 4."""
    controller = DepthController(K_MAX, simulated_cost_model(), estimator=AcceptanceEstimator(alpha0=0.5, prior_weight=2.0))
    for accepted in (3, 0, 3, 3, 0, 3):
        controller.estimator.update(3, accepted)
    assert controller.target() > 4


def test_an_echo_probe_alone_drafts_deep() -> None:
    """Alone, a probe called by echoes drafts at the depth that would pay at `probe_alpha`, more
    than `probe_k`: the output is copying, and a deep block costs little more than a short one."""
    controller = make_controller("auto", K_MAX, draft_model_cost_model(), shared_after_sessions([0.01] * 32))
    history = []
    for t in range(8):
        k = controller.choose()
        history.append(k)
        controller.observe(k, 0, 0.0, simulated_verify_ms(k + 1, 1), 1, echo=t >= 2)
    assert history[:4] == [0, 0, 0, 0]  # gated: the method's recent prompts did not pay
    assert history[4] > controller.probe_k, history  # steps 2 and 3 echoed


def test_a_new_session_starts_from_the_mean_session_not_the_mean_token() -> None:
    """One prompt in four copies and drafts 8 tokens a step; three accept little and draft 2: the
    pooled per-token rate leans toward the copier, a new session starts at the sessions' mean."""
    shared = SharedAcceptance()
    for alpha, k, steps in ((0.95, 8, 40), (0.2, 2, 10), (0.2, 2, 10), (0.2, 2, 10)):
        for _ in range(steps):
            shared.update(k, k if alpha > 0.5 else 0)
        shared.report_session(alpha)
    assert shared.seed == pytest.approx(0.3875)
    assert shared.alpha > 0.8
    assert make_controller("auto", K_MAX, CostModel(), shared).estimator.alpha0 == pytest.approx(0.3875)


def test_a_cheap_first_probe_is_taken_whatever_the_method_did_lately() -> None:
    """Alone with an n-gram draft a probe of 2 costs a few ms on a 62 ms step: an unproven session
    takes it at its first step even after prompts that did not pay; where opening the draft
    session (closed while a session is off) or drafting takes tens of ms, it waits."""
    cm = CostModel()
    for _ in range(16):
        for n in (1, 3, 5, 9):
            cm.observe_verify(1, n, 62.0 + 2.0 * (n - 1))
    poor = shared_after_sessions([0.01] * 32)
    ngram = make_controller("auto", K_MAX, cm, poor)
    assert ngram._probe_extra_cost(None) <= CHEAP_PROBE
    assert ngram.choose() == ngram.probe_k
    reopening = CostModel()  # the same target, but opening the draft session takes 40 ms
    reopening.seed_from_stats(cm.verify_table())
    reopening.observe_open(40.0)
    assert make_controller("auto", K_MAX, reopening, poor).choose() == 0
    for _ in range(8):
        cm.observe_draft(2, 30.0)
    model = make_controller("auto", K_MAX, cm, poor)
    assert model._probe_extra_cost(None) > CHEAP_PROBE
    assert model.choose() == 0


# ---------------------------------------------------------------------------------------------
# Packed passes: a row's block costs only its own positions
# ---------------------------------------------------------------------------------------------

PACKED_PLAIN_MS = {1: 60.0, 16: 130.0}
PACKED_POSITION_MS = {1: 4.0, 16: 5.0}


def packed_cost_model() -> CostModel:
    """A replica that packs its passes: at batch 16 130 ms plain and 5 ms per draft position in
    the pass (about what one costs on this project's CPU machines), at batch 1 60 and 4."""
    cm = CostModel()
    for _ in range(16):
        for b in (1, 16):
            for extra in (0, 2, 8, 16):
                cm.observe_verify(b, 1 + -(-extra // b), PACKED_PLAIN_MS[b] + PACKED_POSITION_MS[b] * extra,
                                  positions=b + extra, packed=True)
    return cm


def test_drafted_passes_of_a_slow_spell_are_forgotten_once_plain_passes_alone_have_run_for_a_while() -> None:
    """A spell at a quarter of the machine's speed (a profiler beside it) left drafted passes of
    600-760 ms at 16 rows; plain passes came back to 150 ms at once, and a session at k = 0
    drafts nothing that could renew the drafted cells: the gap priced every block of a code
    edit (acceptance 0.9) off, at k = 0 to the end. After STALE_PASSES passes without a draft
    position the model forgets its drafted passes and prices a position from the plain passes
    and the prior's shape; the session drafts again, and its passes teach the cells anew."""
    cm = CostModel()
    for _ in range(8):  # the slow spell
        cm.observe_verify(16, 1, 600.0, positions=16, packed=True)
        for extra in (16, 32):
            cm.observe_verify(16, 3, 600.0 + 5.0 * extra + 80.0, positions=16 + extra, packed=True)
    plain_passes = 120  # the plain cell follows the machine back (a moving average over 64 passes)
    for _ in range(plain_passes):
        cm.observe_verify(16, 1, 150.0, positions=16, packed=True)
    assert cm.verify_ms(1, 16) < 180.0
    peers = PassPeers()
    copies = [make_controller("auto", K_MAX, cm, shared_after_sessions([0.9] * 32, fill=0.9), peers) for _ in range(16)]
    for session in copies:
        session.observe(0, 0, 0.0, 150.0, 16, pass_positions=16, packed=True, shadow=(4, 4), pass_id=1)
    load = LoadSignal(0, 16)
    assert copies[0].target(load) == 0  # the slow spell's drafted passes price every block off
    assert cm.position_ms(16) > 10.0 or cm.packed_jump_ms(16) > 100.0
    for _ in range(STALE_PASSES - plain_passes - 2):  # and the sessions' pass
        cm.observe_verify(16, 1, 150.0, positions=16, packed=True)
    assert cm.packed_jump_ms(16) > 100.0  # not yet: one pass short of STALE_PASSES
    cm.observe_verify(16, 1, 150.0, positions=16, packed=True)
    assert cm.packed_jump_ms(16) == 0.0 and cm.position_ms(16) < 5.0
    assert copies[1].target(load) > 0
    cm.observe_verify(16, 3, 150.0 + 3.0 * 32, positions=48, packed=True)  # a drafted pass: the count starts again
    for _ in range(STALE_PASSES - 1):
        cm.observe_verify(16, 1, 150.0, positions=16, packed=True)
    assert [positions for b, _, _, _, positions in cm.verify_table() if positions > b] == [48]


def test_a_packed_position_is_priced_by_the_slope_not_the_jump_to_a_drafted_pass() -> None:
    """A replica whose only drafted passes were probes at batch 1: blocks of 3 and 4 took 149 and
    151 ms against a plain pass's 101 (the model leaves its one-token decode path). Pooled over
    its positions, that jump priced a position at 16 rows at 21 ms, and code edits at 16 sessions
    (acceptance 0.95, full blocks) stayed at k = 0; the slope says 2 ms, and they draft."""
    cm = CostModel()
    for _ in range(32):
        cm.observe_verify(1, 1, 101.0, positions=1, packed=True)
        cm.observe_verify(16, 1, 212.0, positions=16, packed=True)
    for _ in range(5):
        cm.observe_verify(1, 3, 149.0, positions=3, packed=True)
        cm.observe_verify(1, 4, 151.0, positions=4, packed=True)
    assert cm.position_ms(16) == pytest.approx(2.0, abs=0.5)
    peers = PassPeers()
    sessions = [DepthController(K_MAX, cm, peers=peers) for _ in range(16)]
    for s in sessions:
        s.observe(0, 0, 0.0, 212.0, 16, pass_positions=16, packed=True)
    copying = sessions[0]
    for _ in range(8):
        copying.observe(0, 0, 0.0, 212.0, 16, pass_positions=16, packed=True, shadow=(4, 4))
    assert copying.target(LoadSignal(0, 16)) > 0


def test_packed_observations_teach_the_cost_of_one_position() -> None:
    cm = packed_cost_model()
    assert cm.packed
    assert cm.position_ms(16) == pytest.approx(5.0, rel=0.05)
    assert cm.verify_ms(1, 16) == pytest.approx(130.0, rel=0.01)
    # a padded pass of 16 rows x 3 positions is 32 extra positions on the same line
    assert cm.verify_ms(3, 16) == pytest.approx(130.0 + 32 * 5.0, rel=0.05)
    rows = cm.verify_table()
    assert (16, 2, 16, pytest.approx(140.0), 18) in rows  # (batch, positions per row rounded up, count, ms, positions)


def test_a_packed_replica_prices_positions_at_an_unseen_batch_size_pooled_over_the_others() -> None:
    """At 16 rows only plain passes were seen. The nearest batch size with blocks (12) saw two
    short, slow ones (13 ms a position); batch 4 saw long blocks at 2.5 ms a position. A packed
    pass prices positions, not rows: the estimate at 16 is the extra time over the plain pass per
    position, pooled, not 12's two-cell slope scaled up (which kept a burst of code edits off)."""
    cm = CostModel()
    for _ in range(8):
        cm.observe_verify(16, 1, 120.0, positions=16, packed=True)
        for b, plain, blocks in ((12, 100.0, {1: 113.0, 2: 126.0}), (4, 70.0, {8: 90.0, 16: 110.0})):
            cm.observe_verify(b, 1, plain, positions=b, packed=True)
            for extra, ms in blocks.items():
                cm.observe_verify(b, 2, ms, positions=b + extra, packed=True)
    pooled = (13.0 + 26.0 + 20.0 + 40.0) / (1 + 2 + 8 + 16)
    assert cm.position_ms(16) == pytest.approx(pooled, rel=0.05)
    load = LoadSignal(0, 16)
    copiers = controllers_on_one_replica([0.8] * 16, cm)
    assert all(s.target(load) > 0 for s in copiers)


def test_seeding_merges_cells_by_the_positions_they_computed() -> None:
    cm = CostModel()
    cm.seed_from_stats([SimpleNamespace(batch_size=4, block_length=3, count=2, mean_ms=50.0, positions=6),
                        SimpleNamespace(batch_size=4, block_length=2, count=2, mean_ms=40.0, positions=6),
                        (4, 2, 4, 70.0)])  # no positions: padded, 8
    assert sorted((b, p, c, m) for b, _, c, m, p in cm.verify_table()) == [(4, 6, 4, 45.0), (4, 8, 4, 70.0)]


def test_packed_rates_alone_are_depth_rates_over_a_verify_line() -> None:
    draft = [0.0] + [1.5 * k for k in range(1, K_MAX + 1)]
    verify = [60.0 + 4.0 * k for k in range(K_MAX + 1)]
    for alpha in (0.2, 0.6, 0.9):
        assert packed_rates(alpha, draft, 60.0, 4.0, 1, K_MAX) == pytest.approx(depth_rates(alpha, draft, verify, K_MAX))


def test_packed_rates_charge_a_sessions_positions_to_every_row() -> None:
    """At batch 16 a plain pass emits a token per row in 130 ms, and a draft position costs 5 ms
    of every row's time: a position pays when it is accepted often enough to be worth 16 x 5 / 130
    tokens, about 0.62."""
    rates = packed_rates(0.5, [0.0] * (K_MAX + 1), 130.0, 5.0, 16, K_MAX)
    assert max(range(K_MAX + 1), key=rates.__getitem__) == 0
    rates = packed_rates(0.9, [0.0] * (K_MAX + 1), 130.0, 5.0, 16, K_MAX)
    best = max(range(K_MAX + 1), key=rates.__getitem__)
    assert 2 <= best <= 5 and rates[best] > 1.15 * rates[0]
    # a draft call the whole pass waits for is charged to every row
    slow_draft = [0.0] + [4.0] * K_MAX
    assert packed_rates(0.9, slow_draft, 130.0, 5.0, 16, K_MAX, draft_rows=16)[2] < \
        packed_rates(0.9, slow_draft, 130.0, 5.0, 16, K_MAX)[2]


def test_in_a_packed_batch_each_session_chooses_its_own_depth() -> None:
    """Sixteen sessions, eight copying (0.95) and eight not (0.05): padded, the pass stays plain for
    all (test_half_the_batch_copying_...); packed, the copiers speculate and the others do not,
    and the copiers' depth is the one they would choose in a batch of copiers."""
    cm = packed_cost_model()
    load = LoadSignal(0, 16)
    mixed = controllers_on_one_replica([0.95] * 8 + [0.05] * 8, cm)
    ks = [s.target(load) for s in mixed]
    assert all(k >= 3 for k in ks[:8]) and all(k == 0 for k in ks[8:]), ks
    copiers = controllers_on_one_replica([0.95] * 16, cm)
    assert copiers[0].target(load) == ks[0]


def test_a_packed_batch_probes_without_waiting_for_a_probe_pass() -> None:
    """Packed, a probe lengthens the pass by its own positions only: a session whose output echoes
    its context probes at its next step, whatever its peers do, as deep as would pay at the
    probe rate."""
    cm = packed_cost_model()
    load = LoadSignal(0, 16)
    sessions = controllers_on_one_replica([0.05] * 16, cm)
    for s in sessions:  # everyone has drafted and is off
        s.observe(2, 0, 0.0, 140.0, 16, pass_positions=18, packed=True)
        assert s.choose(load) == 0
    copier = sessions[0]
    for _ in range(2):
        copier.observe(0, 0, 0.0, 130.0, 16, pass_positions=16, packed=True, echo=True)
    assert copier.choose(load) >= copier.probe_k


def test_an_echoing_session_probes_whatever_the_methods_last_prompts_filled() -> None:
    """The n-gram method's last prompts (code) found a draft for a fifth of the asked tokens. A
    session whose output echoes its context will find its block there: its probe is priced as
    filled, and it probes at 16 rows where a fifth of a block would not pay."""
    cm = packed_cost_model()
    load = LoadSignal(0, 16)
    shared = SharedAcceptance()
    for _ in range(64):
        shared.update_fill(0.2)
    peers = PassPeers()
    sessions = [DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.55, prior_weight=1000.0),
                                shared=shared, peers=peers) for _ in range(16)]
    copier = sessions[0]
    for _ in range(12):  # past its first probes: idle, as the burst's sessions were
        k = copier.choose(load)
        copier.observe(k, 0, 0.5, 0.0, 16, pass_positions=16 + k, packed=True, compute_ms=130.0 + 5.0 * k)
    assert copier.choose(load) == 0
    for _ in range(ECHO_STREAK):
        copier.observe(0, 0, 0.0, 0.0, 16, pass_positions=16, packed=True, compute_ms=130.0, echo=True)
    assert copier.choose(load) >= 1


def test_in_a_batch_a_shadowed_session_lets_its_shadows_judge_its_echoes() -> None:
    """For the n-gram method the engine judges shadow drafts (`shadowed`): the block an echo probe
    would draft, judged for free. At 16 rows its echoes call no probe, which would lengthen a pass
    every row pays for (chat at 16 sessions: 16 echo probes of 2 in 64 requests, none accepted);
    alone, where a probe costs the session only, they still do."""
    def echoing_session(shadowed: bool, rows: int) -> tuple[DepthController, LoadSignal]:
        cm = packed_cost_model()
        load = LoadSignal(0, rows)
        shared = SharedAcceptance()
        for _ in range(64):
            shared.update_fill(0.2)
        peers = PassPeers()
        sessions = [DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.55, prior_weight=1000.0),
                                    shared=shared, peers=peers) for _ in range(rows)]
        session = sessions[0]
        session.echoes = True
        session.shadowed = shadowed
        for _ in range(12):
            k = session.choose(load)
            session.observe(k, 0, 0.5, 0.0, rows, pass_positions=rows + k, packed=True, compute_ms=130.0 + 5.0 * k)
        for _ in range(ECHO_STREAK):
            session.observe(0, 0, 0.0, 0.0, rows, pass_positions=rows, packed=True, compute_ms=130.0, echo=True)
        return session, load

    shadowed, load = echoing_session(shadowed=True, rows=16)
    assert shadowed.k == 0 and shadowed._probe_due(False, load) != "echo"
    assert shadowed.choose(load) == 0
    unshadowed, load = echoing_session(shadowed=False, rows=16)
    assert unshadowed.k == 0 and unshadowed.choose(load) >= 1
    alone, load = echoing_session(shadowed=True, rows=1)
    assert alone._probe_due(False, load) == "echo"


def test_an_echoing_session_probes_though_no_peer_has_drafted_yet() -> None:
    """A burst of sixteen new sessions, none drafted yet, at the method's modest 0.42, and a jump
    to a packed pass of 60 ms (fitted on passes where every row brought a block). The peers are
    as unproven as the echoing session: in the probe's what-if they count at the probe rate and
    share the jump, so the session probes instead of waiting for a peer that waits too."""
    cm = CostModel()
    for _ in range(16):
        for extra in (0, 16, 32, 64):
            cm.observe_verify(16, 2, 110.0 + (60.0 if extra else 0.0) + 2.3 * extra, positions=16 + extra,
                              packed=True)
    load = LoadSignal(0, 16)
    shared = SharedAcceptance()
    for _ in range(64):
        shared.update_fill(0.4)  # the method's last prompts (chat) found a draft for 40 % of the asked tokens
    peers = PassPeers()
    sessions = [DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.42, prior_weight=1000.0),
                                shared=shared, peers=peers) for _ in range(16)]
    copier = sessions[0]
    assert copier.choose(load) > 0  # its first step probes (unproven, `_probe_due`), and misses
    copier.observe(copier.history[-1], 0, 0.5, 0.0, 16, pass_positions=16 + copier.history[-1], packed=True,
                   compute_ms=110.0 + 60.0 + 2.3 * copier.history[-1])
    assert copier.choose(load) == 0  # now only echoes call its next probe
    for _ in range(2):
        copier.observe(0, 0, 0.0, 110.0, 16, pass_positions=16, packed=True, echo=True)
    assert copier.choose(load) >= 1
    assert sessions[1].target(load) == 0  # the policy itself still charges a lone drafter the whole jump


def test_a_block_within_a_peers_drafts_without_the_batch_margin() -> None:
    assert batch_choice([10.0, 11.0, 10.5], 0.2, 0) == 0  # a 10 % gain, inside the margin
    assert batch_choice([10.0, 11.0, 10.5], 0.2, 1) == 1  # a peer drafts as deep: no margin
    assert batch_choice([10.0, 11.0, 10.5], 0.2, 4) == 1
    assert batch_choice([10.0, 10.5, 11.5], 0.2, 1) == 0  # deeper than any peer: the margin holds
    assert batch_choice([10.0, 9.0, 8.0], 0.2, 4) == 0  # no gain at all
    assert batch_choice([10.0, 13.0, 12.0], 0.2, 0) == 1  # past the margin, as before


def test_in_a_packed_batch_a_modest_session_drafts_once_a_peer_drafts_as_deep() -> None:
    """Code edits at 16 sessions: half of auto's steps sat at k = 0 at acceptance about 0.6, where
    a block of 1 gained 3-13 % (inside the 20 % batch margin) and fixed k = 2 beat auto. A block
    no longer than a peer's adds only its token-wise work to a pass already drafted: no margin."""
    cm = packed_cost_model()
    load = LoadSignal(0, 16)
    sessions = controllers_on_one_replica([0.7] + [0.05] * 15, cm)
    modest = sessions[0]
    rates, _ = modest._rates(0.7, load, None, None)
    assert rates[0] < max(rates[1:]) < 1.2 * rates[0]  # it gains, inside the margin
    assert modest.target(load) == 0
    sessions[1]._commit(2)
    sessions[1]._anchor(2)  # it drafts on its own merit
    assert 1 <= modest.target(load) <= 2
    sessions[1]._commit(0)
    assert modest.target(load) == 0


def test_sessions_that_draft_only_alongside_each_other_hold_no_one_up() -> None:
    """Extraction at 16 sessions (acceptance about 0.5): each block of 2 gained 10-15 % on the
    model's reading with the pass's jump "paid anyway", inside the batch margin; every session
    drafted because the others did, and the replica did fixed k = 2's verify work a token, 1.1-1.2x
    speculation off's. A block joins a peer's at no margin only where that peer drafts on its
    own merit, its gain past the margin (`PassPeers.anchor`)."""
    cm = packed_cost_model()
    load = LoadSignal(0, 16)
    sessions = controllers_on_one_replica([0.7] * 16, cm)
    rates, _ = sessions[0]._rates(0.7, load, None, None)
    assert rates[0] < max(rates[1:]) < 1.2 * rates[0]  # each gains, inside the margin
    for s in sessions:  # all drafting, none of them on its own merit
        s._commit(2)
    assert [s.target(load) for s in sessions] == [0] * 16
    anchor = DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.95, prior_weight=1000.0),
                             peers=sessions[0].peers)
    assert anchor.choose(load) >= 2  # a copying session: past the margin on its own
    assert all(1 <= s.target(load) <= 2 for s in sessions)
    anchor.close()
    assert [s.target(load) for s in sessions] == [0] * 16


def test_the_jump_to_a_packed_pass_is_charged_to_the_first_session_that_drafts() -> None:
    """On a CPU a pass of 16 rows costs more as soon as any row brings a block (18 rows run slower
    per row than 16, longer blocks add attention calls): 20 ms here, on top of 5 ms a position.
    A session whose gain covers the positions but not the jump stays off while no peer drafts
    and none would gain like it; it drafts once a peer drafts (the jump is paid anyway), or when
    enough peers would gain to share the jump."""
    cm = CostModel()
    for _ in range(16):
        for extra in (0, 4, 32, 64, 96):  # blocks of 1 to 7 a row: a slope the cells can tell (`slope_by_precision`)
            cm.observe_verify(16, 2, 130.0 + (20.0 if extra else 0.0) + 5.0 * extra, positions=16 + extra, packed=True)
    assert cm.packed_jump_ms(16) == pytest.approx(20.0, rel=0.05)
    assert cm.position_ms(16) == pytest.approx(5.0, rel=0.05)
    assert CostModel().packed_jump_ms(16) == 0.0  # nothing seen: no jump
    load = LoadSignal(0, 16)
    peers = PassPeers()
    good = DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.95, prior_weight=1000.0), peers=peers)
    others = [DepthController(K_MAX, cm, estimator=AcceptanceEstimator(alpha0=0.05, prior_weight=1000.0), peers=peers)
              for _ in range(15)]
    assert good.target(load) == 0
    others[0]._commit(2)  # a peer drafts (on its own merit): the pass is packed anyway
    others[0]._anchor(2)
    assert good.target(load) > 0
    copiers = controllers_on_one_replica([0.95] * 8 + [0.05] * 8, cm)  # eight share the jump
    for s in copiers:  # the split alone, at the estimates as they are (0.7 % from the boundary)
        s.batch_z = 0.0
    assert all(s.target(load) > 0 for s in copiers[:8]) and all(s.target(load) == 0 for s in copiers[8:])


def test_acceptance_lower_bound_is_the_rate_less_z_standard_errors() -> None:
    assert acceptance_lower_bound(0.7, 8.0, 1.0) == pytest.approx(0.7 - math.sqrt(0.21 / 8))
    assert acceptance_lower_bound(0.7, 8.0, 0.0) == 0.7  # z = 0: the estimate itself
    assert acceptance_lower_bound(1.0, 3.0, 1.0) == 1.0 and acceptance_lower_bound(0.0, 3.0, 1.0) == 0.0
    assert acceptance_lower_bound(0.5, 1.0, 3.0) == 0.0  # never below 0
    assert acceptance_lower_bound(0.7, 800.0, 1.0) > acceptance_lower_bound(0.7, 8.0, 1.0)  # evidence narrows it


def packed_cost_model_at_16() -> CostModel:
    """Packed passes at 16 rows: 200 ms plain, 5 ms a draft position (extraction at 16 sessions
    on the CI machines: 198 ms plain passes, about 4.9 ms a position), no jump."""
    cm = CostModel()
    for _ in range(16):
        for extra in (0, 8, 16, 32):
            cm.observe_verify(16, 2, 200.0 + 5.0 * extra, positions=16 + extra, packed=True)
    return cm


def test_mixture_tokens_weigh_the_recent_prompts_by_the_sessions_own_evidence() -> None:
    """With no evidence of its own a step's tokens are the mean over the recent prompts' (and the
    grid's) acceptances; a block accepted whole moves them toward the prompts that accept, a miss
    at the first position toward the ones that do not; the fill scales the gain; and a session
    unlike every recent prompt (a new kind) escapes them through the grid."""
    assert mixture_tokens([0.5, 0.9], 0, 0, 1.0, 2, diffuse=0.0, grid=()) == pytest.approx(
        [1.0, 1.0 + (0.5 + 0.9) / 2, 1.0 + (0.5 + 0.25 + 0.9 + 0.81) / 2])
    recent = [0.86, 0.92, 0.3]
    prior = mixture_tokens(recent, 0, 0, 1.0, 8)
    assert mixture_tokens(recent, 4, 4, 1.0, 8)[4] > prior[4] > mixture_tokens(recent, 0, 1, 1.0, 8)[4]
    assert mixture_tokens(recent, 0, 0, 0.5, 8)[4] - 1.0 == pytest.approx((prior[4] - 1.0) / 2)
    assert mixture_tokens([0.05] * 32, 16, 16, 1.0, 4)[4] > 4.0
    assert mixture_tokens([0.05] * 32, 16, 16, 1.0, 4, diffuse=0.0, grid=())[4] < 1.1
    with pytest.raises(ValueError):
        mixture_tokens([], 0, 0, 1.0, 4)


def test_a_methods_mixture_prior_is_built_once_per_set_of_recent_sessions() -> None:
    """The prior's components change only when a session ends: every session of the method shares
    one `MixturePrior` until then, and its posterior is `mixture_tokens`' to the last digit."""
    shared = shared_after_sessions([0.86, 0.92, 0.3] * 3)
    prior = shared.mixture_prior(8)
    assert prior is not None and shared.mixture_prior(8) is prior
    assert prior.tokens(3, 5, 0.8) == pytest.approx(mixture_tokens([0.86, 0.92, 0.3] * 3, 3, 5, 0.8, 8), rel=1e-12)
    shared.report_session(0.5)
    assert shared.mixture_prior(8) is not prior
    assert shared_after_sessions([0.9] * 3).mixture_prior(8) is None  # too few sessions to say


def test_a_mixture_priors_quantile_tokens_are_one_recent_prompts_capped_where_asked() -> None:
    """`MixturePrior.quantile_tokens`: the expected tokens of the component at a quantile of the
    posterior (components in order of acceptance), with its rate capped per position where
    caps are given; evidence moves the quantile's component."""
    prior = MixturePrior([0.3, 0.9], 4, diffuse=0.0, grid=())
    low = [1.0 + sum(0.3 ** i for i in range(1, k + 1)) for k in range(5)]
    assert prior.quantile_tokens(0, 0, 1.0, quantile=0.1) == pytest.approx(low)
    assert prior.quantile_tokens(0, 0, 1.0, quantile=0.9)[4] == pytest.approx(1 + 0.9 + 0.81 + 0.729 + 0.6561)
    assert prior.quantile_tokens(8, 8, 1.0, quantile=0.1)[4] > 3.0  # eight of eight: the low quantile is 0.9 now
    capped = prior.quantile_tokens(8, 8, 0.5, [1.0, 0.5, 1.0, 1.0], quantile=0.1)
    assert capped == pytest.approx([1.0, 1.45, 1.45 + 0.5 * 0.45, 1.45 + 0.5 * (0.45 + 0.405),
                                    1.45 + 0.5 * (0.45 + 0.405 + 0.3645)])


def test_a_session_reuses_its_mixture_tokens_until_its_evidence_or_fill_changes() -> None:
    """A session at k = 0 asks for the same posterior step after step: it is kept, and it is
    `MixturePrior.tokens` of the session's current evidence whenever that changes."""
    shared = shared_after_sessions([0.86, 0.92, 0.3] * 3)
    session = DepthController(8, packed_cost_model_at_16(), shared=shared)
    prior = shared.mixture_prior(8)
    assert prior is not None
    first = session._mixture_tokens(0.8)
    assert session._mixture_tokens(0.8) is first and first == prior.tokens(0, 0, 0.8)
    assert session._mixture_tokens(0.5) == prior.tokens(0, 0, 0.5)  # another fill
    session.observe(4, 4, 1.0, 200.0, 16, pass_block_length=5, pass_positions=20, packed=True, pass_id=1)
    trials, successes = sum(session.estimator.trials), sum(session.estimator.successes)
    assert trials > 0 and session._mixture_tokens(0.5) == prior.tokens(successes, trials, 0.5)
    shared.report_session(0.5)  # a new set of recent sessions: a new prior
    assert session._mixture_tokens(0.5) == shared.mixture_prior(8).tokens(successes, trials, 0.5)


def packed_cost_model_here() -> CostModel:
    """Packed passes at 16 rows as on the AMD EPYC machine of 2026-12-02: 195 ms plain, 3 ms a
    draft position, no jump."""
    cm = CostModel()
    for _ in range(16):
        for extra in (0, 16, 32, 64):
            cm.observe_verify(16, 1 + -(-extra // 16), 195.0 + 3.0 * extra, positions=16 + extra, packed=True)
    return cm


def test_in_a_batch_a_new_session_drafts_from_its_first_step_when_its_methods_prompts_pay(monkeypatch) -> None:
    """Code edits after fixed k = 4: two prompts that accepted 0.86 and 0.92, one 0.3. A new
    session priced at their mean with two trials' weight, a standard error low (the path before
    `mixture_tokens`, here by setting MIXTURE_TRIALS to 0), starts at k = 0; priced on the
    prompts it may be, it drafts from its first step, deeper once a block goes through whole,
    and stops at a miss at its first position."""
    cm = packed_cost_model_here()
    load = LoadSignal(0, 16)

    def session(steps: list[tuple[int, int]]) -> DepthController:
        peers = PassPeers()
        shared = shared_after_sessions([0.86, 0.92, 0.3] * 11)
        sessions = [make_controller("auto", K_MAX, cm, shared, peers) for _ in range(16)]
        for s in sessions:
            s.observe(0, 0, 0.0, 195.0, 16, pass_positions=16, packed=True)
        for drafted, accepted in steps:
            sessions[0].observe(drafted, accepted, 0.0, 195.0, 16, pass_positions=16 + drafted, packed=True)
        return sessions[0]

    first = session([]).target(load)
    assert first >= 2
    assert session([(4, 4)]).target(load) > first
    assert session([(4, 0)]).target(load) == 0
    monkeypatch.setattr(controller_module, "MIXTURE_TRIALS", 0.0)
    assert session([]).target(load) == 0


def code_edit_batch_session(cm: CostModel) -> DepthController:
    """The first of 16 auto sessions in a packed batch, each past one plain pass, whose method's
    recent sessions are code edits: two prompts that copy (0.95), one that does not (0.45)."""
    peers = PassPeers()
    shared = shared_after_sessions([0.95, 0.95, 0.45] * 11)
    sessions = [make_controller("auto", K_MAX, cm, shared, peers) for _ in range(16)]
    for s in sessions:
        s.observe(0, 0, 0.0, 195.0, 16, pass_positions=16, packed=True)
    return sessions[0]


def test_past_eight_trials_a_copy_that_began_late_is_priced_at_least_at_its_methods_copying_prompts() -> None:
    """A code edit whose first block missed at position 0 (its copy had not begun), then three
    blocks of 2 accepted whole, each with a shadow's position past it: ten trials, past the
    mixture's. Its own rates a standard error low (one to four trials a position) make a block of
    8 worth 4.5 tokens; its posterior over its method's prompts (two that copy, one that does
    not) lies on the copying ones, and their low quantile, the floor it is priced at, says about
    7. A session whose second position failed at every try is held there by its own evidence:
    the floor adds nothing past its first position."""
    cm = packed_cost_model_here()

    def session(blocks: list[tuple[int, int, tuple[int, int, int] | None]]) -> DepthController:
        own = code_edit_batch_session(cm)
        for drafted, accepted, shadow in blocks:
            own.observe(drafted, accepted, 0.0, 195.0, 16, pass_positions=16 + drafted, packed=True,
                        requested=drafted, shadow=shadow)
        assert sum(own.estimator.trials) > MIXTURE_TRIALS and own._mixture_tokens(own.fill.mean) is None
        return own

    def own_tokens(own: DepthController) -> list[float]:
        rates = own.estimator.profile(K_MAX)
        evidence = own.estimator.profile_evidence(K_MAX)
        low = [acceptance_lower_bound(r, n, own.batch_z) for r, n in zip(rates, evidence)]
        alpha = acceptance_lower_bound(own.estimator.alpha, own.estimator.weight, own.batch_z)
        return profile_tokens(alpha, low, own.fill.mean, K_MAX)

    copy = session([(8, 0, None)] + [(2, 2, (3, 3, 2))] * 3)
    floor = copy._mixture_floor(copy.fill.mean)
    assert floor is not None and floor[8] > 1.4 * own_tokens(copy)[8]
    prose = session([(2, 1, None)] * 8)  # position 1 tried eight times, never accepted
    floor = prose._mixture_floor(prose.fill.mean)
    # its second position capped by its own evidence (0.2 uncapped)
    assert floor is not None and floor[2] - floor[1] < 0.15
    assert prose.target(LoadSignal(0, 16)) <= 1


def test_in_a_batch_a_block_accepted_whole_lets_its_session_go_deeper_inside_the_margin() -> None:
    """At 16 sessions each depth's rate lies within a few percent of the next, and the switch
    margin held copying sessions at their depth while every block went through whole. A block
    accepted whole, as deep as asked, lets the policy's deeper choice through at once; a block
    that came back short of what was asked (the match ran out) does not count as one."""
    cm = packed_cost_model_here()
    load = LoadSignal(0, 16)
    own = code_edit_batch_session(cm)
    own.choose(load)
    own.observe(8, 0, 0.0, 195.0, 16, pass_positions=24, packed=True, requested=8)  # the copy had not begun
    own.choose(load)
    grew_inside_margin = False
    for _ in range(8):
        k = own.k
        assert k is not None
        own.observe(k, k, 0.0, 195.0, 16, pass_positions=16 + k, packed=True, requested=k,
                    shadow=(k + 1, k + 1, k))  # and the position past it, a shadow's
        target = own.target(load)
        rates, _ = own._rates(own.estimator.alpha, load)
        inside = k > 0 and target > k and rates[target] < rates[k] * (1.0 + own.switch_margin)
        chosen = own.choose(load)
        if inside:
            assert chosen == target  # the margin alone would have held it at k for switch_after steps
            grew_inside_margin = True
    assert grew_inside_margin
    own.observe(own.k, own.k, 0.0, 195.0, 16, pass_positions=16 + own.k, packed=True, requested=own.k + 2)
    assert not own._went_through  # drafted all it found, less than it asked

def test_in_a_batch_a_high_estimate_from_a_few_trials_does_not_turn_speculation_on() -> None:
    """A short request's estimate after a copied span (three of four blocks of 2 accepted whole)
    reads 0.7 and more, and priced at that a block of 2 pays at 16 rows; the lower bound of so
    few trials does not, while the same acceptance over many steps does. Alone the estimate is
    used as it is (a wrong "on" costs the session only)."""
    cm = packed_cost_model_at_16()
    load = LoadSignal(0, 16)

    def session(steps: list[tuple[int, int]], z: float = 1.0) -> DepthController:
        est = AcceptanceEstimator(alpha0=0.5, prior_weight=2.0)
        for drafted, accepted in steps:
            est.update(drafted, accepted)
        controller = DepthController(K_MAX, cm, estimator=est, batch_z=z)
        controller.batch_size = 16
        return controller

    few = [(2, 2), (2, 2), (2, 0), (2, 2)]
    assert session(few, z=0.0).target(load) > 0  # the point estimate says draft
    assert session(few).target(load) == 0
    assert session(few * 6).target(load) > 0  # the same rate, seen six times as often
    alone = session(few)
    alone.batch_size = 1
    assert alone.target(LoadSignal(0, 1)) > 0


def test_unseen_positions_are_capped_by_what_the_methods_sessions_accepted_there() -> None:
    """Earlier sessions of the method found copied spans two tokens long (position 1 accepted,
    position 2 and on almost never): a new session whose second position accepts does not
    extrapolate that to positions it has not drafted, and stays at the depth that pays."""
    shared = SharedAcceptance()
    for i in range(300):
        shared.update(6, 2 if i % 2 else 0)  # half the blocks keep two tokens, none keeps three
    caps = shared.position_caps()
    assert caps[0] == pytest.approx(0.5, abs=0.05) and caps[1] > 0.9 and caps[2] < 0.05
    assert shared.position_caps(min_trials=1e9) == [None] * len(caps)  # too little evidence: no cap

    def deep_session(capped: bool) -> AcceptanceEstimator:
        est = AcceptanceEstimator(alpha0=0.5, prior_weight=2.0, ceilings=shared.position_caps if capped else None)
        for _ in range(6):
            est.update(2, 2)  # its own blocks of two all went through
        return est

    free, capped = deep_session(False).profile(K_MAX), deep_session(True).profile(K_MAX)
    assert free[:2] == capped[:2]  # positions it drafted keep its own rates
    assert free[2] > 0.8 and capped[2] < 0.05  # (positions past it never tried: a cap of none, reached 2 % of the time)
    verify = [simulated_verify_ms(k + 1, 1) for k in range(K_MAX + 1)]
    deep = pass_rates([0.8], lambda k: 0.0, verify, K_MAX, profile=free)
    shallow = pass_rates([0.8], lambda k: 0.0, verify, K_MAX, profile=capped)
    assert deep.index(max(deep)) > 2 and shallow.index(max(shallow)) == 2


def test_debug_logging_shows_the_depth_choice_without_changing_it(caplog) -> None:
    """`--log-level DEBUG` on the coordinator logs each choice's inputs (how the head's depths were
    diagnosed); the choice is the same with and without it."""
    quiet = DepthController(K_MAX, simulated_cost_model(), estimator=AcceptanceEstimator(alpha0=0.8))
    chosen = quiet.target()
    loud = DepthController(K_MAX, simulated_cost_model(), estimator=AcceptanceEstimator(alpha0=0.8))
    with caplog.at_level(logging.DEBUG, logger="coordinator.controller"):
        assert loud.target() == chosen > 0
    record = next(r for r in caplog.records if r.getMessage().startswith("depth:"))
    assert f"-> k {chosen}" in record.getMessage() and "verify [" in record.getMessage()


def test_positions_past_the_recent_sessions_deepest_take_its_cap_unless_the_session_went_deeper() -> None:
    """The method's recent sessions tried four positions, the fourth accepting half the time: a
    new session that has drafted two does not price positions 5 and on at its own continuation
    (0.9 and more) but at the deepest cap; one that drafted six positions itself is past the
    recent sessions' evidence and keeps its own rates."""
    shared = SharedAcceptance()
    for i in range(300):
        shared.update(4, 4 if i % 2 else 3)  # the fourth position accepts half the time
    caps = shared.position_caps()
    assert len(caps) == 4 and caps[3] == pytest.approx(0.5, abs=0.05)

    def session(block: int) -> AcceptanceEstimator:
        est = AcceptanceEstimator(alpha0=0.5, prior_weight=2.0, ceilings=shared.position_caps)
        for _ in range(8):
            est.update(block, block)  # its own blocks all went through
        return est

    shallow = session(2).profile(K_MAX)
    assert shallow[2] > 0.9 and shallow[3] == pytest.approx(caps[3])  # positions the recent sessions tried
    assert all(r == pytest.approx(caps[3]) for r in shallow[4:])  # past them: the deepest cap
    deep = session(6).profile(K_MAX)
    assert all(r > 0.8 for r in deep)  # its own positions and its continuation past them


def test_in_a_batch_depth_grows_by_doubling_what_has_been_seen() -> None:
    """A session whose blocks of 4 all went through prices deeper positions at its continuation
    rate, 0.95 and more. Alone it goes as deep as that pays; in a packed batch of 16 it chooses at
    most twice the deepest position it or its method's recent sessions drafted, since a failed
    deep block there costs every row its positions."""
    def copier(cm: CostModel) -> DepthController:
        controller = DepthController(16, cm, shared=SharedAcceptance(), peers=PassPeers())
        for _ in range(8):
            controller.estimator.update(4, 4)
        return controller

    alone = copier(packed_cost_model())
    assert alone._depth_reach() == 8
    assert alone.target(LoadSignal(0, 1)) > 8
    batched = copier(packed_cost_model())
    batched.batch_size = 16  # its last pass had 16 rows
    k = batched.target(LoadSignal(0, 16))
    assert 4 < k <= 8, k



def test_a_shadow_judged_at_a_drafted_step_counts_as_well_as_the_block() -> None:
    """A shadow of 8 started at a k = 0 step, decided at a step that drafted 2 (both accepted):
    the block tries positions 0-1, the shadow positions 0-6 (6 accepted, the seventh not)."""
    c = DepthController(K_MAX)
    c.observe(2, 2, 1.0, 50.0, 1, shadow=(8, 6))
    trials = c.estimator.trials
    assert len(trials) == 7 and trials[0] == pytest.approx(2.0, rel=0.05) and trials[2] == pytest.approx(1.0)
    assert c.estimator.successes[5] == pytest.approx(1.0) and c.estimator.successes[6] == 0.0


def test_a_shadow_past_a_block_counts_only_the_positions_past_it() -> None:
    """A shadow of 6 that ran beside a drafted block of 2 and matched 4, told from position 2:
    the block tried positions 0-1, the shadow adds positions 2-4 (2-3 accepted, 4 not) without
    aging the evidence a second time; one that failed within the block adds nothing."""
    c = DepthController(K_MAX)
    c.observe(2, 2, 1.0, 50.0, 16, shadow=(6, 4, 2))
    assert c.estimator.trials == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0])
    assert c.estimator.successes == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.0])
    assert c.estimator.steps == 1
    failed = DepthController(K_MAX)
    failed.observe(2, 1, 1.0, 50.0, 16, shadow=(6, 1, 2))
    assert failed.estimator.trials == pytest.approx([1.0, 1.0])


def test_a_session_shadows_past_its_block_in_a_batch_only() -> None:
    """Past a block the shadow is as deep as the session could draft next (`shadow_depth`), and
    there is none when that is no deeper than the block, or when the session is alone."""
    shared = SharedAcceptance()
    for _ in range(64):
        shared.update(2, 1)  # the method's recent sessions drafted blocks of 2: reach 4
    session = DepthController(K_MAX, packed_cost_model(), shared=shared, peers=PassPeers())
    session.observe(1, 1, 1.0, 130.0, 16, pass_positions=32, packed=True)
    assert session.shadow_depth_beyond(1) == 4 and session.shadow_depth_beyond(4) == 0
    assert session.shadow_depth_beyond(0) == 0
    session.observe(1, 1, 1.0, 60.0, 1, pass_positions=2, packed=True)
    assert session.shadow_depth_beyond(1) == 0


def test_in_a_batch_shadows_past_a_shallow_block_let_a_session_go_deeper() -> None:
    """A code edit whose answer opened with prose: its shadows at k = 0 failed at position 1, so
    it drafts shallow blocks. Once its output copies, only the shadows past its block can say
    so: with them it goes deep, with the same blocks and no shadows it stays where it was."""
    cm = packed_cost_model()
    load = LoadSignal(0, 16)

    def session_after(past_block: bool) -> DepthController:
        peers = PassPeers()
        sessions = [make_controller("auto", K_MAX, cm, shared_after_sessions([0.9] * 32), peers) for _ in range(16)]
        for s in sessions[1:]:
            s.observe(2, 2, 0.0, 140.0, 16, pass_positions=48, packed=True)
        session = sessions[0]
        for _ in range(10):
            session.observe(0, 0, 0.0, 130.0, 16, pass_positions=48, packed=True, shadow=(K_MAX, 1))
        assert session.target(load) <= 2
        for _ in range(6):
            session.observe(1, 1, 0.0, 130.0, 16, pass_positions=48, packed=True,
                            shadow=(K_MAX, K_MAX, 1) if past_block else None)
        return session

    assert session_after(past_block=False).target(load) <= 2
    assert session_after(past_block=True).target(load) == K_MAX


def test_in_a_batch_shadow_drafts_that_copy_turn_speculation_on_deep() -> None:
    """At k = 0 the n-gram proposer's block is known without drafting, and the output that follows
    judges it (`ShadowDraft`): a free trial. In a packed batch of 16 after prompts that did not
    pay, a session whose shadows are accepted whole leaves k = 0 on its own evidence (the policy,
    not a probe) at a depth past a probe's; one whose shadows fail learns that too, and the same
    steps without shadows teach nothing."""
    cm = packed_cost_model()
    load = LoadSignal(0, 16)

    def session_after(shadow: tuple[int, int] | None, steps: int = 4) -> DepthController:
        peers = PassPeers()
        sessions = [make_controller("auto", K_MAX, cm, shared_after_sessions([0.05] * 32), peers) for _ in range(16)]
        for s in sessions[1:]:
            s.observe(2, 0, 0.0, 140.0, 16, pass_positions=18, packed=True)
        session = sessions[0]
        for _ in range(steps):
            session.observe(0, 0, 0.0, 130.0, 16, pass_positions=16, packed=True, shadow=shadow)
        return session

    untried = session_after(None)
    assert untried.target(load) == 0
    copying, failing = session_after((K_MAX, K_MAX)), session_after((K_MAX, 0))
    assert copying.target(load) > copying.probe_k
    assert failing.target(load) == 0 and failing.estimator.alpha < untried.estimator.alpha
    assert copying.choose(load) > copying.probe_k and not copying._probed  # committed, not a probe step


def test_in_a_batch_shadows_teach_the_fill_as_well_as_the_acceptance() -> None:
    """A session is seeded with its method's recent fill: after chat prompts, where the n-gram
    lookup finds little, about a twentieth. Shadows accepted whole then raise its acceptance but
    not what its blocks would fill, and the packed pass prices their gain at that twentieth: k = 0
    to the end. The shadows' own lengths teach the fill too (a full shadow is a full block), and
    the session turns on; lookups that find nothing teach it that its blocks would be empty.
    Alone a shadow is k_max deep and an empty draft costs nothing, so the fill is left as it is."""
    cm = packed_cost_model()
    load = LoadSignal(0, 16)

    def session_after(shadow_fill: tuple[int, int] | None, batch: int = 16) -> DepthController:
        shared = shared_after_sessions([0.05] * 32)
        for _ in range(64):
            shared.update_fill(0.05)
        peers = PassPeers()
        sessions = [make_controller("auto", K_MAX, cm, shared, peers) for _ in range(batch)]
        for s in sessions[1:]:
            s.observe(0, 0, 0.0, 140.0, 16, pass_positions=16, packed=True)
        session = sessions[0]
        session.observe(0, 0, 0.0, 130.0, batch, pass_positions=batch, packed=True)
        for _ in range(6):
            if shadow_fill is not None:
                session.observe_shadow_fill(*shadow_fill)
            session.observe(0, 0, 0.0, 130.0, batch, pass_positions=batch, packed=True, shadow=(4, 4))
        return session

    assert session_after(None).target(load) == 0  # accepted shadows, fill still the method's
    full = session_after((4, 4))
    assert full.fill.mean > 0.5 and full.target(load) > 0
    empty = session_after((0, 4))
    assert empty.fill.mean < 0.05 and empty.target(load) == 0
    alone = session_after((4, 4), batch=1)
    assert alone.fill.mean == pytest.approx(session_after(None, batch=1).fill.mean)


def test_a_sessions_first_shadow_counts_in_a_batch_before_its_first_pass() -> None:
    """A session's first shadow is drafted at its first step, right after its prefill, before it
    has seen a pass: its peers say it is in a batch, so the shadow is as deep as it could draft
    next and its fill counts. Read from the last pass alone (batch 1 before the first), it went
    k_max deep and its fill was dropped: a code edit after code prompts (fill 0.29) kept that fill
    for three steps while its shadows were accepted, and drafted from its fourth. Alone (no
    peers) it is k_max deep and the fill is left as it is."""
    shared = SharedAcceptance()
    for _ in range(64):
        shared.update(2, 1)  # the method's recent sessions drafted blocks of 2: reach 4
        shared.update_fill(0.25)
    peers = PassPeers()
    sessions = [DepthController(K_MAX, packed_cost_model(), shared=shared, peers=peers) for _ in range(16)]
    first = sessions[0]
    assert first.shadow_depth() == 4
    before = first.fill.mean
    first.observe_shadow_fill(4, first.shadow_depth())
    assert first.fill.mean > before + 0.2
    alone = DepthController(K_MAX, packed_cost_model(), shared=shared, peers=PassPeers())
    assert alone.shadow_depth() == K_MAX
    alone.observe_shadow_fill(K_MAX, K_MAX)
    assert alone.fill.mean == pytest.approx(before)


def test_shadow_drafts_in_a_batch_reach_twice_as_deep_as_what_has_gone_through() -> None:
    """In a batch a shadow drafts as deep as the session could draft next (`_depth_reach`): twice
    the deepest position tried, its own or its method's recent sessions', so depth grows 4, 8,
    16 as copies go through, not to k_max at once. Alone it drafts k_max."""
    shared = SharedAcceptance()
    for _ in range(64):
        shared.update(2, 1)  # the method's recent sessions drafted blocks of 2
    session = DepthController(K_MAX, packed_cost_model(), shared=shared, peers=PassPeers())
    session.observe(0, 0, 0.0, 130.0, 16, pass_positions=16, packed=True)
    assert session.shadow_depth() == 4
    session.observe(0, 0, 0.0, 130.0, 16, pass_positions=16, packed=True, shadow=(4, 4))
    assert session.shadow_depth() == K_MAX == 8
    session.observe(0, 0, 0.0, 60.0, 1, pass_positions=1, packed=True)
    assert session.shadow_depth() == K_MAX


# a session kept at k = 0 -------------------------------------------------------------------


def _packed_replica_at_16(reuse_steps: int) -> list[DepthController]:
    """16 auto sessions on one replica whose packed passes of 16 rows cost 148 ms plus 2 ms a
    drafted position, each pricing its depths again at least every `reuse_steps` steps at k = 0."""
    cm = CostModel()
    for extra in (0, 0, 16, 32, 48) * 4:
        cm.observe_verify(16, 1 + extra // 16, 148.0 + 2 * extra, positions=16 + extra, packed=True)
    shared, peers = shared_after_sessions([0.1] * 32), PassPeers()
    sessions = [make_controller("auto", 16, cm, shared, peers) for _ in range(16)]
    for session in sessions:
        session.settled_reuse_steps = reuse_steps
    return sessions


def _first_of_16(reuse: int, shadow_of: Callable[[int, int], tuple[int, int] | None],
                 accepted_of: Callable[[int, int], int]) -> tuple[DepthController, list[tuple[int, int]]]:
    """`_packed_replica_at_16(reuse)` for 60 packed passes; session 0 gets shadow_of(step, k) and
    accepts accepted_of(step, k), the rest accept nothing. -> (session 0, (step, the policy's
    target) at every step session 0 priced its depths)."""
    sessions = _packed_replica_at_16(reuse)
    watched, targets = sessions[0], []
    original = watched.target

    def target(load=None):
        targets.append((len(watched.history), original(load)))
        return targets[-1][1]

    watched.target = target  # type: ignore[method-assign]
    for step in range(60):  # one packed pass a step, every session in it
        depths = [session.choose() for session in sessions]
        extra = sum(depths)
        for i, (session, k) in enumerate(zip(sessions, depths)):
            shadow = shadow_of(step, k) if i == 0 else None
            accepted = accepted_of(step, k) if i == 0 else 0
            session.observe(k, accepted, 1.0, 160.0 + 2 * extra, 16, compute_ms=148.0 + 2 * extra,
                            requested=k, pass_positions=16 + extra, packed=True, pass_id=step + 1, shadow=shadow)
    return watched, targets


def _watched_first_of_16(shadow_of: Callable[[int, int], tuple[int, int] | None],
                         accepted_of: Callable[[int, int], int],
                         ) -> tuple[list[list[int]], list[list[int]], DepthController]:
    """`_first_of_16`, pricing every step and then every SETTLED_REUSE_STEPS steps. -> (session
    0's depth histories, the steps it priced at, session 0)."""
    histories, pricings = [], []
    for reuse in (1, controller_module.SETTLED_REUSE_STEPS):
        watched, targets = _first_of_16(reuse, shadow_of, accepted_of)
        histories.append(watched.history)
        pricings.append([step for step, _ in targets])
    return histories, pricings, watched


def test_a_session_kept_off_prices_again_on_new_evidence_and_otherwise_every_few_steps() -> None:
    """At 16 sessions whose prompts do not pay, a session at k = 0 reuses its last pricing while
    nothing it rests on changes (`SETTLED_REUSE_STEPS`), and prices at once when its shadows bring
    trials: from step 30 its output copies (shadows of 4 accepted whole) and it leaves k = 0 at the
    same step, with the same depths after, as sessions that price every step."""
    histories, pricings, _ = _watched_first_of_16(
        lambda step, k: (4, 4) if step >= 30 and k == 0 else None, lambda step, k: k if step >= 30 else 0)
    every_step, reused = histories
    assert reused == every_step
    assert every_step[:30] == [0] * 30 and max(every_step[30:]) >= 2, every_step
    # before the copy: the first step, then one pricing in SETTLED_REUSE_STEPS steps; from the step
    # after its first shadow on, every step (new evidence, then a switch pending, then k > 0)
    reuse = controller_module.SETTLED_REUSE_STEPS
    assert [s for s in pricings[1] if s < 31] == [0] + list(range(1, 31, reuse)), pricings[1]
    assert set(range(31, 60)) <= set(pricings[1]), pricings[1]
    assert pricings[0] == list(range(60))


def _copy_then_miss_in_a_batch_of_16() -> tuple[list[int], list[tuple[int, int]]]:
    """Session 0 of a batch of 16 copies its context for 20 steps (shadows of 4 and blocks
    accepted whole), then every draft misses at its first position; its peers accept nothing.
    -> (its depth history, (step, policy target) at every step)."""
    watched, targets = _first_of_16(1, lambda step, k: (4, 4) if step < 20 and k == 0 else None,
                                    lambda step, k: k if step < 20 else 0)
    return watched.history, targets


def test_in_a_batch_a_drafting_session_stops_two_steps_after_its_pricing_says_off(monkeypatch) -> None:
    """In a batch a wrong "on" lengthens every row's pass: a drafting session whose own pricing
    says k = 0, after at least two steps of wanting less than it drafts (`BATCH_OFF_STEPS`),
    stops, where the single-session hysteresis held it on for 12 steps or until plain decoding
    priced 10 % better. Extraction at 16 sessions drafted at 70 % of its drafting steps against
    its own pricing (docs/benchmarks.md)."""
    history, targets = _copy_then_miss_in_a_batch_of_16()
    assert max(history[:20]) >= 2, history
    first_off = next(step for step, target in targets if step >= 20 and target == 0)
    assert history[first_off + controller_module.BATCH_OFF_STEPS - 1] == 0, (first_off, history)
    drafting_after = sum(1 for k in history[20:first_off + 12] if k > 0)
    monkeypatch.setattr(controller_module, "BATCH_OFF_STEPS", 10 ** 6)  # the hysteresis alone
    held, _ = _copy_then_miss_in_a_batch_of_16()
    assert held[:first_off] == history[:first_off]
    assert sum(1 for k in held[20:first_off + 12] if k > 0) > drafting_after + 4, (history, held)


def test_failed_shadows_do_not_make_a_session_kept_off_price_again_and_accepted_ones_do() -> None:
    """A session at k = 0 whose shadows fail at every step (a completion whose lookups keep
    finding spans the output does not take) reuses its pricing for SETTLED_REUSE_STEPS steps
    all the same: a failed trial only lowers the rates its depths are priced on. From step 30
    its shadows go through whole, and it prices at once and leaves k = 0 at the same step, with
    the same depths after, as a session that prices every step."""
    histories, pricings, watched = _watched_first_of_16(
        lambda step, k: None if k else ((4, 4) if step >= 30 else (4, 0)), lambda step, k: k if step >= 30 else 0)
    every_step, reused = histories
    assert reused == every_step
    assert every_step[:30] == [0] * 30 and max(every_step[30:]) >= 2, every_step
    reuse = controller_module.SETTLED_REUSE_STEPS
    assert watched.estimator.evidence > watched.estimator.accepting_evidence > 0
    assert [s for s in pricings[1] if s < 31] == [0] + list(range(1, 31, reuse)), pricings[1]
    assert 31 in pricings[1], pricings[1]  # the first accepted shadow's step after: priced at once


def test_a_gated_probe_that_no_depth_would_pay_for_is_priced_every_few_steps_not_every_step() -> None:
    """16 echoing sessions at k = 0 whose method's recent prompts accepted 0.1-0.4 at fill 0.5 and
    whose own lookups find nothing to draft (a completion at 16 sessions): past the gated interval
    a probe is due at every step, and at the probe's optimistic acceptance, at their fill, no depth
    pays. A session that reuses that answer (`_probe_wanted`) prices it again
    at most every `SETTLED_REUSE_STEPS` steps while nothing it rests on changes, and chooses
    exactly what a session that prices every step chooses."""
    reuse = controller_module.SETTLED_REUSE_STEPS
    histories, pricings = [], []
    for steps in (1, reuse):
        cm = CostModel()
        for extra in (0, 16, 32, 48) * 4:
            cm.observe_verify(16, 1 + extra // 16, 148.0 + 2 * extra, positions=16 + extra, packed=True)
        shared, peers = shared_after_sessions([0.1 + 0.3 * i / 31 for i in range(32)], fill=0.5), PassPeers()
        sessions = [make_controller("auto", 8, cm, shared, peers) for _ in range(16)]
        for session in sessions:
            session.echoes, session.settled_reuse_steps = True, steps
        watched, priced = sessions[0], []
        policy = watched._policy

        def counted(alpha, load, optimistic=None, fill=None):
            if optimistic is not None:  # a probe's what-if, not the session's own pricing
                priced.append(len(watched.history))
            return policy(alpha, load, optimistic, fill)

        watched._policy = counted  # type: ignore[method-assign]
        for step in range(160):  # one packed pass a step, every session in it
            depths = [session.choose(remaining=100) for session in sessions]
            for session, k in zip(sessions, depths):
                session.observe_shadow_fill(0, session.shadow_depth())  # the lookup finds no match to draft
                session.observe(k, 0, 1.0, 150.0, 16, compute_ms=140.0, requested=k, pass_positions=16 + sum(depths),
                                packed=True, pass_id=step + 1)
        histories.append(watched.history)
        pricings.append(priced)
    every_step, reused = histories
    assert reused == every_step == [0] * 160
    assert len(pricings[0]) >= 40, pricings[0]  # due from the gated interval (93 steps) on, priced at each
    gaps = [b - a for a, b in zip(pricings[1], pricings[1][1:])]
    assert gaps and min(gaps) == reuse == max(gaps), pricings[1]


def test_step_reuse_keeps_an_answer_for_its_key_a_few_steps() -> None:
    computed = []

    def compute() -> int:
        computed.append(1)
        return 0

    reuse = StepReuse[int]()
    for _ in range(8):
        reuse.get("same", compute, steps=3)
    assert len(computed) == 3  # steps 0, 3 and 6
    reuse.get("other", compute, steps=3)
    reuse.get(None, compute, steps=3)
    reuse.get(None, compute, steps=3)
    assert len(computed) == 6  # a new key, and no key, compute at once
    reuse.get("kept?", lambda: 5, steps=3, keep=lambda value: value == 0)
    reuse.get("kept?", compute, steps=3)
    assert len(computed) == 7  # an answer `keep` refuses is not reused


def test_a_step_whose_target_differs_from_its_depth_prices_its_depths_once(monkeypatch) -> None:
    """A session committed to k = 4 whose blocks stop going through: its policy turns to a smaller
    depth and the hysteresis compares the two depths' rates. Both read one pricing of the step
    (`_rates` memoized within a choose); the choices are those of pricing twice."""
    def run(memo: bool) -> tuple[list[int], list[int]]:
        session = DepthController(K_MAX, packed_cost_model(), peers=PassPeers())
        session.observe(4, 4, 1.0, 160.0, 16, pass_positions=80, packed=True)
        session._commit(4)
        calls = []
        compute = session._compute_rates

        def counted(*args, **kwargs):
            calls.append(len(session.history))
            return compute(*args, **kwargs)

        monkeypatch.setattr(session, "_compute_rates", counted)
        if not memo:
            monkeypatch.setattr(session, "_memoized", lambda key, fn: fn())
        for _ in range(6):
            k = session.choose()
            session.observe(k, 0, 1.0, 160.0, 16, pass_positions=16 + k, packed=True)
        return session.history, calls

    history, calls = run(memo=True)
    history_twice, calls_twice = run(memo=False)
    assert history == history_twice, (history, history_twice)
    pending = [step for step in range(6) if calls_twice.count(step) > 1]
    assert pending, calls_twice  # some step compared the target's rate with its depth's
    assert all(calls.count(step) == 1 for step in pending), calls
