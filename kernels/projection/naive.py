"""The closed-form projection kernels in plain torch, site by site: the references they are tested against.

Both take the same descriptions as :mod:`.fused` and write the same outputs, in float64 when any
input is float64 and in float32 otherwise, with no tables, strides or tiles.

**Diagonal** (:func:`project_diagonal_naive`; ``a``, ``b`` a layer's two multipliers, per KV group
``j`` and slot ``m``, heads of the group and channels of the slot summed)::

    t[j, m] = (Σ a·u_a − Σ b·u_b) / (Σ a² + Σ b²)     (0 where the denominator ≤ rtol × the layer's largest)
    v_a = t·a,   v_b = −t·b

**RoPE planes** (:func:`project_planes_naive`). The generators of plane ``(p, q)`` are
``I`` and ``J`` (``J`` maps row ``p`` to ``q`` and ``q`` to ``−p``) acting on the augmented rows
``[W̄ | b̄]`` of the query heads (side A, twisted by ``α = λ_q/λ_p`` of their row multipliers) and,
with the opposite sign for ``I``, of the key head (side B, ``β``)::

    g_I(A) = (A_p, A_q),          g_J(A) = (α A_q, −A_p/α)
    g_I(B) = (−B_p, −B_q),        g_J(B) = (β B_q, −B_p/β)

The coefficients ``(a, b)`` of each plane and group solve the 2×2 normal equations
``G (a, b) = (⟨g_I, u⟩, ⟨g_J, u⟩)`` with the pseudo-inverse rule (eigenvalues of ``G`` clamped at 0,
those ``≤ rtol·λ_max`` dropped; here from ``torch.linalg.eigh``, in the kernel from closed-form
eigenvectors), and ``v = a·g_I + b·g_J`` is written on the rows ``p`` and ``q`` (or ``u − v``). A
twist with an exact zero is refused (the generators divide by it).

Example:
    >>> import torch
    >>> from gaugeopt.kernels.projection import PlaneMember, PlaneSite, project_planes_naive
    >>> w_q, w_k = torch.eye(2, dtype=torch.float64)[None], torch.eye(2, dtype=torch.float64)[None]  # (1, 2, 2)
    >>> u = torch.tensor([[[0.0, 1.0], [-1.0, 0.0]]], dtype=torch.float64)   # δW_Q = g_J: a rotation of Q alone
    >>> v_q, v_k = torch.zeros_like(u), torch.zeros_like(u)
    >>> site = PlaneSite([PlaneMember(w_q, u, v_q)], [PlaneMember(w_k, torch.zeros_like(u), v_k)],
    ...                  planes=[(0, 1)], groups=1, repeat_a=1, repeat_b=1)
    >>> project_planes_naive([site], rtol=1e-12)
    >>> v_q.tolist(), torch.equal(v_k, v_q)   # b = 1/2: the gauge rotates Q and K together, half of u on each
    ([[[0.0, 0.5], [-0.5, 0.0]]], True)
"""

from __future__ import annotations

from typing import Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.kernels.projection.spec import (
    DiagonalSite, PlaneMember, PlaneSite, accumulation_dtype, check_diagonal, check_planes,
)

__all__ = ["project_diagonal_naive", "project_planes_naive"]


def project_diagonal_naive(sites: Sequence[DiagonalSite], *, rtol: float, subtract: bool = False) -> None:
    """:func:`.fused.project_diagonal` in plain torch (same arguments, same outputs)."""
    sites = list(sites)
    check_diagonal(sites)
    acc = accumulation_dtype([t for s in sites for t in (s.a, s.b, s.u_a, s.u_b)])
    for s in sites:
        G, w = s.groups, s.width
        a, b = s.a.to(acc).reshape(G, s.repeat_a, w), s.b.to(acc).reshape(G, s.repeat_b, w)
        ua, ub = s.u_a.to(acc).reshape(G, s.repeat_a, w), s.u_b.to(acc).reshape(G, s.repeat_b, w)
        onehot = torch.nn.functional.one_hot(torch.as_tensor(list(s.slot), device=a.device), s.n_slots).to(acc)
        den = ((a * a).sum(1) + (b * b).sum(1)) @ onehot  # (G, n_slots)
        num = ((a * ua).sum(1) - (b * ub).sum(1)) @ onehot
        keep = den > rtol * den.max()
        t = torch.where(keep, num / torch.where(keep, den, torch.ones_like(den)), torch.zeros_like(den))
        tc = (t @ onehot.T)[:, None, :]  # per channel, for every head of the group
        va, vb = tc * a, -tc * b
        if subtract:
            va, vb = ua - va, ub - vb
        s.out_a.copy_(va.reshape(s.out_a.shape))
        s.out_b.copy_(vb.reshape(s.out_b.shape))


def _rows(t: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``(heads, width, n_cols)`` in the accumulation dtype (a bias is one column)."""
    return (t if t.dim() == 3 else t[:, :, None]).to(acc)


def _twist(tw: torch.Tensor | None, p, q, heads: int, n: int, acc, device) -> torch.Tensor:
    """``λ_q / λ_p`` per head and plane (1 without multipliers)."""
    if tw is None:
        return torch.ones(heads, n, dtype=acc, device=device)
    if bool((tw == 0).any()):
        raise GaugeError("a Q/K row multiplier has an exact zero; the gauge generators in W̄ coordinates divide by it. "
                         "Re-initialise that multiplier.")
    t = tw.to(acc)
    return t[:, q] / t[:, p]


def _side(members: list[PlaneMember], p, q, acc):
    """Per head and plane: ``‖X_p‖²``, ``‖X_q‖²``, ``⟨X_p, X_q⟩``, ``⟨U_p, X_p⟩ + ⟨U_q, X_q⟩``,
    ``⟨U_p, X_q⟩``, ``⟨U_q, X_p⟩`` over every member and column."""
    out = 0
    for m in members:
        X, U = _rows(m.param, acc), _rows(m.u, acc)
        Xp, Xq, Up, Uq = X[:, p], X[:, q], U[:, p], U[:, q]
        terms = torch.stack([(Xp * Xp).sum(-1), (Xq * Xq).sum(-1), (Xp * Xq).sum(-1),
                             (Up * Xp).sum(-1) + (Uq * Xq).sum(-1), (Up * Xq).sum(-1), (Uq * Xp).sum(-1)])
        out = out + terms
    return out  # (6, heads, planes)


def _solve_2x2(G: torch.Tensor, r: torch.Tensor, rtol: float) -> torch.Tensor:
    """Minimum-norm solutions of the PSD systems ``G x = r`` (``(..., 2, 2)``, ``(..., 2)``) under the rule."""
    lam, vec = torch.linalg.eigh(G)
    lam = lam.clamp_min(0.0)
    keep = lam > rtol * lam[..., -1:]
    inv = torch.where(keep, 1.0 / torch.where(keep, lam, torch.ones_like(lam)), torch.zeros_like(lam))
    return (vec @ (inv * (vec.mT @ r[..., None])[..., 0])[..., None])[..., 0]


def project_planes_naive(sites: Sequence[PlaneSite], *, rtol: float, subtract: bool = False) -> None:
    """:func:`.fused.project_planes` in plain torch (same arguments, same outputs)."""
    sites = list(sites)
    check_planes(sites)
    acc = accumulation_dtype([t for s in sites for m in s.a + s.b for t in (m.param, m.u)])
    for s in sites:
        p = torch.tensor([pq[0] for pq in s.planes])
        q = torch.tensor([pq[1] for pq in s.planes])
        dev, G, n = s.a[0].param.device, s.groups, len(s.planes)
        al = _twist(s.twist_a, p, q, G * s.repeat_a, n, acc, dev)  # (heads_a, planes)
        be = _twist(s.twist_b, p, q, G * s.repeat_b, n, acc, dev)

        def per_group(x: torch.Tensor, repeat: int) -> torch.Tensor:
            return x.reshape(G, repeat, n).sum(1)

        A_pp, A_qq, A_pq, A_r, A_pq_u, A_qp_u = _side(s.a, p, q, acc)
        B_pp, B_qq, B_pq, B_r, B_pq_u, B_qp_u = _side(s.b, p, q, acc)
        # Gram of (g_I, g_J) and their inner products with u, per group and plane
        gII = per_group(A_pp + A_qq, s.repeat_a) + per_group(B_pp + B_qq, s.repeat_b)
        gJJ = per_group(al**2 * A_qq + A_pp / al**2, s.repeat_a) + per_group(be**2 * B_qq + B_pp / be**2, s.repeat_b)
        gIJ = per_group((al - 1 / al) * A_pq, s.repeat_a) + per_group((1 / be - be) * B_pq, s.repeat_b)
        rI = per_group(A_r, s.repeat_a) - per_group(B_r, s.repeat_b)
        rJ = per_group(al * A_pq_u - A_qp_u / al, s.repeat_a) + per_group(be * B_pq_u - B_qp_u / be, s.repeat_b)
        gram = torch.stack([torch.stack([gII, gIJ], -1), torch.stack([gIJ, gJJ], -1)], -2)  # (G, planes, 2, 2)
        ab = _solve_2x2(gram, torch.stack([rI, rJ], -1), rtol)
        for members, tw, sign, repeat in ((s.a, al, 1.0, s.repeat_a), (s.b, be, -1.0, s.repeat_b)):
            c_a = sign * ab[..., 0].repeat_interleave(repeat, 0)[:, :, None]  # (heads, planes, 1)
            c_b = ab[..., 1].repeat_interleave(repeat, 0)[:, :, None]
            t = tw[:, :, None]
            for m in members:
                X, U = _rows(m.param, acc), _rows(m.u, acc)
                vp = c_a * X[:, p] + c_b * t * X[:, q]
                vq = c_a * X[:, q] - c_b / t * X[:, p]
                if subtract:
                    vp, vq = U[:, p] - vp, U[:, q] - vq
                out = m.out if m.out.dim() == 3 else m.out[:, :, None]
                out[:, p] = vp.to(out.dtype)
                out[:, q] = vq.to(out.dtype)
