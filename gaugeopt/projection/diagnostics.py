"""How much of a step is pure gauge, and how path-dependent the gauge is (paper 004 §5).

* :func:`vertical_fraction` — ``‖u_vert‖/‖u‖`` (paper 004 Algorithm 1 / Fig. 3, Euclidean
  metric): the share of a gradient or an update that moves along gauge orbits without
  changing the function. ``‖u‖`` is over every tensor given. The gradient of a
  gauge-invariant loss has vertical fraction ~0 (paper 000 Prop. 38); an AdamW update does not.
* :func:`vertical_report` — the same per sector, per layer and per unit, with the fit
  diagnostics: the horizontal fraction ``‖u − u_vert‖/‖u‖`` (paper 004's residual of the fit)
  and the *orthogonality defect* ``‖Π_exact(u_hor)‖/‖u‖`` (0 for the exact projector; what the
  approximate mode leaves behind).
* :func:`fisher_rao_split` — paper 004 Algorithm 3 with a metric given as a callable
  ``v ↦ F v`` on flattened parameters: explicit generator basis, Gram system
  ``(AᵀFA + λI)c = AᵀFu``. Small models only (it builds the basis and calls the metric once per
  generator); refused above ``max_generators``.
* :func:`holonomy` — paper 004 Algorithm 4: flow horizontally around the loop
  ``+εu, +εv, −εu, −εv`` (RK4 on ``θ' = Π_θ(w)``), read the vertical displacement in
  Lie-algebra coordinates, divide by ``ε²``, at ``ε`` and ``ε/2``, and Richardson-extrapolate.

A caveat for the Fisher–Rao variant: for a gauge-invariant model the Fisher metric is
*degenerate along the gauge orbits* (``F v_j = 0`` for every generator: the model's outputs
do not move), so ``AᵀFA ≈ 0`` and the FR vertical split is ill-posed; paper 004 resolves this
with the Euclidean connection. Pass a metric that is non-degenerate on the vertical space
(damped Fisher ``F + δI``, or any SPD metric) and a ``damping`` for the Gram system if needed.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)).double()
    >>> x = torch.randint(0, 32, (2, 8))
    >>> _, loss = model(x, x)
    >>> loss.backward()
    >>> grads = {n: p.grad for n, p in model.named_parameters()}
    >>> gaugeopt.vertical_fraction(model, grads) < 1e-10     # paper 000 Prop. 38
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.projection.projector import GaugeProjector, Tensors
from gaugeopt.projection.step import squared_norms, vertical_fraction_of
from gaugeopt.projection.sylvester import psd_solve

__all__ = [
    "vertical_fraction",
    "vertical_report",
    "VerticalReport",
    "fisher_rao_split",
    "FisherRaoSplit",
    "holonomy",
    "HolonomyEstimate",
]


def _sq(tensors: Mapping[str, torch.Tensor | None], names=None) -> float:
    keys = tensors.keys() if names is None else [n for n in names if n in tensors]
    return float(squared_norms({}, {n: tensors[n] for n in keys})[1])


def _projector(model, projector, sectors, mode, kwargs) -> GaugeProjector:
    if projector is not None:
        return projector
    return GaugeProjector(model, sectors, mode, **kwargs)


def vertical_fraction(
    model: nn.Module,
    tensors: Tensors,
    *,
    sectors: str | Sequence[str] = "auto",
    projector: GaugeProjector | None = None,
    at: Mapping[str, torch.Tensor] | None = None,
    **projector_kwargs,
) -> float:
    """``‖u_vert‖ / ‖u‖`` for the vector field ``tensors`` (exact joint projection onto all ``sectors``).

    Args:
        model: the model; ``tensors`` is ``{name: tensor}`` as in ``named_parameters()`` or a
            list aligned with it. ``‖u‖`` is taken over every tensor given.
        sectors: ``"auto"`` or a subset of :data:`gaugeopt.projection.projector.SECTORS`.
        projector: reuse a :class:`~gaugeopt.projection.projector.GaugeProjector` (its sectors win).
        at: project at these weights instead of the model's current ones.

    Returns:
        The fraction in ``[0, 1]`` (0 for a zero field).
    """
    proj = _projector(model, projector, sectors, "exact", projector_kwargs)
    given, _ = proj._as_dict(tensors)  # validates names and shapes, also of an all-zero field
    _, total_sq = squared_norms({}, given)
    if float(total_sq) == 0:
        return 0.0
    vertical_sq, _ = squared_norms(proj.decompose(given, at=at).vertical, {})
    return vertical_fraction_of((vertical_sq, total_sq))


@dataclass
class VerticalReport:
    """Result of :func:`vertical_report` (all fractions are ratios of Euclidean norms).

    Attributes:
        total: joint ``‖u_vert‖/‖u‖`` over all sectors (``‖u‖`` over every tensor given).
        horizontal: ``‖u − u_vert‖/‖u‖`` — paper 004's fit residual (``√(1 − total²)`` for an
            exact projection).
        defect: ``‖Π_exact(u − u_vert)‖/‖u‖``, the vertical part the chosen mode failed to
            remove (rounding for ``"exact"``, what the truncated CG left for ``"approx"``, Algorithm 2's
            error for ``"paper000"``).
        sectors: ``{sector: ‖V_s u‖/‖u‖}``, each sector projected on its own.
        units: ``{(sector, unit): ‖V_s u‖/‖u‖}`` restricted to the unit's entries (a unit is an
            attention layer, or an LRM layer for ``lrm_internal``).
        layers: ``{site name: ‖u_vert‖/‖u‖}`` restricted to the layer's attention parameters
            (joint over sectors).
        info: solver facts of the joint projection.
    """

    total: float
    horizontal: float
    defect: float
    sectors: dict[str, float] = field(default_factory=dict)
    units: dict[tuple[str, str], float] = field(default_factory=dict)
    layers: dict[str, float] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def vertical_report(
    model: nn.Module,
    tensors: Tensors,
    *,
    sectors: str | Sequence[str] = "auto",
    mode: str = "exact",
    at: Mapping[str, torch.Tensor] | None = None,
    **projector_kwargs,
) -> VerticalReport:
    """Vertical fractions per sector, layer and unit, and the fit diagnostics (see :class:`VerticalReport`).

    ``mode="approx"`` or ``"paper000"`` reports what that mode removes (``total``) and leaves behind
    (``defect``, measured with the exact projector).
    """
    proj = GaugeProjector(model, sectors, mode, **projector_kwargs)
    exact = proj if mode == "exact" else GaugeProjector(model, proj.sectors, "exact", **projector_kwargs)
    given, _ = proj._as_dict(tensors)
    total = _sq(given)
    if total == 0:
        raise GaugeError("vertical_report: the vector field is zero; a fraction of it is undefined")
    dec = proj.decompose(given, at=at)
    rep = VerticalReport(
        total=math.sqrt(_sq(dec.vertical) / total),
        horizontal=math.sqrt((_sq(dec.horizontal) + _sq({n: t for n, t in given.items() if n not in dec.horizontal})) / total),
        defect=math.sqrt(_sq(exact.decompose(dec.horizontal, at=at).vertical) / total),
        info=dict(dec.info),
    )
    for s in proj.sectors:
        one = proj.decompose(given, sectors=(s,), at=at, norms=True)
        rep.sectors[s] = math.sqrt(_sq(one.vertical) / total)
        for (sec, unit), (vsq, usq) in one.norms.items():
            key = (sec, unit.split("[")[0])
            acc = rep.units.setdefault(key, [0.0, 0.0])
            acc[0] += vsq
            acc[1] += usq
    rep.units = {k: (math.sqrt(v / u) if u > 0 else 0.0) for k, (v, u) in rep.units.items()}
    for site in proj.sites:
        names = site.parameter_names()
        usq = _sq(given, names)
        rep.layers[site.name] = math.sqrt(_sq(dec.vertical, names) / usq) if usq > 0 else 0.0
    return rep


# ---------------------------------------------------------------------- Fisher–Rao (Algorithm 3)
@dataclass
class FisherRaoSplit:
    """Result of :func:`fisher_rao_split`.

    Attributes:
        vertical, horizontal: ``{name: tensor}`` over all parameters.
        fraction: ``‖u_vert‖_F / ‖u‖_F`` in the metric's norm.
        euclidean_fraction: ``‖u_vert‖/‖u‖`` in the Euclidean norm.
        residual: ``‖(G + λI)c − b‖/‖b‖`` of the Gram solve.
        coefficients: ``c`` over the generator basis (``labels`` names them).
    """

    vertical: dict[str, torch.Tensor]
    horizontal: dict[str, torch.Tensor]
    fraction: float
    euclidean_fraction: float
    residual: float
    coefficients: torch.Tensor
    labels: list[str]


def _flat(model_params: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor | None]) -> torch.Tensor:
    parts = []
    for n, p in model_params.items():
        t = tensors.get(n)
        parts.append(torch.zeros(p.numel(), dtype=torch.float64) if t is None else t.detach().double().reshape(-1).cpu())
    return torch.cat(parts)


def _unflat(model_params: dict[str, torch.Tensor], vec: torch.Tensor) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for n, p in model_params.items():
        out[n] = vec[i : i + p.numel()].view(p.shape)
        i += p.numel()
    return out


def fisher_rao_split(
    model: nn.Module,
    tensors: Tensors,
    metric: Callable[[torch.Tensor], torch.Tensor],
    *,
    sectors: str | Sequence[str] = "auto",
    damping: float = 0.0,
    max_generators: int = 4096,
    **projector_kwargs,
) -> FisherRaoSplit:
    """Vertical/horizontal split of ``tensors`` in the metric ``metric`` (paper 004 Algorithm 3).

    Args:
        model: a *small* model.
        tensors: the vector field ``u``.
        metric: ``v ↦ F v`` on float64 vectors flattened in ``named_parameters()`` order
            (``F`` symmetric positive semi-definite); called once per generator and twice more.
        damping: Tikhonov ``λ`` of the Gram system ``(AᵀFA + λI)c = AᵀFu``.
        max_generators: refuse larger bases (the cost is one metric call per generator and an
            ``O(m³)`` solve); use :func:`vertical_fraction` (Euclidean, any size) instead.

    Returns:
        :class:`FisherRaoSplit`. The Gram solve uses the pseudo-inverse rule of
        :mod:`gaugeopt.projection.sylvester` (plus ``damping``).

    Raises:
        GaugeError: the metric is degenerate along the gauge orbits — its Gram matrix on the
            generators is below ``1e-10`` of what its scale on ``u`` would give, as for the true
            Fisher of a gauge-invariant model (it annihilates every generator), where the split is
            undefined (it would be rounding noise, with fractions above 1). Pass a metric that is
            non-degenerate on the generators, e.g. a damped Fisher ``v ↦ Fv + δv``.
    """
    proj = GaugeProjector(model, sectors, "exact", **projector_kwargs)
    m = _basis_size(proj)
    if m > max_generators:
        raise GaugeError(
            f"fisher_rao_split: the gauge basis of this model has {m} generators, above max_generators={max_generators}; "
            "the Fisher–Rao split builds it explicitly (one metric call each). Use vertical_fraction (Euclidean, "
            "any size), restrict sectors=/sites=, or raise max_generators if the metric is cheap."
        )
    params = dict(model.named_parameters())
    given, _ = proj._as_dict(tensors)
    labels, cols = [], []
    for label, img in proj.basis():
        labels.append(label)
        cols.append(_flat(params, img))
    A = torch.stack(cols, 1) if cols else torch.zeros(sum(p.numel() for p in params.values()), 0, dtype=torch.float64)
    u = _flat(params, given)
    FA = torch.stack([metric(A[:, j]).double() for j in range(A.shape[1])], 1) if cols else A
    Fu = metric(u).double()
    G = A.mT @ FA
    G = 0.5 * (G + G.mT)
    b = A.mT @ Fu
    uFu = float(u @ Fu)
    if uFu <= 0:
        raise GaugeError("fisher_rao_split: ‖u‖_F = 0 under the given metric; the fraction is undefined")
    if cols:  # the metric's energy on the generators against its scale on u (Euclidean gram as the yardstick)
        scale = uFu / float(u @ u) * float(torch.linalg.eigvalsh(A.mT @ A).max())
        top = float(torch.linalg.eigvalsh(G).max())
        if top <= 1e-10 * scale:
            raise GaugeError(
                f"fisher_rao_split: the metric is degenerate along the gauge orbits (largest eigenvalue of AᵀFA is "
                f"{top:.1e}, {top / scale:.1e} of the metric's scale on u), as the true Fisher of a gauge-invariant "
                "model is: the Fisher–Rao vertical part is undefined there. Pass a metric that is non-degenerate on "
                "the generators, e.g. a damped Fisher `lambda v: F(v) + delta * v`, or use vertical_fraction (Euclidean)"
            )
    Gd = G + damping * torch.eye(G.shape[0], dtype=G.dtype)
    c = psd_solve(Gd, b) if cols else b
    vert = A @ c
    vFv = float(vert @ metric(vert).double())
    bn = float(b.norm())
    return FisherRaoSplit(
        vertical=_unflat(params, vert),
        horizontal=_unflat(params, u - vert),
        fraction=math.sqrt(max(vFv, 0.0) / uFu),
        euclidean_fraction=float(vert.norm() / u.norm()),
        residual=float((Gd @ c - b).norm()) / bn if bn > 0 else 0.0,
        coefficients=c,
        labels=labels,
    )


def _basis_size(proj: GaugeProjector) -> int:
    return sum(proj._impl[s].dimension() for s in proj.sectors)


# ---------------------------------------------------------------------- holonomy (Algorithm 4)
@dataclass
class HolonomyEstimate:
    """Result of :func:`holonomy`.

    Attributes:
        h_eps, h_half: ``‖Δ(δ)‖/δ²`` at ``δ = ε`` and ``ε/2`` (``Δ`` in Lie-algebra coordinates).
        estimate: Richardson extrapolation of the two.
        error: ``|estimate − h_half|``, paper 004's error proxy.
        delta_eps, delta_half: ``‖Δ(δ)‖`` themselves (they scale as ``δ²``).
        symmetric: whether the loop was averaged with its point reflection (see :func:`holonomy`).
    """

    h_eps: float
    h_half: float
    estimate: float
    error: float
    delta_eps: float
    delta_half: float
    eps: float
    symmetric: bool


def holonomy(
    model: nn.Module,
    u: Tensors,
    v: Tensors,
    *,
    eps: float = 1e-2,
    steps: int = 4,
    sectors: str | Sequence[str] = "auto",
    symmetric: bool = True,
    **projector_kwargs,
) -> HolonomyEstimate:
    """Small-loop holonomy of the Euclidean gauge connection (paper 004 Algorithm 4, small models).

    ``u`` and ``v`` are made horizontal at θ and orthonormal. For ``δ ∈ {ε, ε/2}`` the weights
    flow along the horizontal fields ``X_w(θ) = Π_θ(w)`` for ``w = +u, +v, −u, −v`` in turn (time
    ``δ`` each, ``steps`` RK4 steps per leg); the vertical part of the net displacement at θ, in
    Lie-algebra coordinates (the projector's coefficients: ``X``/``Y`` matrices per KV group,
    ``t`` per diagonal set, ``(x, y)`` per LRM block), is the holonomy ``Δ(δ) = δ²·Ω(u, v) + …``.

    With ``symmetric=True`` (default) the loop is averaged with the loop for ``(−u, −v)``, which
    is the same loop at ``−δ``: odd orders cancel, ``h(δ) = ‖Δ‖/δ² = h₀ + O(δ²)``, and the
    Richardson weights ``(4h(ε/2) − h(ε))/3`` of paper 004 remove the ``δ²`` term. With
    ``symmetric=False`` the single loop has an ``O(δ)`` term and the weights are ``2h(ε/2) − h(ε)``.
    The model is not modified. Cost: ``2·4·4·steps`` projections per ``δ`` (symmetric).

    Returns:
        :class:`HolonomyEstimate`.
    """
    proj = GaugeProjector(model, sectors, "exact", **projector_kwargs)
    params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    gu, _ = proj._as_dict(u)
    gv, _ = proj._as_dict(v)

    def full(d):
        return {n: (d[n].detach().double().clone() if d.get(n) is not None else torch.zeros_like(p)) for n, p in params.items()}

    def horizontal(w, at):
        hor = proj.decompose(w, at=at).horizontal
        return {n: hor.get(n, w[n]) for n in w}

    def dot(a, b):
        return sum(float((a[n] * b[n]).sum()) for n in a)

    fu, fv = full(gu), full(gv)
    hu, hv = horizontal(fu, params), horizontal(fv, params)
    nu = math.sqrt(dot(hu, hu))
    if nu <= 1e-10 * math.sqrt(dot(fu, fu)):
        raise GaugeError("holonomy: u has no horizontal part at θ (it is pure gauge); pass a direction that changes the function")
    hu = {n: t / nu for n, t in hu.items()}
    c = dot(hv, hu)
    hv = {n: hv[n] - c * hu[n] for n in hv}
    nv = math.sqrt(dot(hv, hv))
    if nv <= 1e-10 * math.sqrt(dot(fv, fv)):
        raise GaugeError("holonomy: v has no horizontal part independent of u; pass two independent directions")
    hv = {n: t / nv for n, t in hv.items()}

    def flow(theta, w, t):
        h = t / steps
        for _ in range(steps):  # classical RK4 on θ' = Π_θ(w)
            k1 = horizontal(w, theta)
            k2 = horizontal(w, {n: theta[n] + 0.5 * h * k1[n] for n in theta})
            k3 = horizontal(w, {n: theta[n] + 0.5 * h * k2[n] for n in theta})
            k4 = horizontal(w, {n: theta[n] + h * k3[n] for n in theta})
            theta = {n: theta[n] + h / 6 * (k1[n] + 2 * k2[n] + 2 * k3[n] + k4[n]) for n in theta}
        return theta

    neg = lambda d: {n: -t for n, t in d.items()}  # noqa: E731

    def loop(a, b, d):
        th = params
        for w in (a, b, neg(a), neg(b)):
            th = flow(th, w, d)
        return {n: th[n] - params[n] for n in th}

    def delta(d):
        disp = loop(hu, hv, d)
        if symmetric:
            other = loop(neg(hu), neg(hv), d)
            disp = {n: 0.5 * (disp[n] + other[n]) for n in disp}
        coeffs = proj.decompose(disp, at=params).coefficients
        return math.sqrt(sum(float(c.double().square().sum()) for c in coeffs.values()))

    d1, d2 = delta(eps), delta(eps / 2)
    h1, h2 = d1 / eps**2, d2 / (eps / 2) ** 2
    est = (4 * h2 - h1) / 3 if symmetric else 2 * h2 - h1
    return HolonomyEstimate(h1, h2, est, abs(est - h2), d1, d2, eps, symmetric)
