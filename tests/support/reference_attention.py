"""Multi-head attention written from the formulas, one head at a time, for layout checks.

Computes a layer's output from an :class:`AttentionSite`'s *effective* weights (and its QK-norm
record) only, so it agrees with the model's own forward iff the site describes the model
correctly (head blocks, fused-row order, GQA mapping, RoPE planes, biases, O column blocks, the
norm's kind, scope, gains, offset and epsilon).
"""

from __future__ import annotations

import math

import torch

from gaugeopt.records.site import AttentionSite


def rotate(x: torch.Tensor, planes, base: float, rotary_dim: int, angle_dtype=torch.float64, inv_freq=None) -> torch.Tensor:
    """Rotate ``x: (T, d_k)`` plane by plane: plane m at position t turns by t·base^(-2m/r).

    ``angle_dtype`` is the precision of the angles (Hugging Face computes them in float32);
    ``inv_freq`` gives the frequencies instead (a model's own buffer, rounded as it rounds them)."""
    out = x.clone()
    T = x.shape[0]
    t = torch.arange(T, dtype=angle_dtype)
    for m, (p, q) in enumerate(planes):
        if inv_freq is not None:
            freq = inv_freq[m].to(angle_dtype)
        else:
            freq = torch.tensor(1.0 / (base ** (2 * m / rotary_dim)), dtype=angle_dtype)
        theta = t * freq
        c, s = torch.cos(theta).to(x), torch.sin(theta).to(x)
        out[:, p] = x[:, p] * c - x[:, q] * s
        out[:, q] = x[:, p] * s + x[:, q] * c
    return out


def qk_norm(site: AttentionSite, x: torch.Tensor, side: str) -> torch.Tensor:
    """The site's recorded QK-norm applied to ``x: (heads, T, d_k)`` of one side, from its formula:
    RMS ``u / sqrt(mean u² + ε) · (g + offset)`` or LayerNorm ``(u − ū) / sqrt(var u + ε) · g + β``,
    the statistics over each head's ``d_k`` channels (``scope="head"``) or over all heads at once
    (``"full"``), the gains shared by every head or per head."""
    n = site.qk_norm
    heads, T, d = x.shape
    u = x.permute(1, 0, 2).reshape(T, 1, heads * d) if n.scope == "full" else x
    if n.kind == "layer":
        u = u - u.mean(-1, keepdim=True)
    u = u / torch.sqrt(u.square().mean(-1, keepdim=True) + n.eps)
    if n.scope == "full":
        u = u.reshape(T, heads, d).permute(1, 0, 2)
    gain, bias = (n.q_gain, n.q_bias) if side == "q" else (n.k_gain, n.k_bias)
    out = u * (gain.get().detach() + n.gain_offset)[:, None, :]
    return out if bias is None else out + bias.get().detach()[:, None, :]


def reference_attention(
    site: AttentionSite, x: torch.Tensor, kv: torch.Tensor | None = None, *, base: float = 10000.0,
    angle_dtype=torch.float64, scale: float | None = None, causal: bool = True, window: int | None = None,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``(B, T, d_out)`` for input ``x: (B, T, d_model)``: causal (optionally within
    a sliding ``window``) or not, scores scaled by ``scale`` (default ``1/sqrt(d_k)``), with the
    site's QK-norm (:func:`qk_norm`) before or after RoPE as recorded."""
    kv = x if kv is None else kv
    wq, bq = site.effective("q")
    wk, bk = site.effective("k")
    wv, bv = site.effective("v")
    wo, bo = site.effective("o")  # (d_out, h, d_v)
    B, T, _ = x.shape
    planes = site.rope.planes(site.d_k)
    scale = 1 / math.sqrt(site.d_k) if scale is None else scale
    out = torch.zeros(B, T, wo.shape[0], dtype=x.dtype)
    mask = torch.ones(T, T, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    if window is not None:
        mask = mask & ~torch.ones(T, T, dtype=torch.bool).tril(-window)
    for b in range(B):
        q = torch.stack([x[b] @ wq[i].T + (0 if bq is None else bq[i]) for i in range(site.h)])  # (h, T, d_k)
        k = torch.stack([kv[b] @ wk[j].T + (0 if bk is None else bk[j]) for j in range(site.h_kv)])
        norm_first = site.qk_norm is not None and site.qk_norm.before_rope
        if norm_first:
            q, k = qk_norm(site, q, "q"), qk_norm(site, k, "k")
        if planes:
            rot = lambda t: torch.stack([rotate(x, planes, base, site.rope.rotary_dim, angle_dtype, inv_freq) for x in t])  # noqa: E731
            q, k = rot(q), rot(k)
        if site.qk_norm is not None and not norm_first:
            q, k = qk_norm(site, q, "q"), qk_norm(site, k, "k")
        for i in range(site.h):
            j = i // (site.h // site.h_kv)
            qi, kj = q[i], k[j]
            v = kv[b] @ wv[j].T + (0 if bv is None else bv[j])  # (T, d_v)
            s = (qi @ kj.T) * scale
            s = s.masked_fill(~mask, float("-inf"))
            out[b] += torch.softmax(s, dim=-1) @ v @ wo[:, i, :].T
    if bo is not None:
        out += bo
    return out
