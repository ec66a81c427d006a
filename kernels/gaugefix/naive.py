"""The fused GaugeFix in plain torch, pair by pair: the reference the kernel is tested against.

Takes the same :class:`~.spec.FixPair` list as :func:`.fused.prepare` and computes, for each pair
and each of its ``groups`` (``n_a``, ``n_b`` heads per group, ``len`` = the columns of a side's
parameters summed, ``|s|`` the channels of slot ``s``)::

    s_a[j, s] = sqrt( Σ_{c∈s} Σ_{heads of j} Σ_x X_a[head, c, x]² / len_a / (|s|·n_a) )     likewise s_b
    g = sqrt((s_a + eps)/(s_b + eps))            (1 where that is not finite or not positive)
    m = sqrt(1 − product_decay) · sqrt(min(1, product_max / (s_a·s_b·(1 − product_decay))))
    X_a ← X_a·m/g,  X_b ← X_b·m·g                 (every parameter, rounded once to its dtype)
    M_a ← M_a / g^(−k),  M_b ← M_b / g^k          (optimizer state of power k)

in float64 for float64 parameters and float32 otherwise, with torch's IEEE-rounded division and
square root, one tensor at a time and without descriptor tables, strides or tiles — what the
kernel computes, written the way one would check it by hand. It returns what
:meth:`.fused.PreparedFix.run` returns: per pair ``(drift_before, drift_after, product_before,
product_after)``, each ``(groups, n_slots)``, then ``changed`` (some ``|m/g − 1| > 4·ε``) and
``skipped`` (a slot whose scale is not finite, left alone), each ``(groups,)``.

Example:
    >>> import torch
    >>> from gaugeopt.kernels.gaugefix import FixPair, FixTensor, fix_naive
    >>> r_q, r_k = torch.full((2, 4), 2.0), torch.full((1, 4), 0.5)   # 2 query heads read 1 KV head
    >>> pair = FixPair([FixTensor(r_q, 0), FixTensor(r_k, 1)], groups=1, width=4, slot=[0, 0, 0, 0],
    ...                n_slots=1, repeat_a=2, repeat_b=1)
    >>> (numbers,) = fix_naive([pair])
    >>> r_q[0, 0].item(), r_k[0, 0].item(), round(float(numbers[0][0, 0]), 4), bool(numbers[4][0])
    (1.0, 1.0, 1.3863, True)
"""

from __future__ import annotations

from typing import Sequence

import torch

from gaugeopt.kernels.gaugefix.spec import CHANGED_ULPS, FixPair, FixTensor, accumulation_dtype, check_pairs

__all__ = ["fix_naive"]


def _rows(t: FixTensor) -> torch.Tensor:
    """The tensor as ``(heads, width, n_cols)`` (a view)."""
    v = t.view
    if v.dim() == 2:
        return v[:, :, None]
    return v.permute(1, 2, 0) if t.columns else v


def _side_scales(pair: FixPair, side: int, acc: torch.dtype) -> torch.Tensor:
    """``(groups, n_slots)`` root mean squares of one side's parameters over each slot's channels."""
    n = pair.repeat_a if side == 0 else pair.repeat_b
    sq = torch.zeros(pair.groups, pair.width, dtype=acc, device=pair.tensors[0].view.device)
    length = 0
    for t in pair.params:
        if t.side != side:
            continue
        x = _rows(t).to(acc)
        sq += (x * x).sum(-1).reshape(pair.groups, n, pair.width).sum(1)
        length += x.shape[-1]
    slot = torch.as_tensor(pair.slot, device=sq.device)
    per_slot = torch.zeros(pair.groups, pair.n_slots, dtype=acc, device=sq.device).index_add_(1, slot, sq / length)
    count = torch.bincount(slot, minlength=pair.n_slots).to(acc)
    return (per_slot / (count * n)).sqrt()


def _scale_(t: FixTensor, factor: torch.Tensor, repeat: int, acc: torch.dtype, divide: bool) -> None:
    """``view ← view·f`` (or ``/ f``) with ``f`` the ``(groups, width)`` factor of each head's group."""
    per_head = factor.repeat_interleave(repeat, dim=0)  # (heads, width)
    rows = _rows(t)
    new = rows.to(acc) / per_head[:, :, None] if divide else rows.to(acc) * per_head[:, :, None]
    rows.copy_(new.to(rows.dtype))


def fix_naive(
    pairs: Sequence[FixPair],
    *,
    eps: float = 1e-12,
    product_decay: float | None = None,
    product_max: float | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Balance every pair in place (arguments as :func:`.fused.prepare`); returns the numbers
    :meth:`.fused.PreparedFix.run` returns."""
    pairs = list(pairs)
    check_pairs(pairs)
    results = []
    for pair in pairs:
        acc = accumulation_dtype(pair.params[0].view.dtype)
        fi = torch.finfo(acc)
        s_a, s_b = _side_scales(pair, 0, acc), _side_scales(pair, 1, acc)
        ratio = (s_a + eps) / (s_b + eps)
        g = ratio.sqrt()
        finite = torch.isfinite(g) & (g > 0)
        g = torch.where(finite, g, torch.ones_like(g))
        product = s_a * s_b
        mag = torch.full_like(g, 1.0 if product_decay is None else (1.0 - product_decay) ** 0.5)
        if product_max is not None:
            cap = torch.full_like(g, product_max) / torch.clamp_min(product * mag * mag, fi.tiny)
            mag = mag * torch.clamp_max(cap, 1.0).sqrt()
        mag = torch.where(finite, mag, torch.ones_like(mag))
        inv_g = 1.0 / g
        new_a, new_b = mag * s_a / g, mag * s_b * g
        numbers = (
            ratio.log().abs(), ((new_a + eps) / (new_b + eps)).log().abs(), product, new_a * new_b,
            ((inv_g * mag - 1.0).abs() > CHANGED_ULPS * fi.eps).any(1), (~finite).any(1),
        )
        slot = torch.as_tensor(pair.slot, device=g.device)
        param_factor = ((inv_g * mag)[:, slot], (g * mag)[:, slot])  # per channel: parameters by gauge·magnitude
        state_factor = (inv_g[:, slot], g[:, slot])  # the state by the gauge alone
        for t in pair.tensors:
            repeat = pair.repeat_a if t.side == 0 else pair.repeat_b
            if t.power == 0:
                _scale_(t, param_factor[t.side], repeat, acc, divide=False)
            else:
                f = state_factor[t.side]
                _scale_(t, f if t.power == 1 else f * f, repeat, acc, divide=True)
        results.append(numbers)
    return results
