"""Building blocks for adapters: linear-like modules and fused row layouts.

A projection is *linear-like* when its forward is ``y = x Wᵀ + b`` over its own ``weight`` and
``bias``: ``nn.Linear`` (exact class), Hugging Face ``Conv1D`` (stored ``in×out``), gaugeopt's
:class:`~gaugeopt.models.lrm.LRMLinear`, and subclasses of ``nn.Linear`` that an adapter
*declares* (Falcon's ``FalconLinear``, torchtitan's ``Linear``): a subclass may compute something
else (LoRA, quantisation), so it is accepted only by name.

Fused Q/K/V projections store the rows of the three projections in one weight. Three layouts are
in use (``h`` query heads, ``h_kv`` KV heads, ``r = h / h_kv``, widths ``d_k``, ``d_v``):

=============  ===================================================  ==========================================
layout         rows                                                 models
=============  ===================================================  ==========================================
``concat``     ``[Q | K | V]``: all query heads, then keys, values  nanoGPT, litgpt, timm, GPT-2, Phi-3
``grouped``    per KV group ``g``: ``[q_(g,0..r-1), k_g, v_g]``     Falcon (new architecture), torchtitan
``per_head``   per head ``i``: ``[q_i, k_i, v_i]`` (``h = h_kv``)    GPT-NeoX, Bloom, Falcon (old, MHA), BigCode
=============  ===================================================  ==========================================

Every record addresses a projection through a :class:`~gaugeopt.records.site.TensorRef`, a
*view* of the stored parameter. ``grouped`` with ``1 < h_kv < h`` has none: the query rows of
one group are interrupted by that group's key and value rows, so the query heads are not equally
spaced and ``W_Q`` has no ``(h, d_k, d)`` view. It is refused; with ``h_kv = 1`` it is ``concat``
and with ``h_kv = h`` it is ``per_head``.

Example:
    >>> import torch.nn as nn
    >>> from gaugeopt.records.linears import fused_qkv_refs
    >>> qkv = nn.Linear(16, 48)                      # h = h_kv = 2 heads of width 8, [q_i, k_i, v_i]
    >>> q, k, v = fused_qkv_refs(qkv, "attn.qkv", layout="per_head", h=2, h_kv=2, d_k=8, d_v=8, d_model=16)
    >>> k.weight.get().shape, k.weight.get()[1, 0].data_ptr() == qkv.weight[24 + 8].data_ptr()
    (torch.Size([2, 8, 16]), True)
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.models.lrm import LRMLinear
from gaugeopt.records.site import ProjectionRefs, TensorRef

__all__ = ["FUSED_LAYOUTS", "linear_like", "projection_refs", "fused_rows", "fused_qkv_refs"]

FUSED_LAYOUTS = ("concat", "grouped", "per_head")


def _qualify(prefix: str, *parts: str) -> str:
    return ".".join(p for p in (prefix, *parts) if p)


def class_path(cls: type) -> str:
    """``"package.module.Class"`` of a class (how optional libraries' classes are named)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _declared(module: nn.Module, accept: Sequence[type | str]) -> bool:
    cls = type(module)
    return any(cls is a if isinstance(a, type) else class_path(cls) == a for a in accept)


def linear_like(module: nn.Module, accept: Sequence[type | str] = ()) -> tuple[bool, int, int]:
    """``(transposed, out_features, in_features)`` of an ``nn.Linear``, HF ``Conv1D``,
    :class:`~gaugeopt.models.lrm.LRMLinear` or a declared ``nn.Linear`` subclass (``accept``:
    classes or import paths); raises :class:`GaugeError` for anything else."""
    if type(module) is nn.Linear or type(module) is LRMLinear:
        return False, module.out_features, module.in_features
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        return True, module.nf, module.weight.shape[0]
    if isinstance(module, nn.Linear) and _declared(module, accept):
        return False, module.weight.shape[0], module.weight.shape[1]
    parametrized = getattr(module, "parametrizations", None)
    if isinstance(parametrized, nn.ModuleDict) and len(parametrized):
        raise GaugeError(
            f"{', '.join(parametrized.keys())} of this {type(module).__qualname__} is parametrized "
            "(torch.nn.utils.parametrize): the forward computes the tensor from its parametrization, so a gauge action "
            "cannot edit it; remove the parametrization (parametrize.remove_parametrizations(module, name)) first"
        )
    raise GaugeError(
        f"expected nn.Linear, transformers Conv1D or gaugeopt LRMLinear, got {type(module).__qualname__}; "
        "a wrapped projection (LoRA, quantised, ...) changes the function the gauge acts on"
        + (f" (this adapter also accepts {', '.join(a if isinstance(a, str) else a.__qualname__ for a in accept)})"
           if accept else "")
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
    groups: int | None = None,
    accept: Sequence[type | str] = (),
) -> ProjectionRefs:
    """Refs for the rows ``rows`` (split number ``split`` of a fused layer) of a linear-like
    ``module``. ``canon="in"`` gives the Q/K/V layout ``(heads, width, d_model)``;
    ``canon="out"`` the O layout ``(d_model, heads, width)``. With ``groups``, ``rows`` selects
    inside each of ``groups`` equal row blocks (:class:`~gaugeopt.records.site.TensorRef`)."""
    transposed, _, _ = linear_like(module, accept)
    if canon == "in":
        wshape = (heads, width, d_model)
        weight = TensorRef(module, "weight", _qualify(module_name, "weight"), wshape, transposed, rows, groups)
    else:
        weight = TensorRef(module, "weight", _qualify(module_name, "weight"), (d_model, heads, width), transposed, rows)
    bias = None
    if getattr(module, "bias", None) is not None:
        bshape = (heads, width) if canon == "in" else (d_model,)
        bias = TensorRef(module, "bias", _qualify(module_name, "bias"), bshape, False, rows, groups)
    row_mult = col_mult = None
    if type(module) is LRMLinear:
        if groups is not None:
            raise GaugeError(
                f"{module_name}: learnable multipliers need the Q, K and V rows of a fused projection in contiguous "
                "blocks; this layout interleaves them per head (see gaugeopt.apply_lrm)"
            )
        rm, cm = module.row_mults, module.col_mults
        if canon == "in":
            row_mult = TensorRef(rm, str(split), _qualify(module_name, "row_mults", str(split)), (heads, width))
            col_mult = TensorRef(cm, str(split), _qualify(module_name, "col_mults", str(split)), (d_model,))
        else:
            row_mult = TensorRef(rm, str(split), _qualify(module_name, "row_mults", str(split)), (d_model,))
            col_mult = TensorRef(cm, str(split), _qualify(module_name, "col_mults", str(split)), (heads, width))
    return ProjectionRefs(weight, bias, row_mult, col_mult)


def fused_rows(module: nn.Module, sizes: Sequence[int], accept: Sequence[type | str] = ()) -> list[slice]:
    """Row slices of a fused projection whose output is the concatenation of ``sizes``.

    For an :class:`~gaugeopt.models.lrm.LRMLinear` the module's own split sizes must agree (the
    multipliers are per split)."""
    _, out, _ = linear_like(module, accept)
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


def fused_qkv_refs(
    module: nn.Module,
    module_name: str,
    *,
    layout: str,
    h: int,
    h_kv: int,
    d_k: int,
    d_v: int,
    d_model: int,
    accept: Sequence[type | str] = (),
) -> tuple[ProjectionRefs, ProjectionRefs, ProjectionRefs]:
    """The Q, K and V projections of one fused linear-like ``module`` in ``layout`` (see the
    module docstring): ``concat``, ``grouped`` or ``per_head``."""
    if layout not in FUSED_LAYOUTS:
        raise GaugeError(f"{module_name}: fused layout {layout!r} is not one of {FUSED_LAYOUTS}")
    if h % h_kv:
        raise GaugeError(f"{module_name}: num_heads={h} is not a multiple of num_kv_heads={h_kv}")
    r = h // h_kv
    if layout == "grouped" and h_kv == 1:
        layout = "concat"  # [q_0 .. q_(h-1), k, v]
    if layout == "grouped" and r == 1:
        layout = "per_head"  # [q_i, k_i, v_i]
    if layout == "grouped":
        raise GaugeError(
            f"{module_name}: a fused QKV grouped per KV group ([q_(g,0..{r - 1}), k_g, v_g] with {h_kv} groups of "
            f"{r} query heads) has no strided view (h, d_k, d) of its query rows: each group's key and value rows "
            "interrupt them. gaugeopt needs one; use separate Q/K/V projections for this model (torchtitan: "
            "fuse_qkv=False), or a layout with num_kv_heads=1 or num_kv_heads=num_heads"
        )
    common = dict(canon="in", d_model=d_model, accept=accept)
    if layout == "concat":
        rows = fused_rows(module, (h * d_k, h_kv * d_k, h_kv * d_v), accept)
        return tuple(  # type: ignore[return-value]
            projection_refs(module, module_name, rows=rows[s], split=s, heads=heads, width=w, **common)
            for s, (heads, w) in enumerate(((h, d_k), (h_kv, d_k), (h_kv, d_v)))
        )
    if h != h_kv:
        raise GaugeError(f"{module_name}: the per-head layout [q_i, k_i, v_i] needs num_kv_heads = num_heads, got {h_kv} and {h}")
    _, out, _ = linear_like(module, accept)
    if out != h * (2 * d_k + d_v):
        raise GaugeError(f"{module_name}: fused projection has {out} output rows, expected {h} × ({d_k} + {d_k} + {d_v})")
    spans = (slice(0, d_k), slice(d_k, 2 * d_k), slice(2 * d_k, 2 * d_k + d_v))
    return tuple(  # type: ignore[return-value]
        projection_refs(module, module_name, rows=spans[s], split=s, heads=h, width=w, groups=h, **common)
        for s, w in enumerate((d_k, d_k, d_v))
    )
