"""Speculation depth: how many draft tokens k (0..k_max) a session asks for at each step.

The controller picks the k with the most expected tokens per millisecond (coordinator/depth_math.py
has the model, E(k, a) = (1 - a^(k+1)) / (1 - a) tokens a step), and k = 0 unless some k > 0 beats
plain decoding by a margin, since a tie is better spent not drafting (draft compute, wire traffic,
KV rollback).

The pieces, each small and testable alone:

- coordinator/depth_math.py, pure functions: `expected_tokens`, `mixture_tokens` (its prior
  computed once per set of recent sessions: `MixturePrior`), `depth_rates`,
  `pass_rates` (with each session's fill, the share of the asked tokens its proposer drafts),
  `packed_rates` (a session in a packed pass, where its block costs only its own positions),
  `pass_sessions`, `best_depth`, `best_reading` (the kinder of the cost model's readings),
  `batch_choice` (a depth in a packed batch), `load_penalty`;
- coordinator/acceptance.py: `AcceptanceEstimator`, per-session acceptance, a moving average per
  draft position; `SharedAcceptance`, the same across a method's sessions on a replica;
- coordinator/cost_model.py: `CostModel`, per-replica draft and verify costs measured online (one
  per target replica, shared by its sessions);
- coordinator/pass_peers.py: `PassPeers`, the acceptance of every session on a replica, because a
  padded pass is as long as its longest block, so the depth worth choosing is the pass's, not one
  session's (`pass_rates`); in a packed pass, who else drafts and who would
  (`DepthController._jump_share`);
- here, `DepthController`: one per session; modes (auto, fixed, schedule), an acceptance floor,
  hysteresis, and re-probing of disabled sessions; `make_controller` parses the CLI forms.

Every name above is importable from here too.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Sequence

from coordinator.acceptance import (CAP_MIN_TRIALS, FILL_WINDOW, MIN_SESSIONS, AcceptanceEstimator, SessionRecord,
                                   SharedAcceptance)
from coordinator.cost_model import CostModel
from coordinator.depth_math import (MIXTURE_TRIALS, Costs, LoadSignal, _argbest, acceptance_lower_bound,
                                    batch_choice, batch_margin, best_depth, best_reading, depth_rates,
                                    expected_tokens, load_penalty, mixture_tokens, packed_rates, pass_alphas,
                                    pass_rates, pass_sessions, profile_tokens)
from coordinator.pass_peers import PassPeers
from coordinator.running_mean import RunningMean
from coordinator.step_reuse import StepReuse

log = logging.getLogger(__name__)

__all__ = [
    "CAP_MIN_TRIALS",
    "MIN_SESSIONS",
    "AcceptanceEstimator",
    "CostModel",
    "Costs",
    "DepthController",
    "LoadSignal",
    "PassPeers",
    "SharedAcceptance",
    "acceptance_lower_bound",
    "batch_choice",
    "batch_margin",
    "best_depth",
    "best_reading",
    "depth_rates",
    "expected_tokens",
    "load_penalty",
    "make_controller",
    "mixture_tokens",
    "pass_alphas",
    "packed_rates",
    "pass_rates",
    "pass_sessions",
    "profile_tokens",
    "probe_period",
]

MODES = ("auto", "fixed", "schedule")
# A session's first re-probe comes this many steps after its first probe, then the interval
# doubles: an answer often starts unlike its prompt (a code edit opens with prose or a fence
# before it copies), and a first probe there would otherwise keep a 32-token request off to its end.
PROBE_FIRST_INTERVAL = 4
# The tokens an early probe may pay back over when the request's remaining tokens are not known.
DEFAULT_HORIZON = 32
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
# k = 0 steps in a row whose token the context predicted (coordinator/echo.py) that make a probe step;
# each echo probe of a session that accepts nothing doubles the streak its next one needs, up to
# ECHO_STREAK_MAX, and any accepted draft token brings it back (code echoes its context often, in
# names and indentation, and its n-gram drafts still fail: at concurrency 1 echo probes had auto
# drafting on a fifth of its steps at 0.08 acceptance, 0.87x speculation off).
ECHO_STREAK = 2
ECHO_STREAK_MAX = 8
# A session the policy keeps at k = 0 prices its depths again after this many steps at most, and
# at once when its own evidence of acceptance, its batch or its method's record of recent sessions
# changes (`_settled_target`); in between, nothing it prices on has moved but the replica's costs
# and its peers, which move over many passes, and a switch they alone bring waits for 12 steps on
# the same side anyway (`switch_after`). At 4, a completion at 16 sessions priced at two steps in
# five, 80 us each in the live coordinator, whose time per step the target's pass waits for.
SETTLED_REUSE_STEPS = 8
# In a batch, a drafting session whose policy has wanted less than it drafts this many steps in a
# row stops drafting as soon as the policy says k = 0, not `switch_after` steps later. A wrong
# "on" there lengthens every row's pass, a wrong "off" costs the session a few tokens, and
# turning on again takes the batch's whole margin (`batch_margin`), which is the hysteresis
# band: from its priced gain down to none. With the 12
# steps of the single-session hysteresis, 70 % of auto's drafting steps on extraction prompts at
# 16 sessions were steps its own pricing said were not worth it (its acceptance estimate lagging
# the end of a copied span), and its passes cost 1.24x speculation off's per token.
BATCH_OFF_STEPS = 2


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
    One exception (auto, in a packed batch): a session whose last block went through whole, as
    deep as it asked, takes a deeper choice at once. Such a block says only that the copy runs at
    least that far, and at 16 sessions, where every depth's rate lies within a few percent of the
    next (each row's pass is mostly the other rows'), the margin held code edits whose copy had
    begun at blocks of 2 for five steps, each accepted whole, while the policy asked for 3 to 5
    (docs/benchmarks.md, "Copies that begin late, at 16 sessions"). In a packed pass a row's
    depth is its own, so a switch restarts nothing the other rows share.
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
        # its acceptance and fill, and what it tells the method's record
        self.record = SessionRecord(shared, estimator)
        self.estimator = self.record.estimator
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
        self._echo_streak = 0  # k = 0 steps in a row whose token echoed the context
        self._echo_needed = ECHO_STREAK  # the streak that makes the next echo probe
        self._echo_probe = False  # the last step chosen was a probe called by echoes
        self._went_through = False  # the last step's block was as deep as asked and accepted whole
        self._remaining: int | None = None  # tokens the request may still produce, as the last choose() was told
        self._saving_cache: tuple[tuple[int, int], float] | None = None  # (shared version, batch) -> ms/token
        # the last `_mixture_tokens` result, with its prior and (successes, trials, fill): a
        # session at k = 0 asks the same at step after step until its trials or fill change
        self._mixture_last: tuple[Any, tuple[float, float, float], list[float]] | None = None
        self._floor_last: tuple[Any, tuple[Any, ...], list[float]] | None = None  # `_mixture_floor`'s, alike
        # within one choose(): what its probe and rate lookups share (`_memoized`); None outside
        self._memo: dict[tuple, Any] | None = None
        # whether observe() hears echoes (coordinator/echo.py: the engine checks them for methods
        # that draft from the context); in a batch they then call the probes (`_probe_due`)
        self.echoes = False
        # whether the engine asks the proposer only at steps where the context holds a match for it
        # (an n-gram's lookup in the coordinator finds one): alone, a step at k > 0 then costs
        # nothing where the proposer has nothing to draft (`_rates`)
        self.match_gated = False
        # whether the engine judges shadow drafts for this session (`observe(shadow=)`: the n-gram
        # proposer, whose draft the coordinator can make itself); in a batch its shadows then stand
        # in for echo probes (`_probe_due`)
        self.shadowed = False
        self.peers = peers if mode == "auto" else None
        self._peer = self.peers.join(self.estimator.alpha, self.fill.mean) if self.peers is not None else 0
        self._anchored = 0  # the depth last told the peers (`_anchor`)
        # answers at k = 0 kept for a few steps while what they rest on is unchanged
        # (coordinator/step_reuse.py): the last pricing (`_settled_target`), a probe step's
        # pricing that wanted no probe (`_probe_wanted`), the gated probes' interval (`_gated_due`)
        self._settled = StepReuse[int]()
        self._unwanted_probe = StepReuse[int]()
        self._gated = StepReuse[int]()
        self.settled_reuse_steps = SETTLED_REUSE_STEPS

    @property
    def fill(self) -> RunningMean:
        """The share of the asked draft tokens the proposer drafted; starts from the method's
        recent steps (`SessionRecord`)."""
        return self.record.fill

    @fill.setter
    def fill(self, value: RunningMean) -> None:
        self.record.fill = value

    @property
    def _drafted(self) -> bool:
        """Whether any step of this session has drafted yet."""
        return self.record.drafted

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
        """`_compute_rates`, once per arguments within one choose(): a step whose policy differs
        from its committed depth priced every depth twice, once for the target and once more for
        the hysteresis' comparison (`_choose`), with nothing changed in between."""
        return self._memoized(("rates", alpha, id(load), optimistic, fill),
                              lambda: self._compute_rates(alpha, load, optimistic, fill))

    def _compute_rates(self, alpha: float, load: LoadSignal | None, optimistic: float | None = None,
                       fill: float | None = None) -> tuple[list[float], int]:
        """Expected tokens/ms per depth, and the pass's rows they assume; with `optimistic`,
        unproven peers count at least at it. Without it (the session's own estimate, not a what-if
        rate) this session's positions count at their own rates (`pass_rates`'s profile).

        `match_gated` and alone: the steps that draft are the ones whose context holds a match, and
        the others cost nothing (no draft call, no positions), so a depth is priced as a step that
        drafts (fill 1): what it is worth is what it is worth where it happens. Priced at the
        session's fill instead, every step also paid the draft call it now skips, and chat, code
        and completion prompts, whose n-gram blocks (on two fifths of the steps or fewer) keep a
        sixth to two fifths of their first tokens and half or more of the next ones
        (`scripts/ngram_replay.py`), stayed at k = 0 alone where fixed k = 4, drafting on every
        match, saved a tenth of the passes."""
        b = self._batch(load)
        if fill is None:
            fill = 1.0 if self.match_gated and b == 1 else self.fill.mean
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
        return pass_rates(alphas, cm.draft_costs(self.k_max), verify, self.k_max, fills, profile), b

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

    def _in_batch(self) -> bool:
        """Whether this session's next pass has other rows (`_batch`). Before its first pass
        the peers say so: the last pass's batch is still 1 then, and a session's first shadow
        (drafted at its first step, right after its prefill) went k_max deep and its fill
        uncounted, so a code edit after code prompts priced its first blocks at their fill (0.29)
        for three steps while its shadows were accepted (docs/benchmarks.md, 2026-12-07)."""
        return self._batch(None) > 1

    def shadow_depth(self) -> int:
        """The depth of a shadow draft (coordinator/echo.py's `ShadowDraft`) at a k = 0 step: as
        deep as this session could draft next. In a batch that is `_depth_reach`, so that depth
        grows by doubling what has gone through, shadows or drafts: shadows of `k_max` = 16 from
        code edits' copied spans sent their sessions to blocks of 16 at once, in passes of 460 ms
        against fixed k = 4's 320, for 4.1 tokens a step against 3.2."""
        return min(self._depth_reach(), self.k_max) if self._in_batch() else self.k_max

    def shadow_depth_beyond(self, drafted: int) -> int:
        """The depth of a shadow draft at a step whose block drafts `drafted` tokens, 0 for none:
        in a batch, `shadow_depth` when that is deeper than the block, so that a session learns
        about the positions past its block while it drafts (coordinator/echo.py's
        `ShadowDraft`); alone, none (a session alone chooses among every depth, with no
        `_depth_reach` to grow)."""
        if drafted <= 0 or not self._in_batch():
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
        if depth > 0 and self._in_batch():
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
            floor = self._mixture_floor(fill)
            if floor is not None:  # at least what the prompts it is like are worth, a quantile low
                own = profile_tokens(alpha, profile, fill, self.k_max)
                expected = [max(a, b) for a, b in zip(own, floor)]
        penalty = load_penalty(load)
        plain, draft = cm.verify_ms(1, b), cm.draft_costs(self.k_max)
        readings = self._memoized(("readings", b), lambda: self._cost_readings(b))
        rates = [packed_rates(alpha, draft, plain, position * penalty, b, self.k_max, fill, profile,
                              jump_ms=self._jump_share(b, plain, position * penalty, optimistic, jump) * penalty,
                              expected=expected)
                 for position, jump in readings]
        return best_reading(rates)

    def _cost_readings(self, b: int) -> list[tuple[float, float]]:
        """(position_ms, jump_ms) at b as the cost model reads its passes, and its other reading
        where the passes cannot tell the two apart (`CostModel.jump_reading`)."""
        cm = self.cost_model
        readings = [(cm.position_ms(b), cm.packed_jump_ms(b))]
        other = cm.jump_reading(b)
        if other is not None:
            readings.append(other)
        return readings

    def _mixture_tokens(self, fill: float) -> list[float] | None:
        """`mixture_tokens` for a session with fewer than MIXTURE_TRIALS trials of its own, over
        its method's recent sessions; None past that, or while the method has too few of them."""
        trials = sum(self.estimator.trials)
        if self.shared is None or trials >= MIXTURE_TRIALS:
            return None
        prior = self.shared.mixture_prior(self.k_max)
        if prior is None:
            return None
        successes = sum(self.estimator.successes)
        last = self._mixture_last
        if last is not None and last[0] is prior and last[1] == (successes, trials, fill):
            return last[2]
        expected = prior.tokens(successes, trials, fill)
        self._mixture_last = (prior, (successes, trials, fill), expected)
        return expected

    def _mixture_floor(self, fill: float) -> list[float] | None:
        """Past MIXTURE_TRIALS, the tokens a step at each k is worth at least: those of the
        recent prompt this session is like at the posterior's low quantile
        (`MixturePrior.quantile_tokens`), its rates capped per position by its own evidence and
        its method's (`AcceptanceEstimator.mixture_caps`); None while the method has too few
        recent sessions.

        Its own per-position rates a standard error low price a copy that began late too low:
        a code edit whose first block missed at position 0, before its copy began, and whose
        next blocks went through whole left the mixture after its third block, with one to three
        trials a position, each priced at 0.6-0.7 where every one had gone through. Priced at
        their product it drafted blocks of 2 to 6 for the rest of a copy a block of 16 would have
        taken. Its posterior then lies on the method's copying prompts, and their low quantile
        is a bound that does not compound position by position (docs/benchmarks.md, "Copies
        that begin late, at 16 sessions")."""
        if self.shared is None:
            return None
        prior = self.shared.mixture_prior(self.k_max)
        if prior is None:
            return None
        key = (sum(self.estimator.successes), sum(self.estimator.trials), fill,
               tuple(self.estimator.mixture_caps(self.k_max, self.batch_z)))
        last = self._floor_last
        if last is not None and last[0] is prior and last[1] == key:
            return last[2]
        floor = prior.quantile_tokens(key[0], key[1], fill, key[3])
        self._floor_last = (prior, key, floor)
        return floor

    def _jump_share(self, b: int, plain_ms: float, position_ms: float, optimistic: float | None = None,
                    jump_ms: float | None = None) -> float:
        """This session's share of the jump to a packed pass (`jump_ms`, by default
        `CostModel.packed_jump_ms`): none when a peer drafts (the pass
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
        jump = self.cost_model.packed_jump_ms(b) if jump_ms is None else jump_ms
        return self._memoized(("jump", b, plain_ms, position_ms, optimistic, jump),
                              lambda: self._compute_jump_share(b, plain_ms, position_ms, optimistic, jump))

    def _compute_jump_share(self, b: int, plain_ms: float, position_ms: float, optimistic: float | None,
                            jump: float) -> float:
        if jump <= 0 or self.peers is None:
            return jump
        if self._anchored_peer_depth() > 0:
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
        margin = batch_margin(self.margin, b)
        best = batch_choice(rates, margin, self._anchored_peer_depth() if self._packed(b) else 0)
        if optimistic is None and fill is None:
            self._anchor(_argbest(rates, margin) if self._packed(b) else best)
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

    def _anchored_peer_depth(self) -> int:
        """The deepest block another session of this replica drafts on its own merit
        (`PassPeers.deepest(anchored=True)`): what a block of this session's may join at no
        margin, and what makes the pass packed whatever this session does. Read once a step:
        the policy and the jump's share each ask for it.

        Counting every peer's block there let the peers hold each other up: at 16 extraction
        sessions (acceptance 0.5) each priced a block of 2 at 10-15 % above plain decoding with
        the jump "paid anyway", drafted because the others did, and the replica ran at fixed
        k = 2's verify work a token, 1.1-1.2x speculation off's (docs/benchmarks.md, "Anchored
        blocks")."""
        if self.peers is None:
            return 0
        peers = self.peers
        return self._memoized(("anchored peer depth",), lambda: peers.deepest(self._peer, anchored=True))

    def _anchor(self, k: int) -> None:
        """Tell the peers the depth this session drafts at on its own merit (when it changed)."""
        if self.peers is not None and k != self._anchored:
            self._anchored = k
            self.peers.anchor(self._peer, k)

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

    def _settled_target(self, load: LoadSignal | None) -> int:
        """`target(load)`, or 0 without pricing the depths again when the session sits at k = 0,
        its last pricing said 0 (no switch pending), and what that pricing rested on is unchanged:
        its own evidence (`_evidence_key`: no step or shadow has accepted a position since), its
        batch, its method's recent sessions; at least every `settled_reuse_steps`
        steps it prices again. A session kept off by a code or completion prompt at 16 sessions
        priced 17 depths at every step (`packed_rates`, a lower bound per position) to find 0
        again: about 60 us a step in the controller alone, 16 times over between one pass and the
        next, serialized by the coordinator's interpreter lock (scripts/bench_auto_step_cost.py).
        Evidence that accepts still turns the session at the step it arrives; a switch that the
        replica's costs or the peers alone bring (12 steps on the same side, or a 10 % better
        rate) comes at most `settled_reuse_steps` - 1 steps later."""
        settled = self.mode == "auto" and self.k == 0 and self._pending_side == 0
        return self._settled.get(self._evidence_key(load) if settled else None, lambda: self.target(load),
                                 self.settled_reuse_steps, keep=lambda target: target == 0)

    def _evidence_key(self, load: LoadSignal | None) -> tuple[int, int, int]:
        """What a k = 0 session's pricing rests on besides the replica's costs and its peers: its
        own evidence that accepted a position (`AcceptanceEstimator.accepting_evidence`), its
        batch, its method's recent sessions.

        Evidence that accepted nothing is left out: a failed trial lowers the rates it prices
        every depth on, and a pricing that said 0 says 0 again on lower rates (it is still priced
        within `settled_reuse_steps` steps). A completion at 16 sessions, its shadows judged at
        half its steps and failing, priced its depths again at every such step: at 45 % of its
        k = 0 steps, about 60 us each live (the coordinator's time per step, at 16 sessions)."""
        return (self.estimator.accepting_evidence, self._batch(load),
                self.shared.version if self.shared is not None else 0)

    def _choose(self, load: LoadSignal | None, remaining: int | None) -> int:
        self._remaining = remaining
        target = self._settled_target(load)
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
            better, off_in_batch, grows_in_batch = False, False, False
            if self.mode == "auto":
                rates, b = self._rates(self.estimator.alpha, load)
                better = rates[target] > rates[self.k] * (1.0 + self.switch_margin)
                off_in_batch = target == 0 and b > 1 and self._pending_steps >= BATCH_OFF_STEPS
                grows_in_batch = side > 0 and self.k > 0 and self._went_through and self._packed(b)
            if better or off_in_batch or grows_in_batch or self._pending_steps >= self.switch_after:
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
            wanted = self._probe_wanted(due, echoed, optimistic, load) if due else 0
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

    def _probe_wanted(self, due: str, echoed: bool, optimistic: float, load: LoadSignal | None) -> int:
        """The depth a probe at this step would want (0: none pays), priced at `optimistic`. A
        probe step that wanted none and, in a batch, found no probe slot stays due at the steps
        after; while its evidence, batch and method's sessions are unchanged it keeps that answer
        for up to `settled_reuse_steps` steps (at 16 sessions kept off, the probe pricing ran at a
        third of all steps, about 25 us each). Echoes are new evidence at every step: priced."""
        key = None if echoed else (due, *self._evidence_key(load))
        price = lambda: self._policy(optimistic, load, optimistic, 1.0 if echoed else None)  # noqa: E731
        return self._unwanted_probe.get(key, price, self.settled_reuse_steps, keep=lambda wanted: wanted == 0)

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
        free, two steps after the copy starts.

        In a batch, a session whose engine judges shadow drafts (`shadowed`: the n-gram method)
        takes no echo probes either: its shadow is the block the probe would send, judged at no
        cost, and a copy it finds turns the session on through its own evidence. At 16 chat
        sessions the echo probes were every probe auto made (16 blocks of 2 in 64 requests, none
        accepted), each a packed pass for all 16 rows and a draft session opened and closed."""
        if self._echo_streak >= self._echo_needed and not (self.shadowed and self._batch(load) > 1):
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
        # the gated interval is at least `probe_interval`: below it, no cost lookups on this step;
        # past it the interval is asked at every step until the probe, and kept for a few
        if self._idle_steps < self.probe_interval:
            return False
        interval = self._gated.get(self._batch(load), lambda: self._gated_interval(load), self.settled_reuse_steps)
        return self._idle_steps >= interval

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
        self._went_through = 0 < k == num_accepted and (requested is None or k >= requested)
        if self._probed and k == 0:
            self._probed = False
            self._idle_steps = self._interval
        self.record.observe(k, num_accepted, requested)  # at k = 0 the evidence ages by the step
        if shadow is not None:  # what a shadow draft judged at this step
            drafted, accepted, first = (*shadow, 0)[:3]
            self.estimator.add(drafted, accepted, first)
        if self.peers is not None:
            self.peers.update(self._peer, self.estimator.alpha, proven=self._drafted, fill=self.fill.mean)
        self.cost_model.observe_step(k, draft_ms, verify_ms, batch_size, pass_block_length, compute_ms, open_ms,
                                     pass_positions, packed, pass_id)
        self.batch_size = max(int(batch_size), 1)

    def close(self) -> None:
        """The session ended: its acceptance no longer counts in its peers' passes, and if it
        drafted, it joins the method's record of recent sessions."""
        if self.peers is not None:
            self.peers.leave(self._peer)
        self.record.close()



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
