"""GaugeFix: function-preserving balancing of the Q/K (and V/O) gauge (paper 002, DESIGN.md §3).

After an optimizer step, every KV group ``j`` of every attention layer gets a gauge factor per
*slot* (a set of channels sharing one scale) and its two sides are rescaled in opposite
directions, which leaves every ``q·k`` (and ``W_O v``) unchanged::

    s_Q = RMS(side Q in the slot),  s_K = RMS(side K in the slot)          (GQA: over all query heads of j)
    g   = sqrt((s_Q + ε) / (s_K + ε))                                        (eq. 4, ε = 1e-12)
    Q   ← Q / g,   K ← K · g                                                 (eq. 5-6)

The granularities (which channels form a slot; ``c`` a channel of ``d_k``, ``i`` a query head of
group ``j``, ``r`` the LRM row multipliers or, without multipliers, the stored augmented rows
``[W | b]``, whose mean square per channel is ``‖[W[c,:] | b[c]]‖² / (d + 1)``):

* ``"head"`` (the paper):  ``s_Q[j]² = mean_{i∈j, c} r_Q[i,c]²``, ``s_K[j]² = mean_c r_K[j,c]²``,
  one ``g[j]`` for the whole group; afterwards ``s_Q[j] = s_K[j]``.
* ``"channel"``: ``s_Q[j,c]² = mean_{i∈j} r_Q[i,c]²``, ``s_K[j,c] = |r_K[j,c]|``, one ``g[j,c]`` per
  channel; afterwards every channel is balanced (and hence every head). Refused under RoPE:
  scaling the two coordinates of a rotation plane differently does not commute with the
  rotation, so it would change the function.
* ``"plane"``: ``s_Q[j,m]² = mean_{i∈j, c∈plane m} r_Q[i,c]²`` for each RoPE plane ``m``
  (:func:`gaugeopt.structure.rope.plane_index`; each non-rotary channel is its own plane), one ``g[j,m]``
  shared by both coordinates: ``g·I`` on the plane commutes with the rotation. The finest
  valid diagonal gauge under RoPE.
* ``"auto"``: ``"plane"`` where the layer uses RoPE, ``"head"`` otherwise.

V/O (``vo=True``): the same with ``r_V[j]`` (rows of ``W_V[j]`` + ``b_V[j]``) divided and
``c_O[i]`` (columns ``W_O[:, i]``) multiplied by ``g = sqrt((s_V + ε)/(s_O + ε))``, per head or
per channel (``vo_granularity``).

**Magnitude control** (paper 002 §5's proposed follow-up). Balancing never changes the
gauge-invariant product ``P = s_Q·s_K``; without weight decay on the Q/K multipliers it grows.
``product_decay=λ`` multiplies *both* sides of every slot by ``sqrt(1 − λ)`` after balancing,
so ``P ← (1 − λ)·P`` and the pair stays balanced; ``product_max=P_max`` additionally caps each
slot's product at ``P_max`` the same symmetric way. Both **change the function on purpose**
(the attention logits of a slot shrink by the same factor): they are decoupled weight decay
acting on the product only. Decoupled weight decay with learning rate ``η`` and coefficient
``w`` multiplies ``r_Q`` and ``r_K`` each by ``(1 − η w)`` per step, i.e. ``P`` by
``(1 − η w)²``: fixing every ``N`` steps with ``1 − λ = (1 − η w)^{2N}`` removes the same
magnitude, but never the ratio (decay is gauge-blind) and never other parameters. Like
decoupled weight decay, this part does not touch the optimizer state: only the
function-preserving factor ``1/g, g`` is transported.

**Optimizer state** (``transport_state=True``, the default): the rescaled parameters' moments are
transported (:mod:`gaugeopt.fix.transport`: ``exp_avg/s``, ``exp_avg_sq/s²``, SGD momentum ``/s``), so
the next step is the one the optimizer would take in the new coordinates. ``transport_state=False``
leaves them stale, as paper 002 did. Unknown optimizers follow ``unknown_state``.

**Structure of the computation** (shared by the Lightning callback, the optimizer wrapper and
the kernels): (a) :func:`gaugeopt.fix.plan.plan_pairs` — which tensors, which channels share a
slot, built from the sites; (b) :func:`balance_factors` — a pure function of stacked
per-channel mean squares ``(L, h_kv, n, width)`` returning the factors and the drift before and
after, batched over layers and heads with tensor ops (**the seam a fused kernel replaces**);
(c) :func:`apply_factors` — in-place writes to parameters and optimizer state (DTensor aware).

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
    ...                                          n_kv_head=2, n_embd=32, rope="split_half")))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    >>> x = torch.randint(0, 64, (2, 16))
    >>> for _ in range(3):
    ...     model(x, x)[1].backward(); opt.step(); opt.zero_grad()
    >>> report = gaugeopt.gauge_fix(model, opt)        # granularity "auto" = per RoPE plane here
    >>> report.max_drift_before > 1e-4, gaugeopt.qk_drift(model) < 1e-6
    (True, True)
    >>> sorted(report.as_dict())[:3]
    ['gaugefix/heads_fixed', 'gaugefix/params_left', 'gaugefix/params_reset']
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from gaugeopt.fix.plan import PairPlan, _check_eps, _log_ratio, plan_pairs, qk_drift, read_mean_squares, slot_rms, vo_drift
from gaugeopt.errors import GaugeError
from gaugeopt.structure.site import AttentionSite, find_attention
from gaugeopt.fix.transport import UNKNOWN_STATE_POLICIES, classify_state, rescale_param, rescale_state, storage_factor

__all__ = ["gauge_fix", "qk_drift", "vo_drift", "GaugeFixReport", "PairRecord", "Balance", "balance_factors", "apply_factors"]


# ---------------------------------------------------------------------- (b) the pure seam
@dataclass
class Balance:
    """Output of :func:`balance_factors` (``L`` layers, ``G = h_kv`` groups, ``C`` channels,
    ``S`` slots).

    Attributes:
        gauge_a, gauge_b: ``(L, G, C)`` function-preserving factors per channel, ``1/g`` and ``g``.
        magnitude: ``(L, G, C)`` symmetric magnitude factor (ones without magnitude control);
            the parameters are multiplied by ``gauge·magnitude``, the optimizer state by ``gauge``.
        drift_before, drift_after: ``(L, G, S)`` slot drift ``|log((s_a+ε)/(s_b+ε))|``.
        product_before, product_after: ``(L, G, S)`` scale product ``s_a·s_b``.
    """

    gauge_a: torch.Tensor
    gauge_b: torch.Tensor
    magnitude: torch.Tensor
    drift_before: torch.Tensor
    drift_after: torch.Tensor
    product_before: torch.Tensor
    product_after: torch.Tensor


def balance_factors(
    ms_a: torch.Tensor,
    ms_b: torch.Tensor,
    slot: torch.Tensor,
    n_slots: int,
    *,
    eps: float = 1e-12,
    product_decay: float | None = None,
    product_max: float | None = None,
) -> Balance:
    """Gauge factors from per-channel mean squares — pure, batched, no parameter access.

    Args:
        ms_a: ``(L, G, n_a, C)`` mean squares of side a (Q or V) per channel; ``n_a`` heads per group.
        ms_b: ``(L, G, n_b, C)`` the same for side b (K or O).
        slot: ``(C,)`` long, slot of each channel; ``n_slots`` their number.
        eps, product_decay, product_max: see :func:`gauge_fix`.

    Returns:
        :class:`Balance`. ``drift_after`` is computed from the rescaled scales
        ``m·s_a/g, m·s_b·g`` (equal to a re-measurement up to the rounding of the writes).
    """
    s_a = slot_rms(ms_a, slot, n_slots)  # (L, G, S)
    s_b = slot_rms(ms_b, slot, n_slots)
    g = ((s_a + eps) / (s_b + eps)).sqrt()
    product = s_a * s_b
    m = torch.ones_like(g)
    if product_decay is not None:
        m = m * (1.0 - product_decay) ** 0.5
    if product_max is not None:
        m = m * (product_max / (product * m * m).clamp_min(torch.finfo(product.dtype).tiny)).clamp(max=1.0).sqrt()
    new_a, new_b = m * s_a / g, m * s_b * g
    idx = slot.to(g.device)
    return Balance(
        gauge_a=(1.0 / g)[..., idx],
        gauge_b=g[..., idx],
        magnitude=m[..., idx],
        drift_before=_log_ratio(s_a, s_b, eps),
        drift_after=_log_ratio(new_a, new_b, eps),
        product_before=product,
        product_after=new_a * new_b,
    )


# ---------------------------------------------------------------------- the report
@dataclass
class PairRecord:
    """What the fix did to one gauge of one layer (tensors ``(h_kv, n_slots)``)."""

    name: str
    layer: int
    kind: str
    mode: str
    granularity: str
    drift_before: torch.Tensor
    drift_after: torch.Tensor
    product_before: torch.Tensor
    product_after: torch.Tensor
    heads_fixed: int


@dataclass
class GaugeFixReport:
    """Result of :func:`gauge_fix`.

    Attributes:
        pairs: one :class:`PairRecord` per layer and gauge (``"qk"``, then ``"vo"`` if asked).
        transported, reset, left: names of the parameters whose optimizer state was transported,
            reset, or left stale (``unknown_state``); parameters without state are in none.
    """

    pairs: list[PairRecord] = field(default_factory=list)
    transported: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    def _of(self, kind: str) -> list[PairRecord]:
        return [p for p in self.pairs if p.kind == kind]

    def _max(self, kind: str, attr: str) -> float:
        vals = [float(getattr(p, attr).max()) for p in self._of(kind)]
        return max(vals) if vals else 0.0

    @property
    def max_drift_before(self) -> float:
        """Q/K slot drift before the fix, max over layers, groups and slots."""
        return self._max("qk", "drift_before")

    @property
    def max_drift_after(self) -> float:
        return self._max("qk", "drift_after")

    @property
    def heads_fixed(self) -> int:
        """Query heads (Q/K) whose factor differed from 1 in at least one channel (right after a
        fix, rounding alone can make a factor differ from 1 by an ulp, which counts)."""
        return sum(p.heads_fixed for p in self._of("qk"))

    def per_layer(self, kind: str = "qk", attr: str = "drift_after") -> list[float]:
        """``attr`` (``drift_before``, ``product_after``, ...) max per layer."""
        return [float(getattr(p, attr).max()) for p in self._of(kind)]

    def as_dict(self, prefix: str = "gaugefix/", per_layer: bool = False) -> dict[str, float]:
        """Flat ``{name: float}`` for loggers (``self.log_dict(report.as_dict())``)."""
        out: dict[str, float] = {
            f"{prefix}heads_fixed": float(self.heads_fixed),
            f"{prefix}params_transported": float(len(self.transported)),
            f"{prefix}params_reset": float(len(self.reset)),
            f"{prefix}params_left": float(len(self.left)),
        }
        for kind in ("qk", "vo"):
            recs = self._of(kind)
            if not recs:
                continue
            prod = torch.cat([p.product_after.flatten() for p in recs])
            out[f"{prefix}{kind}_drift_before"] = self._max(kind, "drift_before")
            out[f"{prefix}{kind}_drift_after"] = self._max(kind, "drift_after")
            out[f"{prefix}{kind}_scale_product_mean"] = float(prod.mean())
            out[f"{prefix}{kind}_scale_product_max"] = float(prod.max())
            if per_layer:
                for p in recs:
                    out[f"{prefix}layer{p.layer}/{kind}_drift_before"] = float(p.drift_before.max())
                    out[f"{prefix}layer{p.layer}/{kind}_scale_product"] = float(p.product_after.mean())
        return out


# ---------------------------------------------------------------------- (c) applying factors
def apply_factors(
    plans: Sequence[PairPlan],
    factors: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    optimizer=None,
    *,
    unknown_state: str = "error",
) -> dict[str, list[str]]:
    """Rescale parameters (and optimizer state) in place.

    Args:
        plans: the plans; ``factors[k] = (gauge_a, gauge_b, magnitude)`` for ``plans[k]``, each
            ``(h_kv, width)``. Side a is multiplied by ``gauge_a·magnitude``, side b by
            ``gauge_b·magnitude`` (query-head sides repeat their group's factor).
        optimizer: whose state to transport by the gauge part (``None``: parameters only).

    Returns:
        ``{"transported": [...], "reset": [...], "left": [...]}`` parameter names.

    Nothing is written unless every parameter's state can be handled (``unknown_state="error"``
    raises before the first write).
    """
    # one storage-layout factor per parameter: several refs can share a parameter (fused QKV)
    per_param: dict[int, list] = {}
    for plan, (fa, fb, mag) in zip(plans, factors):
        for side, gauge in ((plan.a, fa), (plan.b, fb)):
            g_side = gauge.repeat_interleave(side.n, dim=0) if side.n > 1 else gauge  # (heads, width)
            m_side = mag.repeat_interleave(side.n, dim=0) if side.n > 1 else mag
            for role, ref in side.members:
                p = ref.param
                entry = per_param.setdefault(id(p), [p, ref.name, None, None])
                entry[2] = storage_factor(ref, role, g_side * m_side, out=entry[2])
                entry[3] = storage_factor(ref, role, g_side, out=entry[3])
    outcome: dict[str, list[str]] = {"transported": [], "reset": [], "left": []}
    if optimizer is not None:
        for p, name, _, _ in per_param.values():
            classify_state(optimizer, p, unknown_state=unknown_state)  # raises before any write
    for p, name, f_param, f_gauge in per_param.values():
        with torch.no_grad():
            rescale_param(p, f_param)
        if optimizer is not None:
            what = rescale_state(optimizer, p, f_gauge, unknown_state=unknown_state)
            if what in outcome:
                outcome[what].append(name)
    return outcome


# ---------------------------------------------------------------------- the public entry
def check_fix_options(unknown_state: str, product_decay: float | None, product_max: float | None, eps: float) -> None:
    """Validate the options every GaugeFix path (torch, fused kernel) shares."""
    _check_eps(eps)
    if unknown_state not in UNKNOWN_STATE_POLICIES:
        raise GaugeError(f"unknown_state={unknown_state!r} is not one of {UNKNOWN_STATE_POLICIES}")
    if product_decay is not None and not 0.0 <= product_decay < 1.0:
        raise GaugeError(f"product_decay={product_decay!r} must be in [0, 1): the product is multiplied by 1 - product_decay")
    if product_max is not None and not product_max > 0:
        raise GaugeError(f"product_max={product_max!r} must be > 0")


def gauge_fix(
    model: nn.Module | None,
    optimizer=None,
    granularity: str = "auto",
    *,
    sites: Sequence[AttentionSite] | None = None,
    vo: bool = False,
    vo_granularity: str = "head",
    mode: str = "auto",
    transport_state: bool = True,
    unknown_state: str = "error",
    product_decay: float | None = None,
    product_max: float | None = None,
    eps: float = 1e-12,
    backend: str = "auto",
) -> GaugeFixReport:
    """Balance the Q/K (and optionally V/O) gauge of every attention layer, in place.

    The function of the model is unchanged up to rounding (unless ``product_decay`` or
    ``product_max`` is set); see the module docstring for the formulas.

    Args:
        model: the model (a DDP / ``torch.compile`` / FSDP2 module is fine); ignored when
            ``sites`` is given.
        optimizer: the optimizer whose state is transported (``None``: parameters only).
        granularity: ``"auto"`` (per RoPE plane under RoPE, else per head), ``"head"``,
            ``"channel"`` (refused under RoPE) or ``"plane"``.
        sites: precomputed :func:`gaugeopt.find_attention` records (saves the module walk).
        vo: also balance V/O (``r_V`` vs ``c_O``; plain: ``W_V`` rows vs ``W_O`` columns).
        vo_granularity: ``"head"`` or ``"channel"``.
        mode: ``"auto"`` (LRM multipliers where present, else the stored rows and biases),
            ``"lrm"`` (refuse layers without multipliers) or ``"plain"``.
        transport_state: transport the optimizer state (``False``: paper 002's setting).
        unknown_state: ``"error"``, ``"reset"`` or ``"leave"`` for optimizers without a state
            rule (:mod:`gaugeopt.fix.transport`).
        product_decay: ``λ ∈ [0, 1)``: shrink each slot's ``s_Q·s_K`` by ``(1 − λ)``
            symmetrically (changes the function on purpose).
        product_max: cap each slot's ``s_Q·s_K`` at this value, symmetrically.
        eps: ε of eq. 4 (> 0).
        backend: ``"auto"`` (the fused Triton kernel of :mod:`gaugeopt.kernels` on CUDA
            tensors when Triton is importable, this torch code otherwise), ``"triton"`` or
            ``"torch"`` to force one; the environment variable ``GAUGEOPT_BACKEND`` overrides
            ``"auto"``. Forcing Triton where it cannot run raises :class:`GaugeError`.

    Returns:
        :class:`GaugeFixReport` (drift and scale product before/after per layer, heads fixed,
        state outcome); ``report.as_dict()`` for loggers.
    """
    check_fix_options(unknown_state, product_decay, product_max, eps)
    if model is None and sites is None:
        raise GaugeError("gauge_fix: pass a model or sites=find_attention(model)")
    sites = find_attention(model) if sites is None else list(sites)
    kinds = ("qk", "vo") if vo else ("qk",)
    plans = plan_pairs(sites, kinds=kinds, granularity=granularity, vo_granularity=vo_granularity, mode=mode)
    fused = _fused(plans, optimizer if transport_state else None, backend=backend, unknown_state=unknown_state,
                   product_decay=product_decay, product_max=product_max, eps=eps)
    if fused is not None:
        return fused

    # (b) read every statistic first (fused parameters hold several sides), then balance in batches
    stats = [(read_mean_squares(p.a, p.h_kv), read_mean_squares(p.b, p.h_kv)) for p in plans]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, plan in enumerate(plans):
        groups[plan.batch_key() + (stats[k][0].dtype, stats[k][0].device)].append(k)
    results: list = [None] * len(plans)
    for members in groups.values():
        first = plans[members[0]]
        bal = balance_factors(
            torch.stack([stats[k][0] for k in members]), torch.stack([stats[k][1] for k in members]),
            first.slot, first.n_slots, eps=eps, product_decay=product_decay, product_max=product_max,
        )
        for row, k in enumerate(members):
            results[k] = (bal, row)

    factors = [(b.gauge_a[r], b.gauge_b[r], b.magnitude[r]) for b, r in results]
    outcome = apply_factors(plans, factors, optimizer if transport_state else None, unknown_state=unknown_state)

    report = GaugeFixReport(**outcome)
    # a group counts as fixed when its factor differs from 1 by more than rounding; one host sync
    changed = [
        ((b.gauge_a[r] * b.magnitude[r] - 1).abs() > 4 * torch.finfo(b.gauge_a.dtype).eps).any(-1).sum()
        for b, r in results
    ]
    counts = torch.stack(changed).tolist() if changed else []
    for plan, (b, r), n in zip(plans, results, counts):
        report.pairs.append(PairRecord(
            plan.site.name, plan.site.layer_index, plan.kind, plan.mode, plan.granularity,
            b.drift_before[r], b.drift_after[r], b.product_before[r], b.product_after[r],
            int(n) * (plan.site.n_rep if plan.kind == "qk" else 1),
        ))
    return report


def _fused(plans, optimizer, *, backend: str, **options) -> GaugeFixReport | None:
    """The fused kernel's report, or ``None`` when the dispatch keeps this torch code."""
    try:
        from gaugeopt.kernels.ops import try_fused_gauge_fix
    except ModuleNotFoundError as err:  # gaugeopt used from a source tree without kernels/ installed
        if backend == "triton":
            raise GaugeError(f"backend='triton' but gaugeopt.kernels is not installed ({err}); pip install -e .") from err
        return None
    return try_fused_gauge_fix(plans, optimizer, backend=backend, **options)
