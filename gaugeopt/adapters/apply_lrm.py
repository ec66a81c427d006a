"""Learnable multipliers on a model's attention: converting a model, and grouping its multipliers.

The layer itself, ``W = diag(r) · W̄ · diag(c)`` (Velikanov et al. 2026, paper 002 eq. 1), is
:class:`gaugeopt.models.lrm.LRMLinear`: a building block that imports nothing of gaugeopt but its
errors. What lives here reads the attention records, so it sits with them:

* :func:`apply_lrm` replaces a model's linear layers by LRM layers in place (same function); a
  fused Q/K/V projection of an attention record gets one multiplier block per projection, because
  the Q/K gauge lives on ``r_Q`` vs ``r_K`` and paper 002's conditions decay them differently;
* :func:`qk_multiplier_names` names the multipliers of the Q/K pair of every record, and
  :func:`lrm_param_groups` builds the optimizer parameter groups of paper 002's conditions from them.

``LRMLinear``, ``is_lrm`` and :func:`fold_lrm` (the way back: every LRM layer replaced by the plain
layer it computes, for export) are importable from here too.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))
    >>> x = torch.randint(0, 64, (2, 8))
    >>> before = model(x)[0]
    >>> _ = gaugeopt.apply_lrm(model)
    >>> torch.allclose(model(x)[0], before, atol=1e-6)
    True
    >>> groups = gaugeopt.lrm_param_groups(model, condition="B")
    >>> [(g["name"], g["weight_decay"]) for g in groups]
    [('matrices', 0.1), ('multipliers', 0.002), ('qk_multipliers', 0.0), ('no_decay', 0.0)]
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.models.lrm import LRMLinear, _is_conv1d, carry_hooks, fold_lrm, is_lrm
from gaugeopt.adapters.find import find_attention

__all__ = ["LRMLinear", "apply_lrm", "fold_lrm", "lrm_param_groups", "qk_multiplier_names", "is_lrm"]


def _fused_layouts(model: nn.Module, sites) -> dict[int, tuple[int, ...] | str]:
    """id(module) → split sizes for the fused QKV projections of the attention sites, or the reason
    the module cannot carry per-projection multipliers (its Q/K/V rows interleave per head)."""
    layouts: dict[int, tuple[int, ...] | str] = {}
    for s in sites:
        if s.latent is not None:  # multi-head latent attention (docs/mla.md)
            for _, ref in s.refs():
                if isinstance(ref.owner, nn.Linear):
                    layouts[id(ref.owner)] = (
                        f"{ref.name.rpartition('.')[0]} is a projection of multi-head latent attention ({s.kind}); gaugeopt "
                        "does not support learnable multipliers there (its up-projections interleave each head's rows, and "
                        "their column multipliers would duplicate the latent norms' gains)"
                    )
            continue
        q_owner = s.q.weight.owner
        if s.k.weight.owner is q_owner and s.q.weight.groups is not None:
            layouts[id(q_owner)] = (
                f"{s.q.weight.name.rpartition('.')[0]} stores the rows of Q, K and V interleaved per head "
                f"([q_i, k_i, v_i], {s.kind}); learnable multipliers need the three in contiguous blocks"
            )
        elif s.k.weight.owner is q_owner:  # fused
            sizes = [s.h * s.d_k, s.h_kv * s.d_k]
            if s.v.weight.owner is q_owner:
                sizes.append(s.h_kv * s.d_v)
            layouts[id(q_owner)] = tuple(sizes)
    return layouts


def apply_lrm(
    model: nn.Module,
    *,
    include: Callable[[str, nn.Module], bool] | None = None,
    sites=None,
) -> nn.Module:
    """Replace the model's linear layers by :class:`LRMLinear` in place; the function is unchanged.

    Converts every ``nn.Linear`` (exact class) and Hugging Face ``Conv1D`` except: layers whose
    weight is shared with another module (a tied output head), and the projections inside
    ``nn.MultiheadAttention`` (whose forward reads the raw weight). Fused Q/K/V projections of
    the attention sites found by :func:`gaugeopt.find_attention` get one multiplier block each;
    a fused projection that interleaves Q/K/V rows per head (GPT-NeoX, Bloom) is refused (exclude
    it with ``include``). A ``Conv1D``'s weight is stored transposed into ``nn.Linear`` layout.

    Fast paths that read a converted layer's ``weight`` directly would skip its multipliers.
    ``nn.TransformerEncoderLayer`` has one (in eval mode without gradients it calls a fused kernel
    with ``linear1.weight`` and ``linear2.weight``): for a layer whose feed-forward is converted,
    the fast path is switched off (``activation_relu_or_gelu = 0``, which only that decision
    reads) and so is the nested-tensor path of its ``nn.TransformerEncoder``
    (``use_nested_tensor = False``); the regular path computes the same function. A model
    compiled with ``torch.compile`` before the conversion recompiles on its next call (the
    replaced modules fail the compiled graph's guards). A kernel installed later that reads a
    converted layer's ``weight`` itself (a Hugging Face hub kernel from ``model.kernelize()``, a
    hand-written fused block) is not detected: compare such a model's outputs in eval and train mode.

    Args:
        model: the model to convert (modified in place and returned).
        include: optional ``(qualified_name, module) -> bool`` to restrict the conversion.
        sites: attention sites (default: ``find_attention(model)``; a model without attention
            is converted without fused splits).

    Returns:
        ``model``.
    """
    if is_lrm(model):
        raise GaugeError("apply_lrm: the model already contains LRMLinear layers; convert it only once")
    if sites is None:
        try:
            sites = find_attention(model)
        except GaugeError as err:
            if "no attention layer found" not in str(err):
                raise
            sites = []
    layouts = _fused_layouts(model, sites)
    weight_users: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            weight_users[id(p)] = weight_users.get(id(p), 0) + 1
    mha_children = {id(c) for m in model.modules() if isinstance(m, nn.MultiheadAttention) for c in m.modules()}
    replacements = []
    for name, module in model.named_modules():
        if not (type(module) is nn.Linear or _is_conv1d(module)):
            continue
        if id(module) in mha_children or weight_users.get(id(module.weight), 0) > 1:
            continue
        if include is not None and not include(name, module):
            continue
        replacements.append((name, module))
    for name, module in replacements:
        layout = layouts.get(id(module))
        if isinstance(layout, str):
            raise GaugeError(
                f"apply_lrm: {layout}; convert the rest with include=lambda name, m: name != {name!r} (or leave the "
                "attention's projections plain)"
            )
    for name, module in replacements:
        legacy = [type(h).__qualname__ for h in module._forward_pre_hooks.values()
                  if type(h).__qualname__ in ("WeightNorm", "SpectralNorm")]
        if legacy:
            raise GaugeError(
                f"apply_lrm: {name} carries a legacy {legacy[0]} hook (torch.nn.utils.{legacy[0].lower()[:-4]}_norm), "
                "which recomputes its weight before every forward; a multiplier layer cannot take it over. Remove it "
                "first, or leave the layer plain with include=lambda n, m: n != " + repr(name)
            )
    paths: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(name)
    for name, module in replacements:
        new = LRMLinear.from_linear(module, layouts.get(id(module)))
        carry_hooks(module, new)
        for path in paths[id(module)]:  # a module used at several places stays one module
            parent_name, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, new)
    _disable_fused_fast_paths(model)
    return model


def _disable_fused_fast_paths(model: nn.Module) -> None:
    """Switch off the fused encoder kernels that would read a converted ``weight`` directly."""
    touched = set()
    for layer in model.modules():
        if isinstance(layer, nn.TransformerEncoderLayer) and any(
            isinstance(getattr(layer, a, None), LRMLinear) for a in ("linear1", "linear2")
        ):
            layer.activation_relu_or_gelu = 0  # read only by the fast-path test; self.activation is unchanged
            touched.add(id(layer))
    for enc in model.modules():
        if isinstance(enc, nn.TransformerEncoder) and any(id(m) in touched for m in enc.layers):
            enc.use_nested_tensor = False


def qk_multiplier_names(model: nn.Module, sites=None, *, which: str = "rows") -> set[str]:
    """Qualified names of the Q and K multipliers of every attention site.

    ``which="rows"`` (default) gives ``r_Q`` and ``r_K``, the pair the Q/K gauge rescales;
    ``"all"`` adds the column multipliers ``c_Q``, ``c_K`` of the same projections.
    """
    if which not in ("rows", "all"):
        raise GaugeError(f"which={which!r} must be 'rows' or 'all'")
    sites = find_attention(model) if sites is None else sites
    names: set[str] = set()
    for s in sites:
        for proj in (s.q, s.k):
            if proj.row_mult is not None:
                names.add(proj.row_mult.name)
            if which == "all" and proj.col_mult is not None:
                names.add(proj.col_mult.name)
    return names


def lrm_param_groups(
    model: nn.Module,
    condition: str = "A",
    *,
    weight_decay: float = 0.1,
    multiplier_decay: float = 2e-3,
    qk_multipliers: str = "rows",
    sites=None,
    **group_options,
) -> list[dict]:
    """Optimizer parameter groups for paper 002's three conditions.

    ============  ==============  =====================  ===================  ==========
    condition     matrices (≥2-D)  other multipliers     Q/K multipliers      1-D rest
    ============  ==============  =====================  ===================  ==========
    ``"A"``       0.1              2e-3                  2e-3                 0
    ``"B"``       0.1              2e-3                  **0** (+ GaugeFix)   0
    ``"C"``       0.1              2e-3                  **0** (no control)   0
    ============  ==============  =====================  ===================  ==========

    "Matrices" are parameters with ``dim >= 2`` (``W̄``, embeddings — nanoGPT's rule); "1-D
    rest" are biases and norm gains. B and C differ only in whether GaugeFix runs, which is
    not an optimizer setting. Every group carries a ``"name"`` key; extra keyword arguments
    (``lr=...``) are copied into every group. Empty groups are dropped.

    Args:
        condition: ``"A"``, ``"B"`` or ``"C"``.
        qk_multipliers: ``"rows"`` (``r_Q``, ``r_K``: the gauge pair) or ``"all"`` (also ``c_Q``, ``c_K``).
    """
    if condition not in ("A", "B", "C"):
        raise GaugeError(f"lrm_param_groups: condition={condition!r} must be 'A', 'B' or 'C'")
    mult_ids = set()
    for m in model.modules():
        if isinstance(m, LRMLinear):
            mult_ids.update(id(p) for p in (*m.row_mults, *m.col_mults))
    if not mult_ids:
        raise GaugeError("lrm_param_groups: the model has no learnable multipliers; call gaugeopt.apply_lrm(model) first")
    qk = qk_multiplier_names(model, sites, which=qk_multipliers) if condition in ("B", "C") else set()
    groups: dict[str, list] = {"matrices": [], "multipliers": [], "qk_multipliers": [], "no_decay": []}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if name in qk:
            groups["qk_multipliers"].append(p)
        elif id(p) in mult_ids:
            groups["multipliers"].append(p)
        elif p.dim() >= 2:
            groups["matrices"].append(p)
        else:
            groups["no_decay"].append(p)
    decay = {"matrices": weight_decay, "multipliers": multiplier_decay, "qk_multipliers": 0.0, "no_decay": 0.0}
    return [
        {"params": ps, "weight_decay": decay[n], "name": n, **group_options}
        for n, ps in groups.items()
        if ps
    ]

