"""The numbers of a gauge fix, as a pure function of per-channel mean squares (paper 002 eq. 4-6).

For every KV group ``j`` and slot ``s`` (a set of channels sharing one scale)::

    s_a = RMS(side a in the slot),  s_b = RMS(side b in the slot)     (over the group's heads)
    g   = sqrt((s_a + ε) / (s_b + ε))                                  (eq. 4, ε = 1e-12)
    a   ← a · m/g,   b ← b · m·g                                       (eq. 5-6; m = 1 without
                                                                        magnitude control)

so that afterwards ``s_a = s_b`` and the product ``s_a·s_b`` is unchanged (multiplied by ``m²``).

**Magnitude control** (paper 002 §5's proposed follow-up). ``product_decay=λ`` sets
``m = sqrt(1 − λ)`` so ``P ← (1 − λ)·P``; ``product_max=P_max`` additionally caps each slot's
product at ``P_max`` the same symmetric way. Both change the function on purpose (decoupled
weight decay acting on the product only); the optimizer state is transported by the gauge part
``1/g, g`` alone.

**Changed groups.** A group counts as fixed when its factor ``m/g`` differs from 1 by more than
rounding: ``|m/g − 1| > 4·ε_mach`` of the compute dtype in some slot (:func:`changed_groups`).
Right after a fix the factors are 1 up to an ulp, so a second fix reports nothing changed. The
fused kernel applies the same rule.

:func:`balance_factors` is batched over a leading layer axis; the torch backend
(:mod:`gaugeopt.fix.torch_backend`) calls it, the Triton kernel computes the same numbers inside
one launch.

Example:
    >>> import torch
    >>> from gaugeopt.fix.balance import balance_factors
    >>> ms_a = torch.full((1, 1, 2, 4), 4.0)   # (layers, groups, heads per group, channels): s_a = 2
    >>> ms_b = torch.full((1, 1, 1, 4), 1.0)   # s_b = 1
    >>> bal = balance_factors(ms_a, ms_b, torch.zeros(4, dtype=torch.long), 1)
    >>> round(float(bal.gauge_b[0, 0, 0]), 4), round(float(bal.drift_before[0, 0, 0]), 4), float(bal.drift_after[0, 0, 0])
    (1.4142, 0.6931, 0.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gaugeopt.fix.drift import log_ratio, slot_rms

__all__ = ["Balance", "balance_factors", "changed_groups", "CHANGED_ULPS"]

CHANGED_ULPS = 4  # a factor within this many machine epsilons of 1 is rounding, not a fix


@dataclass
class Balance:
    """Output of :func:`balance_factors` (``L`` layers, ``G`` groups, ``C`` channels, ``S`` slots).

    Attributes:
        gauge_a, gauge_b: ``(L, G, C)`` function-preserving factors per channel, ``1/g`` and ``g``.
        magnitude: ``(L, G, C)`` symmetric magnitude factor (ones without magnitude control);
            the parameters are multiplied by ``gauge·magnitude``, the optimizer state by ``gauge``.
        drift_before, drift_after: ``(L, G, S)`` slot drift ``|log((s_a+ε)/(s_b+ε))|``.
        product_before, product_after: ``(L, G, S)`` scale product ``s_a·s_b``.
        changed: ``(L, G)`` bool, :func:`changed_groups` of the side-a parameter factor.
        skipped: ``(L, G)`` bool, groups with a non-finite scale in some slot (a NaN or Inf weight):
            those slots keep factor 1, so nothing non-finite spreads to the rest of the group.
    """

    gauge_a: torch.Tensor
    gauge_b: torch.Tensor
    magnitude: torch.Tensor
    drift_before: torch.Tensor
    drift_after: torch.Tensor
    product_before: torch.Tensor
    product_after: torch.Tensor
    changed: torch.Tensor
    skipped: torch.Tensor


def changed_groups(factor: torch.Tensor) -> torch.Tensor:
    """``(..., G, S) → (..., G)`` bool: some slot's factor differs from 1 beyond rounding."""
    return ((factor - 1).abs() > CHANGED_ULPS * torch.finfo(factor.dtype).eps).any(-1)


def balance_factors(
    ms_a: torch.Tensor,
    ms_b: torch.Tensor,
    slot: torch.Tensor,
    n_slots: int,
    *,
    eps: float = 1e-12,
    product_decay: float | None = None,
    product_max: float | None = None,
    onehot: torch.Tensor | None = None,
) -> Balance:
    """Gauge factors from per-channel mean squares — pure, batched, no parameter access.

    Args:
        ms_a: ``(L, G, n_a, C)`` mean squares of side a (Q or V) per channel; ``n_a`` heads per group.
        ms_b: ``(L, G, n_b, C)`` the same for side b (K or O).
        slot: ``(C,)`` long, slot of each channel; ``n_slots`` their number.
        eps, product_decay, product_max: see :func:`gaugeopt.gauge_fix`.
        onehot: ``one_hot(slot, n_slots)`` in the statistics' dtype and device, if the caller keeps it.

    Returns:
        :class:`Balance`. ``drift_after`` is computed from the rescaled scales
        ``m·s_a/g, m·s_b·g`` (equal to a re-measurement up to the rounding of the writes).
    """
    s_a = slot_rms(ms_a, slot, n_slots, onehot)  # (L, G, S)
    s_b = slot_rms(ms_b, slot, n_slots, onehot)
    g = ((s_a + eps) / (s_b + eps)).sqrt()
    finite = torch.isfinite(g) & (g > 0)  # a NaN/Inf weight makes its slot's scale non-finite
    g = torch.where(finite, g, torch.ones_like(g))  # ... and that slot is left alone, not spread
    inv_g = 1.0 / g
    product = s_a * s_b
    if product_decay is None and product_max is None:  # m = 1: no multiplications by it
        m = None
        new_a, new_b, factor_a = s_a * inv_g, s_b * g, inv_g
    else:
        m = torch.full_like(g, 1.0 if product_decay is None else (1.0 - product_decay) ** 0.5)
        if product_max is not None:
            m = m * (product_max / (product * m * m).clamp_min(torch.finfo(product.dtype).tiny)).clamp(max=1.0).sqrt()
        m = torch.where(finite, m, torch.ones_like(m))
        new_a, new_b, factor_a = m * s_a * inv_g, m * s_b * g, m * inv_g
    if n_slots == 1:  # one slot per group: a broadcast view instead of a gather
        def per_channel(t):
            return t.expand(*t.shape[:-1], slot.shape[0])
    else:
        idx = slot if slot.device == g.device else slot.to(g.device)

        def per_channel(t):
            return t[..., idx]
    gauge_a = per_channel(inv_g)
    return Balance(
        gauge_a=gauge_a,
        gauge_b=per_channel(g),
        magnitude=torch.ones_like(gauge_a) if m is None else per_channel(m),
        drift_before=log_ratio(s_a, s_b, eps),
        drift_after=log_ratio(new_a, new_b, eps),
        product_before=product,
        product_after=new_a * new_b,
        changed=changed_groups(factor_a),
        skipped=~finite.all(-1),
    )
