"""The coordinator's own work per step for auto at k = 0 in a batch: controller, echo and shadow.

    PYTHONPATH=. python scripts/bench_auto_step_cost.py [--sessions 16] [--steps 40] [--recent 32] [--debug-log]
    PYTHONPATH=. python scripts/bench_auto_step_cost.py --acceptance 0.8 [--k-max 16]   # sessions that draft

At 16 sessions the target starts a pass once every session is back, so what each session's
thread does between one pass's end and its next verify is serialized by the coordinator's
interpreter lock, sessions times over. This times that work with no model and no network:
`--sessions` controllers sharing one replica's cost model and pass peers (the cost model seeded
with packed cells at 1 and 16 rows), each step `choose`, the echo guess, a shadow draft when
none is pending, `observe` of a plain pass, and the echo's extend. `--recent N`: the method's
last N sessions drafted and accepted 0.1-0.4 (chat or code after code edits), so that a session
with few trials of its own prices its steps on them (`mixture_tokens`), as after any traffic of
the method; 0 (the default): a replica's first sessions. `--debug-log` turns the
controller's debug lines on (formatted, written nowhere), as `SPECD_LOG_LEVEL=DEBUG` would.
Compare a round's milliseconds with the pass time at that batch size (200-350 ms at 16 rows on
the 2-core CI machines).

`--acceptance A` times sessions that draft instead: each step `choose`, then `observe` of a
packed pass in which each drafted token went through with probability A (the method's recent
sessions at 0.6-0.9), no echo or shadow; the controller's own share of a drafting step.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time

from coordinator.controller import (CostModel, DepthController, LoadSignal, PassPeers, SharedAcceptance,
                                   make_controller)
from coordinator.echo import EchoLookup, ShadowDraft, echo_hit

CONTEXT_TOKENS = 300
VOCAB = 5000


def seeded_cost_model(base_ms: float = 100.0, ms_per_position: float = 2.0, ms_per_row: float = 3.0) -> CostModel:
    """Packed passes of 1 and 16 rows at 0-48 extra positions, four of each (settled cells), each
    costing base_ms + ms_per_position a drafted position + ms_per_row a row."""
    model = CostModel()
    for rows in (1, 16):
        for extra in (0, 16, 32, 48):
            for _ in range(4):
                model.observe_verify(rows, 1 + extra // rows, base_ms + ms_per_position * extra + ms_per_row * rows,
                                     positions=rows + extra, packed=True)
    return model


def seeded_replica(rng: random.Random, sessions: int, k_max: int, recent: int, acceptances: tuple[float, float],
                   fill: float) -> list[DepthController]:
    """`sessions` auto controllers on one replica (`seeded_cost_model`, shared pass peers), their
    method's last `recent` sessions at acceptances drawn from `acceptances` with `fill`."""
    costs, peers, shared = seeded_cost_model(), PassPeers(), SharedAcceptance()
    for _ in range(recent):
        shared.report_session(rng.uniform(*acceptances), fill)
    return [make_controller("auto", k_max, costs, shared, peers) for _ in range(sessions)]


def time_drafting_steps(sessions: int, steps: int, k_max: int, acceptance: float) -> None:
    """`--acceptance`: the controller's time per step of sessions that draft (see the docstring)."""
    rng = random.Random(0)
    controllers = seeded_replica(rng, sessions, k_max, 32, (0.6, 0.9), 0.9)
    load = LoadSignal(0, sessions)
    choose_s = observe_s = 0.0
    depths = []
    for step in range(steps):
        for controller in controllers:
            t0 = time.perf_counter()
            k = controller.choose(load, remaining=100)
            t1 = time.perf_counter()
            accepted = next((i for i in range(k) if rng.random() >= acceptance), k)
            controller.observe(k, accepted, 5.0, 150.0, sessions, pass_block_length=k + 1, compute_ms=140.0,
                               requested=k, pass_positions=3 * sessions, packed=True, pass_id=step + 1)
            observe_s += time.perf_counter() - t1
            choose_s += t1 - t0
            depths.append(k)
    n = steps * sessions
    print(f"{sessions} sessions drafting at acceptance {acceptance}, k_max {k_max}, {steps} steps: mean k "
          f"{sum(depths) / n:.1f}; per session-step choose {choose_s / n * 1e6:.0f} us, observe "
          f"{observe_s / n * 1e6:.0f} us; a round of {sessions}: {(choose_s + observe_s) / steps * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--recent", type=int, default=0)
    parser.add_argument("--debug-log", action="store_true")
    parser.add_argument("--acceptance", type=float, default=0.0,
                        help="time sessions that draft, each token accepted with this probability (0: k = 0 steps)")
    parser.add_argument("--k-max", type=int, default=8, help="the controllers' deepest block (default 8)")
    args = parser.parse_args()
    if args.debug_log:
        logging.basicConfig(level=logging.DEBUG, stream=open(os.devnull, "w"))
    if args.acceptance > 0:
        time_drafting_steps(args.sessions, args.steps, args.k_max, args.acceptance)
        return
    rng = random.Random(0)
    controllers = seeded_replica(rng, args.sessions, args.k_max, args.recent, (0.1, 0.4), 0.5)
    for controller in controllers:
        controller.echoes = True
    context = [rng.randrange(VOCAB) for _ in range(CONTEXT_TOKENS)]
    echoes = [EchoLookup(list(context)) for _ in controllers]
    shadows = [ShadowDraft() for _ in controllers]
    load = LoadSignal(0, args.sessions)
    controller_s = echo_s = 0.0
    start = time.perf_counter()
    for step in range(args.steps):
        for controller, echo, shadow in zip(controllers, echoes, shadows):
            t0 = time.perf_counter()
            controller.choose(load, remaining=100)
            t1 = time.perf_counter()
            guess = echo.guess()
            if not shadow.pending:
                depth = controller.shadow_depth()
                draft = echo.ngram_draft(depth)
                shadow.start(draft)
                controller.observe_shadow_fill(len(draft), depth)
            produced = [rng.randrange(VOCAB)]
            judged = shadow.feed(produced)
            t2 = time.perf_counter()
            controller.observe(0, 0, 0.0, 150.0, args.sessions, pass_block_length=1, compute_ms=140.0, requested=0,
                               echo=echo_hit(guess, produced), shadow=judged, pass_positions=args.sessions,
                               packed=True, pass_id=step + 1)
            echo.extend(produced)
            t3 = time.perf_counter()
            controller_s += (t1 - t0) + (t3 - t2)
            echo_s += t2 - t1
    elapsed = time.perf_counter() - start
    steps = args.steps * args.sessions
    print(f"{args.sessions} sessions at k = 0, {args.steps} steps: per session-step {elapsed / steps * 1e6:.0f} us "
          f"(controller {controller_s / steps * 1e6:.0f}, echo and shadow {echo_s / steps * 1e6:.0f}); "
          f"a round of {args.sessions}: {elapsed / args.steps * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
