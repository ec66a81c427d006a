"""Closed-form gauge projections in one Triton launch: diagonal multiplier gauges, RoPE planes.

The torch projector (:class:`gaugeopt.projection.GaugeProjector`) handles these sectors site by site
with a dozen tensor ops each (gathers, products, ``index_add``, a batched 2×2 ``eigh``). Here one
launch covers every layer (``docs/projection.md``):

**Diagonal** (``lrm_qk``: ``r_Q`` vs ``r_K`` per channel or RoPE plane; ``lrm_vo``: ``r_V`` vs
``c_O`` per channel). One program per layer, two sweeps over its groups ``j``::

    den[j, m] = Σ_{heads, c∈m} a² + Σ b²,     num[j, m] = Σ a·du_a − Σ b·du_b
    t = num / den   (0 where den ≤ rtol · max_{layer} den: the pseudo-inverse rule)
    v_a = t·a,  v_b = −t·b

(the first sweep only finds the layer's largest ``den``, which the rule needs).

**RoPE planes** (``qk`` when every channel is rotated: LLaMA-style full rotary). One program
per (layer, group, block of planes); with rows ``P, Q`` of each plane over the augmented
rows ``[W̄ | b̄]`` of the group's query heads (side A) and key head (side B), twists
``α = λ_Q/λ_P`` from the LRM row multipliers (``1`` without them)::

    pass 1  g_II = Σ ‖A_P‖² + ‖A_Q‖² + (B),   g_JJ = Σ α²‖A_Q‖² + α⁻²‖A_P‖² + (B, β),
            g_IJ = Σ (α − α⁻¹)⟨A_P, A_Q⟩ + (β⁻¹ − β)⟨B_P, B_Q⟩,
            r_I = Σ ⟨dA_P, A_P⟩ + ⟨dA_Q, A_Q⟩ − (B),   r_J = Σ α⟨dA_P, A_Q⟩ − α⁻¹⟨dA_Q, A_P⟩ + (B, β)
            (a, b) = G⁺ r   (2×2, closed-form eigenvectors, the same pseudo-inverse rule)
    pass 2  v_A[P] = a A_P + bα A_Q,  v_A[Q] = a A_Q − bα⁻¹ A_P,  v_B[P] = −a B_P + bβ B_Q, ...

Both kernels read the parameters, the vector field ``u`` and write the vertical part (or
``u − v`` in place, ``subtract=True``) through descriptor tables; reductions run in float32
(float64 when any input is float64).

This module is the kernels, their launchers and the public functions :func:`project_diagonal`
and :func:`project_planes`, which check the tensor descriptions (:mod:`.spec`), pack the tables
and launch. The plain-torch references of both are :mod:`.naive`; the host side that describes
a model's attention sites as :class:`~.spec.DiagonalSite` / :class:`~.spec.PlaneSite` is
:mod:`gaugeopt.projection.triton_backend`.

Example (on CUDA tensors; on CPU only with ``TRITON_INTERPRET=1`` set before this module is
imported, which is how ``tests/kernels/kernels_interpreter_cases.py`` runs it):
    >>> import torch
    >>> from gaugeopt.kernels.projection import DiagonalSite, project_diagonal
    >>> r_q, r_k = torch.ones(1, 2), torch.ones(1, 2)                  # one head, two channels
    >>> u_q, u_k = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    >>> v_q, v_k = torch.zeros(1, 2), torch.zeros(1, 2)
    >>> project_diagonal([DiagonalSite(r_q, r_k, u_q, u_k, v_q, v_k, groups=1, repeat_a=1, repeat_b=1,
    ...                                slot=[0, 1], n_slots=2)], rtol=1e-6)
    >>> v_q.tolist(), v_k.tolist()        # t = (1·1 − 0) / 2 on channel 0, (0 − 1·3) / 2 on channel 1
    ([[0.5, -1.5]], [[-0.5, 1.5]])
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from gaugeopt.errors import GaugeError
from gaugeopt.kernels.projection.spec import (
    DiagonalSite, PlaneSite, accumulation_dtype, check_diagonal, check_planes,
)

__all__ = ["project_diagonal", "project_planes"]

_TL = {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_TILE_ELEMS = 4096  # elements of one (plane, column) tile of the RoPE kernel
_BLOCK_P = 16  # planes per program of the RoPE kernel


# ---------------------------------------------------------------------- device code: diagonal
@triton.jit
def _diag_kernel(
    site_tab,  # (n_sites, 8) int64: desc row, h_kv, k_a, k_b, width, n_slots, slot offset, -
    desc_tab,  # (n_sites * 6, 4) int64: addr, stride_head, stride_chan, - for p_a, u_a, o_a, p_b, u_b, o_b
    slot_tab,  # (Σ width,) int32
    rtol_ptr,  # (1,) ACC
    P_T: tl.constexpr, U_T: tl.constexpr, ACC_T: tl.constexpr,
    SUBTRACT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    s = tl.program_id(0)
    row = site_tab + s * 8
    d0 = tl.load(row + 0)
    h_kv = tl.load(row + 1)
    k_a = tl.load(row + 2)
    k_b = tl.load(row + 3)
    width = tl.load(row + 4)
    n_slots = tl.load(row + 5)
    slot_off = tl.load(row + 6)
    rtol = tl.load(rtol_ptr)

    k = tl.arange(0, BLOCK_K)
    c = tl.arange(0, BLOCK_C)
    cmask = c < width
    ma = (k < k_a)[:, None] & cmask[None, :]
    mb = (k < k_b)[:, None] & cmask[None, :]
    slot = tl.load(slot_tab + slot_off + c, mask=cmask, other=-1)
    sidx = tl.arange(0, BLOCK_C)
    onehot = slot[:, None] == sidx[None, :]  # (channels, slots)
    smask = sidx < n_slots

    pa = tl.load(desc_tab + (d0 + 0) * 4).to(tl.pointer_type(P_T))
    ua = tl.load(desc_tab + (d0 + 1) * 4).to(tl.pointer_type(U_T))
    oa = tl.load(desc_tab + (d0 + 2) * 4).to(tl.pointer_type(U_T))
    pb = tl.load(desc_tab + (d0 + 3) * 4).to(tl.pointer_type(P_T))
    ub = tl.load(desc_tab + (d0 + 4) * 4).to(tl.pointer_type(U_T))
    ob = tl.load(desc_tab + (d0 + 5) * 4).to(tl.pointer_type(U_T))
    # (head, channel) offsets of each tensor; u and out share the parameter's layout
    offa = k[:, None] * tl.load(desc_tab + d0 * 4 + 1) + c[None, :] * tl.load(desc_tab + d0 * 4 + 2)
    offb = k[:, None] * tl.load(desc_tab + (d0 + 3) * 4 + 1) + c[None, :] * tl.load(desc_tab + (d0 + 3) * 4 + 2)
    sha = tl.load(desc_tab + d0 * 4 + 1) * k_a  # one KV group further
    shb = tl.load(desc_tab + (d0 + 3) * 4 + 1) * k_b

    # sweep 1: the layer's largest denominator
    top = tl.zeros([BLOCK_C], dtype=ACC_T)
    for j in range(0, h_kv):
        a = tl.load(pa + j * sha + offa, mask=ma, other=0.0).to(ACC_T)
        b = tl.load(pb + j * shb + offb, mask=mb, other=0.0).to(ACC_T)
        per_c = tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)
        den = tl.sum(tl.where(onehot, per_c[:, None], 0.0), axis=0)
        top = tl.maximum(top, tl.where(smask, den, 0.0))
    thr = rtol * tl.max(top, axis=0)

    # sweep 2: coefficients and the vertical part
    for j in range(0, h_kv):
        a = tl.load(pa + j * sha + offa, mask=ma, other=0.0).to(ACC_T)
        b = tl.load(pb + j * shb + offb, mask=mb, other=0.0).to(ACC_T)
        da = tl.load(ua + j * sha + offa, mask=ma, other=0.0).to(ACC_T)
        db = tl.load(ub + j * shb + offb, mask=mb, other=0.0).to(ACC_T)
        den = tl.sum(tl.where(onehot, (tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0))[:, None], 0.0), axis=0)
        num = tl.sum(tl.where(onehot, (tl.sum(a * da, axis=0) - tl.sum(b * db, axis=0))[:, None], 0.0), axis=0)
        keep = den > thr
        t = num * tl.where(keep, 1.0 / tl.where(keep, den, 1.0), 0.0)
        tc = tl.sum(tl.where(onehot, t[None, :], 0.0), axis=1)[None, :]  # per channel
        va = tc * a
        vb = -tc * b
        if SUBTRACT:
            va = da - va
            vb = db - vb
        tl.store(oa + j * sha + offa, va.to(U_T), mask=ma)
        tl.store(ob + j * shb + offb, vb.to(U_T), mask=mb)


# ---------------------------------------------------------------------- device code: RoPE planes
@triton.jit
def _plane_side(side, d0, n_da, n_db, k_a, k_b):
    """One side of a site: heads per group, its first and past-the-end descriptor rows, the sign of ``I`` on it."""
    n_members = tl.where(side == 0, k_a, k_b)
    dlo = tl.where(side == 0, d0, d0 + n_da)
    dhi = tl.where(side == 0, d0 + n_da, d0 + n_da + n_db)
    return n_members, dlo, dhi, tl.where(side == 0, 1.0, -1.0)


@triton.jit
def _plane_member(desc_tab, d, head, P_T: tl.constexpr, U_T: tl.constexpr):
    """One member tensor: parameter and field pointers, the head's offset, channel and column strides, columns."""
    drow = desc_tab + d * 8
    return (tl.load(drow + 0).to(tl.pointer_type(P_T)), tl.load(drow + 1).to(tl.pointer_type(U_T)),
            head * tl.load(drow + 3), tl.load(drow + 4), tl.load(drow + 5), tl.load(drow + 6))


@triton.jit
def _plane_tile(pptr, hoff, rp, rq, sc, sx, x0, xr, pmask, ncols, ACC_T: tl.constexpr):
    """The rows ``P`` and ``Q`` of every plane of the block over one tile of columns: mask, offsets, values."""
    xm = pmask[:, None] & ((x0 + xr) < ncols)[None, :]
    xo = (x0 + xr)[None, :] * sx
    op = hoff + rp[:, None] * sc + xo
    oq = hoff + rq[:, None] * sc + xo
    ap = tl.load(pptr + op, mask=xm, other=0.0).to(ACC_T)
    aq = tl.load(pptr + oq, mask=xm, other=0.0).to(ACC_T)
    return xm, op, oq, ap, aq


@triton.jit
def _plane_twist(twist_tab, s, side, head, rp, rq, pmask, P_T: tl.constexpr, ACC_T: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    """``α = λ_Q/λ_P`` of one head per plane (1 where the side has no multiplier) and a flag where ``λ`` is 0."""
    al = tl.full([BLOCK_P], 1.0, ACC_T)
    zero = tl.zeros([BLOCK_P], dtype=tl.int32)
    trow = twist_tab + s * 6 + side * 3
    taddr = tl.load(trow)
    if taddr != 0:
        tptr = taddr.to(tl.pointer_type(P_T))
        tsh = tl.load(trow + 1)
        tsc = tl.load(trow + 2)
        lp = tl.load(tptr + head * tsh + rp * tsc, mask=pmask, other=1.0).to(ACC_T)
        lq = tl.load(tptr + head * tsh + rq * tsc, mask=pmask, other=1.0).to(ACC_T)
        zero = ((lp == 0.0) | (lq == 0.0)).to(tl.int32)
        al = lq / tl.where(lp == 0.0, 1.0, lp)
    return al, zero


@triton.jit
def _plane_kernel(
    unit_tab,  # (n_units, 3) int64: site, KV group, first plane
    site_tab,  # (n_sites, 8) int64: desc row start, A members, B members, k_a, k_b, n_planes, plane offset, -
    desc_tab,  # (n_desc, 8) int64: p addr, u addr, o addr, stride_head, stride_chan, stride_col, n_cols, -
    twist_tab,  # (n_sites, 2, 3) int64: addr (0 = none), stride_head, stride_chan for A and B
    plane_tab,  # (Σ planes, 2) int32: rows P, Q
    rtol_ptr,
    zero_flag,  # (n_units,) int32: 1 when a twist (multiplier) of the unit is exactly zero
    P_T: tl.constexpr, U_T: tl.constexpr, ACC_T: tl.constexpr,
    SUBTRACT: tl.constexpr, HAS_TWIST: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_X: tl.constexpr,
):
    uid = tl.program_id(0)
    s = tl.load(unit_tab + uid * 3)
    j = tl.load(unit_tab + uid * 3 + 1)
    m0 = tl.load(unit_tab + uid * 3 + 2)
    srow = site_tab + s * 8
    d0 = tl.load(srow + 0)
    n_da = tl.load(srow + 1)
    n_db = tl.load(srow + 2)
    k_a = tl.load(srow + 3)
    k_b = tl.load(srow + 4)
    n_planes = tl.load(srow + 5)
    plane_off = tl.load(srow + 6)
    rtol = tl.load(rtol_ptr)

    mi = m0 + tl.arange(0, BLOCK_P)
    pmask = mi < n_planes
    rp = tl.load(plane_tab + 2 * (plane_off + mi), mask=pmask, other=0)
    rq = tl.load(plane_tab + 2 * (plane_off + mi) + 1, mask=pmask, other=0)
    xr = tl.arange(0, BLOCK_X)

    g_ii = tl.zeros([BLOCK_P], dtype=ACC_T)
    g_jj = tl.zeros([BLOCK_P], dtype=ACC_T)
    g_ij = tl.zeros([BLOCK_P], dtype=ACC_T)
    r_i = tl.zeros([BLOCK_P], dtype=ACC_T)
    r_j = tl.zeros([BLOCK_P], dtype=ACC_T)
    bad = tl.zeros([BLOCK_P], dtype=tl.int32)
    # ---- pass 1: Gram and cross terms over both sides, every member head, every column
    for side in range(0, 2):
        n_members, dlo, dhi, sgn = _plane_side(side, d0, n_da, n_db, k_a, k_b)
        for kk in range(0, n_members):
            head = j * n_members + kk
            app = tl.zeros([BLOCK_P], dtype=ACC_T)
            aqq = tl.zeros([BLOCK_P], dtype=ACC_T)
            apq = tl.zeros([BLOCK_P], dtype=ACC_T)
            ip = tl.zeros([BLOCK_P], dtype=ACC_T)  # <dA_P, A_P> + <dA_Q, A_Q>
            ipq = tl.zeros([BLOCK_P], dtype=ACC_T)  # <dA_P, A_Q>
            iqp = tl.zeros([BLOCK_P], dtype=ACC_T)  # <dA_Q, A_P>
            for d in range(dlo, dhi):
                pptr, uptr, hoff, sc, sx, ncols = _plane_member(desc_tab, d, head, P_T, U_T)
                for x0 in range(0, ncols, BLOCK_X):
                    xm, op, oq, ap, aq = _plane_tile(pptr, hoff, rp, rq, sc, sx, x0, xr, pmask, ncols, ACC_T)
                    dp = tl.load(uptr + op, mask=xm, other=0.0).to(ACC_T)
                    dq = tl.load(uptr + oq, mask=xm, other=0.0).to(ACC_T)
                    app += tl.sum(ap * ap, axis=1)
                    aqq += tl.sum(aq * aq, axis=1)
                    apq += tl.sum(ap * aq, axis=1)
                    ip += tl.sum(dp * ap + dq * aq, axis=1)
                    ipq += tl.sum(dp * aq, axis=1)
                    iqp += tl.sum(dq * ap, axis=1)
            al = tl.full([BLOCK_P], 1.0, ACC_T)
            if HAS_TWIST:
                al, zero = _plane_twist(twist_tab, s, side, head, rp, rq, pmask, P_T, ACC_T, BLOCK_P)
                bad = bad | zero
            inv_al = 1.0 / tl.where(al == 0.0, 1.0, al)
            g_ii += app + aqq
            g_jj += al * al * aqq + inv_al * inv_al * app
            # A side: (α − 1/α)<A_P, A_Q>, α<dA_P, A_Q> − <dA_Q, A_P>/α;  B side: (1/β − β), β<dB_P, B_Q> − <dB_Q, B_P>/β
            g_ij += sgn * (al - inv_al) * apq
            r_i += sgn * ip
            r_j += al * ipq - inv_al * iqp
    tl.store(zero_flag + uid, tl.max(bad, axis=0))

    # ---- 2×2 pseudo-inverse solve (eigenvalues clamped at 0, those ≤ rtol·λ_max dropped)
    mean = 0.5 * (g_ii + g_jj)
    half = 0.5 * (g_ii - g_jj)
    rad = tl.sqrt(half * half + g_ij * g_ij)
    l1 = tl.maximum(mean + rad, 0.0)
    l2 = tl.maximum(mean - rad, 0.0)
    v1x = l1 - g_jj  # eigenvector of l1: (l1 - g_jj, g_ij) or (g_ij, l1 - g_ii), the longer one
    v1y = g_ij
    w1x = g_ij
    w1y = l1 - g_ii
    use_w = w1x * w1x + w1y * w1y > v1x * v1x + v1y * v1y
    ex = tl.where(use_w, w1x, v1x)
    ey = tl.where(use_w, w1y, v1y)
    nrm = tl.sqrt(ex * ex + ey * ey)
    ex = tl.where(nrm > 0, ex / tl.where(nrm > 0, nrm, 1.0), 1.0)
    ey = tl.where(nrm > 0, ey / tl.where(nrm > 0, nrm, 1.0), 0.0)
    thr = rtol * l1
    i1 = tl.where(l1 > thr, 1.0 / tl.where(l1 > thr, l1, 1.0), 0.0)
    i2 = tl.where(l2 > thr, 1.0 / tl.where(l2 > thr, l2, 1.0), 0.0)
    c1 = (ex * r_i + ey * r_j) * i1
    c2 = (-ey * r_i + ex * r_j) * i2
    ca = ex * c1 - ey * c2
    cb = ey * c1 + ex * c2

    # ---- pass 2: write v (or u − v) on the rows P and Q
    for side in range(0, 2):
        n_members, dlo, dhi, sgn = _plane_side(side, d0, n_da, n_db, k_a, k_b)
        for kk in range(0, n_members):
            head = j * n_members + kk
            al = tl.full([BLOCK_P], 1.0, ACC_T)
            if HAS_TWIST:
                al, zero = _plane_twist(twist_tab, s, side, head, rp, rq, pmask, P_T, ACC_T, BLOCK_P)
            inv_al = 1.0 / tl.where(al == 0.0, 1.0, al)
            # A: v_P = a A_P + bα A_Q, v_Q = a A_Q − bα⁻¹ A_P;   B: v_P = −a B_P + bβ B_Q, v_Q = −a B_Q − bβ⁻¹ B_P
            fa = (sgn * ca)[:, None]
            fpq = (cb * al)[:, None]
            fqp = (cb * inv_al)[:, None]
            for d in range(dlo, dhi):
                pptr, uptr, hoff, sc, sx, ncols = _plane_member(desc_tab, d, head, P_T, U_T)
                optr = tl.load(desc_tab + d * 8 + 2).to(tl.pointer_type(U_T))
                for x0 in range(0, ncols, BLOCK_X):
                    xm, op, oq, ap, aq = _plane_tile(pptr, hoff, rp, rq, sc, sx, x0, xr, pmask, ncols, ACC_T)
                    vp = fa * ap + fpq * aq
                    vq = fa * aq - fqp * ap
                    if SUBTRACT:
                        vp = tl.load(uptr + op, mask=xm, other=0.0).to(ACC_T) - vp
                        vq = tl.load(uptr + oq, mask=xm, other=0.0).to(ACC_T) - vq
                    tl.store(optr + op, vp.to(U_T), mask=xm)
                    tl.store(optr + oq, vq.to(U_T), mask=xm)


# ---------------------------------------------------------------------- launchers
def _launch_diagonal(site_rows, desc_rows, slots, rtol: torch.Tensor, *, param_dtype, field_dtype,
                     subtract: bool, block_k: int, block_c: int) -> None:
    """One program per layer of the diagonal sectors.

    Args:
        site_rows: per layer ``[first desc row, groups, heads per group a, b, width, n_slots, slot offset, 0]``.
        desc_rows: per layer six rows ``[address, stride_head, stride_chan, 0]``: parameter, field and
            output of side a, then of side b.
        slots: slot of each channel, concatenated over layers.
        rtol: ``(1,)`` tensor in the accumulation dtype (the pseudo-inverse threshold).
    """
    device = rtol.device
    i64 = dict(dtype=torch.int64, device=device)
    _diag_kernel[(len(site_rows),)](
        torch.tensor(site_rows, **i64), torch.tensor(desc_rows, **i64),
        torch.tensor(slots, dtype=torch.int32, device=device), rtol,
        P_T=_TL[param_dtype], U_T=_TL[field_dtype], ACC_T=_TL[rtol.dtype], SUBTRACT=subtract,
        BLOCK_K=triton.next_power_of_2(block_k), BLOCK_C=triton.next_power_of_2(block_c),
    )


def _plane_units(groups: int, n_planes: int, site_index: int) -> list[list[int]]:
    """Programs of one layer: ``[site, group, first plane]`` per block of :data:`_BLOCK_P` planes."""
    return [[site_index, j, m0] for j in range(groups) for m0 in range(0, n_planes, _BLOCK_P)]


def _launch_planes(unit_rows, site_rows, desc_rows, twist_rows, planes, rtol: torch.Tensor, *, param_dtype,
                   field_dtype, subtract: bool, has_twist: bool, max_cols: int) -> torch.Tensor:
    """One program per (layer, group, block of planes) of the RoPE-plane ``qk`` sector.

    Returns:
        ``(n_units,)`` int32 flags: nonzero where a twist (row multiplier) had an exact zero.
    """
    device = rtol.device
    i64 = dict(dtype=torch.int64, device=device)
    flags = torch.zeros(len(unit_rows), dtype=torch.int32, device=device)
    _plane_kernel[(len(unit_rows),)](
        torch.tensor(unit_rows, **i64), torch.tensor(site_rows, **i64), torch.tensor(desc_rows, **i64),
        torch.tensor(twist_rows, **i64), torch.tensor(planes, dtype=torch.int32, device=device), rtol, flags,
        P_T=_TL[param_dtype], U_T=_TL[field_dtype], ACC_T=_TL[rtol.dtype], SUBTRACT=subtract, HAS_TWIST=has_twist,
        BLOCK_P=_BLOCK_P, BLOCK_X=min(triton.next_power_of_2(max_cols), max(1, _TILE_ELEMS // _BLOCK_P)),
    )
    return flags


def _geometry(view: torch.Tensor) -> tuple[int, int, int, int]:
    """(stride_head, stride_chan, stride_col, n_cols) of a ``(heads, width[, cols])`` view."""
    if view.dim() == 2:
        return view.stride(0), view.stride(1), 0, 1
    return view.stride(0), view.stride(1), view.stride(2), view.shape[2]


# ---------------------------------------------------------------------- public functions
def project_diagonal(sites: Sequence[DiagonalSite], *, rtol: float, subtract: bool = False) -> None:
    """Write the vertical part of each site's field (or ``u − v`` with ``subtract``) into its outputs,
    every layer in one launch (formula: :class:`~.spec.DiagonalSite`).

    Args:
        sites: the layers (checked by :func:`~.spec.check_diagonal`).
        rtol: pseudo-inverse threshold: ``t = 0`` where the denominator is ``≤ rtol ×`` the layer's largest.
        subtract: write ``u − v`` instead of ``v``.
    """
    sites = list(sites)
    check_diagonal(sites)
    acc = accumulation_dtype([t for s in sites for t in (s.a, s.b, s.u_a, s.u_b)])
    site_rows, desc_rows, slots = [], [], []
    block_k, block_c = 1, 1
    for s in sites:
        site_rows.append([len(desc_rows), s.groups, s.repeat_a, s.repeat_b, s.width, s.n_slots, len(slots), 0])
        slots += list(s.slot)
        for p, u, o in ((s.a, s.u_a, s.out_a), (s.b, s.u_b, s.out_b)):
            for t in (p, u, o):
                desc_rows.append([t.data_ptr(), p.stride(0), p.stride(1), 0])
        block_k = max(block_k, s.repeat_a, s.repeat_b)
        block_c = max(block_c, s.width)
    rt = torch.tensor([rtol], dtype=acc, device=sites[0].a.device)
    _launch_diagonal(site_rows, desc_rows, slots, rt, param_dtype=sites[0].a.dtype, field_dtype=sites[0].u_a.dtype,
                     subtract=subtract, block_k=block_k, block_c=block_c)


def project_planes(sites: Sequence[PlaneSite], *, rtol: float, subtract: bool = False) -> None:
    """Write the vertical part of each site's field in its RoPE-plane sector (or ``u − v`` with
    ``subtract``) into the members' outputs, on the rows of every plane, in one launch.

    Args:
        sites: the layers (checked by :func:`~.spec.check_planes`).
        rtol: pseudo-inverse threshold of the 2×2 solves (eigenvalues ``≤ rtol·λ_max`` dropped).
        subtract: write ``u − v`` instead of ``v``.

    Raises:
        GaugeError: a twist (row multiplier) has an exact zero — after the launch (the outputs are
            written; the torch path refuses the same field before writing).
    """
    sites = list(sites)
    check_planes(sites)
    members = [m for s in sites for m in s.a + s.b]
    acc = accumulation_dtype([t for m in members for t in (m.param, m.u)])
    unit_rows, site_rows, desc_rows, twist_rows, planes = [], [], [], [], []
    max_cols, has_twist = 1, False
    for si, s in enumerate(sites):
        site_rows.append([len(desc_rows), len(s.a), len(s.b), s.repeat_a, s.repeat_b, len(s.planes), len(planes), 0])
        planes += [list(pq) for pq in s.planes]
        for m in s.a + s.b:
            sh, sc, sx, ncols = _geometry(m.param)
            desc_rows.append([m.param.data_ptr(), m.u.data_ptr(), m.out.data_ptr(), sh, sc, sx, ncols, 0])
            max_cols = max(max_cols, ncols)
        for tw in (s.twist_a, s.twist_b):
            if tw is None:
                twist_rows.append([0, 0, 0])
            else:
                twist_rows.append([tw.data_ptr(), tw.stride(0), tw.stride(1)])
                has_twist = True
        unit_rows += _plane_units(s.groups, len(s.planes), si)
    rt = torch.tensor([rtol], dtype=acc, device=members[0].param.device)
    flags = _launch_planes(unit_rows, site_rows, desc_rows, twist_rows, planes, rt, param_dtype=members[0].param.dtype,
                           field_dtype=members[0].u.dtype, subtract=subtract, has_twist=has_twist, max_cols=max_cols)
    if has_twist and bool(flags.any()):  # the one host sync, only with multipliers (as the torch path checks)
        raise GaugeError(
            "a Q/K row multiplier has an exact zero; the gauge generators in W̄ coordinates divide by it. "
            "Re-initialise that multiplier."
        )
