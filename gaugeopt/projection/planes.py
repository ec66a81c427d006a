"""The RoPE planes of the ``qk`` sector in closed form: a 2×2 solve per plane and KV group.

Under RoPE a Q/K generator ``X`` must commute with the rotations: ``a·I + b·J`` on each plane
``(p, q)`` (``J`` maps row ``p`` to ``q`` and ``q`` to ``−p``), free on the rows RoPE does not
rotate (:mod:`gaugeopt.projection.dense` solves that block). The images of ``I`` and ``J`` live on
the rows ``p, q`` only, so planes are mutually orthogonal and orthogonal to the free block: each
plane and group is a 2×2 problem. With the twists ``α = λ_q/λ_p`` (query rows) and ``β = γ_q/γ_p``
(key rows) of learnable multipliers, on the augmented rows ``[W̄ | b̄]``::

    g_I = (A_p, A_q | −B_p, −B_q),      g_J = (α A_q, −A_p/α | β B_q, −B_p/β)
    G = [[⟨g_I, g_I⟩, ⟨g_I, g_J⟩], [⟨g_I, g_J⟩, ⟨g_J, g_J⟩]],   (a, b) = G⁺ (⟨g_I, u⟩, ⟨g_J, u⟩)

summed over the heads of each KV group (:func:`plane_prepare` forms ``G`` at θ, :func:`plane_apply`
the right-hand side, the solve and the images). Without twists ``⟨g_I, g_J⟩ = 0`` and
``‖g_I‖² = ‖g_J‖²``. :func:`solve_2x2` is the pseudo-inverse rule of the package for a batch of
2×2 systems in closed form. On a site that keeps only the orthogonal Q/K gauge
(``site.qk_orthogonal``) only ``b·J`` is a gauge: ``b = ⟨g_J, u⟩ / ‖g_J‖²``. The fused Triton kernel
of the same sector is :func:`gaugeopt.kernels.projection.project_planes`.

Example:
    >>> import torch
    >>> from gaugeopt.projection.planes import solve_2x2
    >>> one = torch.ones(1, dtype=torch.float64)
    >>> [float(x) for x in solve_2x2(2 * one, 0 * one, 4 * one, 2 * one, 2 * one, 1e-12)]   # diag(2, 4) x = (2, 2)
    [1.0, 0.5]
"""

from __future__ import annotations

import torch

from gaugeopt.projection.rows import Rows, grouped_sum, per_head, rows, sel, zero_coef

__all__ = ["plane_prepare", "plane_apply", "solve_2x2"]


def _plane_rows(r: Rows, P, Q):
    return sel(r.W, P), sel(r.W, Q), sel(r.b, P), sel(r.b, Q)


def _pdot(w1, w2, b1, b2):
    """Row-wise inner products of augmented rows ``[w | b]``: ``(heads, planes)``."""
    s = (w1 * w2).sum(-1)
    return s if b1 is None else s + b1 * b2


def plane_prepare(pt, rtol: float) -> dict:
    """2×2 Gram of ``(g_I, g_J)`` per plane and group."""
    st = pt.st
    P, Q = st.p, st.q
    Ap, Aq, apb, aqb = _plane_rows(pt.A, P, Q)
    Bp, Bq, bpb, bqb = _plane_rows(pt.B, P, Q)
    App, Aqq, Apq = _pdot(Ap, Ap, apb, apb), _pdot(Aq, Aq, aqb, aqb), _pdot(Ap, Aq, apb, aqb)  # (heads_a, planes)
    Bpp, Bqq, Bpq = _pdot(Bp, Bp, bpb, bpb), _pdot(Bq, Bq, bqb, bqb), _pdot(Bp, Bq, bpb, bqb)
    al = torch.ones_like(App) if pt.lam is None else sel(pt.lam, Q) / sel(pt.lam, P)  # λ_q / λ_p
    be = torch.ones_like(Bpp) if pt.gam is None else sel(pt.gam, Q) / sel(pt.gam, P)  # γ_q / γ_p
    kA, kB = st.sa.repeat, st.sb.repeat
    gII = grouped_sum(App + Aqq, kA) + grouped_sum(Bpp + Bqq, kB)
    gJJ = grouped_sum(al**2 * Aqq + al**-2 * App, kA) + grouped_sum(be**2 * Bqq + be**-2 * Bpp, kB)
    gIJ = grouped_sum((al - 1 / al) * Apq, kA) + grouped_sum((1 / be - be) * Bpq, kB)
    return {"al": al, "be": be, "gram": (gII, gIJ, gJJ), "rtol": rtol}


def solve_2x2(g11, g12, g22, r1, r2, rtol):
    """Minimum-norm ``(x1, x2)`` of the 2×2 PSD systems ``[[g11, g12], [g12, g22]] x = r`` (batched),
    under the pseudo-inverse rule: an eigenvalue ``≤ rtol·λ_max`` is dropped, never divided by."""
    half_tr = 0.5 * (g11 + g22)
    rad = torch.sqrt((0.5 * (g11 - g22)).square() + g12.square())
    lmax = (half_tr + rad).clamp_min(0.0)
    tiny = torch.finfo(g11.dtype).tiny
    lmin = ((g11 * g22 - g12 * g12) / lmax.clamp_min(tiny)).clamp_min(0.0)  # det / λ_max: no cancellation
    both = lmin > rtol * lmax
    det = (g11 * g22 - g12 * g12).clamp_min(tiny)
    x1_full, x2_full = (g22 * r1 - g12 * r2) / det, (g11 * r2 - g12 * r1) / det
    # rank one: the eigenvector of λ_max, from the better conditioned of its two expressions
    u1, u2 = g12, lmax - g11
    w1, w2 = lmax - g22, g12
    use_w = (w1.square() + w2.square()) > (u1.square() + u2.square())
    v1, v2 = torch.where(use_w, w1, u1), torch.where(use_w, w2, u2)
    nv = torch.sqrt(v1.square() + v2.square())
    ok = (nv > 0) & (lmax > 0)
    v1 = torch.where(ok, v1 / nv.clamp_min(tiny), torch.where(g11 >= g22, torch.ones_like(v1), torch.zeros_like(v1)))
    v2 = torch.where(ok, v2 / nv.clamp_min(tiny), torch.where(g11 >= g22, torch.zeros_like(v2), torch.ones_like(v2)))
    c = torch.where(lmax > 0, (v1 * r1 + v2 * r2) / lmax.clamp_min(tiny), torch.zeros_like(r1))
    return torch.where(both, x1_full, c * v1), torch.where(both, x2_full, c * v2)


def plane_apply(pt, u, out, coefs) -> None:
    st, pl = pt.st, pt.plane
    P, Q, al, be = st.p, st.q, pl["al"], pl["be"]
    Ap, Aq, apb, aqb = _plane_rows(pt.A, P, Q)
    Bp, Bq, bpb, bqb = _plane_rows(pt.B, P, Q)
    dAp, dAq, dapb, daqb = _plane_rows(rows(st.sa, u), P, Q)
    dBp, dBq, dbpb, dbqb = _plane_rows(rows(st.sb, u), P, Q)
    kA, kB = st.sa.repeat, st.sb.repeat
    rI = grouped_sum(_pdot(dAp, Ap, dapb, apb) + _pdot(dAq, Aq, daqb, aqb), kA) \
        - grouped_sum(_pdot(dBp, Bp, dbpb, bpb) + _pdot(dBq, Bq, dbqb, bqb), kB)
    rJ = grouped_sum(al * _pdot(dAp, Aq, dapb, aqb) - _pdot(dAq, Ap, daqb, apb) / al, kA) \
        + grouped_sum(be * _pdot(dBp, Bq, dbpb, bqb) - _pdot(dBq, Bp, dbqb, bpb) / be, kB)
    gII, gIJ, gJJ = pl["gram"]
    if st.orthogonal:  # only the rotation b·J of each plane is a gauge
        a = torch.zeros_like(rJ)
        b = torch.where(gJJ > 0, rJ / gJJ.clamp_min(torch.finfo(gJJ.dtype).tiny), torch.zeros_like(rJ))
    else:
        a, b = solve_2x2(gII, gIJ, gJJ, rI, rJ, pl["rtol"])  # (G, planes)
    aA, bA, aB, bB = per_head(a, kA), per_head(b, kA), per_head(a, kB), per_head(b, kB)
    oAp, oAq, oapb, oaqb = _plane_rows(rows(st.sa, out), P, Q)
    oBp, oBq, obpb, obqb = _plane_rows(rows(st.sb, out), P, Q)
    for (o, x, y, c1, c2) in (
        (oAp, Ap, Aq, aA, bA * al), (oAq, Aq, Ap, aA, -bA / al),
        (oBp, Bp, Bq, -aB, bB * be), (oBq, Bq, Bp, -aB, -bB / be),
    ):
        o.addcmul_(c1[..., None], x).addcmul_(c2[..., None], y)
    for (o, x, y, c1, c2) in (
        (oapb, apb, aqb, aA, bA * al), (oaqb, aqb, apb, aA, -bA / al),
        (obpb, bpb, bqb, -aB, bB * be), (obqb, bqb, bpb, -aB, -bB / be),
    ):
        if o is not None:
            o.addcmul_(c1, x).addcmul_(c2, y)
    if coefs is not None:  # the coefficients as the matrix a·I + b·J (J[q, p] = 1, J[p, q] = -1)
        c = coefs.setdefault(id(pt), zero_coef(pt))
        n = st.n
        ids = torch.arange(n, device=c.device)
        pi, qi = ids[P], ids[Q]
        c[:, pi, pi] = a
        c[:, qi, qi] = a
        c[:, qi, pi] = b
        c[:, pi, qi] = -b
