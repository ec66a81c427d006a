"""Multi-head attention written from the formulas, one head at a time, for layout checks.

Computes a layer's output from an :class:`AttentionSite`'s *effective* weights only, so it
agrees with the model's own forward iff the site describes the model correctly (head blocks,
fused-row order, GQA mapping, RoPE planes, biases, O column blocks).
"""

from __future__ import annotations

import math

import torch

from gaugeopt.structure.site import AttentionSite


def rotate(x: torch.Tensor, planes, base: float, rotary_dim: int, angle_dtype=torch.float64) -> torch.Tensor:
    """Rotate ``x: (T, d_k)`` plane by plane: plane m at position t turns by t·base^(-2m/r).

    ``angle_dtype`` is the precision of the angles (Hugging Face computes them in float32)."""
    out = x.clone()
    T = x.shape[0]
    t = torch.arange(T, dtype=angle_dtype)
    for m, (p, q) in enumerate(planes):
        freq = torch.tensor(1.0 / (base ** (2 * m / rotary_dim)), dtype=angle_dtype)
        theta = t * freq
        c, s = torch.cos(theta).to(x), torch.sin(theta).to(x)
        out[:, p] = x[:, p] * c - x[:, q] * s
        out[:, q] = x[:, p] * s + x[:, q] * c
    return out


def reference_attention(
    site: AttentionSite, x: torch.Tensor, kv: torch.Tensor | None = None, *, base: float = 10000.0, angle_dtype=torch.float64
) -> torch.Tensor:
    """Causal attention output ``(B, T, d_out)`` for input ``x: (B, T, d_model)``."""
    kv = x if kv is None else kv
    wq, bq = site.effective("q")
    wk, bk = site.effective("k")
    wv, bv = site.effective("v")
    wo, bo = site.effective("o")  # (d_out, h, d_v)
    B, T, _ = x.shape
    planes = site.rope.planes(site.d_k)
    out = torch.zeros(B, T, wo.shape[0], dtype=x.dtype)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for b in range(B):
        for i in range(site.h):
            j = i // (site.h // site.h_kv)
            q = x[b] @ wq[i].T + (0 if bq is None else bq[i])  # (T, d_k)
            k = kv[b] @ wk[j].T + (0 if bk is None else bk[j])
            v = kv[b] @ wv[j].T + (0 if bv is None else bv[j])  # (T, d_v)
            if planes:
                q = rotate(q, planes, base, site.rope.rotary_dim, angle_dtype)
                k = rotate(k, planes, base, site.rope.rotary_dim, angle_dtype)
            s = (q @ k.T) / math.sqrt(site.d_k)
            s = s.masked_fill(~mask, float("-inf"))
            out[b] += torch.softmax(s, dim=-1) @ v @ wo[:, i, :].T
    if bo is not None:
        out += bo
    return out
