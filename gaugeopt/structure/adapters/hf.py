"""Adapters for Hugging Face ``transformers`` attention classes (never imports transformers).

* ``GPT2Attention``: ``Conv1D`` weights stored ``in×out``, fused ``c_attn = [Q|K|V]``, learned
  absolute positions. Cross-attention layers (``q_attn``) are refused.
* ``LlamaAttention``, ``MistralAttention``, ``Qwen2Attention``: separate ``q/k/v/o_proj``, GQA,
  RoPE with ``rotate_half`` (split-half planes ``(m, m + d_k/2)``), optional biases. The
  rotary width is read from the model's rotary embedding (``2·len(inv_freq)``); a partial
  rotary width is refused because these classes' ``apply_rotary_pos_emb`` rotates whole heads.
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.structure.rope import RopeSpec
from gaugeopt.structure.site import AttentionSite
from gaugeopt.structure.linears import fused_rows, projection_refs
from gaugeopt.structure.adapters.common import refuse, require_stock_forward


def _q(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def adapt_hf_gpt2(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    require_stock_forward(name, m)
    if getattr(m, "is_cross_attention", False) or hasattr(m, "q_attn"):
        raise refuse(name, "GPT-2 cross-attention (q_attn reads another sequence)", "only self-attention layers are supported")
    h, d, E = m.num_heads, m.head_dim, m.embed_dim
    q_rows, k_rows, v_rows = fused_rows(m.c_attn, (E, E, E))
    c_attn, c_proj = _q(name, "c_attn"), _q(name, "c_proj")
    q = projection_refs(m.c_attn, c_attn, rows=q_rows, split=0, canon="in", heads=h, width=d, d_model=E)
    k = projection_refs(m.c_attn, c_attn, rows=k_rows, split=1, canon="in", heads=h, width=d, d_model=E)
    v = projection_refs(m.c_attn, c_attn, rows=v_rows, split=2, canon="in", heads=h, width=d, d_model=E)
    o = projection_refs(m.c_proj, c_proj, rows=None, split=0, canon="out", heads=h, width=d, d_model=E)
    return AttentionSite(
        name=name, module=m, h=h, h_kv=h, d_k=d, d_v=d, d_model=E,
        q=q, k=k, v=v, o=o, kind="hf_gpt2", features=("fused_qkv", "conv1d_layout"),
    )


def _rotary_dim(root: nn.Module, name: str, family: str, head_dim: int) -> int:
    """Rotary width from the model's ``<Family>RotaryEmbedding`` (all layers share it)."""
    dims = {
        2 * mod.inv_freq.numel()
        for mod in root.modules()
        if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "inv_freq")
    }
    if not dims:
        raise GaugeError(
            f"{name}: {family} attention takes its RoPE angles from the model's rotary embedding, and none was "
            "found under the module passed to find_attention; pass the whole model"
        )
    if len(dims) > 1:
        raise refuse(name, f"several rotary embeddings of different widths {sorted(dims)}")
    (dim,) = dims
    if dim != head_dim:
        raise refuse(name, f"partial rotary (rotary width {dim} < head_dim {head_dim})")
    return dim


def adapt_hf_llama_like(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    require_stock_forward(name, m)
    family = type(m).__name__.replace("Attention", "")
    for norm in ("q_norm", "k_norm"):
        if hasattr(m, norm):
            raise refuse(name, f"per-head Q/K normalisation ({norm})")
    cfg = m.config
    h, h_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, m.head_dim
    E = cfg.hidden_size
    projs = {}
    for role, attr, heads in (("q", "q_proj", h), ("k", "k_proj", h_kv), ("v", "v_proj", h_kv)):
        mod = getattr(m, attr)
        fused_rows(mod, (heads * d,))  # validates the width and the module type
        projs[role] = projection_refs(mod, _q(name, attr), rows=None, split=0, canon="in", heads=heads, width=d, d_model=E)
    fused_rows(m.o_proj, (E,))
    projs["o"] = projection_refs(m.o_proj, _q(name, "o_proj"), rows=None, split=0, canon="out", heads=h, width=d, d_model=E)
    rope = RopeSpec("split_half", _rotary_dim(root, name, family, d))
    features = (("gqa",) if h_kv != h else ()) + ("rope_split_half",)
    return AttentionSite(
        name=name, module=m, h=h, h_kv=h_kv, d_k=d, d_v=d, d_model=E, rope=rope,
        kind=f"hf_{family.lower()}", features=features, **projs,
    )
