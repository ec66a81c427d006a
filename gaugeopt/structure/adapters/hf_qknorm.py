"""Adapters for Hugging Face attention classes that normalise queries and keys (never imports transformers).

==================  ==============================================================  ================
class               QK-norm (``q_norm``/``k_norm``), recorded as :class:`QKNorm`     gain layout
==================  ==============================================================  ================
``Qwen3Attention``  ``Qwen3RMSNorm(head_dim)`` on each head, before RoPE              one vector, shared
``Olmo2Attention``  ``Olmo2RMSNorm(h·head_dim)`` over the whole projection, before     one per head
                    the head split and RoPE (``scope="full"``)
``Gemma3Attention`` ``Gemma3RMSNorm(head_dim)`` on each head, before RoPE; the gain is   one vector, shared
                    ``1 + weight`` (``gain_offset=1``)
==================  ==============================================================  ================

All three have separate ``q/k/v/o_proj`` (``nn.Linear``), GQA and split-half RoPE over the whole
head (``rotate_half``); the rotary width is read from the model's rotary embedding and a partial
width is refused. The norms are matched by exact class (import path) and stock ``forward``; their
epsilon is read from the module. The scores' scale (``query_pre_attn_scalar``), logit soft-capping and
sliding windows act on the scores after the gain gauge has cancelled and change nothing here.

Note on precision: these norms normalise in float32 even in a float64 model (``Gemma3RMSNorm``
also multiplies by its gain in float32), which bounds how exactly a gauge move can be observed in
the model's own forward (docs/qk_norm.md).

Example:
    >>> import transformers, gaugeopt
    >>> cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    ...                                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    >>> site = gaugeopt.find_attention(transformers.Qwen3ForCausalLM(cfg))[0]
    >>> site.qk_norm.kind, site.qk_norm.scope, site.qk_norm.q_gain.shape, site.pair("qk_gain").groups
    ('rms', 'head', (1, 8), 1)
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.structure.adapters.common import refuse, require_stock_forward
from gaugeopt.structure.linears import fused_rows, projection_refs
from gaugeopt.structure.registry import register_named_adapter
from gaugeopt.structure.rope import RopeSpec
from gaugeopt.structure.site import AttentionSite, QKNorm, TensorRef

__all__ = ["adapt_hf_qk_norm", "QK_NORM_FAMILIES"]

# family -> (attention class, norm class, norm scope, epsilon attribute, gain offset)
QK_NORM_FAMILIES = {
    "qwen3": ("Qwen3Attention", "Qwen3RMSNorm", "head", "variance_epsilon", 0.0),
    "olmo2": ("Olmo2Attention", "Olmo2RMSNorm", "full", "variance_epsilon", 0.0),
    "gemma3": ("Gemma3Attention", "Gemma3RMSNorm", "head", "eps", 1.0),
}


def _q(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _family(m: nn.Module) -> str:
    mod = type(m).__module__
    for family in QK_NORM_FAMILIES:
        if mod == f"transformers.models.{family}.modeling_{family}":
            return family
    raise GaugeError(f"{type(m).__qualname__} ({mod}) is not one of the QK-norm families {tuple(QK_NORM_FAMILIES)}")


def _rotary_width(root: nn.Module, name: str, head_dim: int) -> int:
    """Rotary width from the model's ``*RotaryEmbedding`` buffers (``inv_freq``, or one
    ``<layer_type>_inv_freq`` per layer type as in Gemma 3): ``2·len(inv_freq)``, equal for all."""
    dims = set()
    for mod in root.modules():
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            continue
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf_name == "inv_freq" or (buf_name.endswith("_inv_freq") and not buf_name.endswith("original_inv_freq")):
                dims.add(2 * buf.numel())
    if not dims:
        raise GaugeError(
            f"{name}: the attention takes its RoPE angles from the model's rotary embedding, and none was found "
            "under the module passed to find_attention; pass the whole model"
        )
    if len(dims) > 1:
        raise refuse(name, f"several rotary widths {sorted(dims)}")
    (dim,) = dims
    if dim != head_dim:
        raise refuse(name, f"partial rotary (rotary width {dim} < head_dim {head_dim})")
    return dim


def _norm_ref(name: str, m: nn.Module, side: str, family: str, rows: int, d: int) -> tuple[TensorRef, float]:
    _, norm_cls, scope, eps_attr, _ = QK_NORM_FAMILIES[family]
    attr = f"{side}_norm"
    norm = getattr(m, attr, None)
    qual = _q(name, attr)
    path = f"transformers.models.{family}.modeling_{family}.{norm_cls}"
    got = None if norm is None else f"{type(norm).__module__}.{type(norm).__qualname__}"
    if got != path:
        raise refuse(name, f"{attr} of type {got}", f"the {family} adapter knows {path} there")
    require_stock_forward(qual, norm)
    weight = getattr(norm, "weight", None)
    width = d if scope == "head" else rows * d
    if weight is None or tuple(weight.shape) != (width,):
        raise refuse(name, f"{attr}.weight of shape {None if weight is None else tuple(weight.shape)} (expected ({width},))")
    return TensorRef(norm, "weight", f"{qual}.weight", (1 if scope == "head" else rows, d)), float(getattr(norm, eps_attr))


def adapt_hf_qk_norm(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    """The :class:`AttentionSite` of a Qwen3, OLMo 2 or Gemma 3 attention module (see the module docstring)."""
    require_stock_forward(name, m)
    family = _family(m)
    _, _, scope, _, offset = QK_NORM_FAMILIES[family]
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
    q_gain, q_eps = _norm_ref(name, m, "q", family, h, d)
    k_gain, k_eps = _norm_ref(name, m, "k", family, h_kv, d)
    if q_eps != k_eps:
        raise refuse(name, f"different epsilons on q_norm and k_norm ({q_eps}, {k_eps})")
    norm = QKNorm("rms", q_gain, k_gain, eps=q_eps, gain_offset=offset, scope=scope, before_rope=True)
    rope = RopeSpec("split_half", _rotary_width(root, name, d))
    features = (("gqa",) if h_kv != h else ()) + ("rope_split_half", "qk_norm")
    return AttentionSite(
        name=name, module=m, h=h, h_kv=h_kv, d_k=d, d_v=d, d_model=E, rope=rope,
        kind=f"hf_{family}", features=features, qk_norm=norm, **projs,
    )


def _register() -> None:
    for family, (cls, *_rest) in QK_NORM_FAMILIES.items():
        register_named_adapter(f"transformers.models.{family}.modeling_{family}.{cls}", adapt_hf_qk_norm)


_register()
