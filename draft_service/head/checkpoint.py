"""A trained head on disk: `head.safetensors` (the fc, the layer, the draft vocabulary) and
`head.json` (shapes, the target it was trained for, how it was trained).

The target's embedding and LM head are not stored: `load_head` takes them from the target model,
after checking that it is the model the head was trained on (same vocabulary hash and width).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from safetensors.torch import load_file, save_file

from draft_service.head.model import DraftHead, HeadConfig

WEIGHTS = "head.safetensors"
META = "head.json"
FORMAT = "specd-draft-head/1"


@dataclass
class LoadedHead:
    head: DraftHead
    embed: torch.Tensor  # [vocab, hidden] the target's input embedding
    lm_head: nn.Linear  # hidden -> draft_vocab: the target's LM head rows of the draft vocabulary
    draft_vocab: torch.Tensor  # [draft_vocab] long: target token id of each LM-head row
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return self.head.config.vocab_size

    def modules(self) -> nn.Module:
        """The head's layers and its LM head, as one module (e.g. for `use_linear_kernel`)."""
        return nn.ModuleList([self.head, self.lm_head])


SHIPPED = {"smollm2": Path(__file__).parent / "smollm2"}  # heads that ship with specd, by target spec


def default_head_dir(target_spec: str | None) -> Path:
    """The head shipped for a target (None: the bundled default); FileNotFoundError otherwise."""
    from specd.models import DEFAULT_MODEL

    spec = target_spec or DEFAULT_MODEL
    path = SHIPPED.get(spec)
    if path is None or not (path / META).is_file():
        raise FileNotFoundError(f"no draft head ships for target {spec!r}: train one with "
                                f"`specd train-draft --target {spec} --out DIR` and pass --head DIR")
    return path


def is_head_dir(path: str | Path) -> bool:
    return (Path(path) / META).is_file()


def save_head(out: Path, head: DraftHead, draft_vocab: torch.Tensor, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in head.state_dict().items()}
    tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    save_file(tensors, str(out / WEIGHTS))
    (out / META).write_text(json.dumps({"format": FORMAT, "config": head.config.to_dict(), **meta}, indent=2) + "\n")


def read_meta(path: str | Path) -> dict[str, Any]:
    meta = json.loads((Path(path) / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a specd draft head ({META} has format {meta.get('format')!r}, expected {FORMAT})")
    return meta


def load_head(path: str | Path, target_model: Any, target_vocab_hash: str = "") -> LoadedHead:
    """The head in `path`, bound to the target's embedding and LM head (a transformers causal LM)."""
    meta = read_meta(path)
    config = HeadConfig(**meta["config"])
    if target_vocab_hash and meta.get("target_vocab_hash") and meta["target_vocab_hash"] != target_vocab_hash:
        raise ValueError(f"the draft head in {path} was trained for {meta.get('target_model')!r} "
                         f"(vocabulary hash {meta['target_vocab_hash']}), not this target (hash {target_vocab_hash}); "
                         "train one for it with `specd train-draft --target ...`")
    tensors = load_file(str(Path(path) / WEIGHTS))
    draft_vocab = tensors.pop("draft_vocab")
    head = DraftHead(config)
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    return bind_head(head, target_model, draft_vocab, meta, where=str(path))


def load_head_for(target: Any, path: str | Path | None = None, target_spec: str | None = None) -> LoadedHead:
    """The head in `path` (None: the one shipped for `target_spec`) bound to `target`, a
    specd.models.LoadedModel, after checking that the head was trained for its vocabulary."""
    from specd.vocab import vocab_hash

    return load_head(path or default_head_dir(target_spec), target.model, vocab_hash(target.tokenizer, target.vocab_size))


def bind_head(head: DraftHead, target_model: Any, draft_vocab: torch.Tensor, meta: dict[str, Any] | None = None,
              where: str = "the head") -> LoadedHead:
    """A head ready to draft: with the target's embedding and its LM-head rows of draft_vocab."""
    config = head.config
    embed = target_model.get_input_embeddings().weight.detach()
    lm_weight = target_model.get_output_embeddings().weight.detach()
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{where} expects a target of vocabulary {config.vocab_size} and width {config.hidden_size}; "
                         f"this target's embedding is {tuple(embed.shape)}")
    head.eval()
    lm_head = nn.Linear(config.hidden_size, int(draft_vocab.numel()), bias=False)
    lm_head.weight = nn.Parameter(lm_weight[draft_vocab].float().contiguous(), requires_grad=False)
    return LoadedHead(head=head, embed=embed.float(), lm_head=lm_head, draft_vocab=draft_vocab.long(), meta=meta or {})
