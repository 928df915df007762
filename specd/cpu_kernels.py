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
0.59-0.81x ("Packed oneDNN weights" there). Not on every CPU: where torch's kernel multiplies one
row faster, the target runs one-row products on it (`tune_single_row`, timed at start).

The two kernels sum in different orders, so logits differ in the last bits (about 1e-4 on
logits of magnitude 10-30), as MKL's own one-row and five-row products already do. Greedy output
is still the target's token for token wherever the top two logits are not within that distance;
the end-to-end exactness tests compare services running these kernels with transformers' stock
generation.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

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
    single_row_on_torch = False  # a product of one token row runs on torch's kernel (`tune_single_row`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.single_row_on_torch and x.numel() == x.shape[-1]:
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


def _kernel_seconds(call: Callable[[], object], iters: int) -> float:
    """The median time of `call`, over `iters` calls."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_is_faster(torch_s: list[float], onednn_s: list[float]) -> bool:
    """Whether torch's kernel won: its best round (each round a median) beat oneDNN's. Rounds
    alternate the kernels, so that both see the same machine state; the best round, because
    other work on the machine only ever adds time (a target starts beside the services of its
    stack, which import torch and load their models then): with the sum of the rounds'
    medians a busy spell flipped decisions of 40 against 58 us."""
    return min(torch_s) < min(onednn_s)


def fastest_assignment(pass_seconds: Callable[[int], float], candidates: int, rounds: int) -> tuple[int, list[float]]:
    """The candidate (0..candidates-1) whose best pass was the fastest, and each one's best.
    `pass_seconds(i)` times one pass with candidate i in place; each round times every candidate
    once, the order rotated by one a round."""
    best = [float("inf")] * candidates
    for r in range(rounds):
        for j in range(candidates):
            i = (r + j) % candidates
            best[i] = min(best[i], pass_seconds(i))
    return min(range(candidates), key=best.__getitem__), best


def _one_token_pass_seconds(model: nn.Module) -> float:
    ids = torch.zeros((1, 1), dtype=torch.long)
    start = time.perf_counter()
    model(ids)
    return time.perf_counter() - start


def tune_single_row(model: nn.Module, rounds: int = 3, iters: int = 7, pass_rounds: int = 5,
                    pass_seconds: Callable[[nn.Module], float] = _one_token_pass_seconds) -> int:
    """Times a product of one token row on torch's kernel and on oneDNN's packed one, once per
    weight shape of `model`'s oneDNN layers, then whole one-token passes of `model` with one-row
    products as those timings chose, all on torch's kernel, and all on oneDNN's, and runs one-row
    products as the fastest pass did (wider products stay on oneDNN). Returns how many layers now
    run one row on torch's kernel.

    Which wins depends on the machine: on the 2-core machines this was first measured on, oneDNN
    took a forward pass of one token from 66.3 to 49.6 ms; on a later one (Sapphire Rapids, AMX),
    torch's one-core product of one row ran the whole pass in 31.3 ms against oneDNN's 38.3, while
    oneDNN still won every wider shape (a block of 2: 42.0 against 48.9 ms; docs/benchmarks.md,
    "One-row products on the faster kernel"). One row is plain decoding: a session at k = 0, the
    off path. The product of one shape, timed alone, keeps its weights in cache; a pass streams
    them all. The passes decide: two targets started alike on one machine had chosen differently
    shape by shape (150 and 211 layers on torch's kernel), and the first decoded 10 % slower
    (docs/benchmarks.md, "Two stacks that differed by their start-up timings"). Call it on the thread that runs the
    model, with its torch threads set: MKL's one-row product and oneDNN's differ in how many
    threads they use."""
    layers = [m for m in model.modules() if type(m) is OneDnnLinear and m.packed_weight is not None]
    if not layers:
        return 0
    choice: dict[tuple, bool] = {}
    with torch.inference_mode():
        for module in layers:
            key = (tuple(module.weight.shape), module.bias is not None)
            if key not in choice:
                x = torch.randn(1, 1, module.in_features, dtype=module.weight.dtype)
                torch_s, onednn_s = [], []
                for _ in range(rounds):
                    torch_s.append(_kernel_seconds(lambda: nn.functional.linear(x, module.weight, module.bias), iters))
                    onednn_s.append(_kernel_seconds(lambda: _onednn_linear(x, module.packed_weight, module.bias), iters))
                choice[key] = torch_is_faster(torch_s, onednn_s)
                log.info("one-row product %s: torch %.0f us, oneDNN %.0f us", key[0], 1e6 * min(torch_s),
                         1e6 * min(onednn_s))
        by_shape = [choice[(tuple(m.weight.shape), m.bias is not None)] for m in layers]
        assignments = [by_shape, [True] * len(layers), [False] * len(layers)]
        names = ["as each shape chose", "all on torch's kernel", "all on oneDNN's"]

        def timed(i: int) -> float:
            for module, on_torch in zip(layers, assignments[i]):
                module.single_row_on_torch = on_torch
            return pass_seconds(model)

        timed(0)  # a warm-up pass
        chosen, best = fastest_assignment(timed, len(assignments), pass_rounds)
        log.info("one-token passes: %s", ", ".join(f"{n} {1e3 * b:.1f} ms" for n, b in zip(names, best)))
        for module, on_torch in zip(layers, assignments[chosen]):
            module.single_row_on_torch = on_torch
    return sum(m.single_row_on_torch for m in layers)
