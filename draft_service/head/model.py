"""An EAGLE-style draft head: the target's own features, one decoder layer, the target's LM head.

At sequence position i the head reads the target's last hidden state f_i (after the final norm,
so `lm_head(f_i)` are the target's logits for position i + 1) together with the embedding of the
token that followed, x_{i+1}, and predicts f_{i+1}; the target's LM head, restricted to the
draft vocabulary (the tokens the target emits most), turns the prediction into the next draft
token. Drafting further feeds the head its own predicted feature with the token it just drafted.

    pair_i = fc([embed(x_{i+1}), f_i])  ->  decoder layer (attends to pairs 0..i)  ->  norm  ->  f^_{i+1}

The embedding and LM head are the target's and are not trained or stored: a checkpoint holds the
fc, the layer and the draft vocabulary (a few MB), and loads against the target it was trained on.
The layer is written out here (RMSNorm, grouped-query attention with rotary positions, SwiGLU)
rather than borrowed from transformers, so its KV cache is a plain pair of tensors that a draft
session crops and extends itself, independent of transformers' cache API.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int  # the target's full vocabulary

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def of_target(cls, config: Any) -> "HeadConfig":
        """The head mirrors one decoder layer of the target (a transformers config)."""
        rope = getattr(config, "rope_theta", None)
        if rope is None:
            rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   intermediate_size=config.intermediate_size, rope_theta=float(rope),
                   rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)), vocab_size=config.vocab_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head_dim] for rotary position embeddings (the Llama layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, head_dim] rotated by the positions' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class KVCache:
    """The head's cache: keys and values [1, kv_heads, length, head_dim], grown by concatenation."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def crop(self, length: int) -> None:
        if self.k is not None and length < self.length:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]  # type: ignore[index]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)  # type: ignore[list-item]
        return self.k, self.v  # type: ignore[return-value]


class DraftHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        c = config
        self.config = c
        d, hd = c.hidden_size, c.head_dim
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.input_norm = RMSNorm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(d, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, d, bias=False)
        self.post_norm = RMSNorm(d, c.rms_norm_eps)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        # The target's features are taken after its final norm; the head's predictions go through
        # a norm too (initialized from the target's), so they live on the same scale.
        self.final_norm = RMSNorm(d, c.rms_norm_eps)

    def init_from_target_layer(self, layer: nn.Module, final_norm: nn.Module | None = None) -> None:
        """Start from one of the target's decoder layers (a transformers Llama-style layer), its
        final norm, and an fc that passes the feature through: training starts from a working layer."""
        names = {"q_proj": layer.self_attn.q_proj, "k_proj": layer.self_attn.k_proj, "v_proj": layer.self_attn.v_proj,
                 "o_proj": layer.self_attn.o_proj, "gate_proj": layer.mlp.gate_proj, "up_proj": layer.mlp.up_proj,
                 "down_proj": layer.mlp.down_proj}
        with torch.no_grad():
            for name, src in names.items():
                getattr(self, name).weight.copy_(src.weight)
            self.input_norm.weight.copy_(layer.input_layernorm.weight)
            self.post_norm.weight.copy_(layer.post_attention_layernorm.weight)
            if final_norm is not None:
                self.final_norm.weight.copy_(final_norm.weight)
            d = self.config.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, d:].copy_(torch.eye(d))
            nn.init.normal_(self.fc.weight[:, :d], std=0.02)
            self.fc.bias.zero_()

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """Predicted features [batch, seq, hidden] for pairs (features[:, i], embeds[:, i]).

        Training: batch of windows, no cache, causal attention within each window.
        Drafting: batch 1 with a cache holding the earlier pairs; new pairs attend to all of it.
        positions: [seq] absolute positions of the pairs (for the rotary embedding).
        """
        c = self.config
        b, s, _ = features.shape
        x = self.fc(torch.cat([embeds, features], dim=-1))
        h = self.input_norm(x)
        q = self.q_proj(h).view(b, s, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(positions, c.head_dim, c.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.extend(k, v)
        groups = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        if past == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
        else:  # query i (position past + i) sees keys 0 .. past + i
            mask = torch.arange(past + s, device=q.device)[None, :] <= (past + torch.arange(s, device=q.device))[:, None]
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, c.num_heads * c.head_dim))
        h = self.post_norm(x)
        return self.final_norm(x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)))


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


