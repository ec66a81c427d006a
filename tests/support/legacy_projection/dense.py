"""The dense head gauges as projection sectors: ``qk`` (``GL(d_k)`` or its RoPE commutant) and ``vo``.

Each sector knows its generators and removes them from a vector field ``u`` given per
parameter, for every KV group of every layer at once (docs/projection.md, paper 000 Remark 51 /
Algorithm 2). Both sectors are instances of one *bilinear* family: per KV group a matrix
``M ∈ gl(n)`` moves "A-side" tensors ``a_k`` and "B-side" tensors ``b_k`` (rows of width ``n``)

    δa_k = Λ_k⁻¹ Mᵀ Λ_k a_k,        δb_k = −Γ_k⁻¹ M Γ_k b_k,

======  ========================================  ==========================================  ==========
sector  A side (``a_k``, twist ``Λ_k``)             B side (``b_k``, twist ``Γ_k``)               ``M``
======  ========================================  ==========================================  ==========
``qk``  ``[W̄_Q[i] | b̄_Q[i]]``, ``r_Q[i]``          ``[W̄_K[j] | b̄_K[j]]``, ``r_K[j]``             ``X``
``vo``  ``[W̄_V[j] | b̄_V[j]]``, ``r_V[j]``          ``W̄_O[:, i]ᵀ``, ``c_O[i]``                   ``Y = Zᵀ``
======  ========================================  ==========================================  ==========

over the query heads ``i`` of group ``j``. Without multipliers every twist is ``I`` and these
are the generators ``δW_Q[i] = XᵀW_Q[i]``, ``δW_K[j] = −X W_K[j]``, ``δW_V[j] = Z W_V[j]``,
``δW_O[:, i] = −W_O[:, i] Z``. Under LRM the parameters are ``W̄, r, c``, not ``W``: the
effective-weight generator ``δW_Q = XᵀW_Q`` with ``W_Q = diag(r) W̄ diag(c)`` is
``δW̄_Q = diag(r)⁻¹ Xᵀ diag(r) W̄_Q`` — the *twist* (column multipliers cancel, the bias row
follows its row multiplier).

Normal equations (least squares in the parameters' Frobenius metric)::

    Σ_A P̂_k M Λ_k⁻² + Σ_B Γ_k⁻² M R̂_k = S,     P̂_k = Λ_k a_k a_kᵀ Λ_k,  R̂_k = Γ_k b_k b_kᵀ Γ_k,
    S = Σ_A Λ_k a_k du_kᵀ Λ_k⁻¹ − Σ_B Γ_k⁻¹ du_k b_kᵀ Γ_k.

When the twists of a group agree (no LRM; or LRM without GQA) the substitution
``M = Γ Y Λ`` turns this into the Sylvester equation ``(ΓP̂Γ) Y + Y (ΛR̂Λ) = Γ S Λ``, solved
in closed form for the whole batch (:class:`~gaugeopt.projection.sylvester.SylvesterInverse`). With
LRM + GQA the per-head twists differ and the system is solved by preconditioned CG.

**RoPE.** ``X`` must commute with the rotations: ``a·I + b·J`` on each plane ``(p, q)``, free
on the non-rotary block. The images of ``I_m`` and ``J_m`` live on the rows ``p, q`` only, so
planes are mutually orthogonal and orthogonal to the free block: each plane is a 2×2 problem.
Without twists ``⟨g_I, g_J⟩ = tr(J P_mm) − tr(J R_mm) = 0`` (``J`` antisymmetric, the blocks
symmetric) and ``‖g_I‖² = ‖g_J‖² = tr P_mm + tr R_mm`` (``J`` is a rotation of the plane),
so ``a = (S_pp + S_qq)/N``, ``b = (S_qp − S_pq)/N``; with twists the 2×2 Gram is solved.

Modes: ``"exact"`` as above; ``"approx"`` is paper 000 Algorithm 2 — two one-sided
pseudo-inverse estimates ``Y_A = P̃⁺ S̃_A``, ``Y_B = S̃_B R̃⁺`` symmetrised, ``Y = ½(Y_A + Y_B)``
(exact when ``P̃ = R̃ = I``; with GQA the one-sided estimate is the pseudo-inverse of the
stacked query heads). RoPE planes use their closed form in both modes.

Cost per KV group: Gram and cross terms ``O(k·n²·m)`` (``k`` member heads, ``m`` the model
width), one ``O(n³)`` eigendecomposition of each of ``P̃, R̃``, ``O(n³)`` to apply.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.projection.projector import GaugeProjector
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)).double()
    >>> u = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    >>> proj = GaugeProjector(model, sectors=("qk",))
    >>> hor = proj.project(u)
    >>> bool(proj.vertical(hor)["transformer.h.0.attn.c_attn.weight"].abs().max() < 1e-12)
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.records.pair import PairSide
from gaugeopt.records.site import AttentionSite, TensorRef
from legacy_projection import sylvester
from legacy_projection.sylvester import SylvesterInverse, psd_solve, twisted_cg

__all__ = ["DenseSector"]


def _gather(side: PairSide, src) -> torch.Tensor:
    """``(groups, repeat, n, m)`` rows of the side (bias appended as a last column)."""
    w = side.rows(src(side.weight))
    if side.bias is not None:
        w = torch.cat([w, src(side.bias)[..., None]], dim=-1)
    return side.grouped(w)


def _twist(side: PairSide, src, site: AttentionSite) -> torch.Tensor | None:
    if side.mult is None:
        return None
    t = side.grouped(src(side.mult))
    if bool((t == 0).any()):
        raise GaugeError(
            f"{site.name}: multiplier {side.mult.name} has an exact zero; the gauge generators in W̄ coordinates "
            "divide by it (a zero multiplier makes its whole row a gauge direction). Re-initialise that multiplier."
        )
    return t


def _scatter(side: PairSide, out, v: torch.Tensor) -> None:
    """Add ``v (groups, repeat, n, m)`` into the views of ``out`` (a ``ref -> tensor`` accessor)."""
    v = v.reshape(-1, *v.shape[2:])  # (heads, n, m)
    if side.bias is not None:
        out(side.bias).add_(v[..., -1])
        v = v[..., :-1]
    out(side.weight).add_(side.unrows(v))


def _apply_m(A, lam, B, gam, M):
    """Generator images ``(Λ⁻¹MᵀΛA, −Γ⁻¹MΓB)`` for ``M (G, n, n)``; ``A (G, kA, n, m)``."""
    At = A if lam is None else A * lam[..., None]
    vA = M.mT[:, None] @ At
    if lam is not None:
        vA = vA / lam[..., None]
    Bt = B if gam is None else B * gam[..., None]
    vB = -(M[:, None] @ Bt)
    if gam is not None:
        vB = vB / gam[..., None]
    return vA, vB


@dataclass
class _SiteState:
    site: AttentionSite
    sides: tuple[PairSide, PairSide]
    A: torch.Tensor
    lam: torch.Tensor | None
    B: torch.Tensor
    gam: torch.Tensor | None
    plane: dict | None = None  # 2x2 Gram eigendecompositions of the RoPE planes
    free: torch.Tensor | None = None  # row indices of the dense block
    batch: object = None  # (key, offset) into the dense batch
    extras: dict = field(default_factory=dict)


@dataclass
class _Prepared:
    states: list[_SiteState]
    batches: dict


@dataclass
class _Batch:
    """All dense problems of one shape, concatenated over sites: solved in one call."""

    Ph: torch.Tensor  # (G, kA, n, n) per-member Λ a aᵀ Λ
    Rh: torch.Tensor  # (G, kB, n, n)
    la: torch.Tensor | None  # (G, kA, n) λ⁻²   (None: no twist)
    ga: torch.Tensor | None  # (G, kB, n) γ⁻²
    l: torch.Tensor  # (G, n) representative twists (exact ones when uniform)
    g: torch.Tensor
    uniform: bool
    inv: SylvesterInverse | None = None


class DenseSector:
    """The ``qk`` or ``vo`` sector over a list of attention sites (see the module docstring)."""

    def __init__(self, kind: str, sites: list[AttentionSite]) -> None:
        if kind not in ("qk", "vo"):
            raise GaugeError(f"DenseSector: kind={kind!r} must be 'qk' or 'vo'")
        self.name = kind
        self.sites = sites
        self.static = []
        for s in sites:
            n = s.d_k if kind == "qk" else s.d_v
            planes = s.rope.planes(s.d_k) if (kind == "qk" and s.rope.active) else []
            in_plane = {c for pq in planes for c in pq}
            free = torch.tensor([c for c in range(n) if c not in in_plane], dtype=torch.long)
            pidx = torch.tensor([p for p, _ in planes], dtype=torch.long)
            qidx = torch.tensor([q for _, q in planes], dtype=torch.long)
            self.static.append((n, free, pidx, qidx))

    # ------------------------------------------------------------------ structure
    def refs(self) -> list[TensorRef]:
        out = []
        for s in self.sites:
            for side in s.pair(self.name).sides():
                out += [r for r in (side.weight, side.bias) if r is not None]
        return out

    def units(self) -> list[str]:
        return [s.name for s in self.sites]

    def dimension(self) -> int:
        """Number of generators: per KV group ``d_k²`` (RoPE-reduced) for ``qk``, ``d_v²`` for ``vo``."""
        return sum(s.h_kv * (s.rope.qk_gauge_dim(s.d_k) if self.name == "qk" else s.d_v**2) for s in self.sites)

    # ------------------------------------------------------------------ prepare (depends on θ only)
    def prepare(self, ctx) -> "_Prepared":
        states: list[_SiteState] = []
        pending: dict[tuple, list] = {}
        for s, (n, free, pidx, qidx) in zip(self.sites, self.static):
            sa, sb = s.pair(self.name).sides()
            st = _SiteState(
                s, (sa, sb), _gather(sa, ctx.weight), _twist(sa, ctx.weight, s),
                _gather(sb, ctx.weight), _twist(sb, ctx.weight, s),
            )
            if len(pidx):
                st.plane = _plane_prepare(st, pidx.to(ctx.device), qidx.to(ctx.device), ctx.rtol)
            if len(free):
                st.free = free.to(ctx.device)
                key = (len(free), sa.repeat, sb.repeat, st.lam is not None, st.gam is not None)
                pending.setdefault(key, []).append(st)
            states.append(st)
        return _Prepared(states, {key: _batch_prepare(sts, ctx) for key, sts in pending.items()})

    # ------------------------------------------------------------------ apply (per vector field)
    def apply(self, ctx, prep: "_Prepared", u, out, record=None) -> None:
        """Add the vertical part of ``u`` into ``out`` (both ``ref -> view`` accessors)."""
        states = prep.states
        vparts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        coef: dict[int, torch.Tensor] = {}
        for idx, st in enumerate(states):
            sa, sb = st.sides
            dA, dB = _gather(sa, u), _gather(sb, u)
            st.extras = {"dA": dA, "dB": dB}
            vA, vB = torch.zeros_like(st.A), torch.zeros_like(st.B)
            n = st.A.shape[-2]
            coef[idx] = torch.zeros(st.site.h_kv, n, n, dtype=st.A.dtype, device=st.A.device)
            if st.plane is not None:
                _plane_apply(st, dA, dB, vA, vB, coef[idx])
            vparts[idx] = (vA, vB)
        for key, batch in prep.batches.items():
            sts = [(i, st) for i, st in enumerate(states) if st.free is not None and _key(st) == key]
            parts = [_cross(st, st.extras["dA"], st.extras["dB"], st.free) for _, st in sts]
            SA, SB = torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
            M = _batch_solve(batch, SA, SB, ctx, self.name)
            off = 0
            for i, st in sts:
                G = st.site.h_kv
                Mi = M[off : off + G]
                off += G
                F = st.free
                A, B = st.A[..., F, :], st.B[..., F, :]
                lam = None if st.lam is None else st.lam[..., F]
                gam = None if st.gam is None else st.gam[..., F]
                vA_f, vB_f = _apply_m(A, lam, B, gam, Mi)
                vparts[i][0][..., F, :] += vA_f
                vparts[i][1][..., F, :] += vB_f
                coef[i][:, F[:, None], F[None, :]] = Mi
        for i, st in enumerate(states):
            vA, vB = vparts[i]
            _scatter(st.sides[0], out, vA)
            _scatter(st.sides[1], out, vB)
            if record is not None:
                dA, dB = st.extras["dA"], st.extras["dB"]
                record(self.name, st.site.name, coef[i], vA.square().sum() + vB.square().sum(),
                       dA.square().sum() + dB.square().sum())
            st.extras = {}

    # ------------------------------------------------------------------ explicit generators
    def basis(self, ctx, prep: "_Prepared"):
        """Yield ``(label, {ref: image})`` for a basis of the sector's Lie algebra (small models).

        Planes: ``I_m``, ``J_m`` per KV group; the dense block: every elementary matrix."""
        for st, (n, free, pidx, qidx) in zip(prep.states, self.static):
            G = st.site.h_kv
            mats = []
            for m, (p, q) in enumerate(zip(pidx.tolist(), qidx.tolist())):
                eye = torch.zeros(n, n, dtype=st.A.dtype, device=st.A.device)
                eye[p, p] = eye[q, q] = 1.0
                jay = torch.zeros_like(eye)
                jay[q, p], jay[p, q] = 1.0, -1.0
                mats += [(f"I{m}", eye), (f"J{m}", jay)]
            for a in free.tolist():
                for b in free.tolist():
                    e = torch.zeros(n, n, dtype=st.A.dtype, device=st.A.device)
                    e[a, b] = 1.0
                    mats.append((f"E{a},{b}", e))
            for j in range(G):
                for label, E in mats:
                    M = torch.zeros(G, n, n, dtype=st.A.dtype, device=st.A.device)
                    M[j] = E
                    vA, vB = _apply_m(st.A, st.lam, st.B, st.gam, M)
                    yield f"{self.name}:{st.site.name}:group{j}:{label}", _writer(st.sides, vA, vB)


def _writer(sides, vA, vB):
    def write(out) -> None:
        _scatter(sides[0], out, vA)
        _scatter(sides[1], out, vB)

    return write


def _key(st: _SiteState) -> tuple:
    sa, sb = st.sides
    return (len(st.free), sa.repeat, sb.repeat, st.lam is not None, st.gam is not None)


def _cross(st: _SiteState, dA, dB, F) -> tuple[torch.Tensor, torch.Tensor]:
    """``S_A = Σ_A Λ a duᵀ Λ⁻¹`` and ``S_B = Σ_B Γ⁻¹ du bᵀ Γ`` on the rows ``F`` (``S = S_A − S_B``)."""
    A, B = st.A[..., F, :], st.B[..., F, :]
    dA, dB = dA[..., F, :], dB[..., F, :]
    lam = None if st.lam is None else st.lam[..., F]
    gam = None if st.gam is None else st.gam[..., F]
    At = A if lam is None else A * lam[..., None]
    SA = At @ dA.mT
    if lam is not None:
        SA = SA / lam[..., None, :]
    Bt = B if gam is None else B * gam[..., None]
    SB = dB @ Bt.mT
    if gam is not None:
        SB = SB / gam[..., :, None]
    return SA.sum(1), SB.sum(1)


def _uniform(t: torch.Tensor | None) -> bool:
    return t is None or t.shape[1] == 1 or bool(torch.equal(t, t[:, :1].expand_as(t)))


def _rep_twist(t: torch.Tensor | None, gram: torch.Tensor, n: int, ref: torch.Tensor) -> torch.Tensor:
    """Representative twist per group: ``(Σ_k w_k t_k⁻²)^(-1/2)``, ``w_k ∝ tr(gram_k)``."""
    if t is None:
        return torch.ones(ref.shape[0], n, dtype=ref.dtype, device=ref.device)
    if _uniform(t):
        return t[:, 0].abs()
    w = torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1)  # (G, k)
    tot = w.sum(1, keepdim=True)
    w = torch.where(tot > 0, w / tot.clamp_min(torch.finfo(w.dtype).tiny), torch.full_like(w, 1.0 / w.shape[1]))
    return (w[..., None] * t.pow(-2)).sum(1).rsqrt()


def _batch_prepare(sts: list[_SiteState], ctx) -> _Batch:
    Ph, Rh, la, ga, ls, gs, tall = [], [], [], [], [], [], []
    uniform = True
    for st in sts:
        F = st.free
        A, B = st.A[..., F, :], st.B[..., F, :]
        lam = None if st.lam is None else st.lam[..., F]
        gam = None if st.gam is None else st.gam[..., F]
        At = A if lam is None else A * lam[..., None]
        Bt = B if gam is None else B * gam[..., None]
        ph, rh = At @ At.mT, Bt @ Bt.mT
        Ph.append(ph)
        Rh.append(rh)
        uniform = uniform and _uniform(lam) and _uniform(gam)
        if lam is not None:
            la.append(lam.pow(-2))
        if gam is not None:
            ga.append(gam.pow(-2))
        ls.append(_rep_twist(lam, ph, len(F), A))
        gs.append(_rep_twist(gam, rh, len(F), A))
        tall.append((At, Bt))
    Ph, Rh = torch.cat(Ph), torch.cat(Rh)
    l, g = torch.cat(ls), torch.cat(gs)
    b = _Batch(Ph, Rh, torch.cat(la) if la else None, torch.cat(ga) if ga else None, l, g, uniform)
    # Reparametrised Sylvester pair P̃ = Γ(ΣP̂)Γ, R̃ = Λ(ΣR̂)Λ: exact when uniform, the preconditioner otherwise.
    Pt = Ph.sum(1) * g[:, :, None] * g[:, None, :]
    Rt = Rh.sum(1) * l[:, :, None] * l[:, None, :]
    factors = None
    if sylvester.gram_eig_backend(Pt, ()) == "svd":  # P̃ = F_P F_Pᵀ with F_P = [Γ Λ_k a_k]_k (tall: k·m ≥ n)
        fp = _pad_width_cat([_stack_members(At) for At, _ in tall]) * g[:, :, None]
        fr = _pad_width_cat([_stack_members(Bt) for _, Bt in tall]) * l[:, :, None]
        factors = (fp, fr)
    b.inv = SylvesterInverse(Pt, Rt, ctx.rtol, regularize=not uniform and ctx.mode == "exact", factors=factors)
    return b


def _stack_members(X: torch.Tensor) -> torch.Tensor:
    """``(G, k, n, m) -> (G, n, k·m)``: the members side by side, so that ``F Fᵀ = Σ_k X_k X_kᵀ``."""
    G, k, n, m = X.shape
    return X.permute(0, 2, 1, 3).reshape(G, n, k * m)


def _pad_width_cat(mats: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(sylvester._pad_width(*mats), 0)


def _batch_solve(b: _Batch, SA: torch.Tensor, SB: torch.Tensor, ctx, name: str) -> torch.Tensor:
    """``M`` for every group of the batch (``M = Γ Y Λ`` in the reparametrised coordinates)."""
    gl = b.g[:, :, None] * b.l[:, None, :]
    if ctx.mode == "approx":  # paper 000 Algorithm 2: symmetrised one-sided pseudo-inverse estimates
        return gl * (0.5 * (b.inv.left_pinv(SA * gl) + b.inv.right_pinv(-SB * gl)))
    S = SA - SB
    if b.uniform:
        return gl * b.inv(S * gl)

    def op(M):
        out = torch.einsum("gkab,gbc,gkc->gac", b.Ph, M, b.la) if b.la is not None else b.Ph.sum(1) @ M
        if b.ga is not None:
            out = out + torch.einsum("gka,gab,gkbc->gac", b.ga, M, b.Rh)
        else:
            out = out + M @ b.Rh.sum(1)
        return out

    M, iters, res = twisted_cg(op, S, lambda R: gl * b.inv(R * gl), tol=ctx.cg_tol, maxiter=ctx.cg_maxiter)
    ctx.note_cg(name, iters, res)
    return M


def _plane_prepare(st: _SiteState, P, Q, rtol) -> dict:
    """2×2 Gram of ``(g_I, g_J)`` per plane and group, and its eigendecomposition."""
    A, B = st.A, st.B
    Ap, Aq, Bp, Bq = A[..., P, :], A[..., Q, :], B[..., P, :], B[..., Q, :]
    App, Aqq, Apq = (Ap * Ap).sum(-1), (Aq * Aq).sum(-1), (Ap * Aq).sum(-1)  # (G, kA, planes)
    Bpp, Bqq, Bpq = (Bp * Bp).sum(-1), (Bq * Bq).sum(-1), (Bp * Bq).sum(-1)
    al = torch.ones_like(App) if st.lam is None else st.lam[..., Q] / st.lam[..., P]  # λ_q / λ_p
    be = torch.ones_like(Bpp) if st.gam is None else st.gam[..., Q] / st.gam[..., P]  # γ_q / γ_p
    gII = (App + Aqq).sum(1) + (Bpp + Bqq).sum(1)
    gJJ = (al**2 * Aqq + al**-2 * App).sum(1) + (be**2 * Bqq + be**-2 * Bpp).sum(1)
    gIJ = ((al - 1 / al) * Apq).sum(1) + ((1 / be - be) * Bpq).sum(1)
    gram = torch.stack([torch.stack([gII, gIJ], -1), torch.stack([gIJ, gJJ], -1)], -2)  # (G, planes, 2, 2)
    return {"P": P, "Q": Q, "al": al, "be": be, "gram": gram, "rtol": rtol}


def _plane_apply(st: _SiteState, dA, dB, vA, vB, coef) -> None:
    pl = st.plane
    P, Q, al, be = pl["P"], pl["Q"], pl["al"], pl["be"]
    A, B = st.A, st.B
    Ap, Aq, Bp, Bq = A[..., P, :], A[..., Q, :], B[..., P, :], B[..., Q, :]
    dAp, dAq, dBp, dBq = dA[..., P, :], dA[..., Q, :], dB[..., P, :], dB[..., Q, :]
    rI = ((dAp * Ap).sum(-1) + (dAq * Aq).sum(-1)).sum(1) - ((dBp * Bp).sum(-1) + (dBq * Bq).sum(-1)).sum(1)
    rJ = (al * (dAp * Aq).sum(-1) - (dAq * Ap).sum(-1) / al).sum(1) + (
        be * (dBp * Bq).sum(-1) - (dBq * Bp).sum(-1) / be
    ).sum(1)
    ab = psd_solve(pl["gram"], torch.stack([rI, rJ], -1), pl["rtol"])  # (G, planes, 2)
    a, b = ab[..., 0][:, None, :, None], ab[..., 1][:, None, :, None]  # broadcast over members and width
    alx, bex = al[..., None], be[..., None]
    vA[..., P, :] += a * Ap + b * alx * Aq
    vA[..., Q, :] += a * Aq - b / alx * Ap
    vB[..., P, :] += -a * Bp + b * bex * Bq
    vB[..., Q, :] += -a * Bq - b / bex * Bp
    # coefficients as the matrix a·I + b·J (J[q, p] = 1, J[p, q] = -1)
    aa, bb = ab[..., 0], ab[..., 1]
    coef[:, P, P] = aa
    coef[:, Q, Q] = aa
    coef[:, Q, P] = bb
    coef[:, P, Q] = -bb
