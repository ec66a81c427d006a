"""Adapter for the project's own :class:`gaugeopt.models.gpt.CausalSelfAttention`."""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.structure.rope import NO_ROPE, RopeSpec
from gaugeopt.structure.site import AttentionSite
from gaugeopt.structure.linears import fused_rows, projection_refs
from gaugeopt.structure.adapters.common import refuse, require_stock_forward


def adapt_gpt(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    require_stock_forward(name, m)
    if m.qk_norm:
        raise refuse(
            name, "per-head Q/K normalisation (qk_norm=True)",
            "it leaves only separate positive rescalings of q and k (up to the norm's epsilon); build the model with qk_norm=False",
        )
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
    features = ("fused_qkv",) + (("gqa",) if h_kv != h else ()) + ((f"rope_{rope.kind}",) if rope.active else ())
    return AttentionSite(
        name=name, module=m, h=h, h_kv=h_kv, d_k=d, d_v=d, d_model=d_model,
        q=q, k=k, v=v, o=o, rope=rope, kind="gpt", features=features,
    )
