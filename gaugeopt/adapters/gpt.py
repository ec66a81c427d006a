"""Adapter for the project's own :class:`gaugeopt.models.gpt.CausalSelfAttention`.

With ``qk_norm=True`` each query and key head is RMS-normalised over its ``d_k`` channels by one
:class:`~gaugeopt.models.gpt.RMSNorm` per side (one gain vector shared by every head), before RoPE:
the site records it as :class:`~gaugeopt.records.site.QKNorm` (``kind="rms"``, ``scope="head"``).
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.records.rope import NO_ROPE, RopeSpec
from gaugeopt.records.site import AttentionSite, QKNorm, TensorRef
from gaugeopt.records.linears import fused_rows, projection_refs
from gaugeopt.adapters.common import refuse, require_stock_forward


def _qk_norm(name: str, m: nn.Module, d: int) -> QKNorm:
    from gaugeopt.models.gpt import RMSNorm

    refs = {}
    for side in ("q", "k"):
        attr = f"{side}_norm"
        norm = getattr(m, attr)
        qual = f"{name}.{attr}" if name else attr
        if type(norm) is not RMSNorm:
            raise refuse(name, f"{attr} of type {type(norm).__qualname__}", "gaugeopt knows gaugeopt.models.gpt.RMSNorm there")
        require_stock_forward(qual, norm)
        refs[side] = (TensorRef(norm, "weight", f"{qual}.weight", (1, d)), norm.eps)
    if refs["q"][1] != refs["k"][1]:
        raise refuse(name, f"different epsilons on the query and key norms ({refs['q'][1]}, {refs['k'][1]})")
    return QKNorm("rms", refs["q"][0], refs["k"][0], eps=refs["q"][1], scope="head", before_rope=True)


def adapt_gpt(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    require_stock_forward(name, m)
    h, h_kv, d, d_model = m.n_head, m.n_kv_head, m.head_dim, m.n_embd
    q_rows, k_rows, v_rows = fused_rows(m.c_attn, m.split_sizes)
    c_attn = f"{name}.c_attn" if name else "c_attn"
    c_proj = f"{name}.c_proj" if name else "c_proj"
    common = dict(canon="in", d_model=d_model)
    q = projection_refs(m.c_attn, c_attn, rows=q_rows, split=0, heads=h, width=d, **common)
    k = projection_refs(m.c_attn, c_attn, rows=k_rows, split=1, heads=h_kv, width=d, **common)
    v = projection_refs(m.c_attn, c_attn, rows=v_rows, split=2, heads=h_kv, width=d, **common)
    o = projection_refs(m.c_proj, c_proj, rows=None, split=0, canon="out", heads=h, width=d, d_model=d_model)
    rope = NO_ROPE if m.rotary is None else RopeSpec(m.rotary.kind, m.rotary.rotary_dim)
    norm = _qk_norm(name, m, d) if m.qk_norm else None
    features = ("fused_qkv",) + (("gqa",) if h_kv != h else ()) + ((f"rope_{rope.kind}",) if rope.active else ()) \
        + (("qk_norm",) if norm is not None else ())
    return AttentionSite(
        name=name, module=m, h=h, h_kv=h_kv, d_k=d, d_v=d, d_model=d_model,
        q=q, k=k, v=v, o=o, rope=rope, kind="gpt", features=features, qk_norm=norm,
    )
