"""A fingerprint of a vocabulary, so that a draft and a target can check they tokenize alike."""

from __future__ import annotations

import hashlib
import json
from typing import Any


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
