"""A model gaugeopt has no built-in adapter for, written the way users write attention: fused
``[Q|K|V]`` with GQA and partial split-half RoPE (the first ``rotary`` channels of each head), and
a tiny LM around it. The certificate and callback tests describe it with an AttentionSpec."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import gaugeopt


def rotate_half_partial(x: torch.Tensor, rotary: int, base: float = 10000.0) -> torch.Tensor:
    """Split-half RoPE on the first ``rotary`` channels of ``x: (B, H, T, d)``."""
    T = x.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x), torch.cat([ang.sin()] * 2, -1).to(x)
    r, rest = x[..., :rotary], x[..., rotary:]
    r1, r2 = r[..., : rotary // 2], r[..., rotary // 2:]
    return torch.cat([r * cos + torch.cat([-r2, r1], -1) * sin, rest], -1)


class MyAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, rotary: int = 4) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rotary = heads, kv_heads, dim // heads, rotary
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.out = nn.Linear(heads * self.head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        d, h, hk = self.head_dim, self.heads, self.kv_heads
        q, k, v = self.qkv(x).split((h * d, hk * d, hk * d), dim=-1)
        q, k, v = (t.view(B, T, -1, d).transpose(1, 2) for t in (q, k, v))
        q, k = rotate_half_partial(q, self.rotary), rotate_half_partial(k, self.rotary)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(B, T, h * d))


class MyLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 32, layers: int = 2, **attn) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(dim), "attn": MyAttention(dim, **attn)})
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = x + b["attn"](b["ln"](x))
        return self.head(x)


SPEC = gaugeopt.AttentionSpec(
    qkv="qkv", o="out", num_heads="heads", num_kv_heads="kv_heads",
    rope=lambda m: gaugeopt.RopeSpec("split_half", m.rotary),
)
