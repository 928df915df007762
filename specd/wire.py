"""Conversions between protobuf messages and specd's domain objects, in one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specd.errors import InvalidArgument
from specd.sampling import SamplingParams
from specdec.v1 import common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from specd.models import LoadedModel

METHOD_TO_PROTO = {
    "none": common_pb2.DRAFT_METHOD_NONE,
    "ngram": common_pb2.DRAFT_METHOD_NGRAM,
    "suffix": common_pb2.DRAFT_METHOD_SUFFIX,
    "draft_model": common_pb2.DRAFT_METHOD_DRAFT_MODEL,
    "head": common_pb2.DRAFT_METHOD_HEAD,
}
PROTO_TO_METHOD = {v: k for k, v in METHOD_TO_PROTO.items()}
FINISH_TO_PROTO = {
    "stop": coordinator_pb2.FINISH_REASON_STOP,
    "length": coordinator_pb2.FINISH_REASON_LENGTH,
}
# A q row with at most this share of nonzero entries travels sparse.
_SPARSE_MAX_FRACTION = 0.25


def method_from_proto(value: int) -> str | None:
    """None for DRAFT_METHOD_UNSPECIFIED (use the server's default)."""
    if value == common_pb2.DRAFT_METHOD_UNSPECIFIED:
        return None
    if value not in PROTO_TO_METHOD:
        raise InvalidArgument("method", f"unknown draft method {value}")
    return PROTO_TO_METHOD[value]


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int = 256) -> SamplingParams:
    """Proto3 cannot tell 0 from unset: max_tokens 0 takes the default and top_p 0 means 1."""
    return SamplingParams(
        max_tokens=msg.max_tokens or default_max_tokens,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    ).validate()


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def probs_to_proto(probs: torch.Tensor | None) -> common_pb2.DraftProbs | None:
    """Encode q rows [n, vocab]: sparse when truncated by top-k/top-p, else dense float32 bytes."""
    if probs is None:
        return None
    rows = probs.detach().to(torch.float32).cpu()
    vocab = rows.shape[1]
    nonzero = int((rows > 0).sum())
    msg = common_pb2.DraftProbs(vocab_size=vocab)
    if nonzero <= _SPARSE_MAX_FRACTION * rows.numel():
        for row in rows:
            ids = torch.nonzero(row > 0).flatten()
            msg.sparse.add(token_ids=ids.tolist(), probs=row[ids].tolist())
    else:
        msg.dense = rows.numpy().astype("<f4").tobytes()
    return msg


def probs_from_proto(msg: common_pb2.DraftProbs, rows: int, vocab_size: int) -> torch.Tensor | None:
    """Decode q rows; None when the message carries none (a deterministic draft)."""
    if not msg.dense and not msg.sparse:
        return None
    if msg.vocab_size != vocab_size:
        raise InvalidArgument("draft_probs.vocab_size", f"expected {vocab_size}, got {msg.vocab_size}")
    if msg.dense:
        if len(msg.dense) != rows * vocab_size * 4:
            raise InvalidArgument("draft_probs.dense", f"expected {rows} rows of {vocab_size} float32 values")
        return _checked_probs(torch.from_numpy(np.frombuffer(msg.dense, dtype="<f4").reshape(rows, vocab_size).copy()),
                              "draft_probs.dense")
    if len(msg.sparse) != rows:
        raise InvalidArgument("draft_probs.sparse", f"expected {rows} rows, got {len(msg.sparse)}")
    out = torch.zeros(rows, vocab_size)
    for i, row in enumerate(msg.sparse):
        if len(row.token_ids) != len(row.probs) or any(t >= vocab_size for t in row.token_ids):
            raise InvalidArgument("draft_probs.sparse", f"row {i} is malformed")
        out[i, list(row.token_ids)] = torch.tensor(list(row.probs), dtype=torch.float32)
    return _checked_probs(out, "draft_probs.sparse")


def _checked_probs(q: torch.Tensor, field: str) -> torch.Tensor:
    """Rows of a distribution: finite, non-negative, each with some mass (the rejection sampler
    divides by them)."""
    if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
        raise InvalidArgument(field, "probabilities must be finite and >= 0")
    if q.numel() and not bool((q.sum(dim=-1) > 0).all()):
        raise InvalidArgument(field, "every row needs a positive probability")
    return q


def model_info_of(model: "LoadedModel") -> common_pb2.ModelInfo:
    """The ModelInfo a service reports for a loaded model (vocabulary hash included)."""
    from specd.vocab import vocab_hash

    return common_pb2.ModelInfo(name=model.name, vocab_size=model.vocab_size, max_context=model.max_context,
                                eos_token_ids=sorted(model.eos_token_ids),
                                vocab_hash=vocab_hash(model.tokenizer, model.vocab_size))
