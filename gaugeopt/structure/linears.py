"""Building blocks for adapters: linear-like modules, fused row slices, records from linears."""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.structure.rope import NO_ROPE, RopeSpec
from gaugeopt.structure.lrm import LRMLinear
from gaugeopt.structure.site import AttentionSite, Projection, TensorRef

__all__ = ["linear_like", "projection_refs", "fused_rows", "site_from_linears"]

def _qualify(prefix: str, *parts: str) -> str:
    return ".".join(p for p in (prefix, *parts) if p)


def linear_like(module: nn.Module) -> tuple[bool, int, int]:
    """``(transposed, out_features, in_features)`` of an ``nn.Linear``, HF ``Conv1D`` or
    :class:`~gaugeopt.structure.lrm.LRMLinear`; raises :class:`GaugeError` for anything else."""


    if type(module) is nn.Linear or type(module) is LRMLinear:
        return False, module.out_features, module.in_features
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        return True, module.nf, module.weight.shape[0]
    raise GaugeError(
        f"expected nn.Linear, transformers Conv1D or gaugeopt LRMLinear, got {type(module).__qualname__}; "
        "a wrapped projection (LoRA, quantised, ...) changes the function the gauge acts on"
    )


def projection_refs(
    module: nn.Module,
    module_name: str,
    *,
    rows: slice | None,
    split: int,
    canon: str,
    heads: int,
    width: int,
    d_model: int,
) -> Projection:
    """Refs for the rows ``rows`` (split number ``split`` of a fused layer) of a linear-like
    ``module``. ``canon="in"`` gives the Q/K/V layout ``(heads, width, d_model)``;
    ``canon="out"`` the O layout ``(d_model, heads, width)``."""


    transposed, _, _ = linear_like(module)
    if canon == "in":
        wshape = (heads, width, d_model)
        weight = TensorRef(module, "weight", _qualify(module_name, "weight"), wshape, transposed, rows)
    else:
        weight = TensorRef(module, "weight", _qualify(module_name, "weight"), (d_model, heads, width), transposed, rows)
    bias = None
    if getattr(module, "bias", None) is not None:
        bshape = (heads, width) if canon == "in" else (d_model,)
        bias = TensorRef(module, "bias", _qualify(module_name, "bias"), bshape, False, rows)
    row_mult = col_mult = None
    if type(module) is LRMLinear:
        rm, cm = module.row_mults, module.col_mults
        if canon == "in":
            row_mult = TensorRef(rm, str(split), _qualify(module_name, "row_mults", str(split)), (heads, width))
            col_mult = TensorRef(cm, str(split), _qualify(module_name, "col_mults", str(split)), (d_model,))
        else:
            row_mult = TensorRef(rm, str(split), _qualify(module_name, "row_mults", str(split)), (d_model,))
            col_mult = TensorRef(cm, str(split), _qualify(module_name, "col_mults", str(split)), (heads, width))
    return Projection(weight, bias, row_mult, col_mult)


def fused_rows(module: nn.Module, sizes: Sequence[int]) -> list[slice]:
    """Row slices of a fused projection whose output is the concatenation of ``sizes``.

    For an :class:`~gaugeopt.structure.lrm.LRMLinear` the module's own split sizes must agree (the
    multipliers are per split)."""


    _, out, _ = linear_like(module)
    if sum(sizes) != out:
        raise GaugeError(f"fused projection has {out} output rows, expected {' + '.join(map(str, sizes))}")
    if type(module) is LRMLinear and tuple(module.split_sizes) not in (tuple(sizes),):
        raise GaugeError(
            f"LRMLinear split sizes {tuple(module.split_sizes)} do not match the fused layout {tuple(sizes)}; "
            "convert with gaugeopt.apply_lrm so that Q, K and V get their own multipliers"
        )
    out_slices, start = [], 0
    for s in sizes:
        out_slices.append(slice(start, start + s))
        start += s
    return out_slices


def site_from_linears(
    module: nn.Module,
    name: str,
    *,
    q: str,
    k: str,
    v: str,
    o: str,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    v_head_dim: int | None = None,
    rope: RopeSpec = NO_ROPE,
    kind: str = "manual",
) -> AttentionSite:
    """Build an :class:`AttentionSite` from four separate linear-like children of ``module``.

    The manual spec API for an architecture without a built-in adapter: name the Q, K, V
    and O children (``nn.Linear``, HF ``Conv1D`` or ``LRMLinear``), the head counts and the
    RoPE convention. *You* vouch that the module's forward is standard scaled-dot-product
    attention over these projections (no per-head normalisation, no extra learned keys);
    :func:`gaugeopt.structure.invariance.check_invariance` verifies it numerically on your model.

    Args:
        module: the attention module; ``name`` its qualified name in the root model.
        q, k, v, o: attribute names of the projections on ``module``.
        num_heads, num_kv_heads: query heads and key/value heads (GQA when fewer).
        head_dim, v_head_dim: widths (default: Q rows / num_heads).
        rope: the RoPE convention (:class:`~gaugeopt.structure.rope.RopeSpec`).
    """
    if len({q, k, v}) < 3:
        raise GaugeError(
            f"{name}: q={q!r}, k={k!r}, v={v!r} name the same layer: that is a fused QKV projection, and "
            "site_from_linears takes separate Q, K and V linears. Describe the fused layout (its row order) "
            "with an adapter spec instead; see docs/adapters.md"
        )
    mods = {}
    for role, attr in (("q", q), ("k", k), ("v", v), ("o", o)):
        if not hasattr(module, attr):
            raise GaugeError(f"{name}: no attribute {attr!r} for the {role.upper()} projection")
        mods[role] = getattr(module, attr)
    h = num_heads
    h_kv = num_kv_heads or h
    _, q_out, d_model = linear_like(mods["q"])
    d_k = head_dim or q_out // h
    _, v_out, _ = linear_like(mods["v"])
    d_v = v_head_dim or v_out // h_kv
    attrs = {"q": q, "k": k, "v": v, "o": o}
    refs = {}
    for role, heads, width in (("q", h, d_k), ("k", h_kv, d_k), ("v", h_kv, d_v)):
        _, out, _ = linear_like(mods[role])
        if out != heads * width:
            raise GaugeError(f"{name}.{attrs[role]}: {out} output rows, expected {heads}×{width}")
        refs[role] = projection_refs(
            mods[role], _qualify(name, attrs[role]), rows=None, split=0,
            canon="in", heads=heads, width=width, d_model=d_model,
        )
    _, d_out, o_in = linear_like(mods["o"])
    if o_in != h * d_v:
        raise GaugeError(f"{name}.{o}: {o_in} input columns, expected {h}×{d_v}")
    refs["o"] = projection_refs(
        mods["o"], _qualify(name, o), rows=None, split=0, canon="out", heads=h, width=d_v, d_model=d_out
    )
    return AttentionSite(
        name=name, module=module, h=h, h_kv=h_kv, d_k=d_k, d_v=d_v, d_model=d_model,
        q=refs["q"], k=refs["k"], v=refs["v"], o=refs["o"], rope=rope, kind=kind,
    )
