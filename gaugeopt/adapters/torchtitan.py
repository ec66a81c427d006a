"""torchtitan's ``GQAttention`` (Llama 3 and the other decoders; never imports torchtitan).

Projections live in ``qkv_linear``: ``QKVLinear`` (separate ``wq``, ``wk``, ``wv``) or
``FusedQKVLinear`` (``wqkv`` grouped per KV group, ``[q_(g,·), k_g, v_g]``: supported with one KV
head or one query head per KV head, refused otherwise — see :mod:`gaugeopt.records.linears`);
output ``wo``; all torchtitan ``Linear`` (an ``nn.Linear`` subclass with its forward). RoPE over
the whole head: ``ComplexRoPE`` pairs adjacent coordinates (interleaved), ``CosSinRoPE`` rotates
halves (split-half); both rotate q and k in float32 even in a float64 model, which
:attr:`~gaugeopt.AttentionSite.float32_steps` records. The inner attention must be
``ScaledDotProductAttention`` (verified); ``FlexAttention`` and ``VarlenAttention`` are refused
until verified: ``FlexAttention`` runs ``flex_attention`` compiled with max-autotune (a kernel gaugeopt has
not run), and a fused ``wqkv`` with ``1 < n_kv_heads < n_heads`` has no strided view of ``W_Q``.
``qk_norm`` (Qwen3's layout: an ``RMSNorm(head_dim)`` shared by all heads, before RoPE) is supported
through the norm's gain gauge (:mod:`gaugeopt.adapters.qk_norm`).

Example:
    >>> from gaugeopt.adapters.torchtitan import TORCHTITAN_ATTENTION
    >>> TORCHTITAN_ATTENTION
    'torchtitan.models.common.attention.GQAttention'
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from gaugeopt.adapters import qk_norm as qkn
from gaugeopt.records.rope import RopeSpec
from gaugeopt.records.site import AttentionSite
from gaugeopt.adapters.spec import AttentionSpec, QKNormSpec

__all__ = ["TORCHTITAN_ATTENTION", "TORCHTITAN_SPEC", "adapt_torchtitan"]

TORCHTITAN_ATTENTION = "torchtitan.models.common.attention.GQAttention"
_LINEAR = "torchtitan.models.common.linear.Linear"
_ROPES = {"ComplexRoPE": "interleaved", "CosSinRoPE": "split_half"}


def _rope(m: nn.Module) -> RopeSpec:
    return RopeSpec(_ROPES[type(m.rope).__name__], m.head_dim)


def _refusal(m: nn.Module) -> str | None:
    inner = type(m.inner_attention).__name__
    if inner != "ScaledDotProductAttention":
        why = (" (flex_attention compiled with max-autotune: a generated kernel gaugeopt has not run, so its exactness "
               "is not verified)" if inner == "FlexAttention" else "")
        return (f"inner_attention is {inner}{why}; gaugeopt has verified torchtitan's ScaledDotProductAttention only "
                "(configure the model with ScaledDotProductAttention.Config())")
    rope = type(m.rope).__name__
    if rope not in _ROPES:
        return f"rope is {rope}; gaugeopt knows torchtitan's ComplexRoPE (interleaved) and CosSinRoPE (split-half)"
    if type(m.qkv_linear).__name__ not in ("QKVLinear", "FusedQKVLinear"):
        return f"qkv_linear is {type(m.qkv_linear).__name__}; gaugeopt knows QKVLinear and FusedQKVLinear"
    for child in (m.qkv_linear, m.rope, m.inner_attention):
        fwd = getattr(type(child), "forward", None)
        if "forward" in vars(child) or not getattr(fwd, "__module__", "").startswith("torchtitan."):
            return f"{type(child).__qualname__}.forward is not torchtitan's (patched?); gaugeopt cannot vouch for it"
    return None


def _qk_norm(m: nn.Module) -> QKNormSpec | None:
    if m.q_norm is None:
        return None
    return QKNormSpec("rms", "q_norm", "k_norm", eps=lambda a: a.q_norm.eps if a.q_norm.eps is not None else 0.0)
    # (eps None is refused by qk_norm.torchtitan: nn.RMSNorm then uses the dtype's epsilon)


TORCHTITAN_SPEC = AttentionSpec(
    q="qkv_linear.wq", k="qkv_linear.wk", v="qkv_linear.wv", o="wo", num_heads="n_heads", num_kv_heads="n_kv_heads",
    head_dim="head_dim", rope=_rope, qk_norm=_qk_norm, on_qk_norm=qkn.torchtitan, refuse=_refusal,
    linear_types=(_LINEAR,), kind="torchtitan", float32_steps="RoPE in float32 (q and k are rotated in float32)",
)


def adapt_torchtitan(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    spec = TORCHTITAN_SPEC
    if type(m.qkv_linear).__name__ == "FusedQKVLinear":
        spec = dataclasses.replace(spec, q=None, k=None, v=None, qkv="qkv_linear.wqkv", fused="grouped")
    return spec.build(m, name, root)
