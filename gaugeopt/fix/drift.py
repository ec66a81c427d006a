"""Gauge drift: how far the two sides of a pair have drifted apart, and their scale product.

Paper 002 (eq. 3) measures how far the Q/K gauge has wandered by the *multiplicative drift*

    drift = max over layers and heads of |log(s_Q / s_K)|,   s = RMS(r[head])

with ``r_Q``, ``r_K`` the LRM row multipliers of a head. The gauge-invariant companion is the
*scale product* ``s_Q·s_K`` (what weight decay shrinks and what grows without it). This module
computes both, per layer, KV group and slot (:mod:`gaugeopt.fix.plan`), for Q/K and V/O
(``r_V`` rows vs ``c_O`` columns), with multipliers or on the stored rows (``mode``).

**GQA / MQA.** The Q/K gauge of a KV group is shared by the group's query heads, so scales are
per KV group: ``s_Q[j]`` is the RMS over all query heads of group ``j`` (all their multipliers,
or all their rows) and ``s_K[j] = RMS(r_K[j])``. A "head" in these metrics is a KV group.

**QK-norm.** On a site that normalises queries and keys the Q/K drift is the drift of the norm's
gains, ``|log(RMS g_q / RMS g_k)|`` over the slot (docs/qk_norm.md): one gain vector shared by all
heads is one group, so ``granularity="head"`` gives one number per layer (per KV group for
per-head gains, OLMo 2). Gemma's stored ``w`` is measured as the gain ``1 + w``.

Slot drift is ``|log((s_a + ε)/(s_b + ε))|`` (ε as in the fix, eq. 4, so that an all-zero slot
gives a finite number; for ``s ≫ ε`` it is eq. 3). :func:`read_mean_squares` reads one mean
square per channel from the current values (for stored rows the mean over the whole augmented
row ``[W[c, :] | b[c]]``), correct for FSDP2-sharded DTensors.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.fix.drift import drift_table
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)))
    >>> gaugeopt.qk_drift(model)
    0.0
    >>> with torch.no_grad(): _ = model.transformer.h[0].attn.c_attn.row_mults[0].mul_(2.0)  # r_Q ← 2 r_Q
    >>> round(gaugeopt.qk_drift(model), 4)  # log 2
    0.6931
    >>> [round(float(t.drift.max()), 4) for t in drift_table(model)]
    [0.6931, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn as nn

from gaugeopt.distributed import full, is_dtensor
from gaugeopt.fix.options import FixOptions, resolve_options
from gaugeopt.fix.plan import PairPlan, plan_pairs
from gaugeopt.fix.transport import reduced_ref
from gaugeopt.records.pair import Member, PairSide
from gaugeopt.adapters.find import find_attention
from gaugeopt.records.site import AttentionSite

__all__ = [
    "read_mean_squares",
    "slot_rms",
    "log_ratio",
    "worst",
    "product_stats",
    "PairScales",
    "drift_table",
    "qk_drift",
    "vo_drift",
]


@torch.no_grad()
def read_mean_squares(side: PairSide, members: Sequence[Member], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mean square of each channel of ``side``: ``(groups, repeat, width)``, replicated on every rank.

    For a multiplier it is ``r²``; for stored rows the mean of the squares of the whole
    augmented row ``[W[c, :] | b[c]]`` (or O column); for a QK-norm gain ``(g + offset)²`` (its
    LayerNorm bias is not measured). Computed in at least float32. A plain tensor is reduced
    through the member's own view (one pass over its rows, no temporary; a fused QKV weight's
    other rows are not read); a DTensor (FSDP2) is reduced over its whole storage and gathered
    (:func:`gaugeopt.distributed.full`).
    """
    total, length = None, 0
    for member in members:
        if not member.measured:
            continue
        p = member.ref.param.detach()
        cdt = dtype or torch.promote_types(p.dtype, torch.float32)
        if not is_dtensor(p):
            v = member.ref.view(p)
            axis = member.broadcast_axis
            if axis is None:
                sq = (v.to(cdt) + member.offset).square() if member.offset else v.to(cdt).square()
                length += 1
            else:
                sq = torch.linalg.vector_norm(v, dim=axis, dtype=cdt).square()
                length += v.shape[axis]
            v = sq.reshape(side.heads, -1)
        else:
            rref, axis, _ = reduced_ref(member)
            x = p.to(cdt) + member.offset if member.offset else p.to(cdt)
            if axis is None:
                sq = full(x * x)
                length += 1
            else:
                sq = full((x * x).sum(dim=axis, keepdim=True))
                length += p.shape[axis]
            v = rref.view(sq).reshape(side.heads, -1)
        total = v if total is None else total + v
    return side.grouped(total / length)


def slot_rms(ms: torch.Tensor, slot: torch.Tensor, n_slots: int, onehot: torch.Tensor | None = None) -> torch.Tensor:
    """RMS per slot: ``ms: (..., n, width)`` mean squares → ``(..., n_slots)``, averaging over
    the ``n`` heads of a group and the channels of each slot (all rows have equal length).
    ``onehot``: ``one_hot(slot, n_slots)`` in ``ms``'s dtype and device, if the caller keeps it."""
    if onehot is None:
        onehot = torch.nn.functional.one_hot(slot.to(ms.device), n_slots).to(ms.dtype)  # (width, n_slots)
    count = onehot.sum(0) * ms.shape[-2]
    return ((ms.sum(-2) @ onehot) / count).sqrt()


def log_ratio(s_a: torch.Tensor, s_b: torch.Tensor, eps: float) -> torch.Tensor:
    """Slot drift ``|log((s_a + ε)/(s_b + ε))|`` (paper 002 eq. 3 with eq. 4's ε)."""
    return ((s_a + eps) / (s_b + eps)).log().abs()


def _finite(t: torch.Tensor) -> torch.Tensor:
    return t[torch.isfinite(t)]


def worst(values: Iterable[torch.Tensor]) -> float:
    """The largest finite entry over several tensors (``0.0`` when there are none); one host sync.
    A slot whose scale is NaN (a NaN weight) is reported apart, not as the worst drift."""
    flat = [_finite(v.reshape(-1)) for v in values]
    flat = torch.cat(flat) if flat else torch.zeros(0)
    return float(flat.max()) if flat.numel() else 0.0


def product_stats(products: Iterable[torch.Tensor]) -> tuple[float, float]:
    """``(mean, max)`` of the finite scale products over every slot of every layer; one host sync."""
    flat = _finite(torch.cat([p.reshape(-1) for p in products]))
    if not flat.numel():
        return (float("nan"), float("nan"))
    return tuple(torch.stack([flat.mean(), flat.max()]).tolist())


def plan_scales(plan: PairPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s_a, s_b)``, each ``(groups, n_slots)``, of one plan at the current values."""
    s_a = slot_rms(read_mean_squares(plan.a, plan.members_a), plan.slot, plan.n_slots)
    s_b = slot_rms(read_mean_squares(plan.b, plan.members_b), plan.slot, plan.n_slots)
    return s_a, s_b


@dataclass
class PairScales:
    """Scales of one gauge of one layer at one granularity (tensors ``(h_kv, n_slots)``).

    Attributes:
        name: site name; ``layer``: its index; ``kind``: ``"qk"``, ``"vo"`` or ``"qk_gain"``
            (a QK-norm site's Q/K gauge; tensors ``(groups, n_slots)``).
        s_a, s_b: ``s_Q, s_K`` (or ``s_V, s_O``).
        drift: ``|log((s_a + ε)/(s_b + ε))|``.
        product: the gauge-invariant ``s_a·s_b``.
    """

    name: str
    layer: int
    kind: str
    mode: str
    granularity: str
    s_a: torch.Tensor
    s_b: torch.Tensor
    drift: torch.Tensor
    product: torch.Tensor


MEASURED = ("granularity", "vo_granularity", "mode", "eps")  # the fix options a drift metric reads
PER_HEAD = FixOptions(granularity="head")  # paper 002's eq. 3: one scale per head (KV group)


def drift_table(
    model: nn.Module | None,
    sites: Sequence[AttentionSite] | None = None,
    *,
    kinds: Sequence[str] | None = None,
    options: FixOptions | None = None,
    **fields,
) -> list[PairScales]:
    """Per-layer, per-head (KV group) and per-slot scales, drift and scale product.

    Args:
        model: the model (ignored when ``sites`` is given).
        kinds: ``"qk"`` and/or ``"vo"`` (default: ``options.kinds``; ``("qk",)`` without options).
        options: a fix's :class:`~gaugeopt.fix.options.FixOptions`, to measure at its slots
            (default: per head, ``granularity="head"``).
        **fields: the options a measurement reads — ``granularity``, ``vo_granularity``, ``mode``,
            ``eps`` (:class:`~gaugeopt.fix.options.FixOptions`) —, replacing those of ``options``.
    """
    opts = resolve_options(options, fields, "drift_table", base=PER_HEAD, accepted=MEASURED)
    sites = find_attention(model) if sites is None else list(sites)
    out = []
    for plan in plan_pairs(sites, opts, kinds=kinds):
        s_a, s_b = plan_scales(plan)
        out.append(PairScales(plan.site.name, plan.site.layer_index, plan.kind, plan.mode, plan.granularity,
                              s_a, s_b, log_ratio(s_a, s_b, opts.eps), s_a * s_b))
    return out


def qk_drift(
    model: nn.Module | None,
    sites: Sequence[AttentionSite] | None = None,
    *,
    options: FixOptions | None = None,
    **fields,
) -> float:
    """Paper 002 eq. 3: ``max over layers and heads of |log(s_Q/s_K)|`` (KV groups under GQA).

    On a QK-norm site ``s_Q``, ``s_K`` are the RMS of the norm's query and key gains (the Q/K gauge
    acts on them there), so the number is the gain drift ``|log(RMS g_q / RMS g_k)|``.

    Args:
        model: the model (ignored when ``sites`` is given).
        options, **fields: as :func:`drift_table`: ``granularity`` — ``"head"`` (the paper, the
            default), ``"channel"`` or ``"plane"``: the max over those slots instead (``"auto"`` =
            plane under RoPE, head otherwise); ``mode`` — ``"auto"`` (multipliers where the model has
            them, else the W rows and biases), ``"lrm"`` or ``"plain"``; ``eps``.
    """
    return worst(t.drift for t in drift_table(model, sites, kinds=("qk",), options=options, **fields))


def vo_drift(
    model: nn.Module | None,
    sites: Sequence[AttentionSite] | None = None,
    *,
    options: FixOptions | None = None,
    **fields,
) -> float:
    """The V/O analogue of :func:`qk_drift`: ``max |log(s_V/s_O)|`` (``r_V`` rows vs ``c_O`` columns).

    ``granularity`` here names the V/O slots (``options.vo_granularity``): ``"head"`` or ``"channel"``."""
    if "granularity" in fields:
        fields["vo_granularity"] = fields.pop("granularity")
    return worst(t.drift for t in drift_table(model, sites, kinds=("vo",), options=options, **fields))
