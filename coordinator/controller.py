"""Speculation depth: how many draft tokens k (0..k_max) a session asks for at each step.

The model. With per-token acceptance probability a (token i is accepted given tokens < i were),
a step that drafts k tokens emits on average

    E(k, a) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the accepted prefix plus the target's own recovered or bonus token). The step costs the
draft's time for k tokens plus the target's time to verify a block of k + 1 positions; k = 0 is
plain decoding (no draft call at all). The controller picks the k with the most expected tokens
per millisecond, and k = 0 unless some k > 0 beats plain decoding by a margin, since a tie is
better spent not drafting (draft compute, wire traffic, KV rollback).

The pieces, each small and testable alone:

- pure functions: `expected_tokens`, `depth_rates`, `pass_rates` (with each session's fill, the
  share of the asked tokens its proposer drafts), `packed_rates` (a session in a packed pass,
  where its block costs only its own positions), `pass_sessions`, `best_depth`, `load_penalty`;
- `AcceptanceEstimator`: per-session acceptance, a moving average per draft position;
- `CostModel`: per-replica draft and verify costs measured online (one per target replica, shared
  by its sessions);
- `PassPeers`: the acceptance of every session on a replica, because a padded pass is as long as
  its longest block, so the depth worth choosing is the pass's, not one session's (`pass_rates`);
  in a packed pass, who else drafts and who would (`DepthController._jump_share`);
- `DepthController`: one per session; modes (auto, fixed, schedule), an acceptance floor,
  hysteresis, and re-probing of disabled sessions; `make_controller` parses the CLI forms.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

__all__ = [
    "AcceptanceEstimator",
    "CostModel",
    "DepthController",
    "LoadSignal",
    "PassPeers",
    "SharedAcceptance",
    "acceptance_lower_bound",
    "best_depth",
    "depth_rates",
    "expected_tokens",
    "load_penalty",
    "make_controller",
    "pass_alphas",
    "packed_rates",
    "pass_rates",
    "pass_sessions",
    "probe_period",
]

Costs = Callable[[int], float] | Sequence[float]


# ---------------------------------------------------------------------------------------------
# The math
# ---------------------------------------------------------------------------------------------


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
    if not recent:
        raise ValueError("mixture_tokens needs at least one recent session")
    # Equal acceptances (to 0.01) are one component: a method's recent sessions are often a few
    # prompts over again, and this runs at every step of a new session in a batch.
    share = 1.0 - diffuse if grid else 1.0
    priors = [(a, share / len(recent)) for a in recent] + [(a, diffuse / len(grid)) for a in grid or ()]
    weights: dict[float, float] = {}
    for a, weight in priors:
        key = round(min(max(float(a), 0.02), 0.98), 2)
        weights[key] = weights.get(key, 0.0) + weight
    s, n = max(float(successes), 0.0), max(float(trials), 0.0)
    s = min(s, n)
    logs = {a: math.log(w) + s * math.log(a) + (n - s) * math.log(1.0 - a) for a, w in weights.items() if w > 0}
    top = max(logs.values())
    posterior = {a: math.exp(log_p - top) for a, log_p in logs.items()}
    scale = min(max(float(fill), 0.0), 1.0) / sum(posterior.values())
    tokens = [1.0] * (k_max + 1)
    for a, p in posterior.items():
        power, gain = 1.0, 0.0
        for k in range(1, k_max + 1):
            power *= a
            gain += power
            tokens[k] += p * scale * gain
    return tokens


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
    power, gain, rates = 1.0, 0.0, []
    for k in range(k_max + 1):
        cost = plain_ms
        if k > 0:
            power *= own[k - 1] if k <= len(own) else a
            gain += f * power
            cost += b * f * (position_ms * k + jump_ms) + max(int(draft_rows), 1) * draft[k]
        tokens = 1.0 + gain if expected is None else expected[k]
        rates.append(tokens / cost if cost > 0 else math.inf)
    return rates


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


# ---------------------------------------------------------------------------------------------
# Acceptance
# ---------------------------------------------------------------------------------------------


class AcceptanceEstimator:
    """Per-session acceptance: an exponentially weighted estimate per draft position.

    Each drafted step is a run of Bernoulli trials: position i is tried only if positions < i
    were accepted, and it succeeds or fails; positions after the first rejection are not tried.
    Counting them as failures (accepted / drafted) would bias the rate low for deep k; the
    conditional rates c_i = P(accept i | accepted < i) do not.

    Evidence is kept as decayed counts (successes s_i, trials n_i) per position, plus a prior of
    `prior_weight` trials at rate `alpha0` so a new session starts sensibly. All counts decay by
    `1 - 1/window` per step, including k = 0 steps: that ages old evidence without changing the
    estimate, so the first observations after a pause (a re-probe) carry weight. Decay stops once
    the total weight is down to `prior_weight`, so one probe cannot swing the estimate to 0 or 1.

    `alpha` is the pooled rate (prior + sum s_i) / (prior + sum n_i): the mean of the per-position
    rates weighted by their evidence, and the maximum-likelihood per-token rate of the geometric
    model that `expected_tokens` assumes. `position_rates` shrinks each position toward it.
    """

    def __init__(self, alpha0: float = 0.5, prior_weight: float = 4.0, window: float = 32.0,
                 ceilings: Callable[[], Sequence[float | None]] | None = None):
        if not 0.0 <= alpha0 <= 1.0:
            raise ValueError(f"alpha0 must be in [0, 1], got {alpha0}")
        if prior_weight <= 0 or window < 1:
            raise ValueError("prior_weight must be > 0 and window >= 1")
        self.alpha0 = alpha0
        self.prior_weight = prior_weight
        self.decay = 1.0 - 1.0 / window
        self._prior_s = alpha0 * prior_weight
        self._prior_n = prior_weight
        self.successes: list[float] = []
        self.trials: list[float] = []
        self.steps = 0
        # per position, the most an unseen position may be assumed to accept (None: no cap)
        self.ceilings = ceilings

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Record one verify step: num_drafted proposed, the first num_accepted of them accepted.
        The evidence so far ages by a step first."""
        self._check(num_drafted, num_accepted, 0)
        self.steps += 1
        if self._prior_n + sum(self.trials) > self.prior_weight:
            self._prior_s *= self.decay
            self._prior_n *= self.decay
            self.successes = [s * self.decay for s in self.successes]
            self.trials = [n * self.decay for n in self.trials]
        self.add(num_drafted, num_accepted)

    def add(self, num_drafted: int, num_accepted: int, first: int = 0) -> None:
        """Trials without a step: of a block of num_drafted with its first num_accepted accepted,
        the positions from `first` on that were tried. What a shadow draft judged
        (coordinator/echo.py's `ShadowDraft.feed`: its positions as their tokens come, past any
        drafted block beside it) on top of the step's own `update`."""
        self._check(num_drafted, num_accepted, first)
        tried = min(num_accepted + 1, num_drafted)  # positions 0..num_accepted, if drafted
        if len(self.trials) < tried:
            self.successes.extend([0.0] * (tried - len(self.trials)))
            self.trials.extend([0.0] * (tried - len(self.trials)))
        for i in range(first, tried):
            self.trials[i] += 1.0
            if i < num_accepted:
                self.successes[i] += 1.0

    @staticmethod
    def _check(num_drafted: int, num_accepted: int, first: int) -> None:
        if num_drafted < 0 or not 0 <= num_accepted <= num_drafted or first < 0:
            raise ValueError(f"bad step: {num_accepted} accepted of {num_drafted} drafted (from position {first})")

    @property
    def alpha(self) -> float:
        """The per-token acceptance rate to use in `expected_tokens`."""
        return (self._prior_s + sum(self.successes)) / (self._prior_n + sum(self.trials))

    @property
    def weight(self) -> float:
        """Effective number of trials behind `alpha` (prior included)."""
        return self._prior_n + sum(self.trials)

    @property
    def position_rates(self) -> list[float]:
        """Conditional acceptance per position, each shrunk toward `alpha` by `prior_weight` trials."""
        a, w = self.alpha, self.prior_weight
        return [(s + w * a) / (n + w) for s, n in zip(self.successes, self.trials)]

    @property
    def continuation_rate(self) -> float:
        """Conditional acceptance of a position after the first, pooled over positions 1 and on and
        shrunk toward `alpha`: the rate to assume for positions deeper than any drafted yet. For a
        geometric draft it is `alpha`; for a copying draft (all or nothing) it is near 1, and
        `alpha` there (pulled down by position 0) would price every unseen position as a
        first one, which held code edits at the depth they happened to start at."""
        a, w = self.alpha, self.prior_weight
        return (sum(self.successes[1:]) + w * a) / (sum(self.trials[1:]) + w)

    def profile_evidence(self, depth: int) -> list[float]:
        """The (decayed) trials behind each of `profile(depth)`'s rates, prior included: a
        drafted position's own, an unseen one's the continuation's (positions 1 and on), or the
        pooled weight before any step drafted."""
        w = self.prior_weight
        seen = [n + w for n in self.trials[:depth]]
        unseen = sum(self.trials[1:]) + w if self.trials else self.weight
        return seen + [unseen] * (depth - len(seen))

    def profile(self, depth: int) -> list[float]:
        """`position_rates` for positions 0..depth - 1, the unseen ones at `continuation_rate`
        (`alpha` before any step drafted), each capped by `ceilings` where it gives one.

        The cap is what the method's recent sessions accepted at that position (a
        `SharedAcceptance`'s `position_caps`): a session extrapolates its own continuation to
        positions it never drafted, and on extraction prompts, where copied spans are two or three
        tokens, one accepted second position priced blocks of five at 0.8 a position; its sessions
        at 16 ran at k = 2-5 and got no more tokens per step than fixed k = 2 (0.27-0.33 of the
        drafted tokens accepted against 0.39).

        Past the deepest position the recent sessions tried, the cap is the one at that deepest
        position, as long as that is deeper than this session's own positions: nothing says
        deeper positions accept better, and uncapped they were priced at the session's
        continuation rate (0.9 and more). At 16 sessions extraction prompts whose recent
        sessions had tried four positions (the fourth at 0.48) then drafted blocks of 7 to 12
        tokens that kept two or three, in passes every row paid for, and ran at 0.91x speculation
        off where fixed k = 2 ran at 0.98x. A session that has drafted deeper than the recent
        sessions (a code edit after chat prompts) is not held to their shallow caps."""
        rates = self.position_rates[:depth]
        drafted = len(rates)  # positions this session has drafted itself
        if drafted < depth:
            caps = self.ceilings() if self.ceilings is not None else []
            if rates or caps:
                unseen = self.continuation_rate if rates else self.alpha
                known = [j for j, cap in enumerate(caps) if cap is not None]
                deepest = known[-1] if known and known[-1] >= drafted else depth
                for j in range(drafted, depth):
                    if j < len(caps) and caps[j] is not None:
                        cap = caps[j]
                    else:
                        cap = caps[deepest] if j > deepest else 1.0
                    rates.append(min(unseen, cap))
        return rates


# ---------------------------------------------------------------------------------------------
# Costs
# ---------------------------------------------------------------------------------------------


class _Mean:
    """Running mean for the first `window` samples, then an exponential moving average."""

    __slots__ = ("mean", "count")

    def __init__(self, mean: float = 0.0, count: float = 0.0):
        self.mean, self.count = mean, count

    def add(self, x: float, window: float) -> None:
        self.count += 1
        self.mean += (x - self.mean) * max(1.0 / self.count, 1.0 / window)

    def weight(self, window: float) -> float:
        return min(self.count, window)


OUTLIER_FACTOR = 3.0
RECENT_PASSES = 256  # pass numbers a cost model remembers, to count each pass once
# How far from the cells' mean block length the prior's `prior_points` samples count as lying (`_observed_line`)
PRIOR_SPREAD = 0.25
SETTLED = 3  # samples before a cell's mean is trusted beyond its own batch size
# Cells closer than this in block length (positions a row) cannot tell a slope from noise (`_observed_line`)
MIN_SPAN = 1.0
# Draft cost cells follow fast: a draft call's wall time swings with what shares the cores (a
# batched verify pass), and a session at k = 0 makes no draft calls, so samples are few and an
# estimate inflated under load must not outlive the load.
DRAFT_WINDOW = 8.0


def _clip(x: float, cell: _Mean) -> float:
    """A sample more than OUTLIER_FACTOR times a settled cell's mean counts as that much: one pass
    stalled by a neighbour process must not swing a shared cost model (every session's k) for a
    whole window. Real drift still gets through, at up to 3x per sample."""
    return min(x, OUTLIER_FACTOR * cell.mean) if cell.count >= SETTLED and cell.mean > 0 else x


def _span(b: int, cells: Mapping[int, _Mean]) -> float:
    """How far apart in block length (positions a row) the cells of batch size b lie."""
    return (max(cells) - min(cells)) / b if cells else 0.0


def _fit_line(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Weighted least squares y = c + m (x - 1) over (x, y, weight); None with < 2 distinct x."""
    if len({x for x, _, _ in points}) < 2:
        return None
    w = sum(p[2] for p in points)
    mx = sum(x * wt for x, _, wt in points) / w
    my = sum(y * wt for _, y, wt in points) / w
    sxx = sum(wt * (x - mx) ** 2 for x, _, wt in points)
    sxy = sum(wt * (x - mx) * (y - my) for x, y, wt in points)
    slope = max(sxy / sxx, 0.0)  # cost never falls with more tokens; noise can say otherwise
    return my - slope * (mx - 1.0), slope


class CostModel:
    """Draft and verify costs of one replica pair, measured online.

    verify_ms(n, b): a line in the block length n per batch size b, fitted by weighted least
    squares to the moving means of the cells observed at b. A cell is a pass's extra positions
    beyond one per row (b x (n - 1) for a pass padded to n; the rows' draft tokens summed for a
    packed one, `packed`), at n = 1 + extra / b on the line, so padded and packed passes feed
    one line: its slope / b is what one more position costs (`position_ms`), and its value at no
    extra position over the plain pass what packing costs at all (`packed_jump_ms`). With one
    cell at b, the prior's slope is scaled to the cell's level. Batch sizes never observed take their line from the
    observed ones: interpolated between the two around b, and outside them from the nearest
    one, scaled by how the prior grows between the two batch sizes (shape from the prior, level
    from the data). With no observations at all, the prior:

        verify(n, b) = verify_ms * (1 + batch_growth (b - 1)) + per_token_ms * (n - 1) * b

    a fixed pass cost that grows slowly with the batch (weights are read once per pass; on this
    project's CPU machines a batch of 8 costs about twice one row) and a cost per extra position
    and row (compute; measured there: 4 ms a position against a 62 ms pass at batch 1, about 45
    against 150 at batch 16, so the default is 2 against 30). draft_ms(k): a line in k through
    the observed k (proportional to k with one point), else `draft_per_token_ms * k`; 0 at k = 0.
    Means become moving averages after `window` samples so the model follows drift (thermal
    throttling, neighbours, cache growth).

    One instance serves all sessions on a replica, from their threads: a lock guards it.
    """

    def __init__(
        self,
        verify_ms: float = 30.0,
        per_token_ms: float = 2.0,
        batch_growth: float = 1.0 / 7.0,
        draft_per_token_ms: float = 0.0,
        window: float = 64.0,
        prior_points: float = 2.0,
    ):
        self.prior_verify_ms = verify_ms
        self.prior_per_token_ms = per_token_ms
        self.prior_batch_growth = batch_growth
        self.prior_draft_per_token_ms = draft_per_token_ms
        self.window = window
        self.prior_points = prior_points
        self._verify: dict[int, dict[int, _Mean]] = {}  # batch size -> extra positions -> pass ms
        self.packed = False  # the replica packs passes: a row's block costs only its own positions
        self._draft: dict[int, _Mean] = {}
        self._overhead = _Mean()  # ms per verify step outside the pass, when the replica reports its pass time
        self._open = _Mean()  # ms to open a draft session (a probe from k = 0 opens one)
        self._lines: dict[int, tuple[float, float]] = {}
        self._draft_line: tuple[float, float] | None = None
        # the passes counted lately: their other rows' reports are skipped (a replica numbers its
        # passes; rows of one pass come back together, so a short memory does)
        self._recent_passes: deque[int] = deque(maxlen=RECENT_PASSES)
        self._seen_passes: set[int] = set()
        self._lock = threading.Lock()

    # observations

    def observe_verify(self, batch_size: int, block_length: int, ms: float, positions: int = 0,
                       packed: bool | None = None, pass_id: int = 0) -> None:
        """One verify pass of `batch_size` rows took `ms`: padded to `block_length` positions, or
        (`positions` > 0) computing that many positions, all rows together. `packed`: what the
        replica said about its passes (None: nothing).

        `pass_id` (0: unknown): the pass's number on the replica. Every row of a pass reports it,
        and a pass counts once: counted per row, one pass of 16 rows was 16 samples, a cell was
        "settled" (`SETTLED`) by a single pass and its window held its last four, and at 16
        sessions one slow pass at a new block length set a line that priced a draft position at
        6.5 ms where the replica's own means said 1.8 (code edits then stayed at k = 0 to the end)."""
        extra = (positions if positions > 0 else batch_size * block_length) - batch_size
        if batch_size < 1 or block_length < 1 or extra < 0 or not ms >= 0:
            return  # a malformed report should not poison the model
        with self._lock:
            if pass_id:
                if pass_id in self._seen_passes:
                    return
                if len(self._recent_passes) == self._recent_passes.maxlen:
                    self._seen_passes.discard(self._recent_passes[0])
                self._recent_passes.append(pass_id)
                self._seen_passes.add(pass_id)
            if packed is not None:
                self.packed = packed
            cell = self._verify.setdefault(batch_size, {}).setdefault(extra, _Mean())
            cell.add(_clip(ms, cell), self.window)
            self._lines.clear()

    def observe_step(self, k: int, draft_ms: float, verify_ms: float, batch_size: int, pass_block_length: int = 0,
                     compute_ms: float | None = None, open_ms: float = 0.0, pass_positions: int = 0,
                     packed: bool | None = None, pass_id: int = 0) -> None:
        """One engine step's costs: its draft of k tokens, the session open before it, and its
        verify (the pass's own time when the replica reported it, the rest of `verify_ms` being
        per-step overhead). The arguments are `DepthController.observe`'s, which calls this; a
        fixed-k session, which has no controller, calls it directly, so that the auto sessions
        on its replica price depths from every session's passes."""
        if k > 0:
            self.observe_draft(k, draft_ms)
        if open_ms > 0:
            self.observe_open(open_ms)
        block = max(pass_block_length, k + 1)
        pass_ms = verify_ms if compute_ms is None else compute_ms
        self.observe_verify(batch_size, block, pass_ms, pass_positions, packed, pass_id)
        if compute_ms is not None:
            self.observe_overhead(max(verify_ms - compute_ms, 0.0))

    def observe_overhead(self, ms: float) -> None:
        """A verify step spent `ms` outside the replica's pass (the round trip): added to every
        verify estimate, whatever the block length."""
        if ms >= 0:
            with self._lock:
                self._overhead.add(_clip(ms, self._overhead), self.window)

    def observe_draft(self, k: int, ms: float) -> None:
        """Proposing k tokens took `ms` (k = 0 steps never call the draft and are ignored)."""
        if k >= 1 and ms >= 0:
            with self._lock:
                cell = self._draft.setdefault(k, _Mean())
                cell.add(_clip(ms, cell), DRAFT_WINDOW)
                self._draft_line = None

    def observe_open(self, ms: float) -> None:
        """Opening a draft session (its stream, the draft's prefill of the context) took `ms`."""
        if ms >= 0:
            with self._lock:
                self._open.add(ms, self.window)

    def open_ms(self) -> float:
        """Estimated time to open a draft session (0 before any was seen)."""
        with self._lock:
            return self._open.mean

    def verify_table(self) -> list[tuple[int, int, int, float, int]]:
        """The observed verify cells as (batch_size, block_length, count, mean_ms, positions) rows;
        block_length is the positions per row rounded up."""
        with self._lock:
            return [(b, 1 + -(-e // b), int(c.count), c.mean, b + e) for b, cells in self._verify.items()
                    for e, c in cells.items()]

    def draft_table(self) -> list[tuple[int, int, float]]:
        """The observed draft cells as (k, count, mean_ms) rows."""
        with self._lock:
            return [(k, int(c.count), c.mean) for k, c in sorted(self._draft.items())]

    def seed_from_stats(self, rows: Iterable[Any]) -> None:
        """Seed from a target's GetStats verify_latency table.

        Rows are (batch_size, block_length, count, mean_ms[, positions]) tuples or VerifyLatency
        messages (positions 0 or missing: the pass was padded, batch_size x block_length). Cells
        that land on the same extra positions merge. A seeded cell counts as `count` samples
        (capped at the window), so fresh observations blend in.
        """
        for row in rows:
            if isinstance(row, (tuple, list)):
                b, n, count, mean = row[:4]
                positions = row[4] if len(row) > 4 else 0
            else:
                b, n, count, mean = row.batch_size, row.block_length, row.count, row.mean_ms
                positions = getattr(row, "positions", 0)
            b, n, count = int(b), int(n), int(count)
            extra = (int(positions) if positions else b * n) - b
            if b >= 1 and n >= 1 and extra >= 0 and count > 0 and float(mean) >= 0:
                with self._lock:
                    cell = self._verify.setdefault(b, {}).setdefault(extra, _Mean())
                    cell.mean = (cell.mean * cell.count + float(mean) * count) / (cell.count + count)
                    cell.count = min(cell.count + count, self.window)
                    self._lines.clear()

    # estimates

    def _prior_line(self, b: int) -> tuple[float, float]:
        return self.prior_verify_ms * (1.0 + self.prior_batch_growth * (b - 1)), self.prior_per_token_ms * b

    def _observed_line(self, b: int) -> tuple[float, float]:
        """The line through the cells at b. Its slope (cost per extra position) is the weighted
        least-squares slope shrunk toward the prior's slope scaled to the cells' level, with the
        prior counting as `prior_points` samples `PRIOR_SPREAD` block lengths from the cells'
        mean: what a fitted slope is worth grows with the samples and with how far apart their
        block lengths are (their weighted sum of squares), so a few noisy samples (a pass that
        shared the cores with something else) cannot tilt the line wildly, and neither can two
        passes of nearly one length (at 16 rows, single passes of 45 and 48 positions, 196 and 216 ms, made a
        slope of 6 ms a position where the replica's means said 2). One cell alone gives the
        prior's shape through it.

        The line is fitted to the passes with draft positions when any were seen: a one-token
        pass takes the model's decode path, and on this project's CPU machines a block of 2 cost
        about 25 ms more than one of 1 at batch 1 while 9 cost little more than 2 (65, ~90, ~100
        ms), so a line through 1 and 3 predicted 9 at twice its cost. `verify_ms(1, b)` reads the
        one-token cell itself. Where the settled cells (`SETTLED` passes each) span `MIN_SPAN`
        positions a row or more, the line goes through those alone: packed passes at 16 rows
        bring a new total of positions almost every pass, and a cell of one slow pass at the edge
        of the range pulled the slope to twice what the settled cells said. Cells that span less
        have no slope of their own: the prior's then (`_chord_slope` for a packed batch)."""
        cells = self._verify[b]
        if any(e > 0 for e in cells):
            cells = {e: c for e, c in cells.items() if e > 0}
        settled = {e: c for e, c in cells.items() if c.count >= SETTLED}
        if _span(b, settled) >= MIN_SPAN:  # a pass or two at a new block length must not tilt the line
            cells = settled
        points = [(1.0 + e / b, c.mean, c.weight(self.window)) for e, c in cells.items()]
        c0, m0 = self._prior_line(b)
        total = sum(w for _, _, w in points)
        scale = sum(w * y / (c0 + m0 * (n - 1)) for n, y, w in points) / total if c0 > 0 else 1.0
        mean_n = sum(n * w for n, _, w in points) / total
        mean_y = sum(y * w for _, y, w in points) / total
        prior_slope = self._chord_slope(b, mean_n, mean_y)
        if prior_slope is None:
            prior_slope = self._borrowed_slope(b)
        if prior_slope is None:
            prior_slope = m0 * scale
        fit = _fit_line(points) if _span(b, cells) >= MIN_SPAN else None
        spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
        prior = self.prior_points * PRIOR_SPREAD ** 2
        slope = prior_slope if fit is None else (spread * fit[1] + prior * prior_slope) / (spread + prior)
        return mean_y - slope * (mean_n - 1.0), slope

    def _chord_slope(self, b: int, mean_n: float, mean_y: float) -> float | None:
        """For a packed replica's batch of b > 1 rows: the slope from its settled plain pass to the
        drafted passes' mean (a jump to the drafted path counted as slope: the cost a position
        brings at most). The prior where the drafted passes span less than `MIN_SPAN` positions a
        row, so that their own slope is noise: fixed k = 4 at 16 rows left its cells at 60-64
        extra positions, the line through them priced a position at 0.06 ms, and auto sessions
        after that cell drafted blocks of 16, in passes of 1.8x fixed k = 4's (docs/benchmarks.md,
        "Code edits at 16 sessions: a slope the passes can tell"). None alone (at b = 1 the jump
        to the drafted path is a third of a plain pass, and priced as slope it would overprice
        every deep block), unpacked, or before a plain pass has settled."""
        plain = self._verify[b].get(0)
        if not self.packed or b <= 1 or plain is None or plain.count < SETTLED or mean_n <= 1.0:
            return None
        return max(mean_y - plain.mean, 0.0) / (mean_n - 1.0)

    def _borrowed_slope(self, b: int) -> float | None:
        """The cost per extra position at batch size b as another batch size measured it: the
        fitted slope of the nearest batch size with two or more block lengths observed, scaled by
        the prior's slope ratio (the rows). Better than the prior's own slope, whose ratio to the
        pass cost is a guess about the hardware: on this project's CPU machines it overstated the
        cost of long blocks at batch 16 by 2-3x, which kept speculation off where it paid.
        A replica that packs its passes prices positions, not rows: `_pooled_position_ms`."""
        if self.packed:
            pooled = self._pooled_position_ms(b)
            if pooled is not None:
                return pooled * b
        settled = {s: [(1.0 + e / s, c.mean, c.weight(self.window)) for e, c in cells.items() if c.count >= SETTLED]
                   for s, cells in self._verify.items() if s != b}
        measured = [(abs(s - b), s) for s, points in settled.items() if len(points) >= 2]
        if not measured:
            return None
        near = min(measured)[1]
        fit = _fit_line(settled[near])
        if fit is None:
            return None
        pm_near, pm_b = self._prior_line(near)[1], self._prior_line(b)[1]
        return fit[1] * pm_b / pm_near if pm_near > 0 else fit[1]

    def _pooled_position_ms(self, b: int) -> float | None:
        """What one draft position adds to a packed pass, pooled over the other batch sizes,
        weighted by the positions behind each: where a batch size has two or more settled cells
        with draft positions, the slope through them; where it has one, its time beyond the
        settled plain pass over its positions.

        In a packed pass a position costs about the same whatever the rows around it (on the
        2-core CPU, oneDNN kernels: 2-4 ms at 4 and at 16 rows), so a slope scaled by rows from one
        small batch size, two noisy cells apart, is the wrong prior there: one such slope priced
        a position at 13 ms at 16 rows, and a burst of 16 code edits (acceptance 0.8) stayed at
        k = 0 to the end of its requests.

        The slope, not the time over the plain pass, where it can be had: a pass with any draft
        position costs a jump beyond its positions (at batch 1 the model leaves its one-token
        decode path: blocks of 3 and 4 took 149 and 151 ms against a plain pass's 101), and
        pooled over the positions, that jump priced every position at 21 ms. A replica whose only
        drafted passes were one session's probes at batch 1 then priced a code edit's block at 16
        rows at five times its cost, and auto drafted nothing at 16 sessions on any kind in a
        run that opened with chat prompts. The jump at b is priced apart (`packed_jump_ms`)."""
        extra_ms = positions = 0.0
        for s, cells in self._verify.items():
            plain = cells.get(0)
            drafted = [(e, c) for e, c in cells.items() if e > 0 and c.count >= SETTLED]
            if s == b or not drafted:
                continue
            weight = sum(c.weight(self.window) * e for e, c in drafted)
            fit = _fit_line([(float(e), c.mean, c.weight(self.window)) for e, c in drafted])
            if fit is not None:
                extra_ms += fit[1] * weight
                positions += weight
            elif plain is not None and plain.count >= SETTLED:
                e, c = drafted[0]
                extra_ms += (c.mean - plain.mean) * c.weight(self.window)
                positions += weight
        if positions <= 0 or extra_ms <= 0:
            return None
        return extra_ms / positions

    def _line(self, b: int) -> tuple[float, float]:
        """(cost at block length 1, cost per extra position) at batch size b."""
        if b in self._lines:
            return self._lines[b]
        seen = sorted(self._verify)
        if not seen:
            line = self._prior_line(b)
        elif b in self._verify:
            line = self._observed_line(b)
        else:
            lo = max((s for s in seen if s < b), default=None)
            hi = min((s for s in seen if s > b), default=None)
            if lo is not None and hi is not None:
                (c_lo, m_lo), (c_hi, m_hi) = self._observed_line(lo), self._observed_line(hi)
                t = (b - lo) / (hi - lo)
                line = (c_lo + t * (c_hi - c_lo), m_lo + t * (m_hi - m_lo))
            else:
                near = lo if lo is not None else hi
                assert near is not None
                (c, m), (pc, pm), (qc, qm) = self._observed_line(near), self._prior_line(near), self._prior_line(b)
                line = (c * qc / pc, m * qm / pm if pm > 0 else m)
        self._lines[b] = line
        return line

    def verify_ms(self, block_length: int, batch_size: int = 1) -> float:
        """Estimated time of a verify pass over `batch_size` rows of `block_length` positions."""
        b, n = max(int(batch_size), 1), max(block_length, 1)
        with self._lock:
            overhead = self._overhead.mean
            single = self._verify.get(b, {}).get(0) if n == 1 else None
            if single is not None:
                return max(single.mean + overhead, 1e-3)
            intercept, slope = self._line(b)
        return max(intercept + overhead + slope * (n - 1), 1e-3)

    def position_ms(self, batch_size: int = 1) -> float:
        """Estimated cost of one more position in a verify pass of `batch_size` rows (a packed
        pass's extra draft token; a padded pass pays it once per row)."""
        b = max(int(batch_size), 1)
        with self._lock:
            _, slope = self._line(b)
        return slope / b

    def packed_jump_ms(self, batch_size: int = 1) -> float:
        """What a pass of `batch_size` rows costs beyond its positions once any row brings a
        block: the line through the passes with draft positions, at none, over the plain pass
        (0 until both were seen at this batch size)."""
        b = max(int(batch_size), 1)
        with self._lock:
            cells = self._verify.get(b, {})
            if 0 not in cells or not any(e > 0 for e in cells):
                return 0.0
            intercept, _ = self._line(b)
            return max(intercept - cells[0].mean, 0.0)

    def draft_ms(self, k: int) -> float:
        """Estimated time for the draft to propose k tokens (0 for k = 0)."""
        if k <= 0:
            return 0.0
        with self._lock:
            if self._draft_line is None:
                self._draft_line = self._fit_draft()
            c, m = self._draft_line
        return max(c + m * (k - 1), 0.0)

    def _fit_draft(self) -> tuple[float, float]:
        """(cost at k = 1, cost per extra token) of the draft: a line through the observed k,
        proportional to k through a single one, the prior with none."""
        points = [(float(j), c.mean, c.weight(self.window)) for j, c in self._draft.items()]
        if not points:
            return self.prior_draft_per_token_ms, self.prior_draft_per_token_ms
        line = _fit_line(points)
        if line is None:
            j, mean, _ = points[0]
            return mean / j, mean / j
        return line


# ---------------------------------------------------------------------------------------------
# The per-session controller
# ---------------------------------------------------------------------------------------------

MODES = ("auto", "fixed", "schedule")
# A session's first re-probe comes this many steps after its first probe, then the interval
# doubles: an answer often starts unlike its prompt (a code edit opens with prose or a fence
# before it copies), and a first probe there would otherwise keep a 32-token request off to its end.
PROBE_FIRST_INTERVAL = 4
# Sessions of a method that must have ended before their acceptance says whether early probes pay.
MIN_SESSIONS = 4
# The tokens an early probe may pay back over when the request's remaining tokens are not known.
DEFAULT_HORIZON = 32
# A session's fill (share of the asked draft tokens its proposer drafted) starts at 1 with this
# many samples' weight, and follows the last FILL_WINDOW steps that asked for a draft.
FILL_PRIOR = 2.0
FILL_WINDOW = 16.0
# In a batch, a replica opens a probe pass (where its k = 0 sessions that want to probe do so
# together) at most once in `probe_period` passes: at least this many, and more where a probe
# pass costs more than PROBE_BUDGET of the time.
PROBE_EPOCH_PASSES = 16
PROBE_BUDGET = 0.02
# A session whose method's recent prompts did not pay still probes now and then, in case this one
# does: at most this share of its time (`_gated_interval`). Insurance against a draft that has
# failed its last 32 sessions, which at 2 % took a probe in most 32-token requests at concurrency 1
# (a probe of 2 from the useless draft model: 17 ms over a 40 ms step), and with the first
# sessions' probes kept auto at 0.93-0.99x speculation off; with no probes it read 1.00x.
GATED_PROBE_BUDGET = 0.01
# A probe step costing at most this share of a plain step over it is cheap: an unproven session
# takes its first probe whatever its method's recent prompts did (alone with an n-gram draft).
CHEAP_PROBE = 0.25
# Decayed steps of a method that must have tried a draft position before its acceptance there caps
# what a new session assumes for it (SharedAcceptance.position_caps).
CAP_MIN_TRIALS = 8.0
# k = 0 steps in a row whose token the context predicted (coordinator/echo.py) that make a probe step;
# each echo probe of a session that accepts nothing doubles the streak its next one needs, up to
# ECHO_STREAK_MAX, and any accepted draft token brings it back (code echoes its context often, in
# names and indentation, and its n-gram drafts still fail: at concurrency 1 echo probes had auto
# drafting on a fifth of its steps at 0.08 acceptance, 0.87x speculation off).
ECHO_STREAK = 2
ECHO_STREAK_MAX = 8


def probe_period(plain_ms: float, probe_ms: float, budget: float | None = None, least: int | None = None) -> int:
    """Passes between a replica's probe passes, so that probing costs at most `budget` of the
    time: a probe pass takes `probe_ms` where a plain one takes `plain_ms`, and one in `period`
    passes is a probe pass. At least `least`. At batch 16 on this project's CPU machines a block
    of 3 costs about 1.8x a plain pass: 40 passes, where a fixed 16 spent 5 % of the time on
    probes, more than auto's whole allowance against speculation off (0.97x). Defaults:
    PROBE_BUDGET and PROBE_EPOCH_PASSES."""
    budget = PROBE_BUDGET if budget is None else budget
    least = PROBE_EPOCH_PASSES if least is None else least
    extra = max(probe_ms / plain_ms - 1.0, 0.0) if plain_ms > 0 else 0.0
    return max(least, math.ceil(extra / budget))


class SharedAcceptance:
    """Acceptance across the sessions of one (replica, method): a new session starts from it
    instead of a fixed prior, so a short request does not spend its first steps finding out what
    the last hundred requests already showed (a useless draft is off from the first step; a
    good one starts deep). Thread-safe; sessions still adapt to their own prompt from there."""

    def __init__(self, alpha0: float = 0.5, window: float = 256.0, lo: float = 0.02, hi: float = 0.98,
                 sessions_kept: int = 32):
        self._estimator = AcceptanceEstimator(alpha0=alpha0, window=window)
        self._fill = _Mean(1.0, 0.0)
        self._window = window
        self._sessions: deque[tuple[float, float]] = deque(maxlen=sessions_kept)  # (acceptance, fill)
        self.version = 0  # counts reported sessions: what is derived from them may be cached on it
        self._caps: tuple[tuple[int, float], list[float | None]] | None = None  # position_caps, by estimator step
        self._lock = threading.Lock()
        self.lo, self.hi = lo, hi

    def update(self, num_drafted: int, num_accepted: int) -> None:
        with self._lock:
            self._estimator.update(num_drafted, num_accepted)

    def update_fill(self, share: float) -> None:
        """A step that asked for a draft got `share` of the asked tokens."""
        with self._lock:
            self._fill.add(min(max(float(share), 0.0), 1.0), self._window)

    @property
    def fill(self) -> float:
        """The share of asked draft tokens this method drafted over its recent steps (1 before any).

        A new session's fill starts here, not at 1: on prompts where an n-gram proposer finds a
        match one step in three, a session that assumed full drafts turned k = 1 on for a few of
        its first steps at batch 16, in passes every row paid for (completion at 16 sessions ran
        at 0.91x speculation off)."""
        with self._lock:
            return self._fill.mean

    def report_session(self, alpha: float, fill: float = 1.0) -> None:
        """A session that drafted ended with acceptance `alpha`, its proposer having drafted
        `fill` of the tokens it asked for."""
        with self._lock:
            self._sessions.append((float(alpha), min(max(float(fill), 0.0), 1.0)))
            self.version += 1

    def recent_sessions(self) -> list[tuple[float, float]] | None:
        """(acceptance, fill) of the last `sessions_kept` sessions that drafted, oldest first;
        None while fewer than MIN_SESSIONS have.

        The pooled `alpha` is a mean over prompts, and acceptance belongs to the prompt: a mix
        where one request in five is a code edit has a low mean and sessions that pay well. The
        recent sessions, each with its own acceptance and fill, say what a new prompt of this
        method is likely to be worth, which decides whether its early probes are worth their
        cost (`DepthController._early_probes_pay`)."""
        with self._lock:
            return list(self._sessions) if len(self._sessions) >= MIN_SESSIONS else None

    def position_caps(self, min_trials: float = CAP_MIN_TRIALS) -> list[float | None]:
        """The method's conditional acceptance per draft position over its recent steps, None
        where fewer than `min_trials` (decayed) steps tried the position: the ceiling a new
        session's controller puts on positions it has not drafted itself."""
        with self._lock:
            est = self._estimator
            key = (est.steps, min_trials)  # asked at every step of every session; changes with drafted steps only
            if self._caps is None or self._caps[0] != key:
                rates = est.position_rates
                self._caps = (key, [r if n >= min_trials else None for r, n in zip(rates, est.trials)])
            return list(self._caps[1])

    def _clamp(self, alpha: float) -> float:
        return min(max(alpha, self.lo), self.hi)

    @property
    def alpha(self) -> float:
        """The method's acceptance per drafted token over its recent steps."""
        with self._lock:
            return self._clamp(self._estimator.alpha)

    @property
    def seed(self) -> float:
        """Where a new session's acceptance starts: the mean over the recent sessions that drafted
        (each session counts once), `alpha` until MIN_SESSIONS have.

        The pooled `alpha` counts drafted tokens, and the controller drafts most where acceptance
        is best, so it leans toward the best prompts: after summaries a chat prompt started at
        k = 12-13 and paid for 13-token blocks that kept one or two tokens. What a new prompt
        accepts is a draw from the prompts, not from the tokens."""
        with self._lock:
            sessions = [a for a, _ in self._sessions]
        if len(sessions) < MIN_SESSIONS:
            return self.alpha
        return self._clamp(sum(sessions) / len(sessions))


class PassPeers:
    """The acceptance of every open session on one target replica, as their controllers last saw it.

    Sessions on a replica share its batched passes, so each controller chooses the depth for the
    pass (`pass_rates` over its own and its peers' acceptance) rather than for itself: a session
    with poor acceptance among good ones drafts along (the positions are paid for anyway), and a
    session with good acceptance among poor ones does not lengthen everyone's pass alone. All
    sessions see nearly the same acceptances, so they arrive at nearly the same depth.

    A session that has not drafted yet is "unproven": its acceptance is only the prior. When a
    controller asks whether a probe could pay (`others(..., optimistic=...)`), unproven peers count
    as optimistic too, so a batch of new sessions probes together, in one lengthened pass, instead
    of each waiting for peers that know no more than it does.

    Probes are also lined up in time (`probe_slot`): a probe lengthens the pass of every row, and
    sessions that arrive one by one (a server kept busy, not a burst) would each probe in a pass
    of its own. Thread-safe.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: dict[int, tuple[float, bool, float]] = {}  # handle -> (acceptance, proven, fill)
        self._depths: dict[int, int] = {}  # handle -> committed k
        self._next = 0
        self._lock = threading.Lock()
        self._clock = clock
        self._probe_opened = -math.inf  # when the last probe pass was opened (seconds, `clock`)

    def join(self, alpha: float, fill: float = 1.0) -> int:
        """A session opens; returns its handle."""
        with self._lock:
            self._next += 1
            self._sessions[self._next] = (alpha, False, fill)
            return self._next

    def update(self, handle: int, alpha: float, proven: bool = True, fill: float = 1.0) -> None:
        with self._lock:
            if handle in self._sessions:
                self._sessions[handle] = (alpha, proven, fill)

    def leave(self, handle: int) -> None:
        with self._lock:
            self._sessions.pop(handle, None)
            self._depths.pop(handle, None)

    def commit(self, handle: int, k: int) -> None:
        """Session `handle` now runs at depth k."""
        with self._lock:
            if handle in self._sessions:
                self._depths[handle] = k

    def deepest(self, handle: int) -> int:
        """The largest depth another session runs at (0 if none speculates)."""
        with self._lock:
            return max((k for h, k in self._depths.items() if h != handle), default=0)

    def probe_slot(self, pass_s: float, period: int) -> bool:
        """Whether a session at k = 0 may probe now, in a pass of about `pass_s` seconds.

        A probe pass is opened at most once every `period` passes; the sessions that want to probe
        within half a pass of its opening join it (they step together: every row of a pass gets
        its result when the pass ends), the others wait for the next one. At batch 16 a block of
        3 costs about 1.8x a plain pass on this project's CPU machines. Sessions that arrive one
        by one (a server kept busy, not a burst) are out of step with each other: sixteen of them
        each probing one step in sixteen would lengthen about two passes in three
        (1 - (15/16)^16); lined up, they lengthen one pass in `period`."""
        now = self._clock()
        with self._lock:
            since = now - self._probe_opened
            if since <= pass_s / 2:
                return True
            if since >= period * pass_s:
                self._probe_opened = now
                return True
            return False

    def others(self, handle: int, optimistic: float | None = None) -> list[float]:
        """The acceptance of every session but `handle`; unproven ones at least `optimistic`."""
        return [a for a, _ in self.others_with_fills(handle, optimistic)]

    def others_with_fills(self, handle: int, optimistic: float | None = None) -> list[tuple[float, float]]:
        """(acceptance, fill) of every session but `handle`, as `others`; with `optimistic`, an
        unproven session counts as filling its blocks too (it has not asked for one yet)."""
        with self._lock:
            return [(max(a, optimistic), 1.0) if optimistic is not None and not proven else (a, fill)
                    for h, (a, proven, fill) in self._sessions.items() if h != handle]

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)


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


class DepthController:
    """Chooses k for one session, step by step.

    Modes: "auto" (the policy above, with the replica's `CostModel` and the session's
    `AcceptanceEstimator`), "fixed" (always `fixed_k`), "schedule" (a table batch size -> k; the
    entry with the largest key <= the current batch size, the smallest key's entry below all keys).
    In every mode an estimated acceptance below `floor` turns speculation off.

    Hysteresis (auto and schedule): the policy's choice replaces the current k only if it beats it
    by `switch_margin` in expected tokens/ms (auto only), or if the choice has been on the same
    side of the current k (all higher or all lower) for `switch_after` consecutive steps. Near a
    decision boundary the rates of neighbouring depths are nearly equal, so noise there costs
    little throughput, while switching back and forth does cost (pipelines and caches restart).
    Turning off for the floor is immediate. In a batch depth grows by doubling what has been
    seen (`_depth_reach`).

    Re-probing: while the session sits at k = 0, nothing about acceptance is learnt. A session
    whose start comes from a `SharedAcceptance` saying "off" probes at its first step where a
    probe could pay (the shared rate comes from other prompts; acceptance is a property of this
    one). Its first re-probe comes PROBE_FIRST_INTERVAL steps later; while acceptance still does
    not pay the interval doubles, up to `probe_max_interval`, and it restarts at `probe_interval`
    once speculation has come back. The first probe and the early re-probes are kept for when
    what they may find is worth what they cost: the method's recent prompts, each priced at this
    load, save more over the request's remaining tokens than the probe costs
    (`_early_probes_pay`); otherwise (a useless draft, or prompts that do not pay in a batch this
    large) a session waits `probe_interval` steps before any probe. A
    session probes only when k = 0 is down to acceptance: when good acceptance would not pay
    either (load, costs, a schedule entry of 0), there is nothing to learn. Between probes a k = 0
    session does no draft work.

    The pass view (auto): with `peers` (the replica's `PassPeers`), the rates are those of the
    pass (`pass_rates` over this session's and its peers' acceptance), so the sessions of a replica
    agree on one depth. A probe is then worth drafting only if this session's acceptance alone could
    turn the pass's choice, which it rarely can in a large batch: there a probe would lengthen a
    pass that every session pays for. A probe that is worth drafting still waits for a pass that
    is long anyway (a peer speculates) or for the replica's next probe pass (`_probe_depth`).

    Use: `k = choose(load)`, run the step with k, then `observe(k, accepted, draft_ms, verify_ms,
    batch_size)`; `close()` when the session ends. `history` lists the k chosen at each step.
    """

    def __init__(
        self,
        k_max: int,
        cost_model: CostModel | None = None,
        *,
        mode: str = "auto",
        fixed_k: int | None = None,
        schedule: Mapping[int, int] | None = None,
        floor: float = 0.0,
        margin: float = 0.05,
        switch_margin: float = 0.10,
        switch_after: int = 12,
        probe_interval: int = 16,
        probe_max_interval: int = 128,
        probe_k: int = 2,
        probe_alpha: float = 0.9,
        estimator: AcceptanceEstimator | None = None,
        shared: "SharedAcceptance | None" = None,
        peers: PassPeers | None = None,
        batch_z: float = 1.0,
    ):
        if k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {k_max}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "fixed" and (fixed_k is None or not 0 <= fixed_k <= k_max):
            raise ValueError(f"fixed mode needs 0 <= fixed_k <= k_max = {k_max}, got {fixed_k}")
        if mode == "schedule":
            if not schedule:
                raise ValueError("schedule mode needs a non-empty schedule")
            bad = {b: k for b, k in schedule.items() if b < 0 or not 0 <= k <= k_max}
            if bad:
                raise ValueError(f"schedule entries need batch size >= 0 and 0 <= k <= {k_max}: {bad}")
        if not 0.0 <= floor < 1.0:
            raise ValueError(f"floor must be in [0, 1), got {floor}")
        if probe_interval < 1 or probe_max_interval < probe_interval:
            raise ValueError("need 1 <= probe_interval <= probe_max_interval")
        self.k_max = k_max
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.mode = mode
        self.fixed_k = fixed_k
        self.schedule = dict(sorted(schedule.items())) if schedule else {}
        self.floor = floor
        self.margin = margin
        self.switch_margin = switch_margin
        self.switch_after = switch_after
        self.probe_interval = probe_interval
        self.probe_max_interval = probe_max_interval
        self.probe_k = min(max(probe_k, 1), k_max) if k_max > 0 else 0
        self.probe_alpha = probe_alpha
        self.batch_z = batch_z  # in a packed batch, own acceptance priced this many standard errors low
        if estimator is None:
            # Seeded from the shared rate, but lightly: its sessions ran other prompts.
            estimator = (AcceptanceEstimator(alpha0=shared.seed, prior_weight=2.0, ceilings=shared.position_caps)
                         if shared is not None else AcceptanceEstimator())
        self.estimator = estimator
        self.shared = shared
        self.k: int | None = None  # the committed depth (a probe step does not change it)
        self.history: list[int] = []
        self.batch_size = 1  # of the last verify pass, used when choose() gets no load
        self._pending_side = 0
        self._pending_steps = 0
        # short while the session knows little: doubled when its first probe is judged
        self._interval = max(min(PROBE_FIRST_INTERVAL, probe_interval) // 2, 1)
        self._idle_steps = 0
        self._probed = False
        self._drafted = False  # has any step of this session drafted yet
        self._echo_streak = 0  # k = 0 steps in a row whose token echoed the context
        self._echo_needed = ECHO_STREAK  # the streak that makes the next echo probe
        self._echo_probe = False  # the last step chosen was a probe called by echoes
        self._remaining: int | None = None  # tokens the request may still produce, as the last choose() was told
        self._saving_cache: tuple[tuple[int, int], float] | None = None  # (shared version, batch) -> ms/token
        # share of the asked draft tokens the proposer drafted; starts from the method's recent steps
        self.fill = _Mean(shared.fill if shared is not None else 1.0, FILL_PRIOR)
        # within one choose(): what its probe and rate lookups share (`_memoized`); None outside
        self._memo: dict[tuple, Any] | None = None
        # whether observe() hears echoes (coordinator/echo.py: the engine checks them for methods
        # that draft from the context); in a batch they then call the probes (`_probe_due`)
        self.echoes = False
        self.peers = peers if mode == "auto" else None
        self._peer = self.peers.join(estimator.alpha, self.fill.mean) if self.peers is not None else 0
        self._closed = False

    # the policy, before hysteresis

    def _batch(self, load: LoadSignal | None) -> int:
        """The rows this session's next pass will have. With a peer registry: the larger of the last
        pass's batch and the sessions open here, both fresh at every step (the replica's polled
        session count lags by up to a poll interval, and a burst that just ended would hold k down
        for the next request); without one, the replica's polled load."""
        if self.peers is not None:
            return max(self.batch_size, len(self.peers))
        return load.batch_size if load is not None else self.batch_size

    def _rates(self, alpha: float, load: LoadSignal | None, optimistic: float | None = None,
               fill: float | None = None) -> tuple[list[float], int]:
        """Expected tokens/ms per depth, and the pass's rows they assume; with `optimistic`,
        unproven peers count at least at it. Without it (the session's own estimate, not a what-if
        rate) this session's positions count at their own rates (`pass_rates`'s profile)."""
        b = self._batch(load)
        fill = self.fill.mean if fill is None else fill
        if self._packed(b):
            return self._packed_rates(alpha, load, b, optimistic, fill), b
        if self.peers is not None:
            own = (alpha, fill)
            alphas, fills = pass_sessions(own, self.peers.others_with_fills(self._peer, optimistic), b)
            b = len(alphas)  # pass_sessions fills up to b, known peers beyond it count
        else:
            alphas, fills = [alpha], [fill]
        penalty = load_penalty(load)
        cm = self.cost_model
        base = cm.verify_ms(1, b)
        verify = [base + penalty * (cm.verify_ms(k + 1, b) - base) for k in range(self.k_max + 1)]
        # Alone, a copying session's positions count at their own rates; in a pass the pooled rate
        # decides: position 0's rate alone is the noisier estimate, and at batch 12 with geometric
        # acceptance 0.9 it turned a 2-3 token block off in 9 of 30 simulated sessions, not 1.
        profile = self.estimator.profile(self.k_max) if optimistic is None and b == 1 else None
        return pass_rates(alphas, cm.draft_ms, verify, self.k_max, fills, profile), b

    def _depth_reach(self) -> int:
        """The deepest k worth considering in a batch: twice the deepest position that this
        session or the method's recent sessions have drafted (`AcceptanceEstimator.trials`,
        `SharedAcceptance.position_caps`), at least `probe_k`.

        Positions nobody drafted are priced by extrapolation (the session's continuation rate),
        and a copied span ends somewhere: at 8 and 16 sessions, extraction sessions whose blocks of
        4 had all gone through chose blocks of 13-16 that kept a few tokens, in passes every row
        paid for. Alone a failed deep block costs little (a code edit there goes from a probe to
        k = 16 at once); in a batch depth grows 4, 8, 16 as blocks keep going through. With no
        evidence at all (a new replica's first sessions) the prior alone decides, as before."""
        seen = len(self.estimator.trials)
        if self.shared is not None:
            caps = self.shared.position_caps()
            seen = max(seen, max((j + 1 for j, cap in enumerate(caps) if cap is not None), default=0))
        return max(2 * seen, self.probe_k) if seen else self.k_max

    def shadow_depth(self) -> int:
        """The depth of a shadow draft (coordinator/echo.py's `ShadowDraft`) at a k = 0 step: as
        deep as this session could draft next. In a batch that is `_depth_reach`, so that depth
        grows by doubling what has gone through, shadows or drafts: shadows of `k_max` = 16 from
        code edits' copied spans sent their sessions to blocks of 16 at once, in passes of 460 ms
        against fixed k = 4's 320, for 4.1 tokens a step against 3.2."""
        return min(self._depth_reach(), self.k_max) if self.batch_size > 1 else self.k_max

    def shadow_depth_beyond(self, drafted: int) -> int:
        """The depth of a shadow draft at a step whose block drafts `drafted` tokens, 0 for none:
        in a batch, `shadow_depth` when that is deeper than the block, so that a session learns
        about the positions past its block while it drafts (coordinator/echo.py's
        `ShadowDraft`); alone, none (a session alone chooses among every depth, with no
        `_depth_reach` to grow)."""
        if drafted <= 0 or self.batch_size <= 1:
            return 0
        depth = self.shadow_depth()
        return depth if depth > drafted else 0

    def observe_shadow_fill(self, drafted: int, depth: int) -> None:
        """A k = 0 step asked the proposer's lookup for a shadow of `depth` tokens and it found
        `drafted` (0: no match in the context): in a batch, the session's fill learns from it as
        from a drafted step's block.

        Without this a session at k = 0 kept the fill it was seeded with, the method's recent
        steps' fill, while its shadows taught it its acceptance: code edits after chat prompts
        (fill about 0.05) saw their shadows accepted whole and still priced a block's gain at a
        twentieth in the packed pass, and stayed at k = 0 to the end (a 16-session square where auto
        drafted nothing on any kind). Alone the shadow is k_max deep, far deeper than the blocks
        a session asks for, and an empty draft costs no verify work there (`pass_rates`), so only
        batched shadows, as deep as the session could draft next, count. The step's `observe`
        passes the new fill on to the session's peers, as for a drafted step."""
        if depth > 0 and self.batch_size > 1:
            self.fill.add(min(max(drafted, 0) / depth, 1.0), FILL_WINDOW)

    def _packed(self, batch_size: int) -> bool:
        """Whether this session's next pass is a packed one with other rows: its block then costs
        its own positions only, and it chooses its depth for itself (`packed_rates`)."""
        return batch_size > 1 and self.cost_model.packed

    def _packed_rates(self, alpha: float, load: LoadSignal | None, b: int, optimistic: float | None,
                      fill: float) -> list[float]:
        """`packed_rates` for this session at `fill`: its own per-position rates unless this is a
        what-if (`optimistic`)."""
        cm = self.cost_model
        profile = expected = None
        if optimistic is None:
            expected = self._mixture_tokens(fill)
            if expected is None:
                profile = self.estimator.profile(self.k_max)
        if profile is not None and self.batch_z > 0:  # its own estimate: priced at a lower bound
            evidence = self.estimator.profile_evidence(len(profile))
            profile = [acceptance_lower_bound(r, n, self.batch_z) for r, n in zip(profile, evidence)]
            alpha = acceptance_lower_bound(alpha, self.estimator.weight, self.batch_z)
        penalty = load_penalty(load)
        plain, position = cm.verify_ms(1, b), cm.position_ms(b) * penalty
        return packed_rates(alpha, cm.draft_ms, plain, position, b, self.k_max, fill, profile,
                            jump_ms=self._jump_share(b, plain, position, optimistic) * penalty, expected=expected)

    def _mixture_tokens(self, fill: float) -> list[float] | None:
        """`mixture_tokens` for a session with fewer than MIXTURE_TRIALS trials of its own, over
        its method's recent sessions; None past that, or while the method has too few of them."""
        trials = sum(self.estimator.trials)
        if self.shared is None or trials >= MIXTURE_TRIALS:
            return None
        shared = self.shared
        recent = shared.recent_sessions()
        if recent is None:
            return None
        successes = sum(self.estimator.successes)
        return self._memoized(("mixture", shared.version, successes, trials, fill),
                              lambda: mixture_tokens([a for a, _ in recent], successes, trials, fill, self.k_max))

    def _jump_share(self, b: int, plain_ms: float, position_ms: float, optimistic: float | None = None) -> float:
        """This session's share of `CostModel.packed_jump_ms`: none when a peer drafts (the pass
        is packed anyway); else the jump split over the sessions whose first draft position pays
        on its own, acceptance x fill x plain_ms / b > position_ms, this one included. The pass
        pays the jump once for all of them: charged whole to each, no session of a batch would
        start however many would gain.

        With `optimistic` (a what-if: would a probe pay?) peers that have not drafted yet count at
        least at it, as in `pass_sessions`: they are as unproven as this session. Without that, a
        burst of 16 code edits after chat prompts (every session seeded at the method's 0.42)
        charged each echoing session the whole jump, 64 ms x 16 rows, no probe could pay, and
        the burst ran at k = 0 to the end at 0.8x fixed k = 4. The jump is fitted on passes where
        every row brought a block, so it holds each such row's own attention calls too: split
        over the batch, it is about what one row's block adds."""
        return self._memoized(("jump", b, plain_ms, position_ms, optimistic),
                              lambda: self._compute_jump_share(b, plain_ms, position_ms, optimistic))

    def _compute_jump_share(self, b: int, plain_ms: float, position_ms: float, optimistic: float | None) -> float:
        jump = self.cost_model.packed_jump_ms(b)
        if jump <= 0 or self.peers is None:
            return jump
        if self.peers.deepest(self._peer) > 0:
            return 0.0
        pays = position_ms * b / plain_ms if plain_ms > 0 else 1.0
        sharing = 1 + sum(1 for a, fill in self.peers.others_with_fills(self._peer, optimistic) if a * fill > pays)
        return jump / sharing

    def _policy(self, alpha: float, load: LoadSignal | None, optimistic: float | None = None,
                fill: float | None = None) -> int:
        """The mode's choice for acceptance `alpha`, ignoring the floor; `fill` in place of the
        session's own (a what-if)."""
        if self.k_max == 0:
            return 0
        if self.mode == "fixed":
            return int(self.fixed_k)  # type: ignore[arg-type]
        if self.mode == "schedule":
            b = self._batch(load)
            keys = [key for key in self.schedule if key <= b]
            return self.schedule[keys[-1] if keys else next(iter(self.schedule))]
        rates, b = self._rates(alpha, load, optimistic, fill)
        if b > 1:  # in a batch, depth grows by doubling what has been seen (`_depth_reach`)
            rates = rates[: self._depth_reach() + 1]
        best = _argbest(rates, batch_margin(self.margin, b))
        if optimistic is None and log.isEnabledFor(logging.DEBUG):
            cm = self.cost_model
            log.debug("depth: session %x step %d k %s alpha %.2f fill %.2f profile %s b %d verify %s draft %s "
                      "rates/ms %s -> k %d", id(self), len(self.history), self.k, alpha,
                      self.fill.mean if fill is None else fill,
                      [round(r, 2) for r in self.estimator.profile(self.k_max)], b,
                      [round(cm.verify_ms(n, b), 1) for n in range(1, self.k_max + 2)],
                      [round(cm.draft_ms(k), 1) for k in range(self.k_max + 1)],
                      [round(1000 * r, 1) for r in rates], best)
        return best

    def target(self, load: LoadSignal | None = None) -> int:
        """The depth the policy wants now (floor included, hysteresis and probing not)."""
        alpha = self.estimator.alpha
        if alpha < self.floor:
            return 0
        return self._policy(alpha, load)

    # the step API

    def choose(self, load: LoadSignal | None = None, remaining: int | None = None) -> int:
        """The depth for the next step; `remaining`: the most tokens the request may still
        produce (None: not known, then DEFAULT_HORIZON), what an early probe may pay back over."""
        self._memo = {}
        try:
            return self._choose(load, remaining)
        finally:
            self._memo = None

    def _memoized(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """`compute()`, once per key within one choose(). A session at k = 0 in a batch of 16
        asked for a probe step's cost two or three times a step and for its share of the pass's
        jump three or four times, each a walk over its peers: about 50 us a step, which at 16
        sessions is nearly a millisecond in the coordinator, serialized by its interpreter lock,
        between one pass's end and the next pass's start."""
        if self._memo is None:
            return compute()
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def _choose(self, load: LoadSignal | None, remaining: int | None) -> int:
        self._remaining = remaining
        target = self.target(load)
        if self._probed:  # the step before was a probe: judge it
            self._probed = False
            self._interval = self.probe_interval if target > 0 else min(self._interval * 2, self.probe_max_interval)
        if self.k is None or self.mode == "fixed":
            self._commit(target)
        elif target == self.k:
            self._pending_side = self._pending_steps = 0
        elif target == 0 and self.estimator.alpha < self.floor:
            self._commit(0)
        else:
            side = 1 if target > self.k else -1
            self._pending_steps = self._pending_steps + 1 if side == self._pending_side else 1
            self._pending_side = side
            better = False
            if self.mode == "auto":
                rates, _ = self._rates(self.estimator.alpha, load)
                better = rates[target] > rates[self.k] * (1.0 + self.switch_margin)
            if better or self._pending_steps >= self.switch_after:
                self._commit(target)
        k = self.k
        assert k is not None
        due = ""
        if k == 0 and self.k_max > 0:
            self._idle_steps += 1
            optimistic = max(self.estimator.alpha, self.probe_alpha)
            # The shared prior is no evidence about this prompt: until the session has drafted, it
            # probes at the first step where a probe could pay (not while load rules it out), and
            # again soon after, as long as some recent prompt of this method was worth it. The
            # recent sessions are only consulted on a step that could probe.
            unproven = self.shared is not None and not self._drafted
            # Echoes say the context holds the continuation: the proposer's lookup would find it and
            # fill its block, whatever the method's last prompts filled (a code edit after code
            # prompts, fill 0.2 from them, echoing 24 steps in a row, priced its probe at a fifth).
            echoed = self._echo_streak >= self._echo_needed
            due = self._probe_due(unproven, load)
            wanted = self._policy(optimistic, load, optimistic, 1.0 if echoed else None) if due else 0
            if wanted > 0:
                depth = self._probe_depth(load, wanted if echoed else 0)
                if depth > 0:
                    self._idle_steps = 0
                    self._probed = True
                    self._echo_probe = echoed
                    k = depth
        if log.isEnabledFor(logging.DEBUG):
            log.debug("depth: session %x step %d chose k %d (committed %d%s)", id(self), len(self.history), k, self.k,
                      f", {due} probe" if self._probed else "")
        self.history.append(k)
        return k

    def _probe_depth(self, load: LoadSignal | None, echoed: int = 0) -> int:
        """The depth of a probe this step, 0 for none yet. Alone, `probe_k`, or after echoes
        `echoed` (the depth that would pay at `probe_alpha`): the output is copying its context,
        a copy goes through in whole blocks, and alone a deep block costs little more than a short
        one (a code edit probed at 2 after its first block missed, then took 8 and 15 tokens a
        step, where fixed k = 16 had its 17 a step earlier). In a batch the probe lengthens every
        row's pass: where a peer already speculates the pass is long anyway and the probe drafts
        within it (up to that depth); otherwise it waits for the replica's next probe pass
        (`PassPeers.probe_slot`), where the sessions that want to probe do so together. In a
        packed pass a probe lengthens the pass by its own positions only: `probe_k` at once, as
        deep as that, since each position costs every row (at batch 16, 3-5 ms a position against
        a 170 ms pass: a failed 16-token probe is a third of a pass), and a probe that is
        accepted lets the policy go deeper."""
        b = self._batch(load)
        if self._packed(b):  # a failed deep probe costs every row its positions: probe_k, then the policy
            return self.probe_k
        if self.peers is None or b <= 1:
            return max(self.probe_k, echoed)
        deepest = self.peers.deepest(self._peer)
        if deepest > 0:
            return min(self.probe_k, deepest)
        plain_ms = self.cost_model.verify_ms(1, b)
        period = probe_period(plain_ms, self.cost_model.verify_ms(self.probe_k + 1, b))
        return self.probe_k if self.peers.probe_slot(plain_ms / 1000.0, period) else 0

    def _probe_due(self, unproven: bool, load: LoadSignal | None) -> str:
        """Why this k = 0 step is a probe step ("" when it is not; the DEBUG log names it): "echo",
        one whose last ECHO_STREAK tokens echoed the context (the output started copying); "first"
        (an unproven session) and "early" re-probes when early probes pay (`_early_probes_pay`);
        the first also when a probe costs at most CHEAP_PROBE of a plain step ("cheap"); else
        "gated", one every `_gated_interval` idle steps.

        The first probe is gated like the early ones unless it is cheap: a useless draft model
        paid for one probe per request (about 3 % of a 32-token request at concurrency 1, half
        of auto's allowance against speculation off), and in a batch a probe lengthens every
        row's pass. Alone, an n-gram probe costs a few ms, and gating it cost the first
        copying prompt after a run of open-ended ones its first steps (extract at concurrency 1
        fell from 1.06x to 0.87x the best fixed k); echoes would find it too, two steps later.

        In a batch, a session that hears echoes (`echoes`: its method drafts from the context)
        takes no early probes at all, only echo probes and the gated ones: a probe there lengthens
        every row's pass, and the early probes are priced on the method's recent prompts, which
        after a run of code edits said "probe" to every completion, chat or code prompt that
        followed (completions at 16 sessions ran at 0.93x speculation off with 3 % of their steps
        probing, where the same cell with nothing before it ran at 0.98x). The prompts whose
        probes pay are the ones whose output copies its context, and their echoes say so for
        free, two steps after the copy starts."""
        if self._echo_streak >= self._echo_needed:
            return "echo"
        if self.echoes and self._batch(load) > 1:  # echoes call the probes that pay here
            return "gated" if self._gated_due(load) else ""
        if self._idle_steps < self._interval and not unproven:
            return ""
        if self._early_probes_pay(load):
            return "first" if unproven else "early"
        if unproven and self._probe_extra_cost(load) <= CHEAP_PROBE:
            return "cheap"
        return "gated" if self._gated_due(load) else ""

    def _gated_due(self, load: LoadSignal | None) -> bool:
        # the gated interval is at least `probe_interval`: below it, no cost lookups on this step
        return self._idle_steps >= self.probe_interval and self._idle_steps >= self._gated_interval(load)

    def _probe_extra_cost(self, load: LoadSignal | None) -> float:
        """What a probe step costs over a plain one, as a share of the plain one: alone with an
        n-gram draft about 0.1 (a block of 3 and no model to run), from a draft model about 0.6
        (its prefill of the context, its passes, the round trips), in a batch of 16 about 0.8
        (every row's pass grows)."""
        plain_ms, probe_ms = self._probe_step_ms(load)
        return probe_ms / plain_ms - 1.0 if plain_ms > 0 else 0.0

    def _gated_interval(self, load: LoadSignal | None) -> int:
        """Idle steps between the probes of a session whose method's recent prompts did not pay:
        `probe_interval`, or more where a probe step costs more than GATED_PROBE_BUDGET of the
        steps between (`probe_period`): alone, a probe of 2 from a draft model cost about 1.6
        plain steps, so 16 steps between probes spent 4 % of the time on a draft that never paid."""
        plain_ms, probe_ms = self._probe_step_ms(load)
        return probe_period(plain_ms, probe_ms, budget=GATED_PROBE_BUDGET, least=self.probe_interval)

    def _probe_step_ms(self, load: LoadSignal | None) -> tuple[float, float]:
        """A plain step's and a probe step's estimated time at this load. A probe from k = 0
        opens the draft session too (it is closed while the session is off), which for a draft
        model is its prefill of the whole context: most of the probe's cost."""
        return self._memoized(("probe step", load), lambda: self._compute_probe_step_ms(load))

    def _compute_probe_step_ms(self, load: LoadSignal | None) -> tuple[float, float]:
        b = self._batch(load)
        cm = self.cost_model
        plain_ms = cm.verify_ms(1, b)
        if self._packed(b):  # as `packed_rates` prices it: every row pays for the probe's positions
            position = cm.position_ms(b)
            jump = self._jump_share(b, plain_ms, position)
            return plain_ms, (plain_ms + b * (position * self.probe_k + jump) + cm.draft_ms(self.probe_k)
                              + cm.open_ms())
        return plain_ms, cm.verify_ms(self.probe_k + 1, b) + cm.draft_ms(self.probe_k) + cm.open_ms()

    def _early_probes_pay(self, load: LoadSignal | None) -> bool:
        """Whether an early probe is worth its cost: a probe tells whether this prompt pays, and
        what that is worth is what speculating would save on the request's remaining tokens if
        the prompt is like one of the method's recent ones (`SharedAcceptance.recent_sessions`),
        averaged over them (`_saving_per_token`). Worth it when that beats the probe's extra cost
        (`_probe_step_ms`). With fewer than MIN_SESSIONS recent sessions there is nothing to go
        by, and it probes.

        The test was the best recent sessions' (90th percentile) acceptance alone, which said yes
        wherever one prompt in ten paid: at 16 sessions, completions whose best prompt accepted a
        third of its drafts had all sixteen probe at their second step, in one or two passes
        every row paid for (48 positions on a 101 ms pass: 191 ms), and ran at 0.86-0.94x
        speculation off, where the same cell without probes ran at 1.00x. A probe of 2 tokens at
        batch 16 costs about a plain pass; what it can find pays back only if prompts like the
        recent ones save more than that over the tokens left."""
        sessions = self.shared.recent_sessions() if self.shared is not None else None
        if sessions is None:
            return True
        plain_ms, probe_ms = self._probe_step_ms(load)
        horizon = DEFAULT_HORIZON if self._remaining is None else max(self._remaining, 0)
        return self._saving_per_token(load, sessions) * horizon > probe_ms - plain_ms

    def _saving_per_token(self, load: LoadSignal | None, sessions: Sequence[tuple[float, float]]) -> float:
        """The ms per emitted token that speculating at the best depth saves over plain decoding,
        averaged over prompts like `sessions` ((acceptance, fill) each, priced at this load as
        this session's what-if), 0 for those where the policy would keep plain decoding. Cached on the
        shared record's version and the batch size: it is asked at every k = 0 step of a session
        that could probe, and costs a rate curve per recent session."""
        key = (self.shared.version if self.shared is not None else 0, self._batch(load))
        if self._saving_cache is not None and self._saving_cache[0] == key:
            return self._saving_cache[1]
        saved = 0.0
        for alpha, fill in sessions:
            rates, b = self._rates(alpha, load, alpha, fill)
            chosen = rates[_argbest(rates, batch_margin(self.margin, b))]  # what the policy would run
            if rates[0] > 0 and chosen > rates[0]:
                saved += 1.0 / rates[0] - 1.0 / chosen
        saving = saved / len(sessions)
        self._saving_cache = (key, saving)
        return saving

    def _commit(self, k: int) -> None:
        if k != self.k:
            if k > 0:
                self._interval = self.probe_interval
            self._idle_steps = 0
            if self.peers is not None:
                self.peers.commit(self._peer, k)
        self.k = k
        self._pending_side = self._pending_steps = 0

    def observe(self, k: int, num_accepted: int, draft_ms: float, verify_ms: float, batch_size: int,
                pass_block_length: int = 0, compute_ms: float | None = None, requested: int | None = None,
                echo: bool = False, open_ms: float = 0.0, pass_positions: int = 0,
                packed: bool | None = None, pass_id: int = 0, shadow: tuple[int, int] | None = None) -> None:
        """Record the step just run: k drafted, num_accepted accepted, its timings, its batch size,
        and the positions per row of its pass (the longest block in the batch, which is what the
        pass cost; 0 when the target did not say, then this block's k + 1).

        A draft shorter than asked (an n-gram proposer whose match ran out) is judged on what it
        drafted: acceptance counts drafted tokens only. `requested` (the depth asked for) feeds
        the session's fill, the share of asked tokens that were drafted: alone, the missing
        positions cost no verify work, but in a batch the pass is padded to its longest block
        whoever lacked a draft (`pass_rates`). A probe whose draft came back empty (no match yet)
        taught nothing about acceptance: it is not judged, and the next step probes again.

        With `compute_ms` (the pass's time as the replica measured it), the verify cell gets the
        compute time and the rest of `verify_ms` (the round trip, the coordinator's own work) goes
        to the cost model's per-step overhead: that part does not grow with the block, and under
        load it swings by tens of ms, which in a cell seen only a few times tilted the line's
        slope several-fold (a rare long block at batch 1 during a busy spell).

        `open_ms`: the part of the draft call spent opening the draft session (not in `draft_ms`;
        what a probe from k = 0 costs on top, `_probe_step_ms`).

        `pass_positions`: the positions the pass computed, all rows together (0: not reported;
        then it was padded to its longest block); `packed`: whether the replica packs its passes;
        `pass_id`: the pass's number on the replica, which every row of it reports (0: not
        reported): the cost model counts the pass once (`CostModel.observe_verify`).

        `echo` (a step that drafted nothing): whether the token it produced was the one that
        followed its context's last tokens earlier in the context (coordinator/echo.py); ECHO_STREAK
        of them in a row make the next k = 0 step a probe step (more after echo probes that failed).

        `shadow`: what a draft the proposer would have made at this or an earlier step (never
        sent) was judged at this step, as (drafted, accepted) or (drafted, accepted, first): the
        positions from `first` on (coordinator/echo.py's `ShadowDraft.feed`). Trials like a
        drafted step's that cost nothing, and they count as such (`AcceptanceEstimator.add`): a
        session at k = 0 learns its acceptance from its own output, so a copying one leaves k = 0
        when its shadows say so, with no probe that lengthens every row's pass, as deep as its
        copies have gone through (`shadow_depth`); one drafting a shallow block in a batch
        learns about the positions past it (`shadow_depth_beyond`)."""
        if num_accepted > 0:  # drafts go through: echoes are worth a probe again
            self._echo_needed = ECHO_STREAK
        elif self._echo_probe and k > 0:  # an echo probe that failed: the next one waits for more echoes
            self._echo_needed = min(2 * self._echo_needed, ECHO_STREAK_MAX)
        self._echo_probe = False
        self._echo_streak = self._echo_streak + 1 if k == 0 and echo else 0
        if self._probed and k == 0:
            self._probed = False
            self._idle_steps = self._interval
        self._drafted = self._drafted or k > 0
        self.estimator.update(k, num_accepted)  # at k = 0 the evidence ages by the step
        if shadow is not None:  # what a shadow draft judged at this step
            drafted, accepted, first = (*shadow, 0)[:3]
            self.estimator.add(drafted, accepted, first)
        if requested:
            share = min(k / requested, 1.0)
            self.fill.add(share, FILL_WINDOW)
            if self.shared is not None:
                self.shared.update_fill(share)
        if self.peers is not None:
            self.peers.update(self._peer, self.estimator.alpha, proven=self._drafted, fill=self.fill.mean)
        if self.shared is not None and k > 0:
            self.shared.update(k, num_accepted)
        self.cost_model.observe_step(k, draft_ms, verify_ms, batch_size, pass_block_length, compute_ms, open_ms,
                                     pass_positions, packed, pass_id)
        self.batch_size = max(int(batch_size), 1)

    def close(self) -> None:
        """The session ended: its acceptance no longer counts in its peers' passes, and if it
        drafted, it joins the method's record of recent sessions."""
        if self.peers is not None:
            self.peers.leave(self._peer)
        if self.shared is not None and self._drafted and not self._closed:
            self.shared.report_session(self.estimator.alpha, self.fill.mean)
        self._closed = True



def make_controller(spec: str, k_max: int, cost_model: CostModel | None = None,
                    shared: SharedAcceptance | None = None, peers: PassPeers | None = None) -> DepthController:
    """A controller from its CLI form.

        auto                          the policy
        4                             fixed k = 4
        schedule:1=8,4=4,8=2,16=0     k by batch size (largest key <= the current batch size)

    each optionally followed by ",floor=A" (acceptance below A turns speculation off), e.g.
    "auto,floor=0.2" or "schedule:1=8,8=2,floor=0.3". Raises ValueError naming the problem.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("depth spec is empty; expected 'auto', an integer k, or 'schedule:B=K,...'")
    parts = [p.strip() for p in spec.strip().split(",")]
    floor = 0.0
    floors = [p for p in parts if p.lower().startswith("floor=")]
    if len(floors) > 1:
        raise ValueError(f"depth spec {spec!r}: floor given more than once")
    if floors:
        if parts[-1] is not floors[0]:
            raise ValueError(f"depth spec {spec!r}: floor=... must come last")
        parts.pop()
        value = floors[0].split("=", 1)[1]
        try:
            floor = float(value)
        except ValueError:
            raise ValueError(f"depth spec {spec!r}: floor {value!r} is not a number") from None
        if not 0.0 <= floor < 1.0:
            raise ValueError(f"depth spec {spec!r}: floor {floor} is not in [0, 1)")
    head, rest = parts[0], parts[1:]
    if head.lower() == "auto":
        if rest:
            raise ValueError(f"depth spec {spec!r}: unexpected {','.join(rest)!r} after 'auto'")
        return DepthController(k_max, cost_model, mode="auto", floor=floor, shared=shared, peers=peers)
    if head.lower().startswith("schedule:"):
        entries = [head.split(":", 1)[1]] + rest
        table: dict[int, int] = {}
        for entry in entries:
            key, eq, value = entry.partition("=")
            try:
                b, k = int(key), int(value)
            except ValueError:
                raise ValueError(f"depth spec {spec!r}: schedule entry {entry!r} is not BATCH=K") from None
            if not eq or b < 0:
                raise ValueError(f"depth spec {spec!r}: schedule entry {entry!r} is not BATCH=K with BATCH >= 0")
            if b in table:
                raise ValueError(f"depth spec {spec!r}: schedule has batch size {b} twice")
            if not 0 <= k <= k_max:
                raise ValueError(f"depth spec {spec!r}: schedule k {k} for batch size {b} is not in 0..{k_max}")
            table[b] = k
        return DepthController(k_max, cost_model, mode="schedule", schedule=table, floor=floor, shared=shared)
    try:
        k = int(head)
    except ValueError:
        raise ValueError(
            f"depth spec {spec!r}: unknown mode {head!r}; expected 'auto', an integer k, or 'schedule:B=K,...'"
        ) from None
    if rest:
        raise ValueError(f"depth spec {spec!r}: unexpected {','.join(rest)!r} after k = {k}")
    if not 0 <= k <= k_max:
        raise ValueError(f"depth spec {spec!r}: k {k} is not in 0..{k_max} (k_max)")
    return DepthController(k_max, cost_model, mode="fixed", fixed_k=k, floor=floor, shared=shared)
