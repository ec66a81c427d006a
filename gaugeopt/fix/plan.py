"""Gauge drift metrics and the plan that the gauge fix shares with them.

Paper 002 (eq. 3) measures how far the Q/K gauge has wandered by the *multiplicative drift*

    drift = max over layers and heads of |log(s_Q / s_K)|,   s = RMS(r[head])

with ``r_Q``, ``r_K`` the LRM row multipliers of a head. The gauge-invariant companion is the
*scale product* ``s_Q·s_K`` (what weight decay shrinks and what grows without it). This module
computes both, per layer and head, and their V/O analogues (``r_V`` rows vs ``c_O`` columns).

**GQA / MQA.** The Q/K gauge of a KV group is shared by the group's query heads
(``W_Q[i] ← AᵀW_Q[i]`` for every ``i`` reading KV head ``j``), so scales are per KV group:
``s_Q[j] = RMS over all query heads i of group j`` (all their multipliers, or all their rows)
and ``s_K[j] = RMS(r_K[j])``. A "head" in these metrics is a KV group; for standard
multi-head attention that is the head itself. For V/O: ``s_V[j] = RMS(r_V[j])``,
``s_O[j] = RMS over i in group j of c_O[i]``.

**Granularity** (which channels share one scale, the *slots* of a head):

* ``"head"``    — one slot per KV group (the paper);
* ``"channel"`` — one slot per channel ``c`` of ``d_k``: ``s_Q[j, c] = RMS_i r_Q[i, c]``;
* ``"plane"``   — one slot per RoPE plane (both coordinates of a plane, :func:`gaugeopt.structure.rope.plane_index`),
  and one per non-rotary channel; without RoPE it equals ``"channel"``.

Slot drift is ``|log((s_Q + ε)/(s_K + ε))|`` (ε as in the fix, eq. 4, so that an all-zero slot
gives a finite number; for ``s ≫ ε`` it is eq. 3).

**Models without multipliers** ("plain" mode): the same quantities on the stored rows, biases
included (``[W | b]`` is one augmented matrix, DESIGN.md §1): ``s_Q`` is the RMS of all entries
of the rows ``W_Q[i, c, :]`` and ``b_Q[i, c]`` in the slot; ``s_O`` of the O columns
``W_O[:, i, c]``. The per-head scalar gauge ``A = g·I`` is a subgroup of ``GL(d_k)``, so this is
a meaningful section of the full gauge for any attention.

The plan (:class:`PairPlan`: which tensors form each side, which channels share a slot) is
built once and reused by :func:`gaugeopt.gauge_fix`; :func:`read_mean_squares` reads one
mean square per channel from the current values, correct for FSDP2-sharded DTensors.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.fix.plan import drift_table
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
from typing import Sequence

import torch
import torch.nn as nn

from gaugeopt.fix.distributed import full
from gaugeopt.errors import GaugeError
from gaugeopt.structure.rope import plane_index
from gaugeopt.structure.site import AttentionSite, TensorRef, find_attention
from gaugeopt.fix.transport import reduced_ref

__all__ = [
    "GRANULARITIES",
    "MODES",
    "Side",
    "PairPlan",
    "plan_pairs",
    "read_mean_squares",
    "slot_rms",
    "PairScales",
    "drift_table",
    "qk_drift",
    "vo_drift",
]

GRANULARITIES = ("auto", "head", "channel", "plane")
VO_GRANULARITIES = ("head", "channel")
MODES = ("auto", "lrm", "plain")


@dataclass(frozen=True)
class Side:
    """One side of a balanced pair: the tensors that share its gauge factor.

    ``members`` are ``(role, ref)`` with role ``"q.weight"``, ``"q.bias"``, ``"q.row_mult"``,
    ``"o.weight"``, ``"o.col_mult"``...; every member has one value per channel of its
    ``(heads, width)`` canonical layout after reducing the weight's broadcast axis.
    ``n = heads // h_kv`` is ``n_rep`` for the side indexed by query heads (Q, O), else 1.
    """

    proj: str
    members: tuple[tuple[str, TensorRef], ...]
    heads: int
    n: int


@dataclass(frozen=True)
class PairPlan:
    """What the fix of one gauge (Q/K or V/O) of one attention site touches.

    Side ``a`` (Q or V) is divided by the gauge factor ``g``, side ``b`` (K or O) multiplied.
    ``slot[c]`` is the scale slot of channel ``c`` (``(width,)`` long, values ``< n_slots``).
    """

    site: AttentionSite
    kind: str  # "qk" | "vo"
    mode: str  # "lrm" | "plain"
    granularity: str  # resolved: "head" | "channel" | "plane"
    a: Side
    b: Side
    slot: torch.Tensor
    n_slots: int

    @property
    def h_kv(self) -> int:
        return self.site.h_kv

    @property
    def width(self) -> int:
        return int(self.slot.numel())

    def batch_key(self) -> tuple:
        """Plans with equal keys are stacked along a layer axis and balanced in one call."""
        return (self.kind, self.h_kv, self.a.n, self.b.n, tuple(self.slot.tolist()), self.n_slots)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise GaugeError(f"{name}={value!r} is not one of {choices}")


def _resolve_mode(site: AttentionSite, kind: str, mode: str) -> str:
    if kind == "qk":
        have = site.has_multipliers
        need = "q.row_mult and k.row_mult"
    else:
        have = site.v.row_mult is not None and site.o.col_mult is not None
        need = "v.row_mult and o.col_mult"
    if mode == "lrm" and not have:
        raise GaugeError(
            f"mode='lrm' but {site.name} has no learnable multipliers ({need}); convert the model with "
            "gaugeopt.apply_lrm, or use mode='plain' (rescale the W rows and biases) or mode='auto'"
        )
    if mode == "auto":
        return "lrm" if have else "plain"
    return mode


def _slots(site: AttentionSite, kind: str, granularity: str) -> tuple[str, torch.Tensor, int]:
    width = site.d_k if kind == "qk" else site.d_v
    rope = site.rope if kind == "qk" else None
    if granularity == "auto":
        granularity = "plane" if rope is not None and rope.active else "head"
    if granularity == "head":
        return "head", torch.zeros(width, dtype=torch.long), 1
    if granularity == "channel":
        if rope is not None and rope.active:
            raise GaugeError(
                f"granularity='channel' on {site.name}, which uses RoPE ({rope.kind}, rotary_dim={rope.rotary_dim}): "
                "scaling the two coordinates of a rotation plane differently does not commute with the position-"
                "dependent rotation, so q·k (and the model) would change. Use granularity='plane' (one scale per "
                "RoPE plane, the finest valid diagonal gauge), 'head', or 'auto' (plane under RoPE)"
            )
        return "channel", torch.arange(width), width
    if granularity == "plane":
        if kind == "vo":
            raise GaugeError("vo_granularity='plane': V/O has no rotation planes; use 'head' or 'channel'")
        idx = plane_index(site.rope, width)
        return "plane", idx, int(idx.max()) + 1
    raise GaugeError(f"granularity={granularity!r} is not one of {GRANULARITIES}")


def _side(site: AttentionSite, proj: str, mode: str) -> Side:
    p = getattr(site, proj)
    heads = site.h if proj in ("q", "o") else site.h_kv
    if mode == "lrm":
        role = "col_mult" if proj == "o" else "row_mult"
        members = ((f"{proj}.{role}", getattr(p, role)),)
    else:
        members = ((f"{proj}.weight", p.weight),)
        if proj != "o" and p.bias is not None:  # the O bias is added after the heads are summed
            members += ((f"{proj}.bias", p.bias),)
    return Side(proj, members, heads, heads // site.h_kv)


def plan_pairs(
    sites: Sequence[AttentionSite],
    *,
    kinds: Sequence[str] = ("qk",),
    granularity: str = "auto",
    vo_granularity: str = "head",
    mode: str = "auto",
) -> list[PairPlan]:
    """Build the fix/metric plan for ``sites`` (validates every option; no tensor is read).

    Args:
        kinds: ``"qk"`` and/or ``"vo"``.
        granularity: Q/K slots, one of :data:`GRANULARITIES` (``"auto"``: per RoPE plane
            where the site uses RoPE, per head otherwise).
        vo_granularity: V/O slots, ``"head"`` or ``"channel"`` (RoPE does not act on values).
        mode: ``"lrm"`` (multipliers; refuses a site without them), ``"plain"`` (stored rows
            and biases) or ``"auto"`` (multipliers where present).
    """
    _check_choice("granularity", granularity, GRANULARITIES)
    _check_choice("vo_granularity", vo_granularity, VO_GRANULARITIES)
    _check_choice("mode", mode, MODES)
    for k in kinds:
        _check_choice("kind", k, ("qk", "vo"))
    plans = []
    for site in sites:
        for kind in kinds:
            m = _resolve_mode(site, kind, mode)
            gran, slot, n_slots = _slots(site, kind, granularity if kind == "qk" else vo_granularity)
            a, b = ("q", "k") if kind == "qk" else ("v", "o")
            plans.append(PairPlan(site, kind, m, gran, _side(site, a, m), _side(site, b, m), slot, n_slots))
    return plans


@torch.no_grad()
def read_mean_squares(side: Side, h_kv: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mean square of each channel of ``side``: ``(h_kv, n, width)``, replicated on every rank.

    For multipliers it is ``r²``; for stored rows the mean of the squares of the whole
    augmented row ``[W[c, :] | b[c]]`` (or O column). Computed in at least float32.
    """
    total, length = None, 0
    for role, ref in side.members:
        p = ref.param.detach()
        cdt = dtype or torch.promote_types(p.dtype, torch.float32)
        rref, axis, _ = reduced_ref(ref, role)
        x = p.to(cdt)
        if axis is None:
            sq = full(x * x)
            length += 1
        else:
            sq = full((x * x).sum(dim=axis, keepdim=True))
            length += p.shape[axis]
        v = rref.view(sq).reshape(side.heads, -1)
        total = v if total is None else total + v
    return (total / length).reshape(h_kv, side.n, -1)


def slot_rms(ms: torch.Tensor, slot: torch.Tensor, n_slots: int) -> torch.Tensor:
    """RMS per slot: ``ms: (..., n, width)`` mean squares → ``(..., n_slots)``, averaging over
    the ``n`` heads of a group and the channels of each slot (all rows have equal length)."""
    onehot = torch.nn.functional.one_hot(slot.to(ms.device), n_slots).to(ms.dtype)  # (width, n_slots)
    count = onehot.sum(0) * ms.shape[-2]
    return ((ms.sum(-2) @ onehot) / count).sqrt()


@dataclass
class PairScales:
    """Scales of one gauge of one layer at one granularity (tensors ``(h_kv, n_slots)``).

    Attributes:
        name: site name; ``layer``: its index; ``kind``: ``"qk"`` or ``"vo"``.
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


def _log_ratio(s_a: torch.Tensor, s_b: torch.Tensor, eps: float) -> torch.Tensor:
    return ((s_a + eps) / (s_b + eps)).log().abs()


def _check_eps(eps: float) -> None:
    if not eps > 0:
        raise GaugeError(f"eps={eps!r} must be > 0 (paper 002 uses 1e-12); it keeps g finite for an all-zero head")


def drift_table(
    model: nn.Module | None,
    sites: Sequence[AttentionSite] | None = None,
    *,
    kinds: Sequence[str] = ("qk",),
    granularity: str = "head",
    vo_granularity: str = "head",
    mode: str = "auto",
    eps: float = 1e-12,
) -> list[PairScales]:
    """Per-layer, per-head (KV group) and per-slot scales, drift and scale product."""
    _check_eps(eps)
    sites = find_attention(model) if sites is None else list(sites)
    out = []
    for plan in plan_pairs(sites, kinds=kinds, granularity=granularity, vo_granularity=vo_granularity, mode=mode):
        s_a = slot_rms(read_mean_squares(plan.a, plan.h_kv), plan.slot, plan.n_slots)
        s_b = slot_rms(read_mean_squares(plan.b, plan.h_kv), plan.slot, plan.n_slots)
        out.append(PairScales(plan.site.name, plan.site.layer_index, plan.kind, plan.mode, plan.granularity,
                              s_a, s_b, _log_ratio(s_a, s_b, eps), s_a * s_b))
    return out


def qk_drift(
    model: nn.Module | None,
    sites: Sequence[AttentionSite] | None = None,
    *,
    granularity: str = "head",
    mode: str = "auto",
    eps: float = 1e-12,
) -> float:
    """Paper 002 eq. 3: ``max over layers and heads of |log(s_Q/s_K)|`` (KV groups under GQA).

    Args:
        model: the model (ignored when ``sites`` is given).
        granularity: ``"head"`` (the paper), ``"channel"`` or ``"plane"``: the max over those
            slots instead (``"auto"`` = plane under RoPE, head otherwise).
        mode: ``"auto"`` (multipliers where the model has them, else the W rows and biases),
            ``"lrm"`` or ``"plain"``.
    """
    return max(float(t.drift.max()) for t in drift_table(model, sites, granularity=granularity, mode=mode, eps=eps))


def vo_drift(
    model: nn.Module | None,
    sites: Sequence[AttentionSite] | None = None,
    *,
    granularity: str = "head",
    mode: str = "auto",
    eps: float = 1e-12,
) -> float:
    """The V/O analogue of :func:`qk_drift`: ``max |log(s_V/s_O)|`` (``r_V`` rows vs ``c_O`` columns)."""
    tables = drift_table(model, sites, kinds=("vo",), vo_granularity=granularity, mode=mode, eps=eps)
    return max(float(t.drift.max()) for t in tables)
