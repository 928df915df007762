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

from specd.models import LoadedModel
from target_service.kv_pool import BatchCacheView, KVPool, KVShape


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


class BatchedForward:
    def __init__(self, model: LoadedModel):
        self.model = model
        self.pool = KVPool(KVShape.of(model.model.config), model.dtype, model.device)

    def run(self, rows: list[RowInput], keep_last: int = 0) -> list[torch.Tensor]:
        """Logits [len(row.tokens), vocab] (or only the last keep_last) per row, in float32."""
        device = self.model.device
        n_new = max(len(r.tokens) for r in rows)
        kv_length = max(r.start for r in rows) + n_new
        self.pool.ensure_capacity(kv_length)
        input_ids = torch.zeros(len(rows), n_new, dtype=torch.long)
        for b, r in enumerate(rows):
            input_ids[b, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.long)
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)
        positions = (starts[:, None] + torch.arange(n_new)[None, :]).clamp(max=self.model.max_context - 1)
        mask = attention_mask(starts, n_new, kv_length)
        view = BatchCacheView(self.pool, [r.slot for r in rows], [r.start for r in rows], kv_length)
        with torch.inference_mode():
            out = self.model.model(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                cache=view,
                use_cache=True,
                logits_to_keep=keep_last if len(rows) == 1 else 0,
            )
            logits = out.logits.float()
        if len(rows) == 1:
            return [logits[0]]
        return [logits[b, : len(r.tokens)][-keep_last:] if keep_last else logits[b, : len(r.tokens)] for b, r in enumerate(rows)]
