"""The learnable-multiplier gauges as projection sectors: ``lrm_qk``, ``lrm_vo``, ``lrm_internal``.

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

from gaugeopt.adapters.apply_lrm import LRMLinear
from gaugeopt.records.rope import plane_index
from gaugeopt.records.site import AttentionSite
from legacy_projection.sylvester import _pinv_values

__all__ = ["DiagonalSector", "InternalSector"]


def _safe_inv(den: torch.Tensor, rtol: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    top = den.max() if scale is None else scale
    keep = den > rtol * top
    return torch.where(keep, 1.0 / torch.where(keep, den, torch.ones_like(den)), torch.zeros_like(den))


class DiagonalSector:
    """``lrm_qk`` or ``lrm_vo`` over the sites that carry the multipliers: the ``mult`` of each
    side of their :class:`~gaugeopt.records.pair.GaugePair`."""

    def __init__(self, kind: str, sites: list[AttentionSite]) -> None:
        self.name = kind
        pairs = [s.pair("qk" if kind == "lrm_qk" else "vo") for s in sites]
        self.pairs = [p for p in pairs if p.has_multipliers]
        self.pids = [plane_index(p.rope, p.width) for p in self.pairs]  # one id per channel without RoPE

    def param_names(self) -> list[str]:
        return [r.name for p in self.pairs for r in (p.a.mult, p.b.mult)]

    def units(self) -> list[str]:
        return [p.site.name for p in self.pairs]

    def dimension(self) -> int:
        """Number of generators: one per group and scale slot (RoPE plane or channel)."""
        return sum(p.groups * p.rope.n_slots(p.width) for p in self.pairs)

    def prepare(self, ctx):
        prep = []
        for pair, pid in zip(self.pairs, self.pids):
            a, b = pair.a.grouped(ctx.weight(pair.a.mult)), pair.b.grouped(ctx.weight(pair.b.mult))  # (G, k, width)
            pid = pid.to(ctx.device)
            n_ids = int(pid.max()) + 1
            den = torch.zeros(pair.groups, n_ids, dtype=a.dtype, device=a.device)
            den.index_add_(1, pid, (a * a).sum(1) + (b * b).sum(1))
            prep.append((pair, pid, n_ids, a, b, _safe_inv(den, ctx.rtol)))
        return prep

    @staticmethod
    def _write(pair, out, va, vb) -> None:
        out(pair.a.mult).add_(va.reshape(out(pair.a.mult).shape))
        out(pair.b.mult).add_(vb.reshape(out(pair.b.mult).shape))

    def apply(self, ctx, prep, u, out, record=None) -> None:
        for pair, pid, n_ids, a, b, inv in prep:
            da, db = pair.a.grouped(u(pair.a.mult)), pair.b.grouped(u(pair.b.mult))
            num = torch.zeros_like(inv)
            num.index_add_(1, pid, (a * da).sum(1) - (b * db).sum(1))
            t = num * inv  # (groups, n_ids)
            va, vb = t[:, None, pid] * a, -t[:, None, pid] * b
            self._write(pair, out, va, vb)
            if record is not None:
                record(self.name, pair.site.name, t, va.square().sum() + vb.square().sum(),
                       da.square().sum() + db.square().sum())

    def basis(self, ctx, prep):
        for pair, pid, n_ids, a, b, inv in prep:
            for j in range(pair.groups):
                for m in range(n_ids):
                    t = torch.zeros(pair.groups, n_ids, dtype=a.dtype, device=a.device)
                    t[j, m] = 1.0
                    va, vb = t[:, None, pid] * a, -t[:, None, pid] * b
                    yield f"{self.name}:{pair.site.name}:group{j}:set{m}", (
                        lambda out, pair=pair, va=va, vb=vb: self._write(pair, out, va, vb))


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
        """Number of generators: :attr:`~gaugeopt.adapters.apply_lrm.LRMLinear.internal_gauge_dim` per layer."""
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
