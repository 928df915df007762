"""A fingerprint of a vocabulary, so that a draft and a target can check they tokenize alike."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# In every mismatch message; lets a caller tell this refusal from other FAILED_PRECONDITIONs.
MISMATCH_MARK = "does not share the tokenizer and vocabulary of"


def vocab_hash(tokenizer: Any | None, vocab_size: int) -> str:
    """sha256 over the token-to-id map and the special tokens; for tokenizer-less models, the size."""
    h = hashlib.sha256()
    if tokenizer is None:
        h.update(f"ids:{vocab_size}".encode())
    else:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        h.update(json.dumps(vocab, ensure_ascii=False).encode())
        h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()[:16]


def vocab_mismatch(target_model: str, target_hash: str, draft_model: str, draft_hash: str) -> str | None:
    """Why a draft model cannot draft for a target, naming both; None when they agree.

    An empty hash means "unknown" (a peer from before hashes were exchanged, or a model-free
    draft replica) and is not a mismatch: refusing would turn a version skew into an outage,
    and the check runs again wherever both sides know their hash.
    """
    if not target_hash or not draft_hash or target_hash == draft_hash:
        return None
    return (f"draft model {draft_model or '?'} (vocabulary {draft_hash}) {MISMATCH_MARK} target model "
            f"{target_model or '?'} (vocabulary {target_hash}); its drafts would be other tokens' ids")


def check_vocab(target_model: str, target_hash: str, draft_model: str, draft_hash: str) -> None:
    """Raises FailedPrecondition (gRPC FAILED_PRECONDITION) when `vocab_mismatch` finds one."""
    from specd.errors import FailedPrecondition

    message = vocab_mismatch(target_model, target_hash, draft_model, draft_hash)
    if message is not None:
        raise FailedPrecondition(message)
