"""One forward pass over the new tokens of several sessions, each on its own KV-pool row.

Rows differ in length (the tokens already cached) and in how many new tokens they bring (a
k-token block plus the pending token; 1 for plain decoding, the whole prompt for a prefill).
New tokens are right-padded to the longest row; each row gets its own positions and a mask that
lets query i of row b see exactly positions 0 .. starts[b] + i, so every row computes what it
would compute alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.cpu_kernels import runs_onednn
from specd.models import LoadedModel
from target_service.kv_pool import BatchCacheView, KVPool, KVShape
from target_service.packed_attention import Packing, RowCover, install


# torch's CPU matrix kernels (MKL) run a linear layer on 2 to 4 token rows slower than on 5 to 8
# (torch 2.13, 2 cores, SmolLM2-135M: a verify pass of 3 tokens 109 ms, of 4 83 ms, of 5 72 ms,
# of 1 58 ms; docs/benchmarks.md, "Small CPU blocks"). On them a pass with 2 to 4 rows in all is
# padded to 5. oneDNN's kernels (specd/cpu_kernels.py, the default) have no such dip, and there
# padding only costs: 2 sessions x 1 token 56-66 ms unpadded against 69-86 padded to 6 rows.
MIN_FAST_ROWS = 5


def fast_block_length(batch: int, n_new: int, room: int, min_rows: int = MIN_FAST_ROWS) -> int:
    """The block length to run: n_new, or more when batch * n_new is 2 .. min_rows - 1 and the
    extra positions fit in `room` (context positions left after the longest row's cache).

    Padding positions come after every real token, so causal attention keeps them out of the real
    rows' results; their KV writes land past each row's length, where stale rows already live."""
    rows = batch * n_new
    if rows <= 1 or rows >= min_rows:
        return n_new
    padded = -(-min_rows // batch)
    return padded if padded <= room else n_new


@dataclass
class RowInput:
    slot: int  # the session's KV-pool row
    start: int  # tokens already in the row's cache
    tokens: list[int]  # new tokens to run


def attention_mask(starts: torch.Tensor, n_new: int, kv_length: int) -> torch.Tensor:
    """Boolean [batch, 1, n_new, kv_length]: True where query i of row b may attend key j.

    starts: [batch] long, cached positions per row. Query i sits at position starts[b] + i and
    sees keys 0 .. starts[b] + i (its own cache, then the new tokens up to itself).
    """
    query_pos = starts[:, None] + torch.arange(n_new, device=starts.device)[None, :]  # [batch, n_new]
    keys = torch.arange(kv_length, device=starts.device)
    return (keys[None, None, :] <= query_pos[:, :, None])[:, None]


def slot_order(rows: list[RowInput]) -> list[int] | None:
    """The order that sorts `rows` by KV-pool slot, or None when they are sorted already.

    The scheduler batches sessions in arrival order, which at 16 sessions is a shuffle of slots
    0..15; the cache view reads a contiguous run of slots as a slice but any other order by
    gathering every layer's K and V (a copy of the whole batch's cache per layer). In slot order
    a batch of the lowest slots is a slice: about a fifth off a batch-16 pass at 600 cached tokens
    (docs/benchmarks.md, "Batch rows in slot order")."""
    order = sorted(range(len(rows)), key=lambda b: rows[b].slot)
    return None if order == list(range(len(rows))) else order


def inverse_permutation(order: list[int]) -> list[int]:
    """back[b] = the position of b in `order`."""
    back = [0] * len(order)
    for position, b in enumerate(order):
        back[b] = position
    return back


def should_pack(lengths: list[int], cpu: bool, min_rows: int = MIN_FAST_ROWS) -> bool:
    """Whether a verify pass over rows of these block lengths runs packed: when several rows
    bring blocks (with equal blocks nothing is padded, but packed attention still reads the
    grouped K/V in place) and, on a CPU, when the real tokens make a fast kernel shape."""
    return len(lengths) > 1 and max(lengths) > 1 and (not cpu or sum(lengths) >= min_rows)


class BatchedForward:
    """Forward passes over KV-pool rows: padded to the longest row, or packed
    (target_service/packed_attention.py) when several rows bring blocks (`should_pack`) and
    `packed` is on."""

    def __init__(self, model: LoadedModel, packed: bool = True):
        self.model = model
        self.pool = KVPool(KVShape.of(model.model.config), model.dtype, model.device)
        self.wrapped = install(model.model)  # the attention takes packing= and causal_prefill=
        self.packed = packed and self.wrapped
        self.last_positions = 0  # positions the last pass computed, all rows together

    def run(self, rows: list[RowInput], keep_last: int = 0) -> list[torch.Tensor]:
        """Logits [len(row.tokens), vocab] (or only the last keep_last) per row, in float32."""
        return self.run_with_features(rows, keep_last, features=False)[0]

    def run_with_features(self, rows: list[RowInput], keep_last: int = 0,
                          features: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """`run`, plus each row's final hidden states [len(row.tokens), hidden] (after the final
        norm: what the LM head reads) when `features` is set, for draft heads. With features the
        decoder and the LM head run as two calls, the same operations the causal LM runs."""
        order = slot_order(rows)
        if order is not None:  # run the rows in slot order, hand the results back in the caller's
            logits, feats = self.run_with_features([rows[b] for b in order], keep_last, features)
            back = inverse_permutation(order)
            return [logits[i] for i in back], None if feats is None else [feats[i] for i in back]
        device = self.model.device
        lengths = [len(r.tokens) for r in rows]
        min_rows = 1 if runs_onednn(self.model.model) else MIN_FAST_ROWS
        if self.packed and not keep_last and should_pack(lengths, device.type == "cpu", min_rows):
            self.last_positions = sum(lengths)
            return self._run_packed(rows, lengths, features)
        n_new = max(lengths)
        if device.type == "cpu" and not keep_last:  # a prefill keeps the last position: never padded
            n_new = fast_block_length(len(rows), n_new, self.model.max_context - max(r.start for r in rows), min_rows)
        self.last_positions = len(rows) * n_new
        kv_length = max(r.start for r in rows) + n_new
        self.pool.ensure_capacity(kv_length)
        input_ids = torch.zeros(len(rows), n_new, dtype=torch.long)
        for b, r in enumerate(rows):
            input_ids[b, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)
        positions = (starts[:, None] + torch.arange(n_new)[None, :]).clamp(max=self.model.max_context - 1)
        mask = attention_mask(starts, n_new, kv_length)
        view = BatchCacheView(self.pool, [r.slot for r in rows], [r.start for r in rows], kv_length, cover=self.wrapped)
        inputs = dict(input_ids=input_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                      cache=view, use_cache=True, **self._cover(view))
        if self.wrapped and len(rows) == 1 and rows[0].start == 0 and n_new == len(rows[0].tokens) > 1:
            inputs["causal_prefill"] = True  # a prompt from position 0: the mask is plain causal
        logits, hidden = self._call(inputs, features, keep_last if len(rows) == 1 else 0)
        feats = None if hidden is None else [hidden[b, : len(r.tokens)].float() for b, r in enumerate(rows)]
        if len(rows) == 1:
            return [logits[0, : len(rows[0].tokens)]], feats
        return ([logits[b, : len(r.tokens)][-keep_last:] if keep_last else logits[b, : len(r.tokens)]
                 for b, r in enumerate(rows)], feats)

    def _cover(self, view: BatchCacheView) -> dict:
        """The attention's `cover` keyword where the view reads a covering slice of the pool."""
        return {} if view.cover_rows is None else {"cover": RowCover.of(view.cover_rows, self.model.device)}

    def _call(self, inputs: dict, features: bool, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model on `inputs`: float32 logits (of the last `keep` positions, all with 0) and,
        with `features`, the final hidden states of every position."""
        with torch.inference_mode():
            if not features:
                return self.model.model(**inputs, logits_to_keep=keep).logits.float(), None
            model = self.model.model
            hidden = model.get_decoder()(**inputs).last_hidden_state
            return model.get_output_embeddings()(hidden[:, -keep:] if keep else hidden).float(), hidden

    def _run_packed(self, rows: list[RowInput], lengths: list[int],
                    features: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """`run_with_features` for rows in slot order, their new tokens as one sequence."""
        device = self.model.device
        packing = Packing.of(lengths, device)
        kv_length = max(r.start + n for r, n in zip(rows, lengths))
        self.pool.ensure_capacity(kv_length)
        input_ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long)[None]
        positions = torch.tensor([r.start + i for r in rows for i in range(len(r.tokens))], dtype=torch.long)[None]
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)
        mask = attention_mask(starts, max(lengths), kv_length)
        view = BatchCacheView(self.pool, [r.slot for r in rows], [r.start for r in rows], kv_length, lengths,
                              cover=True)
        inputs = dict(input_ids=input_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                      cache=view, use_cache=True, packing=packing, **self._cover(view))
        logits, hidden = self._call(inputs, features)
        feats = None if hidden is None else [h.float() for h in torch.split(hidden[0], lengths)]
        return list(torch.split(logits[0], lengths)), feats
