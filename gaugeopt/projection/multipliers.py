"""The diagonal gauges as projection sectors: ``lrm_qk``, ``lrm_vo``, ``lrm_internal``, ``qk_gain``.

With LRM (docs/gaugefix.md) a layer's effective weight is ``diag(r)·W̄·diag(c)``, which adds
gauges that move the *multipliers* (paper 002). Their generators, in the coordinates the
optimizer sees (``W̄, b̄, r, c``), and the closed forms used to project them out:

``lrm_qk`` — ``r_Q[i] ← r_Q[i] ⊙ δ``, ``r_K[j] ← r_K[j] ⊘ δ`` per KV group ``j``, one ``δ`` per
    channel, or per RoPE plane (both coordinates share it; :func:`gaugeopt.records.rope.plane_index`).
    Generator of channel set ``π``: ``δr_Q[i, c] = r_Q[i, c]``, ``δr_K[j, c] = −r_K[j, c]``
    (``c ∈ π``, ``i`` in group ``j``). Different ``(j, π)`` touch disjoint entries, so the
    projection is one ratio each (docs/projection.md):
    ``t = (Σ r_Q·du_rQ − Σ r_K·du_rK) / (Σ r_Q² + Σ r_K²)``.
``lrm_vo`` — ``r_V[j] ← r_V[j] ⊙ e``, ``c_O[i] ← c_O[i] ⊘ e`` per channel:
    ``t = (r_V·du_rV − Σ_i c_O[i]·du_cO[i]) / (r_V² + Σ_i c_O[i]²)``.
``qk_gain`` — on a QK-norm site (docs/qk_norm.md) ``g_q ← g_q ⊙ δ``, ``g_k ← g_k ⊘ δ`` (the
    LayerNorm biases ``β_q``, ``β_k`` alike), one ``δ`` per RoPE plane when the norm acts before
    RoPE, per channel otherwise; per layer for a gain vector shared by every head, per KV group
    for per-head gains. The same closed form as ``lrm_qk`` with ``r`` replaced by the gains (and
    biases): ``t = (Σ g̃_q·du_gq + Σ β_q·du_βq − Σ g̃_k·du_gk − Σ β_k·du_βk) / (Σ g̃_q² + Σ β_q² + Σ g̃_k² + Σ β_k²)``,
    ``g̃ = g + offset`` (Gemma stores ``w`` with gain ``1 + w``; ``δw = (1 + w)·δ``).
``lrm_internal`` — inside every LRM layer and multiplier block, ``r ← r⊙t``,
    ``W̄ ← W̄ ⊘ (t⊗s)``, ``b̄ ← b̄ ⊘ t``, ``c ← c⊙s``. Row generator ``ρ``:
    ``(δr_ρ, δW̄_ρ,:, δb̄_ρ) = (r_ρ, −W̄_ρ,:, −b̄_ρ)``; column generator ``κ``:
    ``(δc_κ, δW̄_:,κ) = (c_κ, −W̄_:,κ)``. Their Gram matrix is ``[[D_r, W̄∘W̄], [(W̄∘W̄)ᵀ, D_c]]``
    with diagonal ``D_r = r² + ‖W̄_ρ‖² + b̄²``, ``D_c = c² + ‖W̄_:,κ‖²``. Eliminating the larger
    diagonal block leaves the Schur complement, e.g. ``S = D_c − (W̄∘W̄)ᵀ D_r⁻¹ (W̄∘W̄)`` on the
    columns, which is never formed: it is solved by conjugate gradients preconditioned by ``D_c⁻¹``,
    with two matrix–vector products with ``W̄∘W̄`` per iteration (``O(rows·in)``, no
    ``O(min(rows, in)³)`` eigendecomposition), to the relative residual ``cg_tol``, every block of a
    shape in one batched call. It converges fast because the Gram is diagonally dominant:
    ``D_r ≥ rowsum(W̄∘W̄)`` and ``D_c ≥ colsum(W̄∘W̄)`` (the multipliers' own terms ``r²``, ``c²``
    make it strict), so ``D_c^{-1/2} S D_c^{-1/2} = I − KᵀK`` with ``‖K‖₂² ≤ max_ρ rowsum/D_r ·
    max_κ colsum/D_c < 1`` (Schur test; ``K = D_r^{-1/2}(W̄∘W̄)D_c^{-1/2}``): a handful of iterations
    where the multipliers carry a fair share of the rows' norm (at initialisation, ``‖K‖₂ ≈ 0.2``
    for GPT-2 small), more where the rows of ``W̄`` dominate.

These sectors overlap the dense ones (``lrm_internal`` moves ``W̄`` like ``qk``/``vo`` do and ``r``
like ``lrm_qk``/``lrm_vo`` do); see :mod:`gaugeopt.projection.projector` for the joint projection.

The pseudo-inverse rule of :mod:`gaugeopt.projection.sylvester` applies: a one-dimensional block (a
diagonal gauge's ``(j, π)``) whose denominator is ``≤ rtol ·`` the largest denominator of the
same layer gets coefficient 0, and so does an ``lrm_internal`` generator whose diagonal entry is
``≤ rtol ·`` the block's largest (a row or column with nothing to rescale); the Schur systems
are consistent, and CG from zero converges to a solution of them.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.projection.projector import GaugeProjector
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))).double()
    >>> u = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    >>> proj = GaugeProjector(model, sectors=("lrm_qk", "lrm_vo", "lrm_internal"))
    >>> dec = proj.decompose(u)
    >>> gaugeopt.vertical_fraction(model, dec.horizontal, projector=proj) < 1e-10
    True
    >>> dec.info["joint_residual"] <= 1e-12
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gaugeopt.models.lrm import LRMLinear
from gaugeopt.records.rope import plane_index
from gaugeopt.records.site import AttentionSite
from gaugeopt.projection.cg import batched_pcg

__all__ = ["DiagonalSector", "InternalSector"]


def _safe_inv(den: torch.Tensor, rtol: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    top = den.max() if scale is None else scale
    keep = den > rtol * top
    return torch.where(keep, 1.0 / torch.where(keep, den, torch.ones_like(den)), torch.zeros_like(den))


class DiagonalSector:
    """A diagonal gauge between the two sides of each site's pair, one closed-form coefficient per
    group and slot: ``lrm_qk``/``lrm_vo`` (the ``mult`` of each side of the ``"qk"``/``"vo"``
    :class:`~gaugeopt.records.pair.GaugePair`, sites with multipliers) and ``qk_gain`` (the
    ``"qk_gain"`` pair of QK-norm sites: gains ``g + offset`` and the LayerNorm biases that travel
    with them). A QK-norm site has no ``lrm_qk`` sector: rescaling ``r_Q`` against ``r_K`` changes
    its function.

    Generator of group ``j`` and slot ``π`` on every tensor ``x`` of side a: ``δx = x̃ ⊙ 1_π``, of
    side b: ``δx = −x̃ ⊙ 1_π`` (``x̃ = x + offset``); its coefficient in ``u`` is
    ``t = (Σ_a x̃·u − Σ_b x̃·u) / Σ_{a,b} x̃²`` over the slot's entries.
    """

    def __init__(self, kind: str, sites: list[AttentionSite]) -> None:
        self.name = kind
        if kind == "qk_gain":
            self.mode = "gain"
            self.pairs = [s.pair("qk_gain") for s in sites if s.qk_norm is not None]
        else:
            self.mode = "lrm"
            pk = "qk" if kind == "lrm_qk" else "vo"
            pairs = [s.pair(pk) for s in sites if not (pk == "qk" and (s.qk_norm is not None or s.qk_orthogonal))]
            self.pairs = [p for p in pairs if p.has_multipliers]
        self.members = [(p.a.members(self.mode), p.b.members(self.mode)) for p in self.pairs]
        self.pids = [plane_index(p.rope, p.width) for p in self.pairs]  # one id per channel without RoPE

    def param_names(self) -> list[str]:
        return list(dict.fromkeys(m.ref.name for ma, mb in self.members for m in ma + mb))

    def units(self) -> list[str]:
        return [p.site.name for p in self.pairs]

    def dimension(self) -> int:
        """Number of generators: one per group and scale slot (RoPE plane or channel)."""
        return sum(p.groups * p.rope.n_slots(p.width) for p in self.pairs)

    def prepare(self, ctx):
        prep = []
        for pair, (ma, mb), pid in zip(self.pairs, self.members, self.pids):
            pid = pid.to(ctx.device)
            n_ids = int(pid.max()) + 1
            vals = []  # (member, sign, x̃ (G, k, width))
            for side, members, sign in ((pair.a, ma, 1.0), (pair.b, mb, -1.0)):
                for m in members:
                    x = side.grouped(ctx.weight(m.ref))
                    vals.append((m, side, sign, x + m.offset if m.offset else x))
            x0 = vals[0][3]
            den = torch.zeros(pair.groups, n_ids, dtype=x0.dtype, device=x0.device)
            for _, _, _, x in vals:
                den.index_add_(1, pid, (x * x).sum(1))
            prep.append((pair, pid, n_ids, vals, _safe_inv(den, ctx.rtol)))
        return prep

    @staticmethod
    def _write(out, vals, t, pid) -> None:
        for m, side, sign, x in vals:
            target = out(m.ref)
            target.add_((sign * t[:, None, pid] * x).reshape(target.shape))

    def apply(self, ctx, prep, u, out, record=None) -> None:
        for pair, pid, n_ids, vals, inv in prep:
            num = torch.zeros_like(inv)
            usq = torch.zeros((), dtype=inv.dtype, device=inv.device)
            for m, side, sign, x in vals:
                du = side.grouped(u(m.ref))
                num.index_add_(1, pid, sign * (x * du).sum(1))
                usq = usq + du.square().sum()
            t = num * inv  # (groups, n_ids)
            self._write(out, vals, t, pid)
            if record is not None:
                vsq = sum((t[:, None, pid] * x).square().sum() for _, _, _, x in vals)
                record(self.name, pair.site.name, t, vsq, usq)

    def basis(self, ctx, prep):
        for pair, pid, n_ids, vals, inv in prep:
            for j in range(pair.groups):
                for m in range(n_ids):
                    t = torch.zeros(pair.groups, n_ids, dtype=inv.dtype, device=inv.device)
                    t[j, m] = 1.0
                    yield f"{self.name}:{pair.site.name}:group{j}:set{m}", (
                        lambda out, vals=vals, t=t, pid=pid: self._write(out, vals, t, pid))


@dataclass
class _Block:
    """One multiplier block of one LRM layer: views of ``W̄, b̄, r, c`` at θ."""

    module: str
    names: dict  # role -> parameter name
    rows: slice
    k: int
    W: torch.Tensor  # (n_r, n_c)
    b: torch.Tensor | None
    r: torch.Tensor
    c: torch.Tensor


@dataclass
class _Shape:
    """The blocks of one shape, solved together: ``W2 = W̄∘W̄`` stacked ``(B, n_r, n_c)``."""

    blocks: list[_Block]
    W2: torch.Tensor
    inv_r: torch.Tensor  # (B, n_r) D_r⁻¹ (0 for non-directions)
    inv_c: torch.Tensor  # (B, n_c)
    Dr: torch.Tensor
    Dc: torch.Tensor
    eliminate_rows: bool


class InternalSector:
    """``lrm_internal`` over LRM layers (all of the model's, or those of the given sites)."""

    name = "lrm_internal"

    def __init__(self, modules: list[tuple[str, LRMLinear]], param_name: dict[int, str]) -> None:
        self.modules = modules
        self.param_name = param_name

    def _names(self, mname: str, m: LRMLinear, k: int) -> dict:
        pn = self.param_name
        return {
            "weight": pn[id(m.weight)],
            "bias": None if m.bias is None else pn[id(m.bias)],
            "r": pn[id(m.row_mults[k])],
            "c": pn[id(m.col_mults[k])],
        }

    def param_names(self) -> list[str]:
        out = []
        for mname, m in self.modules:
            for k in range(len(m.split_sizes)):
                out += [v for v in self._names(mname, m, k).values() if v is not None]
        return list(dict.fromkeys(out))

    def units(self) -> list[str]:
        return [name for name, _ in self.modules]

    def split(self, names: set[str]) -> tuple["InternalSector", "InternalSector"]:
        """``(touching, apart)``: the layers with a parameter in ``names``, and the others (whose
        generators are orthogonal to anything supported on ``names``)."""
        def touches(mname, m):
            return any(v in names for k in range(len(m.split_sizes)) for v in self._names(mname, m, k).values() if v)

        inside = [(n, m) for n, m in self.modules if touches(n, m)]
        return (InternalSector(inside, self.param_name),
                InternalSector([(n, m) for n, m in self.modules if not touches(n, m)], self.param_name))

    def dimension(self) -> int:
        """Number of generators: :attr:`~gaugeopt.models.lrm.LRMLinear.internal_gauge_dim` per layer."""
        return sum(m.internal_gauge_dim for _, m in self.modules)

    def _blocks(self, acc) -> list[_Block]:
        blocks = []
        for mname, m in self.modules:
            start = 0
            for k, size in enumerate(m.split_sizes):
                rows = slice(start, start + size)
                start += size
                names = self._names(mname, m, k)
                blocks.append(_Block(
                    mname, names, rows, k, acc(names["weight"])[rows],
                    None if names["bias"] is None else acc(names["bias"])[rows], acc(names["r"]), acc(names["c"]),
                ))
        return blocks

    def prepare(self, ctx) -> list[_Shape]:
        by_shape: dict[tuple, list[_Block]] = {}
        for blk in self._blocks(ctx.weight):
            by_shape.setdefault((*blk.W.shape, blk.b is not None), []).append(blk)
        shapes = []
        for (n_r, n_c, _), blocks in by_shape.items():
            W0 = blocks[0].W
            W2 = torch.empty(len(blocks), n_r, n_c, dtype=W0.dtype, device=W0.device)
            for i, blk in enumerate(blocks):
                torch.mul(blk.W, blk.W, out=W2[i])
            r = torch.stack([blk.r for blk in blocks])
            c = torch.stack([blk.c for blk in blocks])
            Dr = r * r + W2.sum(2)
            if blocks[0].b is not None:
                Dr = Dr + torch.stack([blk.b for blk in blocks]).square()
            Dc = c * c + W2.sum(1)
            scale = torch.maximum(Dr.amax(1), Dc.amax(1))[:, None]
            shapes.append(_Shape(blocks, W2, _safe_inv(Dr, ctx.rtol, scale), _safe_inv(Dc, ctx.rtol, scale),
                                 Dr, Dc, n_r >= n_c))  # eliminate the larger diagonal block
        return shapes

    def apply(self, ctx, prep: list[_Shape], u, out, record=None) -> None:
        """Add the vertical part of ``u`` into ``out``; with ``record``, ``out`` must be zero on the
        sector's entries (its norms are read there)."""
        for sh in prep:
            blocks = sh.blocks
            tr, tc = [], []
            for blk in blocks:  # right-hand sides: ⟨generator, u⟩
                n = blk.names
                WdW = blk.W * u(n["weight"])[blk.rows]
                t_r = blk.r * u(n["r"]) - WdW.sum(1)
                if blk.b is not None:
                    t_r = t_r - blk.b * u(n["bias"])[blk.rows]
                tr.append(t_r)
                tc.append(blk.c * u(n["c"]) - WdW.sum(0))
            tr, tc = torch.stack(tr), torch.stack(tc)
            W2 = sh.W2
            if sh.eliminate_rows:  # S y = t_c − W2ᵀ D_r⁻¹ t_r,  S = D_c − W2ᵀ D_r⁻¹ W2;  x = D_r⁻¹ (t_r − W2 y)
                rhs = tc - _mv(W2.mT, sh.inv_r * tr)
                y = self._solve(ctx, lambda v: sh.Dc * v - _mv(W2.mT, sh.inv_r * _mv(W2, v)), rhs, sh.inv_c)
                x = sh.inv_r * (tr - _mv(W2, y))
            else:
                rhs = tr - _mv(W2, sh.inv_c * tc)
                x = self._solve(ctx, lambda v: sh.Dr * v - _mv(W2, sh.inv_c * _mv(W2.mT, v)), rhs, sh.inv_r)
                y = sh.inv_c * (tc - _mv(W2.mT, x))
            for i, blk in enumerate(blocks):
                self._write(blk, out, x[i], y[i])
                if record is not None:
                    n = blk.names
                    vsq = _sq(out, n, blk.rows)
                    usq = _sq(u, n, blk.rows)
                    record(self.name, f"{blk.module}[{blk.k}]", torch.cat([x[i], y[i]]), vsq, usq)

    def _solve(self, ctx, op, rhs, inv_diag):
        sol, iters, res, _ = batched_pcg(op, rhs, lambda v: inv_diag * v, tol=ctx.cg_tol, maxiter=ctx.cg_maxiter)
        ctx.note_cg(self.name, iters, float(res.max()) if res.numel() else 0.0)
        return sol

    @staticmethod
    def _write(blk: _Block, out, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the images ``δW̄ = −(x ⊕ y)∘W̄``, ``δb̄ = −x∘b̄``, ``δr = x∘r``, ``δc = y∘c``."""
        n = blk.names
        ow = out(n["weight"])[blk.rows]
        ow.addcmul_(blk.W, x[:, None], value=-1.0).addcmul_(blk.W, y[None, :], value=-1.0)
        if blk.b is not None:
            out(n["bias"])[blk.rows].addcmul_(blk.b, x, value=-1.0)
        out(n["r"]).addcmul_(blk.r, x)
        out(n["c"]).addcmul_(blk.c, y)

    def basis(self, ctx, prep: list[_Shape]):
        for sh in prep:
            for blk in sh.blocks:
                n_r, n_c = blk.W.shape
                for kind, size in (("row", n_r), ("col", n_c)):
                    for i in range(size):
                        x = torch.zeros(n_r, dtype=blk.W.dtype, device=blk.W.device)
                        y = torch.zeros(n_c, dtype=blk.W.dtype, device=blk.W.device)
                        (x if kind == "row" else y)[i] = 1.0
                        yield (f"{self.name}:{blk.module}[{blk.k}]:{kind}{i}",
                               lambda out, blk=blk, x=x, y=y: self._write(blk, out, x, y))


def _mv(M: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Batched matrix–vector product ``(B, p, q) @ (B, q) -> (B, p)``, one ``gemv`` per block (a
    ``bmm`` with one column is an order of magnitude slower on CPU BLAS)."""
    out = torch.empty(M.shape[0], M.shape[1], dtype=v.dtype, device=v.device)
    for i in range(M.shape[0]):
        torch.mv(M[i], v[i], out=out[i])
    return out


def _sq(store, names: dict, rows: slice) -> torch.Tensor:
    s = store(names["weight"])[rows].square().sum() + store(names["r"]).square().sum() + store(names["c"]).square().sum()
    return s if names["bias"] is None else s + store(names["bias"])[rows].square().sum()
