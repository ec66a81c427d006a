"""Adapter for timm's ``Attention`` built with ``qk_norm=True`` and a LayerNorm (never imports timm).

``timm.layers.attention.Attention`` (re-exported as ``timm.models.vision_transformer.Attention``):
fused ``qkv`` (``[Q|K|V]``, no GQA), output ``proj``, no RoPE. With ``qk_norm=True`` the
``VisionTransformer`` puts one ``LayerNorm(head_dim)`` on the queries and one on the keys, shared by
all heads, with a bias: recorded as :class:`~gaugeopt.structure.site.QKNorm` (``kind="layer"``).

This adapter claims the class only when ``q_norm``/``k_norm`` are LayerNorms (timm's or torch's, with a
gain). Any other instance is handed to the adapter registered for the class before this one (plain
attention, ``qk_norm=False``), or refused when there is none. ``scale_norm=True`` (a norm over all
heads' outputs before ``proj``) and ``gated=True`` (a sigmoid gate on the outputs) change the V/O
gauge and are refused.

Example:
    >>> import gaugeopt
    >>> from gaugeopt.structure.adapters.timm_qknorm import TIMM_ATTENTION
    >>> TIMM_ATTENTION in gaugeopt.structure.registry.registered_adapters()
    True
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.structure.adapters.common import refuse, require_stock_forward
from gaugeopt.structure.linears import fused_rows, projection_refs
from gaugeopt.structure.registry import Adapter, register_named_adapter, registered_adapters
from gaugeopt.structure.site import AttentionSite, QKNorm, TensorRef

__all__ = ["adapt_timm_qk_norm", "TIMM_ATTENTION"]

TIMM_ATTENTION = "timm.layers.attention.Attention"
_LAYER_NORMS = ("timm.layers.norm.LayerNorm", "torch.nn.modules.normalization.LayerNorm")


def _path(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _is_layer_norm(module: nn.Module | None) -> bool:
    return module is not None and _path(module) in _LAYER_NORMS


def _q(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _norm(name: str, m: nn.Module, side: str, d: int) -> tuple[TensorRef, TensorRef | None, float]:
    attr = f"{side}_norm"
    norm = getattr(m, attr)
    qual = _q(name, attr)
    if _path(norm) == "timm.layers.norm.LayerNorm":
        require_stock_forward(qual, norm)
    elif type(norm).forward is not nn.LayerNorm.forward or "forward" in vars(norm):
        raise refuse(name, f"{attr} with a patched forward")
    if tuple(norm.normalized_shape) != (d,):
        raise refuse(name, f"{attr} over {tuple(norm.normalized_shape)} (expected the head width ({d},))")
    if norm.weight is None:
        raise refuse(name, f"{attr} without a learnable gain (elementwise_affine=False)",
                     "no continuous Q/K gauge is left; gaugeopt needs the gains")
    gain = TensorRef(norm, "weight", f"{qual}.weight", (1, d))
    bias = None if norm.bias is None else TensorRef(norm, "bias", f"{qual}.bias", (1, d))
    return gain, bias, float(norm.eps)


def adapt_timm_qk_norm(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    """The :class:`AttentionSite` of a timm ``Attention`` with LayerNorm QK-norm (see the module docstring)."""
    require_stock_forward(name, m)
    if not (isinstance(getattr(m, "norm", None), nn.Identity)):
        raise refuse(name, "scale_norm=True (a norm over all heads' outputs before proj)", "it changes the V/O gauge")
    if getattr(m, "gate", None) is not None:
        raise refuse(name, "gated=True (a sigmoid gate on the attention output)", "it restricts the V/O gauge")
    h, d = m.num_heads, m.head_dim
    A = h * d
    q_rows, k_rows, v_rows = fused_rows(m.qkv, (A, A, A))
    E = m.qkv.in_features
    qkv, proj = _q(name, "qkv"), _q(name, "proj")
    q = projection_refs(m.qkv, qkv, rows=q_rows, split=0, canon="in", heads=h, width=d, d_model=E)
    k = projection_refs(m.qkv, qkv, rows=k_rows, split=1, canon="in", heads=h, width=d, d_model=E)
    v = projection_refs(m.qkv, qkv, rows=v_rows, split=2, canon="in", heads=h, width=d, d_model=E)
    o = projection_refs(m.proj, proj, rows=None, split=0, canon="out", heads=h, width=d, d_model=m.proj.out_features)
    q_gain, q_bias, q_eps = _norm(name, m, "q", d)
    k_gain, k_bias, k_eps = _norm(name, m, "k", d)
    if q_eps != k_eps:
        raise refuse(name, f"different epsilons on q_norm and k_norm ({q_eps}, {k_eps})")
    norm = QKNorm("layer", q_gain, k_gain, q_bias, k_bias, eps=q_eps, scope="head", before_rope=True)
    return AttentionSite(
        name=name, module=m, h=h, h_kv=h, d_k=d, d_v=d, d_model=E, q=q, k=k, v=v, o=o,
        kind="timm", features=("fused_qkv", "qk_norm"), qk_norm=norm,
    )


def _dispatch(previous: Adapter | None) -> Adapter:
    def adapter(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
        if _is_layer_norm(getattr(m, "q_norm", None)) and _is_layer_norm(getattr(m, "k_norm", None)):
            return adapt_timm_qk_norm(root, name, m)
        if previous is not None:
            return previous(root, name, m)
        raise refuse(
            name, f"timm Attention with q_norm={type(getattr(m, 'q_norm', None)).__qualname__}",
            "gaugeopt handles timm's Attention with qk_norm=True and a LayerNorm norm_layer",
        )

    return adapter


def _register() -> None:
    # registered after the built-in adapters: an instance without LayerNorm QK-norm goes to the
    # adapter that was there before (plain timm attention)
    register_named_adapter(TIMM_ATTENTION, _dispatch(registered_adapters().get(TIMM_ATTENTION)))


_register()
