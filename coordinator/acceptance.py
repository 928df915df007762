"""Acceptance: how often a session's draft tokens go through, per draft position, and the same
across the sessions of one (replica, method), which a new session starts from."""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Callable, Sequence

from coordinator.depth_math import MixturePrior
from coordinator.running_mean import RunningMean

# Decayed steps of a method that must have tried a draft position before its acceptance there caps
# what a new session assumes for it (SharedAcceptance.position_caps).
CAP_MIN_TRIALS = 8.0
# Sessions of a method that must have ended before their acceptance says whether early probes pay.
MIN_SESSIONS = 4
# A session's fill (share of the asked draft tokens its proposer drafted) starts at its method's
# recent fill with this many samples' weight, and follows the last FILL_WINDOW steps that asked
# for a draft.
FILL_PRIOR = 2.0
FILL_WINDOW = 16.0


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
        # trials recorded so far (a step or shadow that tried a position), and those of them that
        # accepted a position: what a decision made on this evidence is keyed on (a k = 0
        # session's, on the second: `DepthController._evidence_key`); the per-step decay leaves both alone
        self.evidence = 0
        self.accepting_evidence = 0
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
        if tried > first:
            self.evidence += 1
            if num_accepted > first:
                self.accepting_evidence += 1
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
                rates += [min(unseen, cap) for cap in self.unseen_caps(depth, caps)[drafted:]]
        return rates

    def unseen_caps(self, depth: int, caps: Sequence[float | None] | None = None) -> list[float]:
        """The ceiling `profile` puts on each of positions 0..depth - 1 where this session has
        not drafted it itself (1: none, and 1 at the positions it has drafted): the method's
        recent rate there (`caps`, by default `ceilings()`), or past the deepest position the
        recent sessions tried, the rate at that deepest one, where that lies at or past this
        session's own positions."""
        drafted = min(len(self.trials), depth)
        if caps is None:
            caps = self.ceilings() if self.ceilings is not None else []
        known = [j for j, cap in enumerate(caps) if cap is not None]
        deepest = known[-1] if known and known[-1] >= drafted else depth
        out = [1.0] * depth
        for j in range(drafted, depth):
            if j < len(caps) and caps[j] is not None:
                out[j] = caps[j]
            elif j > deepest:
                out[j] = caps[deepest]
        return out

    def mixture_caps(self, depth: int, z: float = 1.0) -> list[float]:
        """The ceilings a mixture over the method's prompts (`MixturePrior.tokens`) puts on each
        of positions 0..depth - 1 for this session: at a position it has drafted, its own rate
        there z standard errors high; at one it has not, its method's (`unseen_caps`).

        A recent session's acceptance is one rate over its blocks. A session whose second
        position has failed ten times in ten is not priced there at the rate of the prompt it is
        likeliest to be, while one that has tried a position once or twice is left to the
        mixture, whose posterior is what weighs so little evidence: the bound is high then."""
        caps = self.unseen_caps(depth)
        w = self.prior_weight
        for j, r in enumerate(self.position_rates[:depth]):
            n = self.trials[j] + w
            caps[j] = min(r + z * math.sqrt(r * (1.0 - r) / n), 1.0)
        return caps


class SharedAcceptance:
    """Acceptance across the sessions of one (replica, method): a new session starts from it
    instead of a fixed prior, so a short request does not spend its first steps finding out what
    the last hundred requests already showed (a useless draft is off from the first step; a
    good one starts deep). Thread-safe; sessions still adapt to their own prompt from there."""

    def __init__(self, alpha0: float = 0.5, window: float = 256.0, lo: float = 0.02, hi: float = 0.98,
                 sessions_kept: int = 32):
        self._estimator = AcceptanceEstimator(alpha0=alpha0, window=window)
        self._fill = RunningMean(1.0, 0.0)
        self._window = window
        self._sessions: deque[tuple[float, float]] = deque(maxlen=sessions_kept)  # (acceptance, fill)
        self.version = 0  # counts reported sessions: what is derived from them may be cached on it
        self._caps: tuple[tuple[int, float], list[float | None]] | None = None  # position_caps, by estimator step
        self._mixture: tuple[tuple[int, int], MixturePrior] | None = None  # mixture_prior, by (version, k_max)
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
            return list(self._sessions) if self._enough_sessions() else None

    def _enough_sessions(self) -> bool:
        """Whether MIN_SESSIONS sessions have drafted (under `_lock`)."""
        return len(self._sessions) >= MIN_SESSIONS

    def mixture_prior(self, k_max: int) -> MixturePrior | None:
        """The `MixturePrior` over the recent sessions' acceptances (`recent_sessions`), one per
        version and depth range, shared by every session that asks; None while too few sessions
        have drafted."""
        with self._lock:
            if not self._enough_sessions():
                return None
            key = (self.version, k_max)
            if self._mixture is None or self._mixture[0] != key:
                self._mixture = (key, MixturePrior([a for a, _ in self._sessions], k_max))
            return self._mixture[1]

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


class SessionRecord:
    """One session's acceptance and fill, and what the session tells its method's record
    (`SharedAcceptance`): each drafted step's trials, each step's fill, and at its end, if it
    drafted, its acceptance and fill among the method's recent sessions.

    A depth controller keeps one (coordinator/controller.py); so does a session whose depth is
    fixed (coordinator/engine.py), so that the record a new auto session starts from is the
    method's recent traffic whatever depth each request asked for. Kept by auto sessions alone,
    the record said what the last auto requests were: in a bench that runs each kind's fixed
    depths before auto, a code edit's first auto sessions started from the record of the code
    prompts before them (acceptance 0.27, fill 0.29) while fixed k = 2 had just shown what code
    edits accept."""

    def __init__(self, shared: SharedAcceptance | None, estimator: AcceptanceEstimator | None = None):
        self.shared = shared
        if estimator is None:
            # Seeded from the shared rate, but lightly: its sessions ran other prompts.
            estimator = (AcceptanceEstimator(alpha0=shared.seed, prior_weight=2.0, ceilings=shared.position_caps)
                         if shared is not None else AcceptanceEstimator())
        self.estimator = estimator
        self.fill = RunningMean(shared.fill if shared is not None else 1.0, FILL_PRIOR)
        self.drafted = False  # has any step of this session drafted yet
        self._closed = False

    def observe(self, drafted: int, accepted: int, requested: int = 0) -> None:
        """A step drafted `drafted` tokens of the `requested` it asked for (0: it asked for none)
        and `accepted` of them went through. At `drafted` = 0 the evidence ages by the step."""
        self.drafted = self.drafted or drafted > 0
        self.estimator.update(drafted, accepted)
        if requested:
            share = min(drafted / requested, 1.0)
            self.fill.add(share, FILL_WINDOW)
            if self.shared is not None:
                self.shared.update_fill(share)
        if self.shared is not None and drafted > 0:
            self.shared.update(drafted, accepted)

    def close(self) -> None:
        """The session ended: if it drafted, it joins the method's recent sessions (once)."""
        if self.shared is not None and self.drafted and not self._closed:
            self.shared.report_session(self.estimator.alpha, self.fill.mean)
        self._closed = True
