"""A toy sector, registered the way a new sector is (docs/sectors.md): one scalar per KV group between
the queries and the keys, ``W_Q[i] ← a_j·W_Q[i]``, ``W_K[j] ← W_K[j]/a_j`` (biases alike).

It is a subgroup of ``qk`` (scalars commute with every RoPE rotation), so it is a true symmetry of every
plain attention record; it exists to show that a sector is one module and one :func:`register` call —
nothing else in gaugeopt changes — and that everything reading the registry picks it up. It acts on the
stored weights, so it declares itself lacking on records with learnable multipliers, QK-norms, an
orthogonal-only Q/K group, or latent attention. ``sign=+1`` registers a *wrong* variant (queries and
keys both multiplied by ``a``: the scores scale by ``a²``), which the certificate must refuse.
"""

from __future__ import annotations

import torch

from gaugeopt.sectors.group_actions import act_qk
from gaugeopt.sectors import Family, ProjectionRule, Sector, register

NAME = "qk_scalar"


def _lacking(site) -> str | None:
    if site.qk_norm is not None or site.qk_orthogonal or site.latent is not None:
        return "the toy sector acts on plain Q/K weights only"
    if site.pair("qk").has_multipliers:
        return "the toy sector acts on stored weights, not on learnable multipliers"
    return None


def _scale(site, a: torch.Tensor, sign: int) -> None:
    """Queries by ``a`` per KV group, keys by ``a^sign``: ``sign = −1`` the symmetry, ``+1`` the wrong one."""
    wq, bq = site.effective("q")
    eye = torch.eye(site.d_k, dtype=wq.dtype, device=wq.device)
    A = a.to(wq.dtype)[:, None, None] * eye
    if sign == -1:
        act_qk(site, A)
    else:  # act_qk's B_inv: the factor put on K instead of A⁻¹
        act_qk(site, A, B_inv=A, check=False)


class ScalarSolver:
    """The projector's solver object for the toy sector (the protocol of :mod:`gaugeopt.projection.context`).

    Generator of group ``j``: ``δW_Q[i] = W_Q[i]`` for the query heads of ``j`` and ``δW_K[j] = −W_K[j]``
    (biases alike); its coefficient in ``u`` is ``t_j = ⟨u, δ_j⟩ / ⟨δ_j, δ_j⟩``.
    """

    def __init__(self, name: str, sites: list, options: dict) -> None:
        self.name, self.options = name, options
        self.pairs = [s.pair("qk") for s in sites if _lacking(s) is None]

    def param_names(self) -> list[str]:
        return list(dict.fromkeys(m.ref.name for p in self.pairs for side in (p.a, p.b) for m in side.members("plain")))

    def units(self) -> list[str]:
        return [p.site.name for p in self.pairs]

    def dimension(self) -> int:
        return sum(p.site.h_kv for p in self.pairs)

    def prepare(self, ctx):
        prep = []
        for pair in self.pairs:
            vals = [(m, side, sign, side.grouped(ctx.weight(m.ref)))
                    for side, sign in ((pair.a, 1.0), (pair.b, -1.0)) for m in side.members("plain")]
            den = sum(x.flatten(1).square().sum(1) for *_, x in vals)
            prep.append((pair, vals, 1.0 / den))
        return prep

    @staticmethod
    def _write(out, vals, t) -> None:
        for m, side, sign, x in vals:
            target = out(m.ref)
            target.add_((sign * t.reshape(-1, *([1] * (x.dim() - 1))) * x).reshape(target.shape))

    def apply(self, ctx, prep, u, out, record=None) -> None:
        for pair, vals, inv in prep:
            num = sum(sign * (x * side.grouped(u(m.ref))).flatten(1).sum(1) for m, side, sign, x in vals)
            t = num * inv
            self._write(out, vals, t)
            if record is not None:
                vsq = sum((t.reshape(-1, *([1] * (x.dim() - 1))) * x).square().sum() for *_, x in vals)
                usq = sum(side.grouped(u(m.ref)).square().sum() for m, side, _, _ in vals)
                record(self.name, pair.site.name, t, vsq, usq)

    def basis(self, ctx, prep):
        for pair, vals, inv in prep:
            for j in range(pair.site.h_kv):
                t = torch.zeros_like(inv)
                t[j] = 1.0
                yield f"{self.name}:{pair.site.name}:group{j}", (lambda out, vals=vals, t=t: self._write(out, vals, t))


def sector(sign: int = -1, name: str = NAME) -> Sector:
    """The toy sector (``sign=-1``), or its wrong variant (``sign=+1``) under another name."""

    def valid(site, g, log_scale: float) -> None:
        _scale(site, torch.exp(log_scale * torch.randn(site.h_kv, generator=g, dtype=torch.float64)), sign)

    def control(site, g) -> str:  # the queries alone: the scores change by a
        wq, bq = site.effective("q")
        site.set_effective("q", 2.0 * wq, None if bq is None else 2.0 * bq)
        return f"{name}_queries_alone"

    def families(site) -> list[Family]:
        return [Family(name, site.name, site.h_kv, lambda t: _scale(site, torch.exp(t), sign), sign == -1,
                       "q·k unchanged by a on the queries, 1/a on the keys")]

    return Sector(
        name=name, family="toy", summary="one scalar per KV group: a·W_Q against W_K/a", lacking=_lacking,
        valid=valid, control=control, families=families,
        projection=ProjectionRule(lambda n, units, options: ScalarSolver(n, units, options),
                              frozenset({"q.weight", "q.bias", "k.weight", "k.bias"})),
        count=lambda shape: {} if shape.qk_norm is not None or shape.latent is not None else {name: shape.h_kv},
    )


def register_toy(sign: int = -1, name: str = NAME) -> Sector:
    return register(sector(sign, name))
