"""The diagonal gauges as projection sectors: ``lrm_qk``, ``lrm_vo``, ``lrm_internal``, ``qk_gain``.

With LRM (docs/gaugefix.md) a layer's effective weight is ``diag(r)·W̄·diag(c)``, which adds
gauges that move the *multipliers* (paper 002). Their generators, in the coordinates the
optimizer sees (``W̄, b̄, r, c``), and the closed forms used to project them out:

``lrm_qk`` — ``r_Q[i] ← r_Q[i] ⊙ δ``, ``r_K[j] ← r_K[j] ⊘ δ`` per KV group ``j``, one ``δ`` per
    channel, or per RoPE plane (both coordinates share it; :func:`gaugeopt.structure.rope.plane_index`).
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
    with diagonal ``D_r = r² + ‖W̄_ρ‖² + b̄²``, ``D_c = c² + ‖W̄_:,κ‖²``: solved through the
    Schur complement of the larger diagonal block (a dense ``min(rows, in)`` PSD system).

These sectors overlap the dense ones (``lrm_internal`` moves ``W̄`` like ``qk``/``vo`` do and ``r``
like ``lrm_qk``/``lrm_vo`` do); see :mod:`gaugeopt.projection.projector` for the joint projection.

The pseudo-inverse rule of :mod:`gaugeopt.projection.sylvester` applies: a one-dimensional block (a
diagonal gauge's ``(j, π)``) whose denominator is ``≤ rtol ·`` the largest denominator of the
same layer gets coefficient 0; the Schur systems use the rule relative to their own largest
eigenvalue.

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

from gaugeopt.structure.lrm import LRMLinear
from gaugeopt.structure.rope import plane_index
from gaugeopt.structure.site import AttentionSite
from gaugeopt.projection.sylvester import _pinv_values

__all__ = ["DiagonalSector", "InternalSector"]


def _safe_inv(den: torch.Tensor, rtol: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    top = den.max() if scale is None else scale
    keep = den > rtol * top
    return torch.where(keep, 1.0 / torch.where(keep, den, torch.ones_like(den)), torch.zeros_like(den))


class DiagonalSector:
    """A diagonal gauge between the two sides of each site's pair, one closed-form coefficient per
    group and slot: ``lrm_qk``/``lrm_vo`` (the ``mult`` of each side of the ``"qk"``/``"vo"``
    :class:`~gaugeopt.structure.pair.GaugePair`, sites with multipliers) and ``qk_gain`` (the
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
            pairs = [s.pair(pk) for s in sites if not (pk == "qk" and s.qk_norm is not None)]
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
    module: str
    names: dict  # role -> parameter name
    rows: slice
    k: int
    W: torch.Tensor  # (n_r, n_c)
    b: torch.Tensor | None
    r: torch.Tensor
    c: torch.Tensor
    W2: torch.Tensor
    inv_diag: torch.Tensor  # inverse of the eliminated diagonal block
    eliminate_rows: bool
    eig: tuple | None = None  # (inv eigenvalues, eigenvectors) of the Schur complement


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

    def dimension(self) -> int:
        """Number of generators: :attr:`~gaugeopt.structure.lrm.LRMLinear.internal_gauge_dim` per layer."""
        return sum(m.internal_gauge_dim for _, m in self.modules)

    def prepare(self, ctx) -> list[_Block]:
        blocks: list[_Block] = []
        for mname, m in self.modules:
            start = 0
            for k, size in enumerate(m.split_sizes):
                rows = slice(start, start + size)
                start += size
                names = self._names(mname, m, k)
                W = ctx.weight(names["weight"])[rows]
                b = None if names["bias"] is None else ctx.weight(names["bias"])[rows]
                r, c = ctx.weight(names["r"]), ctx.weight(names["c"])
                W2 = W * W
                Dr = r * r + W2.sum(1) + (0 if b is None else b * b)
                Dc = c * c + W2.sum(0)
                scale = torch.maximum(Dr.max(), Dc.max())
                elim_rows = W.shape[0] >= W.shape[1]  # eliminate the larger diagonal block
                if elim_rows:
                    inv = _safe_inv(Dr, ctx.rtol, scale)
                    schur = torch.diag(Dc) - W2.mT @ (inv[:, None] * W2)
                else:
                    inv = _safe_inv(Dc, ctx.rtol, scale)
                    schur = torch.diag(Dr) - W2 @ (inv[:, None] * W2.mT)
                blk = _Block(mname, names, rows, k, W, b, r, c, W2, inv, elim_rows)
                blk.eig = schur  # replaced by its eigendecomposition below
                blocks.append(blk)
        by_size: dict[int, list[_Block]] = {}
        for blk in blocks:
            by_size.setdefault(blk.eig.shape[0], []).append(blk)
        for size, group in by_size.items():  # one batched eigh per Schur size
            lam, vec = torch.linalg.eigh(torch.stack([blk.eig for blk in group]))
            inv = _pinv_values(lam.clamp_min(0.0), ctx.rtol)
            for i, blk in enumerate(group):
                blk.eig = (inv[i], vec[i])
        return blocks

    def apply(self, ctx, prep: list[_Block], u, out, record=None) -> None:
        for blk in prep:
            n = blk.names
            dW = u(n["weight"])[blk.rows]
            db = None if n["bias"] is None else u(n["bias"])[blk.rows]
            dr, dc = u(n["r"]), u(n["c"])
            WdW = blk.W * dW
            tr = blk.r * dr - WdW.sum(1) - (0 if db is None else blk.b * db)
            tc = blk.c * dc - WdW.sum(0)
            inv_s, U = blk.eig
            if blk.eliminate_rows:
                y = U @ (inv_s * (U.mT @ (tc - blk.W2.mT @ (blk.inv_diag * tr))))
                x = blk.inv_diag * (tr - blk.W2 @ y)
            else:
                x = U @ (inv_s * (U.mT @ (tr - blk.W2 @ (blk.inv_diag * tc))))
                y = blk.inv_diag * (tc - blk.W2.mT @ x)
            vW, vb, vr, vc = self._images(blk, x, y)
            out(n["weight"])[blk.rows] += vW
            if vb is not None:
                out(n["bias"])[blk.rows] += vb
            out(n["r"]).add_(vr)
            out(n["c"]).add_(vc)
            if record is not None:
                vsq = vW.square().sum() + vr.square().sum() + vc.square().sum() + (0 if vb is None else vb.square().sum())
                usq = dW.square().sum() + dr.square().sum() + dc.square().sum() + (0 if db is None else db.square().sum())
                record(self.name, f"{blk.module}[{blk.k}]", torch.cat([x, y]), vsq, usq)

    @staticmethod
    def _images(blk: _Block, x: torch.Tensor, y: torch.Tensor):
        vW = -(x[:, None] * blk.W) - (y[None, :] * blk.W)
        vb = None if blk.b is None else -x * blk.b
        return vW, vb, x * blk.r, y * blk.c

    def basis(self, ctx, prep: list[_Block]):
        for blk in prep:
            n_r, n_c = blk.W.shape
            for kind, size in (("row", n_r), ("col", n_c)):
                for i in range(size):
                    x = torch.zeros(n_r, dtype=blk.W.dtype, device=blk.W.device)
                    y = torch.zeros(n_c, dtype=blk.W.dtype, device=blk.W.device)
                    (x if kind == "row" else y)[i] = 1.0
                    vW, vb, vr, vc = self._images(blk, x, y)

                    def write(out, blk=blk, vW=vW, vb=vb, vr=vr, vc=vc):
                        n = blk.names
                        out(n["weight"])[blk.rows] += vW
                        if vb is not None:
                            out(n["bias"])[blk.rows] += vb
                        out(n["r"]).add_(vr)
                        out(n["c"]).add_(vc)

                    yield f"{self.name}:{blk.module}[{blk.k}]:{kind}{i}", write
