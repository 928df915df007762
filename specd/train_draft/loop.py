"""The training loop both draft kinds share: a time budget, a progress bar, a JSON-lines log with
held-out figures, and a checkpoint every few minutes that a rerun resumes from."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

WARMUP_STEPS = 20
EVAL_EVERY_STEPS = 50
CHECKPOINT_EVERY_S = 120.0

LossFn = Callable[[], tuple[torch.Tensor, dict[str, float]]]  # one batch: (loss, figures for the log)
EvalFn = Callable[[], dict[str, float]]  # held-out figures


def lr_at(step: int, total_steps: int, peak: float, warmup: int = WARMUP_STEPS) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class LoopResult:
    steps: int
    minutes: float
    held_out: dict[str, float]


def train_for(module: torch.nn.Module, loss_fn: LossFn, eval_fn: EvalFn, out: Path, minutes: float, peak_lr: float,
              desc: str, extra_state: dict | None = None) -> LoopResult:
    """Train `module` with AdamW until `minutes` of training have passed (counting earlier runs'
    time when resuming from out/checkpoint.pt); return the step count and final held-out figures.
    `extra_state` is saved in the checkpoint and, when resuming, updated from it."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.0, betas=(0.9, 0.95))
    ckpt_path = out / "checkpoint.pt"
    step, elapsed = 0, 0.0
    if ckpt_path.is_file():
        ckpt = torch.load(ckpt_path)
        module.load_state_dict(ckpt["module"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, elapsed = ckpt["step"], ckpt["elapsed_s"]
        if extra_state is not None:
            extra_state.update(ckpt.get("extra", {}))
        print(f"resuming from {ckpt_path} at step {step} ({elapsed / 60:.1f} min trained)", file=sys.stderr)
    budget_s = minutes * 60
    started = time.monotonic() - elapsed
    last_ckpt = time.monotonic()
    total_steps = step + 10_000  # replaced by an estimate from the first steps' speed
    step_times: list[float] = []

    def save() -> None:
        torch.save({"module": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "elapsed_s": time.monotonic() - started, "extra": extra_state or {}}, ckpt_path)

    bar = tqdm(total=int(budget_s), initial=int(min(elapsed, budget_s)), desc=desc, unit="s", file=sys.stderr)
    with (out / "train.log").open("a") as log:
        module.train()
        while time.monotonic() - started < budget_s:
            t0 = time.monotonic()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, peak_lr)
            loss, stats = loss_fn()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            step_times.append(time.monotonic() - t0)
            if len(step_times) == 5:
                mean = sum(step_times) / len(step_times)
                total_steps = step + int((budget_s - (time.monotonic() - started)) / mean)
            bar.n = int(min(time.monotonic() - started, budget_s))
            bar.set_postfix(step=step, loss=f"{loss.item():.3f}", **{k: f"{v:.2f}" for k, v in stats.items() if k.startswith("acc")})
            if step % EVAL_EVERY_STEPS == 0:
                held = _held_out(module, eval_fn)
                log.write(json.dumps({"step": step, "minutes": round((time.monotonic() - started) / 60, 2),
                                      "lr": round(lr_at(step, total_steps, peak_lr), 6), "loss": round(loss.item(), 4),
                                      **{k: round(v, 4) for k, v in stats.items()},
                                      **{f"held_{k}": round(v, 4) for k, v in held.items()}}) + "\n")
                log.flush()
            if time.monotonic() - last_ckpt > CHECKPOINT_EVERY_S:
                save()
                last_ckpt = time.monotonic()
        bar.close()
        save()
        final = _held_out(module, eval_fn)
        log.write(json.dumps({"step": step, "final": True, **{f"held_{k}": round(v, 4) for k, v in final.items()}}) + "\n")
    return LoopResult(step, (time.monotonic() - started) / 60, final)


def _held_out(module: torch.nn.Module, eval_fn: EvalFn) -> dict[str, float]:
    module.eval()
    try:
        with torch.no_grad():
            return eval_fn()
    finally:
        module.train()
