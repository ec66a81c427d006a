"""Adapter for ``torch.nn.MultiheadAttention`` (self- or cross-attention, no RoPE)."""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.records.site import AttentionSite, ProjectionRefs, TensorRef
from gaugeopt.adapters.common import refuse


def _q(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def adapt_mha(root: nn.Module, name: str, m: nn.MultiheadAttention) -> AttentionSite:
    if "forward" in vars(m):
        raise refuse(name, "an instance-level forward override")
    if m.bias_k is not None or m.bias_v is not None:
        raise refuse(
            name, "add_bias_kv=True (learned keys/values appended after the projection)",
            "build the layer with add_bias_kv=False",
        )
    h, E = m.num_heads, m.embed_dim
    d = m.head_dim
    bias = m.in_proj_bias
    qkv = []
    for j, role in enumerate("qkv"):
        rows = slice(j * E, (j + 1) * E)
        if m._qkv_same_embed_dim:
            w = TensorRef(m, "in_proj_weight", _q(name, "in_proj_weight"), (h, d, E), False, rows)
        else:
            attr = f"{role}_proj_weight"
            w = TensorRef(m, attr, _q(name, attr), (h, d, getattr(m, attr).shape[1]))
        b = None if bias is None else TensorRef(m, "in_proj_bias", _q(name, "in_proj_bias"), (h, d), False, rows)
        qkv.append(ProjectionRefs(w, b))
    out = m.out_proj
    o_name = _q(name, "out_proj")
    o = ProjectionRefs(
        TensorRef(out, "weight", o_name + ".weight", (out.out_features, h, d)),
        None if out.bias is None else TensorRef(out, "bias", o_name + ".bias", (out.out_features,)),
    )
    return AttentionSite(
        name=name, module=m, h=h, h_kv=h, d_k=d, d_v=d, d_model=E,
        q=qkv[0], k=qkv[1], v=qkv[2], o=o, kind="torch_mha",
        features=("fused_qkv",) if m._qkv_same_embed_dim else (),
    )
