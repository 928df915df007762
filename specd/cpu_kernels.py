"""oneDNN kernels for the linear layers of a model served on a CPU.

torch runs `nn.Linear` on a CPU through MKL. On the machines this project runs on (2 cores,
AVX-512, torch 2.13) MKL multiplies a single token row on one core, and 2 to 4 rows slower
than 5 to 8 (the reason for `fast_block_length`); the LM head of the bundled model, a 49152 x
576 product, takes 11.4 ms for one row and 25 ms for two. oneDNN's inner product
(`torch.ops.mkldnn._linear_pointwise`, the op torch.compile's CPU backend emits for linear
layers) reads the same dense float32 weights, keeps both cores busy at every row count, and
takes 5.4 ms and 7.8 ms there. On the whole model, one forward pass at 400 cached tokens, in one
process (docs/benchmarks.md, "oneDNN linear layers"): 1 token 66.3 -> 49.6 ms, 5 tokens 101.5 ->
65.7 ms, 9 tokens 117.4 -> 73.6 ms, 4 sessions x 1 token 119.0 -> 74.2 ms. With the weights
packed once into oneDNN's layout (`pack_weight`) instead of reordered on every call, a further
0.59-0.81x ("Packed oneDNN weights" there). Not on every CPU: where torch's kernel multiplies a
few rows faster, the target runs products of that few on it (`tune_few_rows`, timed at start).

The two kernels sum in different orders, so logits differ in the last bits (about 1e-4 on
logits of magnitude 10-30), as MKL's own one-row and five-row products already do. Greedy output
is still the target's token for token wherever the top two logits are not within that distance;
the end-to-end exactness tests compare services running these kernels with transformers' stock
generation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from specd.config import LINEAR_KERNELS

log = logging.getLogger(__name__)

# Float32 alone: the kernels were measured and checked in float32; other dtypes keep torch's.
_ONEDNN_DTYPES = (torch.float32,)


# The row count oneDNN lays the packed weights out for (`torch.ops.mkldnn._reorder_linear_weight`'s
# batch-size hint): the target's largest batch by default. Packed for 16 rows, a product of 2 to 64
# rows runs from the packed layout; with the dense weight oneDNN reorders it on every call, which
# is what made a 2-token pass cost 1.6x a 1-token one (docs/benchmarks.md, "Packed oneDNN weights").
PACK_ROWS = 16


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_weight(weight: torch.Tensor, rows: int = PACK_ROWS) -> torch.Tensor:
    """`weight` in oneDNN's layout for products of about `rows` rows (an opaque mkldnn tensor)."""
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose forward runs oneDNN's inner product on a packed copy of its weights
    (`packed_weight`, made by `use_linear_kernel`; the dense weight stays, so tied weights such as
    an LM head sharing the embedding matrix stay shared). Installed by swapping the class of
    existing modules. Inference only: the op has no autograd formula, and the packed copy is taken
    once, so weights changed later are not seen (load, then swap)."""

    packed_weight: torch.Tensor | None = None
    torch_rows = 0  # products of at most this many token rows run on torch's kernel (`tune_few_rows`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.torch_rows * x.shape[-1]:
            return nn.functional.linear(x, self.weight, self.bias)
        return _onednn_linear(x, self.weight if self.packed_weight is None else self.packed_weight, self.bias)


def onednn_linear_works(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build has the oneDNN linear op and it agrees with `F.linear` on a probe."""
    if dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(64, 32, generator=generator, dtype=dtype)
        bias = torch.randn(64, generator=generator, dtype=dtype)
        x = torch.randn(2, 3, 32, generator=generator, dtype=dtype)
        with torch.inference_mode():
            got = _onednn_linear(x, weight, bias)
            packed = _onednn_linear(x, pack_weight(weight), bias)
            want = nn.functional.linear(x, weight, bias)
    except (RuntimeError, AttributeError) as err:  # op missing from this build, or refused
        log.info("oneDNN linear kernel unavailable: %s", err)
        return False
    return all(y.shape == want.shape and torch.allclose(y, want, rtol=1e-4, atol=1e-4) for y in (got, packed))


def runs_onednn(model: nn.Module) -> bool:
    """Whether `model`'s LM head (and so, after `use_linear_kernel`, its other linear layers) runs on oneDNN."""
    get_head = getattr(model, "get_output_embeddings", None)
    return type(get_head() if get_head is not None else None) is OneDnnLinear


def use_linear_kernel(model: nn.Module, kernel: str) -> int:
    """Runs every plain `nn.Linear` of `model` on `kernel` ("onednn" or "aten", torch's default).
    Returns how many layers now run on oneDNN: 0 with "aten", when the model is not a float32 CPU
    model, or when the op is missing or fails its probe (then nothing changes)."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel {kernel!r} is not one of {', '.join(LINEAR_KERNELS)}")
    linears = [m for m in model.modules() if type(m) in (nn.Linear, OneDnnLinear)]
    for module in linears:  # a tuning before (`tune_few_rows`) is void
        module.__dict__.pop("torch_rows", None)
    if kernel == "aten":
        for module in linears:
            module.__dict__.pop("packed_weight", None)
            module.__class__ = nn.Linear
        return 0
    cpu_float32 = [m for m in linears if m.weight.device.type == "cpu" and m.weight.dtype in _ONEDNN_DTYPES]
    if not cpu_float32 or not onednn_linear_works(cpu_float32[0].weight.dtype):
        return 0
    for module in cpu_float32:
        module.__class__ = OneDnnLinear
        module.packed_weight = pack_weight(module.weight)
    return len(cpu_float32)


# The widest product `tune_few_rows` times on both kernels.
MAX_TUNED_ROWS = 8
# A best pass of a few rows this many times the best one-row pass says the machine was busy for
# all of that count's passes (wider passes here cost up to 1.6x a one-row one): `tune_few_rows`
# times that count again, BUSY_WAIT_S later, up to BUSY_RETRIES times in one tuning, all row
# counts together: targets started together, as tests start them, find the machine busy
# throughout, and must not keep timing.
BUSY_FACTOR = 2.0
BUSY_RETRIES = 4
BUSY_WAIT_S = 0.5


def fastest_assignment(pass_seconds: Callable[[int], float], candidates: int, rounds: int) -> tuple[int, list[float]]:
    """The candidate (0..candidates-1) whose best pass was the fastest, and each one's best.
    `pass_seconds(i)` times one pass with candidate i in place; each round times every candidate
    once, the order rotated by one a round. The best pass, because other work on the machine only
    ever adds time: a target is tuned as it starts, beside the services of its stack importing
    torch and loading their models."""
    best = [float("inf")] * candidates
    for r in range(rounds):
        for j in range(candidates):
            i = (r + j) % candidates
            best[i] = min(best[i], pass_seconds(i))
    return min(range(candidates), key=best.__getitem__), best


def torch_rows_from(torch_won: Sequence[bool]) -> int:
    """The most rows r such that torch's kernel won the passes of every row count from 1 to r
    (`torch_won[i]`: at i + 1 rows)."""
    rows = 0
    for won in torch_won:
        if not won:
            break
        rows += 1
    return rows


def _pass_seconds(model: nn.Module, rows: int) -> float:
    ids = torch.zeros((1, rows), dtype=torch.long)
    start = time.perf_counter()
    model(ids)
    return time.perf_counter() - start


def tune_few_rows(model: nn.Module, max_rows: int = MAX_TUNED_ROWS, rounds: int = 3,
                  pass_seconds: Callable[[nn.Module, int], float] = _pass_seconds,
                  sleep: Callable[[float], None] = time.sleep) -> int:
    """Times whole passes of `model` over 1, 2, ... token rows with its oneDNN layers' products
    on torch's kernel and on oneDNN's, and runs products of as many rows as torch's kernel won
    at every count up to on torch's kernel (wider ones stay on oneDNN). Stops at the first count
    oneDNN wins, or at `max_rows`. Returns that row count (0: oneDNN throughout).

    Which wins depends on the machine. On the 2-core machines this was first measured on,
    oneDNN took a one-token pass from 66.3 to 49.6 ms and won at every width. On a later one
    (Sapphire Rapids, AMX), torch's kernel ran passes of 1, 2 and 3 rows in 33.9, 34.8 and
    36.5 ms against oneDNN's 42.0, 43.2 and 44.2, and lost from 4 rows on (50.4 against 44.2):
    plain decoding of up to three sessions, and a session's blocks of one or two drafted tokens
    (docs/benchmarks.md, "Start-up tuning that two stacks disagreed on").

    Whole passes decide, not each weight shape's product timed alone: that kept its weights in
    cache where a pass streams them all, and judged on the sum of a few rounds' medians while
    the stack's other services started, it put 60 layers on the slower kernel in one target and
    none in another started alike, which then decoded 10 % slower. A row count whose best pass
    took over BUSY_FACTOR times the best one-row pass is timed again a little later (a target
    tuned while its draft service loaded its model read 124 against 116 ms for 3 rows, where
    the machine alone reads 37 against 44), BUSY_RETRIES times at most. Call it on the thread that
    runs the model, with its torch threads set: MKL's few-row products and oneDNN's differ in
    how many threads they use."""
    layers = [m for m in model.modules() if type(m) is OneDnnLinear and m.packed_weight is not None]
    if not layers:
        return 0

    def timed(torch_rows: int, rows: int) -> float:
        for module in layers:
            module.torch_rows = torch_rows
        return pass_seconds(model, rows)

    torch_won: list[bool] = []
    one_row_s = float("inf")
    retries = BUSY_RETRIES
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            kernels = (rows, 0)  # torch's kernel for this many rows, then oneDNN's
            timed(0, rows)  # oneDNN makes its primitive for a new shape on the first call
            while True:
                chosen, best = fastest_assignment(lambda i: timed(kernels[i], rows), len(kernels), rounds)
                log.info("%d-row passes: torch %.1f ms, oneDNN %.1f ms", rows, 1e3 * best[0], 1e3 * best[1])
                if min(best) <= BUSY_FACTOR * one_row_s or retries == 0:
                    break
                retries -= 1
                log.info("%d-row passes took over %.0fx a one-row pass (%.1f ms): the machine is busy, timing "
                         "them again", rows, BUSY_FACTOR, 1e3 * one_row_s)
                sleep(BUSY_WAIT_S)
            one_row_s = min(one_row_s, min(best))
            torch_won.append(chosen == 0)
            if not torch_won[-1]:
                break
    torch_rows = torch_rows_from(torch_won)
    for module in layers:
        module.torch_rows = torch_rows
    return torch_rows
