"""Speculation depth's math: what a step of depth k is expected to yield and cost, as pure
functions of acceptance, fill and measured costs (no state), and the load signal they read.

With per-token acceptance probability a (token i is accepted given tokens < i were), a step that
drafts k tokens emits on average

    E(k, a) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the accepted prefix plus the target's own recovered or bonus token). The step costs the
draft's time for k tokens plus the target's time to verify a block of k + 1 positions; k = 0 is
plain decoding (no draft call at all). coordinator/controller.py picks, per session and step, the
k with the most expected tokens per millisecond from these functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

Costs = Callable[[int], float] | Sequence[float]


def expected_tokens(k: int, alpha: float) -> float:
    """Expected tokens emitted by one verify step with k draft tokens and acceptance `alpha`.

    (1 - a^(k+1)) / (1 - a): the geometric sum 1 + a + ... + a^k, since draft token i counts only
    if tokens 0..i were all accepted, and the target always adds one token of its own. k = 0 gives
    1 (plain decoding), a = 1 gives k + 1 (everything accepted), a = 0 gives 1.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    a = min(max(float(alpha), 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


# A new prompt of a method is like one of its recent prompts, or (this share) like none of them:
# then anywhere on this grid of acceptances (`mixture_tokens`).
MIXTURE_DIFFUSE = 0.2
MIXTURE_GRID = (0.1, 0.3, 0.5, 0.7, 0.9, 0.98)
# In a packed batch a session prices its depth by `mixture_tokens` until its own trials reach
# this; then by its own per-position rates, a standard error low (`DepthController._packed_rates`):
# with the evidence of a few blocks, where each position stands, not one rate, says how deep.
MIXTURE_TRIALS = 8.0
# Past MIXTURE_TRIALS a session's tokens are at least those of the recent prompt it is like at this
# posterior quantile (`MixturePrior.quantile_tokens`): the mixture's "a standard error low".
MIXTURE_FLOOR_QUANTILE = 0.16


def mixture_tokens(recent: Sequence[float], successes: float, trials: float, fill: float, k_max: int,
                   diffuse: float = MIXTURE_DIFFUSE, grid: Sequence[float] = MIXTURE_GRID) -> list[float]:
    """Expected tokens of a step at k = 0..k_max for a session whose acceptance is one of the
    method's recent sessions' (`recent`, equally likely) or, with probability `diffuse`, one of
    `grid`, weighed by the session's own evidence: `successes` of `trials` drafted positions.

    The posterior over those acceptances a_i is the prior times a_i^s (1 - a_i)^(n - s), and a
    step's tokens are its mean of 1 + fill (a_i + ... + a_i^k). Why not one estimate: E(k, a)
    is convex in a for deep blocks, and a method's prompts differ. Code edits after fixed k = 4
    sessions: two prompts that accepted 0.86 and 0.92 of their drafts, one 0.3; the mean, 0.69,
    priced a standard error low with two trials' weight (0.38), turned every new session's
    first three steps off in a batch of 16, where a step at k = 4 was worth 3.2 tokens on
    average. With its own evidence a session's posterior moves to the prompts it is like: one
    block of 4 accepted whole leaves the good ones, a miss at its first position mostly the bad
    one. The diffuse share keeps a prompt unlike the recent ones (a new kind of request) from
    being held to them."""
    return MixturePrior(recent, k_max, diffuse, grid).tokens(successes, trials, fill)


class MixturePrior:
    """`mixture_tokens`' prior for one set of recent sessions, each component's gains
    a + a^2 + ... + a^k computed once: a session's posterior is then one weighted sum.

    Why apart: it runs at every step of every session with few trials of its own (in a batch of
    16 after chat prompts, every session at k = 0), on the coordinator's critical path between two
    passes, and built anew each step it was most of a k = 0 step's controller time (0.09 of
    0.135 ms; 2 ms between two passes of 16 rows). The components change only when a session
    ends (`SharedAcceptance.mixture_prior` keeps one per version)."""

    def __init__(self, recent: Sequence[float], k_max: int, diffuse: float = MIXTURE_DIFFUSE,
                 grid: Sequence[float] = MIXTURE_GRID):
        if not recent:
            raise ValueError("mixture_tokens needs at least one recent session")
        # Equal acceptances (to 0.01) are one component: a method's recent sessions are often a few
        # prompts over again.
        share = 1.0 - diffuse if grid else 1.0
        priors = [(a, share / len(recent)) for a in recent] + [(a, diffuse / len(grid)) for a in grid or ()]
        weights: dict[float, float] = {}
        for a, weight in priors:
            key = round(min(max(float(a), 0.02), 0.98), 2)
            weights[key] = weights.get(key, 0.0) + weight
        components = sorted((a, w) for a, w in weights.items() if w > 0)
        rates = np.array([a for a, _ in components])
        self.k_max = k_max
        self._log_prior = np.log([w for _, w in components])
        self._log_accept, self._log_reject = np.log(rates), np.log1p(-rates)
        # gains[i, k] = a_i + ... + a_i^k (0 at k = 0)
        self._gains = np.concatenate([np.zeros((len(components), 1)),
                                      np.cumsum(rates[:, None] ** np.arange(1, k_max + 1), axis=1)], axis=1)

    def tokens(self, successes: float, trials: float, fill: float) -> list[float]:
        """Expected tokens of a step at k = 0..k_max after `successes` of `trials` drafted
        positions, at `fill` (`mixture_tokens`)."""
        posterior = self._posterior(successes, trials)
        scale = min(max(float(fill), 0.0), 1.0) / posterior.sum()
        return (1.0 + scale * (posterior @ self._gains)).tolist()

    def quantile_tokens(self, successes: float, trials: float, fill: float, caps: Sequence[float] | None = None,
                        quantile: float = MIXTURE_FLOOR_QUANTILE) -> list[float]:
        """Expected tokens of a step at k = 0..k_max were the session's acceptance the
        component at `quantile` of its posterior (components in order of acceptance): the
        mixture's lower bound, where `tokens` is its mean."""
        posterior = self._posterior(successes, trials)
        cumulative = np.cumsum(posterior) / posterior.sum()
        i = min(int(np.searchsorted(cumulative, quantile)), len(cumulative) - 1)
        if caps is None or min(caps) >= 1.0:
            return (1.0 + min(max(float(fill), 0.0), 1.0) * self._gains[i]).tolist()
        rate = float(np.exp(self._log_accept[i]))
        return profile_tokens(rate, [min(rate, float(cap)) for cap in caps], fill, self.k_max)

    def _posterior(self, successes: float, trials: float) -> np.ndarray:
        """The components' posterior weights (unnormalized) after `successes` of `trials`."""
        n = max(float(trials), 0.0)
        s = min(max(float(successes), 0.0), n)
        logs = self._log_prior + s * self._log_accept + (n - s) * self._log_reject
        return np.exp(logs - logs.max())


def _cost_list(costs: Costs, k_max: int) -> list[float]:
    if callable(costs):
        return [float(costs(k)) for k in range(k_max + 1)]
    if len(costs) < k_max + 1:
        raise ValueError(f"need costs for k = 0..{k_max}, got {len(costs)} values")
    return [float(c) for c in costs[: k_max + 1]]


def depth_rates(alpha: float, draft_cost_ms: Costs, verify_cost_ms: Costs, k_max: int) -> list[float]:
    """Expected tokens per millisecond for every k in 0..k_max.

    Both cost arguments are indexed by the depth k (a callable of k, or a sequence with entries
    for k = 0..k_max): draft_cost_ms(k) is the draft's time to propose k tokens, verify_cost_ms(k)
    the target's time to verify a block of depth k, i.e. k + 1 positions. The draft cost at k = 0
    is taken as 0 whatever is passed, because a k = 0 step never calls the draft.
    """
    return pass_rates([alpha], draft_cost_ms, verify_cost_ms, k_max)


def pass_rates(alphas: Sequence[float], draft_cost_ms: Costs, verify_cost_ms: Costs, k_max: int,
               fills: Sequence[float] | None = None, profile: Sequence[float] | None = None) -> list[float]:
    """Expected tokens per millisecond and per session, for every k in 0..k_max, of a batched pass
    whose sessions have acceptances `alphas` and all ask for k draft tokens.

    A batched verify pads every row to the longest block, so a pass costs verify_cost_ms(k) for
    its longest block whoever drafted it: one session going deep makes every row pay for k + 1
    positions, and once the pass is that long, drafting up to k is free to every other session.
    So the sessions choose one depth for the whole pass, and this returns, per depth, the
    sessions' geometric mean of E(k, a_i) over cost(k), so that one alpha gives `depth_rates`.
    Costs are indexed by depth as there.

    Why the geometric mean (proportional fairness), not the pool's tokens (the arithmetic mean):
    the cost of a long block falls on every row, its gain only on the rows that accept. Eight
    sessions copying their prompt and eight that do not, at batch 16: a 7-token block costs 3x a
    plain pass, the copiers gain 4.7 tokens, the others nothing, so the pool gains a little while
    the others run at a third of their speed, and a request finishes when its last token does
    (the bench's 16-request bursts ran at 0.85-0.94x speculation off). Speculation pays for the
    pass when it pays for its sessions broadly: log-utility counts a session slowed 3x as much
    as one sped up 3x. With equal acceptances the two means agree.

    `fills` (default all 1): per session, the share of the asked tokens its proposer drafts. An
    n-gram or suffix proposer offers nothing where its context has no match (on chat prompts about
    half the steps), and the acceptance rate is counted over drafted tokens only. A session with
    fill f gains f (E(k, a) - 1) tokens over plain decoding, while the pass is padded to k + 1
    positions as soon as any one row drafted: it costs verify(k) with probability
    1 - prod(1 - f_i) and verify(0) otherwise. Alone (b = 1) an empty draft is free; in a batch of
    twelve, someone nearly always drafts, and every row pays for drafts that half of them lack.

    `profile` (optional): the first session's conditional acceptance per draft position,
    P(accept i | accepted < i) (`AcceptanceEstimator.profile`); positions past its end, and
    every other session, at their single rate. One rate per session is the geometric model, which
    fits a draft whose every token is an independent guess; a copying draft is all or nothing
    (a code edit either is in the unchanged code, where whole blocks go through, or is not), its
    first position is its weakest and the later ones accept at 0.9 and more, and one pooled rate
    then undervalues deep blocks (code edits at concurrency 1 settled at k = 4 where fixed k = 16
    ran faster).
    """
    if not alphas:
        raise ValueError("pass_rates needs at least one session's acceptance")
    if fills is not None and len(fills) != len(alphas):
        raise ValueError(f"pass_rates got {len(fills)} fills for {len(alphas)} sessions")
    draft = _cost_list(draft_cost_ms, k_max)
    verify = _cost_list(verify_cost_ms, k_max)
    # E(k, a) = E(k - 1, a) + a^k: one multiplication per session and depth (this runs at every
    # step of every session, on the coordinator's cores that a CPU target shares).
    clipped = [min(max(float(a), 0.0), 1.0) for a in alphas]
    shares = [1.0] * len(clipped) if fills is None else [min(max(float(f), 0.0), 1.0) for f in fills]
    none_drafts = math.prod(1.0 - f for f in shares)
    powers = [1.0] * len(clipped)
    gains = [0.0] * len(clipped)  # per session f_i (E(k, a_i) - 1)
    rates = []
    own = [min(max(float(r), 0.0), 1.0) for r in profile] if profile else []
    for k in range(k_max + 1):
        if k > 0:
            at_k = clipped if k > len(own) else [own[k - 1], *clipped[1:]]  # draft position k - 1
            powers = [p * a for p, a in zip(powers, at_k)]
            gains = [g + f * p for g, f, p in zip(gains, shares, powers)]
        tokens = math.prod(1.0 + g for g in gains) ** (1.0 / len(gains))
        cost = verify[0] if k == 0 else (1.0 - none_drafts) * verify[k] + none_drafts * verify[0] + draft[k]
        rates.append(tokens / cost if cost > 0 else math.inf)
    return rates


def packed_rates(alpha: float, draft_cost_ms: Costs, plain_ms: float, position_ms: float, batch_size: int,
                 k_max: int, fill: float = 1.0, profile: Sequence[float] | None = None,
                 draft_rows: int = 1, jump_ms: float = 0.0, expected: Sequence[float] | None = None) -> list[float]:
    """Expected tokens per millisecond of one session in a packed pass of `batch_size` rows, for
    every k in 0..k_max, with the cost of its draft work counted as the whole pass pays it.

    A packed pass (target_service/packed_attention.py) computes each row's own block, so a
    session's k draft tokens add f k positions to the pass (f: its fill), `position_ms` each, and
    lengthen it for every row. The pass's rows emit about `batch_size` tokens in `plain_ms`, so
    c ms of extra pass time costs every row c ms: this session's step is priced at
    plain_ms + batch_size * c. Then E(k) / that cost peaks at the k that maximizes the pass's
    throughput to first order, and beats plain decoding exactly when f (E(k) - 1) >
    batch_size * c / plain_ms: the session's extra tokens outweigh what its positions cost all.

    `jump_ms`: what a pass costs beyond its positions as soon as any row brings a block
    (`CostModel.packed_jump_ms`: on a CPU, 16 rows run faster than 18 and the longer blocks'
    attention is extra calls); the caller passes 0 when a peer drafts anyway. Charged to every
    row, when this session drafts (its fill). `draft_rows`: the rows that wait for this
    session's draft call (default 1, the session itself: the call runs while the coordinator
    steps the pass's other sessions, one after another, and the pass waits for it only when it
    comes back last; charged to all 16 rows of a batch, a 7 ms n-gram call outweighed what a
    summary's accepted tokens gained). `profile` as in `pass_rates`. At batch size 1 this is
    `depth_rates` with a verify line of slope `position_ms` (and the jump).

    `expected` (optional): the step's expected tokens per k, fill included (`mixture_tokens`), in
    place of those of `alpha`, `profile` and `fill`; the fill still prices the positions.
    """
    draft = _cost_list(draft_cost_ms, k_max)
    b = max(int(batch_size), 1)
    f = min(max(float(fill), 0.0), 1.0)
    a = min(max(float(alpha), 0.0), 1.0)
    own = [min(max(float(r), 0.0), 1.0) for r in profile] if profile else []
    tokens = profile_tokens(a, own, f, k_max) if expected is None else expected
    rates = []
    for k in range(k_max + 1):
        cost = plain_ms
        if k > 0:
            cost += b * f * (position_ms * k + jump_ms) + max(int(draft_rows), 1) * draft[k]
        rates.append(tokens[k] / cost if cost > 0 else math.inf)
    return rates


def profile_tokens(alpha: float, profile: Sequence[float], fill: float, k_max: int) -> list[float]:
    """Expected tokens of a step at k = 0..k_max whose position i accepts at profile[i] given
    the ones before it (at `alpha` past the profile), at `fill`: what `packed_rates` counts."""
    f = min(max(float(fill), 0.0), 1.0)
    power, tokens = 1.0, [1.0]
    for k in range(1, k_max + 1):
        power *= min(max(float(profile[k - 1] if k <= len(profile) else alpha), 0.0), 1.0)
        tokens.append(tokens[-1] + f * power)
    return tokens


def best_reading(rates_by_reading: Sequence[Sequence[float]]) -> list[float]:
    """Each depth's rate under the reading of the costs that favours it most: where the passes
    seen cannot tell two readings apart (`CostModel.jump_reading`), the depth is chosen as if the
    kinder one held. A depth that pays only under the kinder reading is tried, and its passes
    tell which holds; under the dearer one alone it would never be tried, and a cold replica
    at 16 code edits ran without drafting to the end of its requests."""
    return [max(rates) for rates in zip(*rates_by_reading)]


def best_depth(
    alpha: float, draft_cost_ms: Costs, verify_cost_ms: Costs, k_max: int, margin: float = 0.05
) -> tuple[int, float]:
    """The depth with the most expected tokens per ms, and that rate: (k, tokens/ms).

    Costs are indexed by depth as in `depth_rates`. k = 0 is returned unless the best k > 0 beats
    plain decoding by at least `margin` (relative): a gain inside the noise of the estimates is not
    worth the draft work and the wire traffic. Among equal rates the smaller k wins.
    """
    rates = depth_rates(alpha, draft_cost_ms, verify_cost_ms, k_max)
    k = _argbest(rates, margin)
    return k, rates[k]


def acceptance_lower_bound(rate: float, trials: float, z: float) -> float:
    """`rate` less z standard errors of a proportion seen over `trials` (decayed) trials, at
    least 0: what a session's acceptance is priced at in a batch (`DepthController._packed_rates`).

    A session drafts when its estimate is high, and with the few trials of a short request the
    estimate is high by chance as often as by merit: the steps that follow a "yes" then accept
    less than it said (regression to the mean). In a batch a wrong "on" lengthens every row's
    pass; alone it costs the session only."""
    r = min(max(float(rate), 0.0), 1.0)
    if z <= 0 or trials <= 0:
        return r
    return max(r - z * math.sqrt(r * (1.0 - r) / trials), 0.0)


def batch_margin(margin: float, batch_size: int) -> float:
    """The margin by which speculating must beat plain decoding in a pass of `batch_size` rows:
    `margin` times sqrt(batch_size).

    In a batch the depth is one decision for every row: a wrong "on" lengthens the pass for all
    of them, and the estimates it rests on are the weakest there (verify cells of long blocks at
    large batch sizes are seen least; the pass also waits for the slowest of the sessions' draft
    round trips, which the per-session draft cost does not see). On this project's CPU machines
    the model's gain of speculating at batch 16 with chat-like acceptance was a few percent where
    the bench measured a loss of 5-12 %; sqrt(16) x 5 % = 20 % keeps those off while code
    editing (a 30 % gain and more) stays on.

    A smaller margin for packed passes (batch_size ** 0.25, 10 % at 16 rows) was measured on
    2026-12-01 and dropped: code edits at 16 sessions drafted more (mean k 1.8) and ran at 0.97x
    speculation off and 0.85x fixed k = 4, extraction at 0.88x off (docs/benchmarks.md)."""
    return margin * math.sqrt(max(int(batch_size), 1))


def batch_choice(rates: Sequence[float], margin: float, peer_depth: int) -> int:
    """A session's depth in a packed batch: the best rate's k where it beats plain decoding by
    `margin` (`batch_margin`), else, where a peer of the pass already drafts `peer_depth` >= that
    k, the best k at no margin at all.

    The margin keeps a session off where the model's gain may be noise, because a wrong "on"
    lengthens every row's pass. A block no longer than a peer's adds least to a pass: the jump to
    the drafted path is paid already, and packed attention runs the short blocks in the grid the
    longer rows set (`target_service/packed_attention.grid_length`), so the block adds its
    token-wise work and little else. At 16 code edits the margin held half of auto's steps at
    k = 0 at acceptance 0.56-0.63, where the model's gain at k = 1 was 3-13 % and fixed k = 2
    did 0.84-0.90x speculation off's verify work a token (docs/benchmarks.md, "A cold replica
    drafts, and a block within a peer's")."""
    k = _argbest(rates, margin)
    if k == 0 and peer_depth > 0:
        free = _argbest(rates, 0.0)
        if free <= peer_depth:
            return free
    return k


def _argbest(rates: Sequence[float], margin: float) -> int:
    k = max(range(len(rates)), key=lambda i: (rates[i], -i))
    return 0 if k > 0 and rates[k] < rates[0] * (1.0 + margin) else k


@dataclass(frozen=True)
class LoadSignal:
    """A target replica's load, as its GetStats reports it (plus the replica's max batch size).

    queue_depth: verify/prefill requests waiting for the model now.
    open_sessions: sessions open on the replica.
    batch_occupancy: mean verify batch size / max batch size, in [0, 1].
    max_batch_size: most sessions one forward pass takes (0: unknown).
    """

    queue_depth: int = 0
    open_sessions: int = 1
    batch_occupancy: float = 0.0
    max_batch_size: int = 0

    @property
    def batch_size(self) -> int:
        """Sessions expected to share this session's forward pass (at least 1)."""
        b = max(self.open_sessions, 1)
        if self.max_batch_size > 0:
            b = max(min(b, self.max_batch_size), round(self.batch_occupancy * self.max_batch_size))
        return max(int(b), 1)

    @classmethod
    def from_target_stats(cls, stats: Any, max_batch_size: int = 0) -> "LoadSignal":
        """From a TargetStats message (or anything with its field names)."""
        return cls(int(stats.queue_depth), int(stats.open_sessions), float(stats.batch_occupancy), max_batch_size)


def load_penalty(load: LoadSignal | None) -> float:
    """Multiplier (>= 1) on the verify cost of each extra (draft) position in a block.

    Load lowers k through two channels, and this function is the second one.

    1. The verify cost is looked up at the batch size the session shares (`LoadSignal.batch_size`)
       in the measured cost model. In a batched pass every row is padded to the longest block, so
       verify_ms(k + 1, b) is the time of the whole pass, and for b sessions sharing it the pool
       emits b * E(k) tokens per pass: the pool's throughput and each session's tokens/ms are
       maximized by the same k. On a compute-bound target the pass time grows with b times the
       block length, so k falls by itself as b rises. The sessions in the pass need no extra term.
    2. Requests in the queue are not in the pass: they wait for it to end and gain nothing from
       this session's draft tokens. Each extra position lengthens the pass by d ms, which costs
       each of the q queued requests d ms; the b sessions that share the pass split that bill.
       So the marginal cost of an extra position is d * (1 + q / b). That is the penalty: zero
       with an empty queue, and growing with the backlog exactly when the target is saturated
       and rejected draft tokens spend compute that other requests are waiting for.

       Up to b - 1 of the queued requests are the pass's other rows, whose verifies wait for the
       next pass with this session's (a poll during a prefill finds every session of the batch
       queued): they are in b already, so only the queue beyond them counts. Counting them had
       doubled the price of a draft position at 16 sessions whenever prompts were long.
    """
    if load is None:
        return 1.0
    outside = load.queue_depth - (load.batch_size - 1)
    return 1.0 + outside / load.batch_size if outside > 0 else 1.0


def pass_alphas(own: float, others: Sequence[float], batch_size: int) -> list[float]:
    """The acceptances of the sessions sharing a pass of `batch_size` rows, one of them `own`.

    Peers this coordinator does not know of (the replica's other coordinators' sessions) are taken
    to accept like the known ones on average; known peers beyond the batch size all count (the
    registry is fresher than the replica's polled session count)."""
    known = [own, *others]
    missing = max(int(batch_size) - len(known), 0)
    return known + [sum(known) / len(known)] * missing


def pass_sessions(own: tuple[float, float], others: Sequence[tuple[float, float]],
                  batch_size: int) -> tuple[list[float], list[float]]:
    """`pass_alphas` for (acceptance, fill) pairs: the pass's acceptances and fills, unknown
    peers at the known sessions' means."""
    alphas = pass_alphas(own[0], [a for a, _ in others], batch_size)
    fills = pass_alphas(own[1], [f for _, f in others], batch_size)
    return alphas, fills
