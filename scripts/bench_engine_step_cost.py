"""The engine loop's own work per session step, speculation off against auto, on real outputs.

    PYTHONPATH=. python scripts/bench_engine_step_cost.py [--kind completion] [--rounds 6] [--repeats 3]
    PYTHONPATH=. python scripts/bench_engine_step_cost.py --kind code_edit --configs off,2,auto

`scripts/bench_auto_step_cost.py` times the controller, echo and shadow alone on a random
context, where the lookups rarely find a match. This runs `SpeculativeEngine`'s whole loop,
with the n-gram proposer, on the kind's prompts and the bundled target's own greedy outputs
(computed once, at the start): 16 sessions stepped in turn in one thread, against a verifier
that replays those outputs and reports packed passes of 16 rows, so every lookup, shadow and
echo sees the text a live session sees. Off is a fixed k = 0 whose steps still teach the
replica's cost model (as `specd bench-load`'s "off"); auto is `--k auto`; `--configs` names
others (a fixed k: "2"), the first the baseline. They alternate, `--repeats` times each, and the
thread CPU per session step and per token streamed of each is printed, then their medians.

In the live stack at 16 sessions the coordinator's CPU shares the two cores with the target's
pass, and what it spends between one pass and the next the pass waits for: this is the part of
that time which is the engine's and the controller's own, with no gRPC or network in it.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

from coordinator.depth import CostModels, DepthPolicy
from coordinator.engine import SpeculativeEngine
from draft_service.proposers import make_proposer
from draft_service.proposers.base import Proposal
from specd.models import load_model
from specd.sampling import SamplingParams
from specd.workloads import default_prompts_path, load_prompts, prompts_of_kind
from scripts.bench_auto_step_cost import seeded_cost_model
from target_service.verifier import TargetModel

SESSIONS = 16
MAX_TOKENS = 32
PASS_MS = 65.0  # a plain pass of 16 rows on the CI machines (held cells of completion)


@dataclass
class ReplayOutcome:
    """A verify outcome as a remote replica reports it, in a packed pass of SESSIONS rows."""

    num_accepted: int
    tokens: list[int]
    pass_id: int
    pass_block_length: int = 1
    pass_positions: int = SESSIONS
    batch_size: int = SESSIONS
    compute_ms: float = PASS_MS
    packed: bool = True
    queue_ms: float = 0.0


class ReplaySession:
    """A target session that emits a recorded greedy output: a block is accepted as far as it
    agrees with it, as the target's greedy verification would."""

    replica = None  # the engine's cost models key it as the embedded replica

    def __init__(self, output: Sequence[int], passes: itertools.count):
        self.output, self.position, self.passes = list(output), 0, passes

    @property
    def room(self) -> int:
        return 1 << 16

    def prefill(self) -> int:
        self.position = 1
        return self.output[0]

    def verify(self, proposal: Proposal) -> ReplayOutcome:
        accepted = 0
        for token in proposal.tokens:
            at = self.position + accepted
            if at >= len(self.output) or token != self.output[at]:
                break
            accepted += 1
        tokens = self.output[self.position:self.position + accepted + 1]
        tokens += [0] * (accepted + 1 - len(tokens))  # past the recording (the step limit stops it first)
        self.position += accepted + 1
        drafted = len(proposal.tokens)
        return ReplayOutcome(accepted, tokens, next(self.passes) // SESSIONS, pass_block_length=drafted + 1,
                             pass_positions=SESSIONS + drafted)

    def close(self) -> None:
        pass


class ReplayVerifier:
    def __init__(self, outputs: dict[tuple[int, ...], list[int]]):
        self.outputs = outputs
        self.passes = itertools.count(1)

    def open_session(self, prompt_ids: Sequence[int], params: SamplingParams) -> ReplaySession:
        return ReplaySession(self.outputs[tuple(prompt_ids)], self.passes)


def greedy_outputs(kind: str) -> dict[tuple[int, ...], list[int]]:
    """Each prompt of `kind` (encoded) -> the bundled target's greedy output, MAX_TOKENS at most."""
    model = load_model()
    engine = SpeculativeEngine(TargetModel(model), None, k=0, eos_token_ids=model.eos_token_ids)
    outputs = {}
    for prompt in prompts_of_kind(load_prompts(default_prompts_path()), kind, MAX_TOKENS):
        ids = model.encode(prompt.prompt, chat=prompt.chat)
        generation = engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        generation.run()
        outputs[tuple(ids)] = list(generation.token_ids)
    return outputs


def engine_for(config: str, outputs: dict[tuple[int, ...], list[int]]) -> SpeculativeEngine:
    # a settled replica, as after a bench's warm-up: passes of PASS_MS and 1.5 ms a drafted position
    costs = CostModels(factory=lambda: seeded_cost_model(PASS_MS, ms_per_position=1.5, ms_per_row=0.0))
    proposer = make_proposer("ngram", None)
    if config in ("off", "0"):
        return SpeculativeEngine(ReplayVerifier(outputs), proposer, k=0, cost_models=DepthPolicy("auto", 8, costs))
    return SpeculativeEngine(ReplayVerifier(outputs), proposer, k=8, depth=DepthPolicy(config, 8, costs))


def us_per_step(config: str, outputs: dict[tuple[int, ...], list[int]], rounds: int) -> tuple[float, float]:
    """Thread CPU per session step and per token streamed over `rounds` rounds of SESSIONS
    requests stepped in turn."""
    engine, prompts = engine_for(config, outputs), list(outputs)
    steps, tokens, start = 0, 0, time.thread_time()
    for _ in range(rounds):
        live = [iter(engine.generate(list(prompts[i % len(prompts)]), SamplingParams(max_tokens=MAX_TOKENS)).chunks)
                for i in range(SESSIONS)]
        while live:
            still = []
            for chunks in live:
                chunk = next(chunks, None)
                if chunk is not None:
                    steps += 1
                    tokens += len(chunk)
                    still.append(chunks)
            live = still
    elapsed = time.thread_time() - start
    return elapsed / steps * 1e6, elapsed / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="completion", help="workload kind whose prompts run (default completion)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of 16 requests per measurement (default 6)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each configuration (default 3)")
    parser.add_argument("--configs", default="off,auto",
                        help="comma list of depths: off, auto or a fixed k (default off,auto; the first is the baseline)")
    args = parser.parse_args()
    outputs = greedy_outputs(args.kind)
    configs = args.configs.split(",")
    for config in configs:
        DepthPolicy("auto" if config == "off" else config)  # a bad spec fails before the outputs' minute
    times: dict[str, list[tuple[float, float]]] = {config: [] for config in configs}
    for repeat in range(args.repeats):
        for config in configs:
            times[config].append(us_per_step(config, outputs, args.rounds))
            step_us, token_us = times[config][-1]
            print(f"{config}: {step_us:.1f} us a session step, {token_us:.1f} us a token", flush=True)
    base = statistics.median(step for step, _ in times[configs[0]])
    for config in configs:
        step_us = statistics.median(step for step, _ in times[config])
        token_us = statistics.median(token for _, token in times[config])
        print(f"{args.kind}, {SESSIONS} sessions, median {config}: {step_us:.1f} us a session step ({step_us - base:+.1f} "
              f"vs {configs[0]}; a round of {SESSIONS}: {(step_us - base) * SESSIONS / 1000:+.2f} ms), {token_us:.1f} us a token")


if __name__ == "__main__":
    main()
