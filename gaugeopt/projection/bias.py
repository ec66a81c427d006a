"""The bias sectors as projection sectors: ``key_bias`` and ``value_bias``.

The sectors of :mod:`gaugeopt.records.bias_sector`, in the coordinates the optimizer sees (``b̄`` with
the effective bias ``r ⊙ b̄`` under learnable multipliers), per site, KV group ``j`` and channel ``c``:

``key_bias`` — generator ``δb̄_K[j, c] = 1/r_K[j, c]`` on a non-rotary channel ``c``: a coordinate
    direction. The projection keeps ``u`` on those entries (coefficient ``t = r·u``, the shift of
    the effective bias) and nothing else.
``value_bias`` — generator ``δb̄_V[j, c] = a_jc = 1/r_V[j, c]``, ``δb̄_O = −m_jc`` with
    ``m_jc = Σ_{i∈j} W̄_O[:, i, c]·c_O[i, c]`` (the effective ``W_O`` columns summed over the
    group's query heads, over ``r_O``: the ``r_O`` of the effective output bias cancels). With
    ``n = h_kv·d_v`` generators ``A = [diag(a); −M]``, the coefficients solve the ``n×n`` normal
    equations ``(diag(a²) + MᵀM) t = a ⊙ u_{b_V} − Mᵀ u_{b_O}`` (Cholesky: the Gram is positive
    definite, ``a² > 0``), batched over the sites of one shape; ``O(d·n²)`` to form it, about
    ``1e10`` flops per step for GPT-2 small's twelve layers.

Both overlap the head gauges (``qk`` moves ``b̄_K`` with the key rows, ``vo`` moves ``b̄_V``) and
``lrm_internal`` (row rescalings move ``b̄``); :class:`gaugeopt.GaugeProjector` projects onto the
sum by its joint projection. They are disjoint from each other and from ``lrm_qk``, ``lrm_vo``
and ``qk_gain`` (which move multipliers and gains only).

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)).double()
    >>> proj = gaugeopt.GaugeProjector(model, sectors=("key_bias", "value_bias"))
    >>> u = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    >>> hor = proj.project(u)
    >>> k_rows = slice(16, 32)  # the key rows of c_attn: the key bias is wholly vertical without RoPE
    >>> float(hor["transformer.h.0.attn.c_attn.bias"][k_rows].abs().max())
    0.0
    >>> gaugeopt.vertical_fraction(model, hor, sectors=("key_bias", "value_bias")) < 1e-12
    True
"""

from __future__ import annotations

import torch

from gaugeopt.records.bias_sector import BiasSector
from gaugeopt.records.site import AttentionSite

__all__ = ["BiasShiftSector"]


class BiasShiftSector:
    """``key_bias`` or ``value_bias`` over the sites that have it (module docstring)."""

    def __init__(self, kind: str, sites: list[AttentionSite]) -> None:
        self.name = kind
        self.secs: list[BiasSector] = [s.bias_sector(kind) for s in sites if kind in s.bias_kinds]

    def param_names(self) -> list[str]:
        names = [b.bias.name for b in self.secs] + [b.site.o.bias.name for b in self.secs if b.absorber]
        return list(dict.fromkeys(names))

    def units(self) -> list[str]:
        return [b.site.name for b in self.secs]

    def dimension(self) -> int:
        return sum(b.dim for b in self.secs)

    # ------------------------------------------------------------------ per site, at θ
    @staticmethod
    def _a(ctx, b: BiasSector) -> torch.Tensor:
        """``1/r`` on the shifted channels, ``(h_kv, k)`` (ones without multipliers)."""
        idx = list(b.channels)
        if b.mult is None:
            return torch.ones(b.site.h_kv, len(idx), dtype=ctx.dtype, device=ctx.device)
        return 1.0 / ctx.weight(b.mult)[:, idx]

    @staticmethod
    def _M(ctx, b: BiasSector) -> torch.Tensor:
        """``(d, n)``: the columns ``m_jc`` (``W̄_O ⊙ c_O`` summed over the group's query heads)."""
        s = b.site
        wo = ctx.weight(s.o.weight)  # (d, h, d_v)
        if s.o.col_mult is not None:
            wo = wo * ctx.weight(s.o.col_mult)[None]
        return wo.reshape(wo.shape[0], s.h_kv, s.n_rep, s.d_v).sum(2).reshape(wo.shape[0], -1)

    def prepare(self, ctx):
        if self.name == "key_bias":
            return [(b, self._a(ctx, b)) for b in self.secs]
        by_shape: dict[tuple, list[BiasSector]] = {}
        for b in self.secs:
            by_shape.setdefault((b.site.o.weight.shape, b.site.h_kv, b.site.d_v), []).append(b)
        prep = []
        for group in by_shape.values():
            a = torch.stack([self._a(ctx, b).reshape(-1) for b in group])  # (B, n)
            M = torch.stack([self._M(ctx, b) for b in group])  # (B, d, n)
            G = M.mT @ M
            G.diagonal(dim1=-2, dim2=-1).add_(a * a)
            prep.append((group, a, M, torch.linalg.cholesky(G)))
        return prep

    def apply(self, ctx, prep, u, out, record=None) -> None:
        if self.name == "key_bias":
            for b, a in prep:
                idx = list(b.channels)
                du = u(b.bias)[:, idx]
                target = out(b.bias)
                target[:, idx] += du
                if record is not None:
                    sq = du.square().sum()
                    record(self.name, b.site.name, du / a, sq, sq)
            return
        for group, a, M, L in prep:
            ub = torch.stack([u(b.bias).reshape(-1) for b in group])  # (B, n)
            uo = torch.stack([u(b.site.o.bias) for b in group])  # (B, d)
            rhs = a * ub - (M.mT @ uo[..., None])[..., 0]
            t = torch.cholesky_solve(rhs[..., None], L)[..., 0]
            dv, do = a * t, -(M @ t[..., None])[..., 0]
            for i, b in enumerate(group):
                out(b.bias).add_(dv[i].view(b.bias.shape))
                out(b.site.o.bias).add_(do[i])
                if record is not None:
                    vsq = dv[i].square().sum() + do[i].square().sum()
                    record(self.name, b.site.name, t[i].view(b.site.h_kv, -1), vsq, ub[i].square().sum() + uo[i].square().sum())

    def basis(self, ctx, prep):
        if self.name == "key_bias":
            for b, a in prep:
                for j in range(b.site.h_kv):
                    for k, c in enumerate(b.channels):
                        def write(out, b=b, j=j, c=c, v=float(a[j, k])):
                            out(b.bias)[j, c] += v
                        yield f"key_bias:{b.site.name}:group{j}:channel{c}", write
            return
        for group, a, M, _ in prep:
            for i, b in enumerate(group):
                for col in range(a.shape[1]):
                    j, c = divmod(col, b.site.d_v)

                    def write(out, b=b, j=j, c=c, v=float(a[i, col]), m=M[i, :, col]):
                        out(b.bias)[j, c] += v
                        out(b.site.o.bias).sub_(m)
                    yield f"value_bias:{b.site.name}:group{j}:channel{c}", write
