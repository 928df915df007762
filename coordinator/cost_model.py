"""Draft and verify costs of one replica pair, measured online (`CostModel`): what a draft of k
tokens and a verify pass of b rows and n positions a row cost, from the passes the replica
reports, shared by every session on the replica."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterable, Mapping

from coordinator.running_mean import RunningMean

OUTLIER_FACTOR = 3.0
RECENT_PASSES = 256  # pass numbers a cost model remembers, to count each pass once
# How far from the cells' mean block length the prior's `prior_points` samples count as lying (`_observed_line`)
PRIOR_SPREAD = 0.25
SETTLED = 3  # samples before a cell's mean is trusted beyond its own batch size
# Cells closer than this in block length (positions a row) cannot tell a slope from noise (`_observed_line`)
MIN_SPAN = 1.0
# A cell's mean moves with the machine, not only with its own samples: identical passes differ by
# about this share of their time from one minute to the next (docs/benchmarks.md: 10-20 % on the
# 2-core machines), and a cell's many samples do not average that away (`slope_by_precision`).
CELL_NOISE = 0.10
# How far a chord slope may be off, as a share of it: its uncertainty as the fit's prior.
CHORD_SD = 0.5
# Draft cost cells follow fast: a draft call's wall time swings with what shares the cores (a
# batched verify pass), and a session at k = 0 makes no draft calls, so samples are few and an
# estimate inflated under load must not outlive the load.
DRAFT_WINDOW = 8.0
# Passes a replica may run with no draft position in any of them before its cost model forgets
# the drafted passes it saw (`CostModel.observe_verify`): their times are of another minute's
# machine, and only drafting can renew them.
STALE_PASSES = 256


def _clip(x: float, cell: RunningMean) -> float:
    """A sample more than OUTLIER_FACTOR times a settled cell's mean counts as that much: one pass
    stalled by a neighbour process must not swing a shared cost model (every session's k) for a
    whole window. Real drift still gets through, at up to 3x per sample."""
    return min(x, OUTLIER_FACTOR * cell.mean) if cell.count >= SETTLED and cell.mean > 0 else x


def _span(b: int, cells: Mapping[int, RunningMean]) -> float:
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


def slope_by_precision(fitted: float, chord: float, points: list[tuple[float, float, float]], noise_ms: float) -> float:
    """A packed batch's slope: the cells' fitted slope and the chord from the plain pass
    (`CostModel._chord_slope`), each weighted by its precision.

    The fit's variance is that of a weighted least-squares slope over (block length, ms, weight)
    cells whose means are each off by `noise_ms` whatever their sample counts:
    noise^2 sum w^2 (n - mean)^2 / (sum w (n - mean)^2)^2. The chord's is (CHORD_SD chord)^2.
    Cells a position or two a row apart, each off by a tenth of a 150 ms pass, cannot tell a
    slope: fixed k = 4 at 16 code edits left cells 36-64 extra positions apart whose line priced a
    position at 0.02 ms, and the auto sessions after it drafted blocks of 16 in passes of twice
    fixed k = 4's time (docs/benchmarks.md, "A slope the cells cannot tell"). Spread over many
    block lengths (auto's own mixed blocks), the cells outweigh the chord."""
    total = sum(w for _, _, w in points)
    if total <= 0 or chord <= 0:
        return fitted
    mean_n = sum(n * w for n, _, w in points) / total
    sxx = sum(w * (n - mean_n) ** 2 for n, _, w in points)
    sww = sum(w * w * (n - mean_n) ** 2 for n, _, w in points)
    if sxx <= 0:  # one block length: no slope of their own
        return chord
    if noise_ms <= 0:
        return fitted
    fit_precision = sxx * sxx / (noise_ms * noise_ms * sww)
    chord_precision = 1.0 / (CHORD_SD * chord) ** 2
    return (fit_precision * fitted + chord_precision * chord) / (fit_precision + chord_precision)


def jump_reading_line(chord: float, extra_per_row: float, mean_y: float,
                      prior_slope: float) -> tuple[float, float] | None:
    """The other reading of a packed batch's drafted passes where they average under `MIN_SPAN`
    draft positions a row: their time beyond the plain pass as a jump to the drafted path plus
    the prior's slope (`prior_slope`, per position a row), as the line (cost at no extra position,
    slope); None where the passes hold a position a row or more, or the prior's slope is no
    cheaper than the chord.

    The chord (`CostModel._chord_slope`) charges that jump to the positions. Over a position or
    more a row that bounds what a position costs; over a few positions in all, it is the jump. A
    cold replica's first drafted passes at 16 rows held 1-3 positions at 142-148 ms against a
    plain pass of 80: the chord priced a position at 35 ms where one costs 2-3, sessions at
    acceptance 0.99 never drafted, and the passes that would have told the slope never came
    (`DepthController._packed_rates` takes the better of the two readings)."""
    if extra_per_row >= MIN_SPAN or extra_per_row <= 0 or prior_slope >= chord:
        return None
    return mean_y - prior_slope * extra_per_row, prior_slope


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
        self._verify: dict[int, dict[int, RunningMean]] = {}  # batch size -> extra positions -> pass ms
        self.packed = False  # the replica packs passes: a row's block costs only its own positions
        self._draft: dict[int, RunningMean] = {}
        self._overhead = RunningMean()  # ms per verify step outside the pass, when the replica reports its pass time
        self._open = RunningMean()  # ms to open a draft session (a probe from k = 0 opens one)
        self._lines: dict[int, tuple[float, float]] = {}
        self._jump_lines: dict[int, tuple[float, float] | None] = {}  # batch size -> `jump_reading`'s line
        self._draft_line: tuple[float, float] | None = None
        self._draft_costs: dict[int, tuple[float, ...]] = {}  # k_max -> draft_ms(0 .. k_max), until a draft is seen
        # the passes counted lately: their other rows' reports are skipped (a replica numbers its
        # passes; rows of one pass come back together, so a short memory does)
        self._recent_passes: deque[int] = deque(maxlen=RECENT_PASSES)
        self._seen_passes: set[int] = set()
        self._passes_without_drafts = 0  # passes counted since the last one with a draft position
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
            self._passes_without_drafts = 0 if extra > 0 else self._passes_without_drafts + 1
            if self._passes_without_drafts == STALE_PASSES:
                self._forget_drafted_passes()
            cell = self._verify.setdefault(batch_size, {}).setdefault(extra, RunningMean())
            cell.add(_clip(ms, cell), self.window)
            self._forget_lines()

    def _forget_drafted_passes(self) -> None:
        """Drop every cell of passes with draft positions (under `_lock`): the model then prices a
        position from its plain passes and the prior's shape until drafted passes come again.

        A session at k = 0 drafts nothing, so while the replica's plain passes keep their cells
        current, its drafted cells keep whatever the machine did when they were last seen. A
        spell when the machine ran at a quarter of its speed (a profiler beside it) left drafted
        passes of 600 ms at 16 rows; plain passes were back at 160 within seconds, the gap priced
        every position far past what any block could keep, and auto ran a code edit cell at
        k = 0 for 1969 of 1974 steps (docs/benchmarks.md, 2026-12-07). Forgetting costs a
        replica where speculation does not pay a few drafted passes every STALE_PASSES passes,
        which teach the cells again."""
        for cells in self._verify.values():
            for extra in [e for e in cells if e > 0]:
                del cells[extra]

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
                cell = self._draft.setdefault(k, RunningMean())
                cell.add(_clip(ms, cell), DRAFT_WINDOW)
                self._draft_line = None
                self._draft_costs.clear()

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
                    cell = self._verify.setdefault(b, {}).setdefault(extra, RunningMean())
                    cell.mean = (cell.mean * cell.count + float(mean) * count) / (cell.count + count)
                    cell.count = min(cell.count + count, self.window)
                    self._forget_lines()

    def _forget_lines(self) -> None:
        self._lines.clear()
        self._jump_lines.clear()

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
        have no slope of their own: the prior's then (`_chord_slope` for a packed batch). Where a
        packed batch has a chord, a fitted slope is weighed against it by what each can tell
        (`slope_by_precision`): cells that span a position or two a row, each off by the machine's
        drift, tell little more than ones that span less."""
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
        chord = prior_slope = self._chord_slope(b, mean_n, mean_y)
        if prior_slope is None:
            prior_slope = self._borrowed_slope(b)
        if prior_slope is None:
            prior_slope = m0 * scale
        fit = _fit_line(points) if _span(b, cells) >= MIN_SPAN else None
        self._jump_lines[b] = None if fit is not None or chord is None else \
            jump_reading_line(chord, mean_n - 1.0, mean_y, m0 * scale)
        if fit is None:
            slope = prior_slope
        elif chord is not None and chord > 0:  # data on both sides: each by what it can tell
            slope = slope_by_precision(fit[1], chord, points, CELL_NOISE * mean_y)
        else:
            spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
            prior = self.prior_points * PRIOR_SPREAD ** 2
            slope = (spread * fit[1] + prior * prior_slope) / (spread + prior)
        return mean_y - slope * (mean_n - 1.0), slope

    def _chord_slope(self, b: int, mean_n: float, mean_y: float) -> float | None:
        """For a packed replica's batch of b > 1 rows: the slope from its settled plain pass to the
        drafted passes' mean (a jump to the drafted path counted as slope: the cost a position
        brings at most). The prior the line's slope is shrunk toward, and all of it where the
        drafted passes span less than `MIN_SPAN` positions a row, so that their own slope is
        noise: fixed k = 4 at 16 rows left its cells at 56-64 extra positions, the line through
        them priced a position at 0.06 ms, and auto sessions after that cell drafted blocks of 16,
        in passes of 1.8x fixed k = 4's (docs/benchmarks.md, "The sweep on the current code: a
        slope the passes can tell"). None alone (at b = 1 the jump
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

    def jump_reading(self, batch_size: int = 1) -> tuple[float, float] | None:
        """(position_ms, packed_jump_ms) at `batch_size` under the other reading of drafted passes
        too few positions long to tell a position's cost from the jump (`jump_reading_line`);
        None where the passes tell it, or there is no such reading."""
        b = max(int(batch_size), 1)
        with self._lock:
            plain = self._verify.get(b, {}).get(0)
            if plain is None:
                return None
            self._line(b)
            line = self._jump_lines.get(b)
            if line is None:
                return None
            return line[1] / b, max(line[0] - plain.mean, 0.0)

    def draft_ms(self, k: int) -> float:
        """Estimated time for the draft to propose k tokens (0 for k = 0)."""
        if k <= 0:
            return 0.0
        with self._lock:
            return self._draft_at(k)

    def draft_costs(self, k_max: int) -> tuple[float, ...]:
        """`draft_ms(k)` for k = 0 .. k_max, kept until the next draft is observed. Every session
        prices every depth at every step: 17 calls, each taking the lock, were a fifth of a
        session's step at k = 0 in a batch of 16 (`scripts/bench_auto_step_cost.py`)."""
        with self._lock:
            costs = self._draft_costs.get(k_max)
            if costs is None:
                costs = (0.0, *(self._draft_at(k) for k in range(1, k_max + 1)))
                self._draft_costs[k_max] = costs
            return costs

    def _draft_at(self, k: int) -> float:
        """The draft line at k >= 1 (under the lock), fitted when a draft was seen since."""
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
