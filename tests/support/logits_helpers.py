"""Independent measurements of attention logits, for the ``max_attention_logits`` and QK-Clip tests.

The maxima are taken where the model itself forms its scores: SDPA's arguments (``q``, ``k``, the mask,
``is_causal``, ``scale``, as the module passes them to ``torch.nn.functional.scaled_dot_product_attention``),
or the arguments of a Hugging Face family's ``eager_attention_forward``. Nothing of gaugeopt's
reconstruction (records, readers, RoPE tables) is used, so a layout, RoPE, scale or mask bug in the
library cannot hide in both.
"""

from __future__ import annotations

import contextlib
import importlib
import math

import torch
import torch.nn.functional as F


def _masked_max(s: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``(h,)``: max over batch, queries and allowed keys of ``s: (B, h, T_q, T_k)``."""
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return s.amax(dim=(0, 2, 3))


def _allowed(mask: torch.Tensor | None, t_q: int, t_k: int, causal: bool) -> torch.Tensor | None:
    out = torch.ones(t_q, t_k, dtype=torch.bool).tril() if causal else None
    if mask is not None:
        m = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        out = m if out is None else out & m
    return out


@contextlib.contextmanager
def sdpa_maxima():
    """Record, per SDPA call, the maximum scaled ``q·k`` per query head (a list, in call order)."""
    records: list[torch.Tensor] = []
    orig = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        s = (q @ kk.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        records.append(_masked_max(s, _allowed(attn_mask, q.shape[-2], k.shape[-2], is_causal)).detach())
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, **kw)

    F.scaled_dot_product_attention = sdpa
    try:
        yield records
    finally:
        F.scaled_dot_product_attention = orig


@contextlib.contextmanager
def eager_maxima(family: str):
    """Record the maxima of a Hugging Face family's ``eager_attention_forward`` (scores before a soft cap)."""
    records: list[torch.Tensor] = []
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    orig = mod.eager_attention_forward

    def eager(module, query, key, value, attention_mask, scaling=None, **kw):
        kk = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        s = (query @ kk.transpose(-1, -2)) * scaling
        mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]
        records.append(_masked_max(s, _allowed(mask, query.shape[-2], key.shape[-2], False)).detach())
        return orig(module, query, key, value, attention_mask, scaling=scaling, **kw)

    mod.eager_attention_forward = eager
    try:
        yield records
    finally:
        mod.eager_attention_forward = orig
