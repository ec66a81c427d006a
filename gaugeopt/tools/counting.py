"""How many parameter-space directions are pure gauge: counts per model and per symmetry.

Two published conventions (docs/gauge_group.md), computed from a model *or* from a config without
allocating weights:

``convention="wang"`` (paper 000): the continuous head-wise attention symmetries,
    per layer and KV group ``dim(Q/K) + d_v²`` with ``dim(Q/K) = d_k²`` without RoPE and
    ``r + (d_k − r)²`` with ``r`` rotated coordinates — ``h(d_k + d_v²)`` per layer for full
    RoPE. GPT-2 small: ``12·12·(64² + 64²) = 1,179,648``.

``convention="van_nierop"`` (paper 003, Table 1): ``L·h·(d_k² + d_v²)`` plus the residual-stream
    rotations ``(d−1)(d−2)/2`` (it ignores RoPE). GPT-2 small 1,473,409; GPT-2 XL 11,108,001
    (≈ 11.1M); LLaMA-65B 201,314,305 (≈ 201M).

With GQA every count uses the KV groups (``h_kv``), which is where the symmetry lives. A model
with learnable multipliers has one more family, the internal ``r·W̄·c`` rescalings of every
LRM layer (``rows + in`` per multiplier block), reported as ``"lrm_internal"`` and included in
the total.

Example:
    >>> from gaugeopt import gauge_dimension
    >>> gauge_dimension({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768})
    1179648
    >>> gauge_dimension({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}, convention="van_nierop")
    1473409
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.structure.rope import NO_ROPE, RopeSpec

__all__ = ["LayerShape", "gauge_dimension", "layer_shapes"]

CONVENTIONS = ("wang", "van_nierop")


@dataclass(frozen=True)
class LayerShape:
    """The head structure of one attention layer, all a count needs."""

    h: int
    h_kv: int
    d_k: int
    d_v: int
    d_model: int
    rope: RopeSpec = NO_ROPE


def _get(cfg: Any, *names: str, default=None):
    for n in names:
        v = cfg.get(n) if isinstance(cfg, dict) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _rope_from_hf(cfg: Any, d_k: int) -> RopeSpec:
    params = _get(cfg, "rope_parameters", "rope_scaling") or {}
    factor = params.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor", default=1.0)) or 1.0
    r = int(d_k * factor)
    r -= r % 2
    return RopeSpec("split_half", r)


def layer_shapes(model_or_config: Any) -> list[LayerShape]:
    """Per-layer head structure of a model (via :func:`gaugeopt.find_attention`) or a config.

    Configs: :class:`gaugeopt.models.GPTConfig`, a Hugging Face ``PretrainedConfig`` or its
    ``config.json`` as a dict, for ``model_type`` gpt2, llama, mistral or qwen2.
    """
    if isinstance(model_or_config, nn.Module):
        from gaugeopt.structure.registry import find_attention

        return [LayerShape(s.h, s.h_kv, s.d_k, s.d_v, s.d_model, s.rope) for s in find_attention(model_or_config)]
    cfg = model_or_config
    from gaugeopt.models.gpt import GPTConfig

    if isinstance(cfg, GPTConfig):
        rope = NO_ROPE if cfg.rope == "none" else RopeSpec(cfg.rope, cfg.rotary_dim)
        shape = LayerShape(cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.head_dim, cfg.n_embd, rope)
        return [shape] * cfg.n_layer
    model_type = _get(cfg, "model_type")
    if model_type == "gpt2":
        L, h, d = _get(cfg, "n_layer", "num_hidden_layers"), _get(cfg, "n_head", "num_attention_heads"), _get(cfg, "n_embd", "hidden_size")
        return [LayerShape(h, h, d // h, d // h, d)] * L
    if model_type in ("llama", "mistral", "qwen2"):
        L = _get(cfg, "num_hidden_layers")
        h = _get(cfg, "num_attention_heads")
        h_kv = _get(cfg, "num_key_value_heads", default=h)
        d = _get(cfg, "hidden_size")
        d_k = _get(cfg, "head_dim", default=d // h)
        return [LayerShape(h, h_kv, d_k, d_k, d, _rope_from_hf(cfg, d_k))] * L
    raise GaugeError(
        f"gauge_dimension: cannot read a config of model_type={model_type!r} ({type(cfg).__qualname__}); "
        "pass a model, a gaugeopt GPTConfig, or a gpt2/llama/mistral/qwen2 config (object or config.json dict)"
    )


def _lrm_internal(model: Any) -> int:
    if not isinstance(model, nn.Module):
        return 0
    from gaugeopt.structure.lrm import LRMLinear

    return sum(m.internal_gauge_dim for m in model.modules() if isinstance(m, LRMLinear))


def gauge_dimension(
    model_or_config: Any, convention: str = "wang", *, per_symmetry: bool = False
) -> int | dict[str, int]:
    """Count the gauge dimensions of a model or config.

    Args:
        model_or_config: an ``nn.Module`` or a config (see :func:`layer_shapes`).
        convention: ``"wang"`` (paper 000, RoPE-reduced) or ``"van_nierop"`` (paper 003 Table 1).
        per_symmetry: return ``{"qk": ..., "vo": ..., ["residual_rotation": ...], ["lrm_internal": ...]}``
            instead of the total.
    """
    if convention not in CONVENTIONS:
        raise GaugeError(f"gauge_dimension: convention={convention!r} must be one of {CONVENTIONS}")
    shapes = layer_shapes(model_or_config)
    if convention == "wang":
        qk = sum(s.h_kv * s.rope.qk_gauge_dim(s.d_k) for s in shapes)
    else:
        qk = sum(s.h_kv * s.d_k**2 for s in shapes)
    counts = {"qk": qk, "vo": sum(s.h_kv * s.d_v**2 for s in shapes)}
    if convention == "van_nierop":
        d = shapes[0].d_model
        counts["residual_rotation"] = (d - 1) * (d - 2) // 2
    lrm = _lrm_internal(model_or_config)
    if lrm:
        counts["lrm_internal"] = lrm
    return counts if per_symmetry else sum(counts.values())
