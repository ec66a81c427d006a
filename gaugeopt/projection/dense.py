"""The dense head gauges as projection sectors: ``qk`` (``GL(d_k)`` or its RoPE commutant) and ``vo``.

Each sector knows its generators and removes them from a vector field ``u`` given per
parameter, for every KV group of every layer at once (docs/projection.md, paper 000 Remark 51 /
Algorithm 2). Both sectors are instances of one *bilinear* family: per KV group a matrix
``M ∈ gl(n)`` moves "A-side" tensors ``a_k`` and "B-side" tensors ``b_k`` (rows of width ``n``)

    δa_k = Λ_k⁻¹ Mᵀ Λ_k a_k,        δb_k = −Γ_k⁻¹ M Γ_k b_k,

===========  ========================================  ==========================================  ==========
sector       A side (``a_k``, twist ``Λ_k``)             B side (``b_k``, twist ``Γ_k``)               ``M``
===========  ========================================  ==========================================  ==========
``qk``       ``[W̄_Q[i] | b̄_Q[i]]``, ``r_Q[i]``          ``[W̄_K[j] | b̄_K[j]]``, ``r_K[j]``             ``X``
``vo``       ``[W̄_V[j] | b̄_V[j]]``, ``r_V[j]``          ``W̄_O[:, i]ᵀ``, ``c_O[i]``                   ``Y = Zᵀ``
``qk_rope``  RoPE query rows of every head              the shared RoPE key rows (one group)          ``X``
===========  ========================================  ==========================================  ==========

over the query heads ``i`` of group ``j`` (``qk_rope``: multi-head latent attention, docs/mla.md —
one group, all heads; its generators are the RoPE commutant, closed form per plane). Without multipliers every twist is ``I`` and these
are the generators ``δW_Q[i] = XᵀW_Q[i]``, ``δW_K[j] = −X W_K[j]``, ``δW_V[j] = Z W_V[j]``,
``δW_O[:, i] = −W_O[:, i] Z``. Under LRM the parameters are ``W̄, r, c``, not ``W``: the
effective-weight generator ``δW_Q = XᵀW_Q`` with ``W_Q = diag(r) W̄ diag(c)`` is
``δW̄_Q = diag(r)⁻¹ Xᵀ diag(r) W̄_Q`` — the *twist* (column multipliers cancel, the bias row
follows its row multiplier).

Normal equations (least squares in the parameters' Frobenius metric)::

    K(M) = Σ_A P̂_k M Λ_k⁻² + Σ_B Γ_k⁻² M R̂_k = S,     P̂_k = Λ_k a_k a_kᵀ Λ_k,  R̂_k = Γ_k b_k b_kᵀ Γ_k,
    S = Σ_A Λ_k a_k du_kᵀ Λ_k⁻¹ − Σ_B Γ_k⁻¹ du_k b_kᵀ Γ_k.

When the twists of a group agree (no LRM; or LRM without GQA) the substitution
``M = Γ Y Λ`` turns this into the Sylvester equation ``(ΓP̂Γ) Y + Y (ΛR̂Λ) = Γ S Λ``, solved
in closed form for the whole batch (:class:`~gaugeopt.projection.sylvester.SylvesterInverse`). With
LRM + GQA the per-head twists differ and the system is solved by preconditioned CG.

**Orthogonal Q/K gauge** (``site.qk_orthogonal``: a weight-free norm per head, Llama 4). Only the
antisymmetric part survives, ``b·J`` on each plane: the plane's 1×1 problem ``b = r_J / g_JJ``.
Such a site must rotate every channel (a non-rotary block would need ``so(d_k − r)``, which is
not implemented: :class:`DenseSector` refuses it, and the projector leaves such a site out).

**RoPE.** ``X`` must commute with the rotations: ``a·I + b·J`` on each plane ``(p, q)``, free
on the non-rotary block. The images of ``I_m`` and ``J_m`` live on the rows ``p, q`` only, so
planes are mutually orthogonal and orthogonal to the free block: each plane is a 2×2 problem
(solved in closed form, :mod:`gaugeopt.projection.planes`). Without twists ``⟨g_I, g_J⟩ = tr(J P_mm) − tr(J R_mm) = 0``
(``J`` antisymmetric, the blocks symmetric) and ``‖g_I‖² = ‖g_J‖² = tr P_mm + tr R_mm``, so
``a = (S_pp + S_qq)/N``, ``b = (S_qp − S_pq)/N``; with twists the 2×2 Gram is solved.

**Modes.** ``"exact"`` as above. ``"approx"``: a fixed number of CG steps on the same normal
equations ``K(M) = S``, preconditioned by one ADI step of the (reparametrised) Sylvester pair
(:class:`~gaugeopt.projection.sylvester.ShiftedSylvester`: two Cholesky factorisations, no
eigendecomposition), started from the best multiple of the previous call's coefficients
(:func:`~gaugeopt.projection.cg.batched_pcg`):
CG minimises the ``K``-norm of the coefficient error, which *is* the norm of the vertical part
left behind, over a space that contains the start, so the approximation never leaves more
vertical part than there was. ``"paper000"``: paper 000 Algorithm 2 — two one-sided
pseudo-inverse estimates ``Y_A = P̃⁺ S̃_A``, ``Y_B = S̃_B R̃⁺`` symmetrised, ``Y = ½(Y_A + Y_B)``
(exact when ``P̃ = R̃ = I``; with GQA the one-sided estimate is the pseudo-inverse of the
stacked query heads). RoPE planes use their closed form in every mode.

**Implementation.** The rows are views into the stored tensors (``TensorRef``; the O columns a
strided view, never a permuted copy); a bias is a rank-one term of the Gram and cross matrices
(``P = W Wᵀ + b bᵀ``, one ``baddbmm``), and the row subsets of a RoPE layer (planes, the free
block) are slices. Per batch of equally shaped sites: one ``bmm`` per side for the Grams, one
for the cross terms, one solve for every KV group of every layer, one ``baddbmm`` per side that
adds the vertical part into the output in place. On CUDA the sites of a batch are stacked along
the head axis so that each of those is one call for all layers (:data:`STACK_SITES`); on CPU the
views are used directly, one call per layer.

Cost per KV group: Gram and cross terms ``O(k·n²·m)`` (``k`` member heads, ``m`` the model
width), the vertical part ``O(k·n²·m)``, one ``O(n³)`` eigendecomposition of each of ``P̃, R̃``
(exact) or ``O(iters·n³)`` (approx).

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

from dataclasses import dataclass

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.records.pair import GaugePair, PairSide
from gaugeopt.records.site import AttentionSite, TensorRef
from gaugeopt.projection import sylvester
from gaugeopt.projection.cg import batched_pcg
from gaugeopt.projection.planes import plane_apply, plane_prepare
from gaugeopt.projection.rows import Rows, grouped_sum, per_head, rows, sel, sel_rows, zero_coef
from gaugeopt.projection.sylvester import ShiftedSylvester, SylvesterInverse

__all__ = ["DenseSector", "STACK_SITES"]

# Whether the sites of one batch are stacked along the head axis (one bmm for all layers, at the
# price of copying their rows) or handled one view at a time: "auto" stacks on CUDA, where a
# call costs a launch, and not on CPU, where the copy costs more than the call; True/False force it.
STACK_SITES: str | bool = "auto"


def _index(idx: list[int]) -> slice | None:
    """Row selection as a ``slice`` (indexing gives a view, so the output can be written through
    it), ``None`` when empty. RoPE planes (``(2m, 2m+1)`` or ``(m, m + r/2)``) and the free block
    (the trailing ``d_k − r`` rows) are arithmetic progressions."""
    if not idx:
        return None
    step = idx[1] - idx[0] if len(idx) > 1 else 1
    if step <= 0 or any(b - a != step for a, b in zip(idx, idx[1:])):
        raise GaugeError(f"rows {idx} are not an arithmetic progression; no RoPE layout gives such planes")
    return slice(idx[0], idx[-1] + 1, step)


def _twist(side: PairSide, acc, site: AttentionSite) -> torch.Tensor | None:
    if side.mult is None:
        return None
    t = acc(side.mult)
    if bool((t == 0).any()):
        raise GaugeError(
            f"{site.name}: multiplier {side.mult.name} has an exact zero; the gauge generators in W̄ coordinates "
            "divide by it (a zero multiplier makes its whole row a gauge direction). Re-initialise that multiplier."
        )
    return t


def _cat(ts: list):
    """Concatenation along the head axis; the tensor itself (no copy) when there is one."""
    if ts[0] is None:
        return None
    return ts[0] if len(ts) == 1 else torch.cat(ts, 0)


def _products(x: Rows, y: Rows) -> torch.Tensor:
    """``[W_x | b_x] [W_y | b_y]ᵀ`` per head, ``(heads, f, f)``: one ``baddbmm``, the bias as a rank-one term."""
    if x.b is None:
        return torch.bmm(x.W, y.W.mT)
    return torch.baddbmm(x.b[:, :, None] * y.b[:, None, :], x.W, y.W.mT)


def _add_images(Mh: torch.Tensor, src: Rows, dst: list[Rows]) -> None:
    """``dst += Mh · src`` row block by row block (``Mh (heads, f, f)``; ``dst`` one ``Rows`` per
    site, together ``heads`` heads): in place into the output's views. A column side (the O
    weight, rows strided along the model width) is written as ``dstᵀ += srcᵀ Mhᵀ``, the layout
    BLAS writes in place."""
    if len(dst) == 1:
        out = dst[0].W
        if out.stride(-1) == 1:
            out.baddbmm_(Mh, src.W)
        else:
            out.mT.baddbmm_(src.W.mT, Mh.mT)
        if src.b is not None:
            dst[0].b.add_(torch.bmm(Mh, src.b[..., None])[..., 0])
        return
    sizes = [d.W.shape[0] for d in dst]
    torch._foreach_add_([d.W for d in dst], list(torch.bmm(Mh, src.W).split(sizes)))
    if src.b is not None:
        torch._foreach_add_([d.b for d in dst], list(torch.bmm(Mh, src.b[..., None])[..., 0].split(sizes)))


@dataclass
class _Site:
    """Static facts of one site: its sides, the free rows and the RoPE planes (as slices)."""

    site: AttentionSite
    sa: PairSide
    sb: PairSide
    n: int
    free: slice | None
    n_free: int
    p: slice | None
    q: slice | None
    n_planes: int
    orthogonal: bool = False  # only b·J per plane (site.qk_orthogonal)
    groups: int = 0  # independent group elements (h_kv; 1 for the shared RoPE key of latent attention)

    def key(self) -> tuple:
        """Sites with equal keys are solved in one batch (and stacked on CUDA)."""
        s = self.site
        sa, sb = self.sa, self.sb
        return (self.n, self.n_free, self.n_planes, sa.heads, sb.heads, sa.repeat, sb.repeat,
                sa.weight.shape, sb.weight.shape, sa.bias is not None, sb.bias is not None,
                sa.mult is not None, sb.mult is not None, self.groups)


@dataclass
class _Point:
    """One site at θ: its rows and twists, and the RoPE planes' 2×2 Grams."""

    st: _Site
    A: Rows
    B: Rows
    lam: torch.Tensor | None  # (heads_a, n)
    gam: torch.Tensor | None  # (heads_b, n)
    plane: dict | None = None


@dataclass
class _Batch:
    """The dense blocks of equally shaped sites, solved in one call."""

    points: list[_Point]
    chunks: list[list[int]]  # indices into points stacked together
    Ph: torch.Tensor  # (G, kA, f, f) member Grams Λ a aᵀ Λ (kA = 1: summed over the group)
    Rh: torch.Tensor  # (G, kB, f, f)
    la: torch.Tensor | None  # (G, kA, f) λ⁻² per member (only when the twists of a group differ)
    ga: torch.Tensor | None  # (G, kB, f) γ⁻²
    l: torch.Tensor  # (G, f) representative twists (the exact ones when uniform)
    g: torch.Tensor
    uniform: bool
    twisted: bool = False
    inv: SylvesterInverse | None = None
    stacked: dict | None = None  # chunk index -> stacked θ rows (CUDA)


@dataclass
class _Prepared:
    points: list[_Point]
    batches: list[_Batch]


class DenseSector:
    """The ``qk`` or ``vo`` sector over a list of attention sites (see the module docstring).

    Args:
        kind: ``"qk"`` or ``"vo"``.
        sites: the attention sites.
        approx_iters: CG steps of ``mode="approx"``.
    """

    def __init__(self, kind: str, sites: list[AttentionSite], *, approx_iters: int = 4) -> None:
        if kind not in ("qk", "vo", "qk_rope"):
            raise GaugeError(f"DenseSector: kind={kind!r} must be 'qk', 'vo' or 'qk_rope'")
        self.name = kind
        self.sites = sites
        self.approx_iters = approx_iters
        self._warm: dict[tuple, torch.Tensor] = {}  # batch key -> the last approx coefficients
        self.static: list[_Site] = []
        for s in sites:
            pair = GaugePair.of(s, kind, orthogonal_ok=True)
            n = pair.width
            planes = pair.rope.planes(n) if pair.rope.active else []
            in_plane = {c for pq in planes for c in pq}
            free = [c for c in range(n) if c not in in_plane]
            orthogonal = kind == "qk" and bool(s.qk_orthogonal)
            if orthogonal and free:
                raise GaugeError(f"DenseSector: {s.name} keeps only the orthogonal Q/K gauge and has {len(free)} channels "
                                 "RoPE does not rotate; their so(d) part is not implemented (leave the site out)")
            self.static.append(_Site(s, pair.a, pair.b, n, _index(free), len(free),
                                     _index([p for p, _ in planes]), _index([q for _, q in planes]), len(planes),
                                     orthogonal, pair.groups))

    # ------------------------------------------------------------------ structure
    def refs(self) -> list[TensorRef]:
        out = []
        for s in self.sites:
            for side in GaugePair.of(s, self.name, orthogonal_ok=True).sides():
                out += [r for r in (side.weight, side.bias) if r is not None]
        return out

    def units(self) -> list[str]:
        return [s.name for s in self.sites]

    def dimension(self) -> int:
        """Number of generators: per KV group ``d_k²`` (RoPE-reduced; the rotations of the planes alone on a
        ``qk_orthogonal`` layer) for ``qk``, ``d_v²`` for ``vo``; the RoPE commutant of the one shared key for
        ``qk_rope``."""
        def dim(st: _Site) -> int:
            rope = GaugePair.of(st.site, self.name, orthogonal_ok=True).rope
            return rope.orthogonal_gauge_dim(st.n) if st.orthogonal else rope.qk_gauge_dim(st.n)

        return sum(st.groups * dim(st) for st in self.static)

    # ------------------------------------------------------------------ prepare (depends on θ only)
    def prepare(self, ctx) -> _Prepared:
        points = []
        by_key: dict[tuple, list[int]] = {}
        for st in self.static:
            pt = _Point(st, rows(st.sa, ctx.weight), rows(st.sb, ctx.weight),
                        _twist(st.sa, ctx.weight, st.site), _twist(st.sb, ctx.weight, st.site))
            if st.n_planes:
                pt.plane = plane_prepare(pt, ctx.rtol)
            if st.n_free:
                by_key.setdefault(st.key(), []).append(len(points))
            points.append(pt)
        batches = [_batch_prepare([points[i] for i in idx], ctx) for idx in by_key.values()]
        return _Prepared(points, batches)

    # ------------------------------------------------------------------ apply (per vector field)
    def apply(self, ctx, prep: _Prepared, u, out, record=None) -> None:
        """Add the vertical part of ``u`` into ``out`` (both ``ref -> view`` accessors).

        With ``record``, ``out`` must be zero on the sector's entries (its norms are read there)."""
        coefs = {} if record is not None else None
        for pt in prep.points:
            if pt.plane is not None:
                plane_apply(pt, u, out, coefs)
        for bi, batch in enumerate(prep.batches):
            key = batch.points[0].st.key()
            d = [(sel_rows(rows(pt.st.sa, u), pt.st.free), sel_rows(rows(pt.st.sb, u), pt.st.free))
                 for pt in batch.points]
            SA, SB = [], []
            for ci, chunk in enumerate(batch.chunks):
                A, B, lam, gam = _chunk_theta(batch, ci)
                dA = Rows(_cat([d[i][0].W for i in chunk]), _cat([d[i][0].b for i in chunk]))
                dB = Rows(_cat([d[i][1].W for i in chunk]), _cat([d[i][1].b for i in chunk]))
                sa, sb = _cross(A, dA, lam, B, dB, gam, batch.points[0].st)
                SA.append(sa)
                SB.append(sb)
            M = _batch_solve(batch, _cat(SA), _cat(SB), ctx, self, key)
            off = 0
            for ci, chunk in enumerate(batch.chunks):
                A, B, lam, gam = _chunk_theta(batch, ci)
                st = batch.points[chunk[0]].st
                G = st.groups * len(chunk)
                Mc = M[off : off + G]
                off += G
                Ma, Mb = _head_matrices(Mc, lam, gam, st)
                outs = [(sel_rows(rows(batch.points[i].st.sa, out), st.free),
                         sel_rows(rows(batch.points[i].st.sb, out), st.free)) for i in chunk]
                _add_images(Ma, A, [o[0] for o in outs])
                _add_images(Mb, B, [o[1] for o in outs])
                if coefs is not None:
                    for j, i in enumerate(chunk):
                        pt = batch.points[i]
                        c = coefs.setdefault(id(pt), zero_coef(pt))
                        h = st.groups
                        _set_block(c, st.free, Mc[j * h : (j + 1) * h])
        if record is None:
            return
        for pt in prep.points:
            sa, sb = pt.st.sa, pt.st.sb
            vsq = _sq(rows(sa, out)) + _sq(rows(sb, out))
            usq = _sq(rows(sa, u)) + _sq(rows(sb, u))
            record(self.name, pt.st.site.name, coefs.get(id(pt), zero_coef(pt)), vsq, usq)

    # ------------------------------------------------------------------ explicit generators
    def basis(self, ctx, prep: _Prepared):
        """Yield ``(label, write)`` for a basis of the sector's Lie algebra (small models).

        Planes: ``I_m``, ``J_m`` per KV group; the dense block: every elementary matrix."""
        for pt in prep.points:
            st = pt.st
            n, G = st.n, st.groups
            dev, dt = pt.A.W.device, pt.A.W.dtype
            rng = lambda idx: [] if idx is None else list(range(n))[idx]  # noqa: E731
            mats = []
            for m, (p, q) in enumerate(zip(rng(st.p), rng(st.q))):
                eye = torch.zeros(n, n, dtype=dt, device=dev)
                eye[p, p] = eye[q, q] = 1.0
                jay = torch.zeros_like(eye)
                jay[q, p], jay[p, q] = 1.0, -1.0
                mats += [(f"I{m}", eye), (f"J{m}", jay)]
            free = rng(st.free)
            for a in free:
                for b in free:
                    e = torch.zeros(n, n, dtype=dt, device=dev)
                    e[a, b] = 1.0
                    mats.append((f"E{a},{b}", e))
            for j in range(G):
                for label, E in mats:
                    M = torch.zeros(G, n, n, dtype=dt, device=dev)
                    M[j] = E
                    yield f"{self.name}:{st.site.name}:group{j}:{label}", _writer(pt, M)


def _sq(r: Rows) -> torch.Tensor:
    s = torch.linalg.vector_norm(r.W).square()
    return s if r.b is None else s + r.b.square().sum()


def _set_block(c: torch.Tensor, idx, block: torch.Tensor) -> None:
    c[:, idx, idx] = block


def _writer(pt: _Point, M: torch.Tensor):
    """Write the generator images of the full coefficient matrices ``M (groups, n, n)`` into ``out``."""

    def write(out) -> None:
        Ma, Mb = _head_matrices(M, pt.lam, pt.gam, pt.st)
        _add_images(Ma, pt.A, [rows(pt.st.sa, out)])
        _add_images(Mb, pt.B, [rows(pt.st.sb, out)])

    return write


def _head_matrices(M, lam, gam, st: _Site) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head generator matrices: ``Λ_k⁻¹ Mᵀ Λ_k`` (side a), ``−Γ_k⁻¹ M Γ_k`` (side b)."""
    Ma = per_head(M.mT, st.sa.repeat)
    if lam is not None:
        Ma = Ma * (lam[:, None, :] / lam[:, :, None])
    Mb = per_head(M, st.sb.repeat)
    Mb = -Mb if gam is None else Mb * (gam[:, None, :] / -gam[:, :, None])
    return Ma, Mb


def _cross(A: Rows, dA: Rows, lam, B: Rows, dB: Rows, gam, st: _Site) -> tuple[torch.Tensor, torch.Tensor]:
    """``S_A = Σ_A Λ a duᵀ Λ⁻¹`` and ``S_B = Σ_B Γ⁻¹ du bᵀ Γ`` per group ``(G, f, f)`` (``S = S_A − S_B``)."""
    SA = _products(A, dA)
    if lam is not None:
        SA = SA * (lam[:, :, None] / lam[:, None, :])
    SB = _products(dB, B)
    if gam is not None:
        SB = SB * (gam[:, None, :] / gam[:, :, None])
    return grouped_sum(SA, st.sa.repeat), grouped_sum(SB, st.sb.repeat)


def _stack_sites(device: torch.device) -> bool:
    return device.type == "cuda" if STACK_SITES == "auto" else bool(STACK_SITES)


def _chunk_theta(batch: _Batch, ci: int):
    """``(A, B, λ, γ)`` of a chunk at θ on the free rows, stacked along the head axis."""
    if batch.stacked is not None and ci in batch.stacked:
        return batch.stacked[ci]
    chunk = batch.chunks[ci]
    pts = [batch.points[i] for i in chunk]
    F = pts[0].st.free
    A = Rows(_cat([sel(p.A.W, F) for p in pts]), _cat([sel(p.A.b, F) for p in pts]))
    B = Rows(_cat([sel(p.B.W, F) for p in pts]), _cat([sel(p.B.b, F) for p in pts]))
    lam = _cat([sel(p.lam, F) for p in pts])
    gam = _cat([sel(p.gam, F) for p in pts])
    out = (A, B, lam, gam)
    if len(chunk) > 1:
        batch.stacked = batch.stacked or {}
        batch.stacked[ci] = out
    return out


def _uniform(t: torch.Tensor | None) -> bool:
    return t is None or t.shape[1] == 1 or bool(torch.equal(t, t[:, :1].expand_as(t)))


def _rep_twist(t: torch.Tensor | None, gram: torch.Tensor, G: int, f: int, ref: torch.Tensor) -> torch.Tensor:
    """Representative twist per group: ``(Σ_k w_k t_k⁻²)^(-1/2)``, ``w_k ∝ tr(gram_k)``."""
    if t is None:
        return torch.ones(G, f, dtype=ref.dtype, device=ref.device)
    if _uniform(t):
        return t[:, 0].abs()
    w = torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1)  # (G, k)
    tot = w.sum(1, keepdim=True)
    w = torch.where(tot > 0, w / tot.clamp_min(torch.finfo(w.dtype).tiny), torch.full_like(w, 1.0 / w.shape[1]))
    return (w[..., None] * t.pow(-2)).sum(1).rsqrt()


def _batch_prepare(points: list[_Point], ctx) -> _Batch:
    st = points[0].st
    dev = points[0].A.W.device
    chunks = [list(range(len(points)))] if (_stack_sites(dev) and len(points) > 1) else [[i] for i in range(len(points))]
    b = _Batch(points, chunks, None, None, None, None, None, None, True)
    Ph, Rh, lams, gams = [], [], [], []
    kA, kB = st.sa.repeat, st.sb.repeat
    for ci in range(len(chunks)):
        A, B, lam, gam = _chunk_theta(b, ci)
        ph, rh = _products(A, A), _products(B, B)
        if lam is not None:
            ph = ph * (lam[:, :, None] * lam[:, None, :])
        if gam is not None:
            rh = rh * (gam[:, :, None] * gam[:, None, :])
        Ph.append(ph.reshape(-1, kA, *ph.shape[1:]))
        Rh.append(rh.reshape(-1, kB, *rh.shape[1:]))
        lams.append(None if lam is None else lam.reshape(-1, kA, lam.shape[-1]))
        gams.append(None if gam is None else gam.reshape(-1, kB, gam.shape[-1]))
    Ph, Rh = torch.cat(Ph), torch.cat(Rh)
    lam, gam = _cat(lams), _cat(gams)
    G, f = Ph.shape[0], Ph.shape[-1]
    b.uniform = _uniform(lam) and _uniform(gam)
    b.twisted = lam is not None or gam is not None
    b.l = _rep_twist(lam, Ph, G, f, Ph)
    b.g = _rep_twist(gam, Rh, G, f, Ph)
    if b.uniform:  # one Gram per group
        Ph = Ph if kA == 1 else Ph.sum(1, keepdim=True)
        Rh = Rh if kB == 1 else Rh.sum(1, keepdim=True)
    else:
        b.la = None if lam is None else lam.pow(-2)
        b.ga = None if gam is None else gam.pow(-2)
    b.Ph, b.Rh = Ph, Rh
    # Reparametrised Sylvester pair P̃ = Γ(ΣP̂)Γ, R̃ = Λ(ΣR̂)Λ: exact when uniform, the preconditioner otherwise.
    Pt, Rt = _member_sum(Ph), _member_sum(Rh)
    if lam is not None or gam is not None:
        Pt = Pt * (b.g[:, :, None] * b.g[:, None, :])
        Rt = Rt * (b.l[:, :, None] * b.l[:, None, :])
    if ctx.mode == "approx":  # no eigendecomposition: one ADI step as the CG preconditioner
        b.inv = ShiftedSylvester(Pt, Rt)
        return b
    factors = None
    if sylvester.gram_eig_backend(Pt, ()) == "svd":  # P̃ = F_P F_Pᵀ with F_P = [Γ Λ_k a_k]_k (tall: k·m ≥ n)
        factors = (_factor(b, "a") * b.g[:, :, None], _factor(b, "b") * b.l[:, :, None])
    b.inv = SylvesterInverse(Pt, Rt, ctx.rtol, regularize=not b.uniform and ctx.mode == "exact", factors=factors)
    return b


def _member_sum(t: torch.Tensor) -> torch.Tensor:
    """``(G, k, f, f) → (G, f, f)``, a view when ``k = 1``."""
    return t[:, 0] if t.shape[1] == 1 else t.sum(1)


def _factor(b: _Batch, side: str) -> torch.Tensor:
    """``(G, f, k·(m+1))``: the twisted rows of each group's members side by side, ``F Fᵀ = Σ_k Λ_k a_k a_kᵀ Λ_k``."""
    parts = []
    for ci in range(len(b.chunks)):
        A, B, lam, gam = _chunk_theta(b, ci)
        R, t = (A, lam) if side == "a" else (B, gam)
        k = b.points[0].st.sa.repeat if side == "a" else b.points[0].st.sb.repeat
        X = R.W if R.b is None else torch.cat([R.W, R.b[..., None]], -1)
        if t is not None:
            X = X * t[..., None]
        heads, f, m = X.shape
        parts.append(X.reshape(heads // k, k, f, m).permute(0, 2, 1, 3).reshape(heads // k, f, k * m))
    return _cat(sylvester._pad_width(*parts))


def _batch_solve(b: _Batch, SA: torch.Tensor, SB: torch.Tensor, ctx, sector: "DenseSector", key: tuple) -> torch.Tensor:
    """``M`` for every group of the batch (``M = Γ Y Λ`` in the reparametrised coordinates)."""
    gl = b.g[:, :, None] * b.l[:, None, :] if b.twisted else None
    if ctx.mode == "paper000":  # paper 000 Algorithm 2: symmetrised one-sided pseudo-inverse estimates
        return _gl(0.5 * (b.inv.left_pinv(_gl(SA, gl)) + b.inv.right_pinv(_gl(-SB, gl))), gl)
    S = SA - SB
    if b.uniform and ctx.mode == "exact":
        return _gl(b.inv(_gl(S, gl)), gl)
    op = _operator(b)
    if ctx.mode == "exact":  # LRM + GQA: CG preconditioned by the Sylvester inverse of the mean twists
        M, iters, res, _ = batched_pcg(op, S, lambda R: _gl(b.inv(_gl(R, gl)), gl), tol=ctx.cg_tol, maxiter=ctx.cg_maxiter)
        ctx.note_cg(sector.name, iters, float(res.max()))
        return M
    # approx: a fixed number of CG steps preconditioned by one ADI step, warm-started from the last call
    x0 = sector._warm.get(key)
    if x0 is not None and (x0.shape != S.shape or x0.dtype != S.dtype or x0.device != S.device):
        x0 = None
    M, iters, res, left = batched_pcg(op, S, lambda R: _gl(b.inv(_gl(R, gl)), gl), maxiter=sector.approx_iters, x0=x0)
    sector._warm[key] = M.detach()
    ctx.note_approx(sector.name, iters, res, left)
    return M


def _gl(x: torch.Tensor, gl: torch.Tensor | None) -> torch.Tensor:
    """``x ∘ (g lᵀ)``: between ``M`` and the reparametrised ``Y`` (nothing to do without twists)."""
    return x if gl is None else x * gl


def _operator(b: _Batch):
    """``M ↦ K(M) = Σ_A P̂_k M Λ_k⁻² + Σ_B Γ_k⁻² M R̂_k`` for every group of the batch."""
    if b.uniform:
        P, R = b.Ph[:, 0], b.Rh[:, 0]
        li, gi = b.l.pow(-2)[:, None, :], b.g.pow(-2)[:, :, None]
        return lambda M: torch.bmm(P, M) * li + gi * torch.bmm(M, R)

    def op(M):
        a = torch.einsum("gkab,gbc,gkc->gac", b.Ph, M, b.la) if b.la is not None else _member_sum(b.Ph) @ M
        c = torch.einsum("gka,gab,gkbc->gac", b.ga, M, b.Rh) if b.ga is not None else M @ _member_sum(b.Rh)
        return a + c

    return op
