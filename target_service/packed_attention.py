"""Packed verify passes: the new tokens of every row laid end to end, so that a batch whose rows
bring blocks of different lengths computes only the tokens it has.

A padded pass runs every row at the longest row's block length: one session verifying a block of
9 while fifteen decode makes a pass of 16 x 9 positions for 24 real ones, and on a CPU target,
where a pass at batch 16 is compute-bound, the projections and the MLP cost in proportion to the
positions. In a packed pass the input is one sequence of the T real tokens (batch 1, each with its
own position id), so every token-wise layer (projections, MLP, norms, LM head) runs on T rows.
Attention is the one operation that needs the rows apart (`packed_attention`): each row's first
token attends in one call over every row, as in a plain pass, and the rest of a longer block
per row, over that row's KV-pool entries.

The model keeps one attention implementation: `install` wraps the one it had; a call without a
`Packing` goes straight through to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "specd_packed_"


@dataclass(frozen=True)
class Packing:
    """Where each row's tokens sit in the packed sequence: row b's are offsets[b] ..
    offsets[b] + lengths[b] - 1."""

    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    firsts: torch.Tensor  # [rows] long: each row's first token in the packed sequence
    uniform: bool  # every row brings as many tokens: the packed sequence is the padded grid
    # the grid's block length (`grid_length`), and where each packed token inside it sits: (row, index)
    grid: int = 1
    grid_index: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> "Packing":
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        uniform = len(set(lengths)) == 1
        grid = max(lengths) if uniform else grid_length(lengths)
        index = None
        if not uniform and grid > 1:
            rows = [b for b, n in enumerate(lengths) for _ in range(min(n, grid))]
            cols = [i for n in lengths for i in range(min(n, grid))]
            index = (torch.tensor(rows, dtype=torch.long, device=device),
                     torch.tensor(cols, dtype=torch.long, device=device))
        return cls(tuple(lengths), tuple(offsets), torch.tensor(offsets, dtype=torch.long, device=device),
                   uniform, grid, index)


# What one attention call over one row's keys costs, in query positions of a batched call: fitted
# on whole passes of the bundled target at 16 rows over 600 cached tokens (`grid_length`).
ROW_CALL_QUERIES = 4.0


def grid_length(lengths: list[int], row_call: float = ROW_CALL_QUERIES) -> int:
    """How many of each row's tokens a packed pass's attention runs in one call over every row
    (a grid of rows x c queries, shorter blocks padded, the padding's outputs dropped); the
    tokens of longer blocks past c run in one call per row over that row's keys.

    The c that minimizes the queries computed plus `row_call` per per-row call, the longest c
    among equals. Both extremes lose somewhere: c = 1 (each row's first token together, the rest
    row by row: 16 rows x 30 layers of small calls) made a pass of blocks of 4 to 7 at 16 rows
    cost 320 ms where one grid took 287, and blocks of fixed k = 4 where the n-gram lacked a few
    drafts 270 against 220; the whole grid made one block of 9 among fifteen plain rows cost 191
    ms against 126 (16 x 9 queries for 24). Chosen this way those passes took 287, 220 and 126,
    and a mix like auto's (blocks of 1 to 17) 258 against 262 by rows and 330 by the grid
    (docs/benchmarks.md, "Packed attention in a grid")."""
    def queries(c: int) -> float:
        return len(lengths) * c + sum(n - c + row_call for n in lengths if n > c)

    return min(range(1, max(lengths) + 1), key=lambda c: (queries(c), -c))


def grouped_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                            scaling: float) -> torch.Tensor:
    """Attention of query [rows, heads, n, d] over key/value [rows, kv_heads, L, d] with a boolean
    mask [rows, 1, n, L]; returns [rows, n, heads, d].

    With grouped-query attention (heads = groups x kv_heads) the query heads of one key/value head
    are folded into the query length, so the keys and values are read in place. transformers
    repeats them per query head whenever a mask is given and more than one query token per row
    comes in: at batch 16 over 300 cached tokens that copy doubled the cost of a pass with one
    3-token block."""
    rows, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.reshape(rows, kv_heads, groups * n, dim)  # head h = g * groups + r -> [g, r * n + i]
    # one query per row: its mask row serves every folded head as it is (a broadcast, no copy)
    m = mask if n == 1 else mask.expand(rows, groups, n, mask.shape[-1]).reshape(rows, 1, groups * n, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scaling)
    return out.reshape(rows, heads, n, dim).transpose(1, 2)


@dataclass(frozen=True)
class RowCover:
    """Where a batch's rows sit among the pool rows its keys and values were read from: one
    slice of the pool, gap rows included (target_service/kv_pool.py's `covering_rows`), so that
    a batch missing a session is not gathered. Attention runs over the slice's rows, the gap rows
    with empty queries that see every key (a row that sees none would come out as NaN), and
    keeps the batch's rows."""

    positions: tuple[int, ...]  # row b of the batch is row positions[b] of the slice
    index: torch.Tensor
    total: int  # rows in the slice

    @classmethod
    def of(cls, positions: list[int], device: torch.device) -> "RowCover":
        return cls(tuple(positions), torch.tensor(positions, dtype=torch.long, device=device), positions[-1] + 1)

    def spread(self, x: torch.Tensor, fill: float | bool) -> torch.Tensor:
        """[rows, ...] -> [total, ...], the batch's rows at their places, the gap rows `fill`."""
        out = x.new_full((self.total, *x.shape[1:]), fill)
        out[self.index] = x
        return out

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        """[total, ...] -> [rows, ...]: the batch's rows."""
        return x[self.index]


def _sees_all(mask: torch.Tensor) -> bool | float:
    """A mask entry that lets a query see its key: True in a boolean mask, 0 in an additive one."""
    return True if mask.dtype == torch.bool else 0.0


def covered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scaling: float, cover: RowCover | None) -> torch.Tensor:
    """`grouped_query_attention` of the batch's rows over keys and values read as a covering
    slice (`RowCover`); the plain call without one."""
    if cover is None:
        return grouped_query_attention(query, key, value, mask, scaling)
    return cover.pick(grouped_query_attention(cover.spread(query, 0.0), key, value,
                                              cover.spread(mask, _sees_all(mask)), scaling))


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     packing: Packing, scaling: float, cover: RowCover | None = None) -> torch.Tensor:
    """Attention of a packed pass: query [1, heads, T, d]; key/value [rows, kv_heads, L, d] (each
    row's pool entries); mask [rows, 1, n_max, L] (row b's query i sees keys 0 .. start_b + i).
    Returns [1, T, heads, d].

    The first `packing.grid` tokens of every row run in one call over all rows (with c = 1, as in
    a plain decoding pass), the rest of a longer block per row, over that row's keys alone
    (`grid_length` chooses c). Padding every row to the longest block always instead tripled the
    attention work of a batch-16 pass with one 3-token block (attention cost goes with the query
    rows), a third of the pass on a CPU."""
    if packing.uniform:
        rows, n = len(packing.lengths), packing.lengths[0]
        grid = query[0].view(query.shape[1], rows, n, query.shape[3]).transpose(0, 1)
        return covered_attention(grid, key, value, mask, scaling, cover).reshape(1, rows * n, query.shape[1], -1)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, d]
    rows, c = len(packing.lengths), packing.grid
    if packing.grid_index is None:  # c = 1: each row's first token
        firsts = query[0, :, packing.firsts].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, d]
        out[packing.firsts] = covered_attention(firsts, key, value, mask[:, :, :1], scaling, cover)[:, 0]
    else:
        at_row, at_col = packing.grid_index
        inside = packing.firsts[at_row] + at_col  # the grid's tokens in the packed sequence
        padded = query.new_zeros(rows, c, query.shape[1], query.shape[3])
        padded[at_row, at_col] = query[0, :, inside].transpose(0, 1)
        grid = covered_attention(padded.transpose(1, 2), key, value, mask[:, :, :c], scaling, cover)
        out[inside] = grid[at_row, at_col]
    places = cover.positions if cover is not None else range(rows)
    for b, (offset, n, p) in enumerate(zip(packing.offsets, packing.lengths, places)):
        if n > c:
            rest = query[:, :, offset + c: offset + n]
            out[offset + c: offset + n] = grouped_query_attention(
                rest, key[p:p + 1], value[p:p + 1], mask[b:b + 1, :, c:n], scaling)[0]
    return out.unsqueeze(0)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of a prompt over itself from position 0 (query and keys the same positions):
    [rows, heads, n, d] over [rows, kv_heads, n, d] -> [rows, n, heads, d].

    Causal without a mask, grouped-query heads read in place. With the explicit mask every pass
    brings, transformers repeats K and V per query head and the kernel reads the mask: a prefill
    of the bundled target took about 5 % longer (200 and 600 tokens,
    scripts/bench_packed_passes.py)."""
    groups = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           enable_gqa=groups > 1)
    return out.transpose(1, 2)


def packed_attention_function(inner: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[torch.Tensor, Any]]:
    """An attention function that runs `packed_attention` when the call carries a `packing`
    keyword, `causal_attention` when it says `causal_prefill`, and is `inner` (the model's own)
    otherwise; with a `cover` (`RowCover`), over keys and values read as a covering slice."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, packing: Packing | None = None, causal_prefill: bool = False,
                  cover: RowCover | None = None, **kwargs: Any):
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        if causal_prefill:
            assert key.shape[2] == query.shape[2], "a causal prefill starts at position 0"
            return causal_attention(query, key, value, scaling), None
        if packing is None:
            if cover is None:
                return inner(module, query, key, value, attention_mask, **kwargs)
            mask = None if attention_mask is None else cover.spread(attention_mask, _sees_all(attention_mask))
            out, _ = inner(module, cover.spread(query, 0.0), key, value, mask, **kwargs)
            return cover.pick(out), None
        assert attention_mask is not None, "a packed pass brings its per-row mask"
        return packed_attention(query, key, value, attention_mask, packing, scaling, cover), None

    return attention


def install(model: Any) -> bool:
    """Wrap the model's attention implementation so that its forward accepts `packing=` and
    `causal_prefill=`; False (and nothing changed) when the model's attention is not one this can
    wrap."""
    config = model.config
    current = config._attn_implementation or "eager"
    if current.startswith(PREFIX):
        return True
    if current not in ALL_ATTENTION_FUNCTIONS and current != "eager":
        return False
    name = PREFIX + current
    if name not in ALL_ATTENTION_FUNCTIONS:
        # eager is the same math as sdpa, which every model class that has an interface runs
        inner = ALL_ATTENTION_FUNCTIONS["sdpa" if current == "eager" else current]
        AttentionInterface.register(name, packed_attention_function(inner))
        mask_kind = current if current in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_kind])
    config._attn_implementation = name
    return True
