"""The target's features (last hidden states) travelling to a draft head, and their bookkeeping.

A request's features arrive in pieces: the prompt's with the prefill, then the positions each
verify step kept. `FeatureLog` holds them in order and says which piece a draft has not had yet;
a piece starting at 0 (a prefill, also the one after a failover re-opened the session) replaces
everything. The wire form is float16 rows (`common_pb2.TargetFeatures`).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from specd.errors import InvalidArgument
from specdec.v1 import common_pb2


def features_to_proto(start: int, rows: torch.Tensor) -> common_pb2.TargetFeatures:
    data = rows.detach().to(torch.float16).cpu().contiguous().numpy().astype("<f2", copy=False).tobytes()
    return common_pb2.TargetFeatures(start=start, rows=rows.shape[0], dim=rows.shape[1], data=data)


def features_from_proto(msg: common_pb2.TargetFeatures, field: str = "target_features") -> tuple[int, torch.Tensor]:
    """(start, float32 rows [rows, dim]); INVALID_ARGUMENT naming `field` when the bytes do not fit."""
    if len(msg.data) != msg.rows * msg.dim * 2:
        raise InvalidArgument(field, f"{len(msg.data)} bytes do not hold {msg.rows} x {msg.dim} float16 values")
    array = np.frombuffer(msg.data, dtype="<f2").reshape(msg.rows, msg.dim)
    return int(msg.start), torch.from_numpy(array.astype(np.float32))


class FeatureLog:
    """Features of positions 0 .. length - 1 of one sequence, kept in the order they came."""

    def __init__(self) -> None:
        self._pieces: list[torch.Tensor] = []
        self._starts: list[int] = []  # first position of each piece, ascending
        self.length = 0

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Append rows for positions start ..; start 0 restarts the log. Raises ValueError for a
        gap or an overlap (features out of order: the caller lost track of the sequence)."""
        if start == 0:
            self._pieces, self._starts, self.length = [], [], 0
        elif start != self.length:
            raise ValueError(f"features for position {start} arrived after {self.length} positions")
        if rows.shape[0]:
            self._pieces.append(rows)
            self._starts.append(self.length)
            self.length += rows.shape[0]

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows for positions start .. stop - 1 (stop None: to the end), as one tensor.

        Only the pieces the range touches are joined: a drafting step asks for the newest rows,
        and copying the whole history each step would grow with the sequence."""
        if not self._pieces:
            return torch.zeros(0, 0)
        stop = self.length if stop is None else min(stop, self.length)
        first = max(bisect.bisect_right(self._starts, start) - 1, 0)
        parts = []
        for piece_start, piece in zip(self._starts[first:], self._pieces[first:]):
            if piece_start >= stop:
                break
            parts.append(piece[max(start - piece_start, 0): stop - piece_start])
        if not parts:
            return self._pieces[0][:0]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
