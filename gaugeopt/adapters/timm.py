"""timm's ViT ``Attention`` (``timm.layers.attention.Attention``; never imports timm).

Fused ``qkv = [Q|K|V]`` (``num_heads`` heads of width ``head_dim``, no GQA, no RoPE), output
``proj``; the fused (SDPA) and manual paths compute the same attention. ``scale_norm=True`` (a
norm over all heads' outputs before ``proj``) and ``gated=True`` (an elementwise sigmoid gate on
the outputs) change the V/O gauge and are refused; ``qk_norm=True`` (LayerNorm or RMSNorm over each
head) is supported on the norm's gain gauge (:mod:`gaugeopt.adapters.qk_norm`,
``docs/qk_norm.md``), a norm of another kind refused.

Example:
    >>> from gaugeopt.adapters.timm import TIMM_SPEC
    >>> TIMM_SPEC.qkv, TIMM_SPEC.o, TIMM_SPEC.num_heads
    ('qkv', 'proj', 'num_heads')
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.adapters import qk_norm as qkn
from gaugeopt.adapters.spec import AttentionSpec, QKNormSpec

__all__ = ["TIMM_ATTENTION", "TIMM_SPEC"]

TIMM_ATTENTION = "timm.layers.attention.Attention"


def _norm_kind(norm: nn.Module) -> str | None:
    name = type(norm).__name__.lower()
    return "rms" if "rms" in name else ("layer" if "layernorm" in name else None)


def _refusal(m: nn.Module) -> str | None:
    if not isinstance(m.norm, nn.Identity):
        return ("scale_norm=True normalises all heads' outputs together (h·d_v channels) before proj: that norm does "
                "not commute with GL(d_v) per head, so the V/O gauge changes; build the Attention with scale_norm=False")
    if getattr(m, "gate", None) is not None:
        return ("gated=True multiplies the attention output elementwise by sigmoid(gate(x)): only a diagonal V/O gauge "
                "survives; build the Attention with gated=False")
    if not isinstance(m.q_norm, nn.Identity) and _norm_kind(m.q_norm) is None:
        return (f"qk_norm=True with {type(m.q_norm).__qualname__} norms (per-head Q/K normalisation of a kind gaugeopt "
                "does not know) changes the Q/K gauge; build the Attention with qk_norm=False")
    return None


def _qk_norm(m: nn.Module) -> QKNormSpec | None:
    if isinstance(m.q_norm, nn.Identity):
        return None
    return QKNormSpec(_norm_kind(m.q_norm), "q_norm", "k_norm", eps="q_norm.eps")


TIMM_SPEC = AttentionSpec(qkv="qkv", o="proj", num_heads="num_heads", head_dim="head_dim", kind="timm",
                          refuse=_refusal, qk_norm=_qk_norm, on_qk_norm=qkn.timm)
