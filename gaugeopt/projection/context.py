"""One projection call: the point θ, the precision and solver settings, and the sectors' common calls.

A sector object (:class:`~gaugeopt.projection.dense.DenseSector`, the diagonal, internal and bias
sectors) is built once per model and knows its generators; every call of the projector reads
the weights anew through a :class:`Context` — ``ctx.weight(ref)`` is the canonical view of a
parameter at θ in the compute dtype — and runs ``sector.prepare(ctx)`` (what depends on θ only:
Grams, factorisations) then ``sector.apply(ctx, prepared, u, out, record)``, which *adds* the
sector's vertical part of ``u`` into ``out``. :func:`vertical_family` does that for a family of
sectors whose spans are mutually orthogonal (their parts add up); the joint solves
(:mod:`gaugeopt.projection.joint`) and :class:`~gaugeopt.projection.projector.GaugeProjector`
both call it. The context also gathers the solver facts of the call (``info``: CG iterations and
residuals, the approximate mode's estimates, kept as tensors so that reading them is the only
host synchronisation).

Example:
    >>> import torch
    >>> from gaugeopt.projection.context import accessor
    >>> store = {"w": torch.zeros(2, 3)}
    >>> accessor(store)("w").shape
    torch.Size([2, 3])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import torch

from gaugeopt.projection.dense import DenseSector
from gaugeopt.records.site import TensorRef

__all__ = ["Context", "Decomposition", "Tensors", "accessor", "names_of", "vertical_family"]

Tensors = Union[Mapping[str, torch.Tensor], Sequence[Union[torch.Tensor, None]]]


@dataclass
class Decomposition:
    """Result of :meth:`GaugeProjector.decompose <gaugeopt.projection.projector.GaugeProjector.decompose>`.

    Attributes:
        vertical: ``{name: tensor}`` over the sectors' parameters (compute dtype).
        horizontal: ``u − vertical`` over the same names.
        coefficients: ``{(sector, unit): tensor}`` Lie-algebra coordinates of ``vertical``
            (``X``/``Y`` per KV group as ``(h_kv, n, n)``, ``t`` per diagonal set, ``(x, y)`` per
            LRM block); summed over the sweeps of a joint projection.
        norms: ``{(sector, unit): (‖u_vert‖², ‖u‖²)}`` over the unit's entries (with
            ``decompose(..., norms=True)``; not filled for joint projections).
        info: solver facts: ``cg_iterations``, ``cg_residual``, ``joint_iterations``, ``joint_residual``;
            in ``"approx"`` mode also ``approx_iterations``, ``approx_residual`` and ``approx_left_estimate``.
    """

    vertical: dict[str, torch.Tensor]
    horizontal: dict[str, torch.Tensor]
    coefficients: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    norms: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


class Context:
    """One projection call: the point θ (``at`` over the model's parameters ``params``), the compute
    dtype and the solver settings; ``warn`` reports a solve that stopped short (once per kind)."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        at: Mapping[str, torch.Tensor] | None,
        *,
        dtype: torch.dtype,
        rtol: float,
        mode: str,
        cg_tol: float,
        cg_maxiter: int,
        device: torch.device,
        warn: Callable[[str], None],
    ) -> None:
        self.params, self.at = params, at
        self.dtype, self.rtol, self.mode = dtype, rtol, mode
        self.cg_tol, self.cg_maxiter = cg_tol, cg_maxiter
        self.device, self.warn = device, warn
        self.info: dict = {"cg_iterations": 0, "cg_residual": 0.0}
        self._cache: dict[str, torch.Tensor] = {}

    def moved(self, at: Mapping[str, torch.Tensor] | None) -> "Context":
        """The same settings at another point (its own ``info``)."""
        return Context(self.params, at, dtype=self.dtype, rtol=self.rtol, mode=self.mode, cg_tol=self.cg_tol,
                       cg_maxiter=self.cg_maxiter, device=self.device, warn=self.warn)

    def _param(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            src = self.at[name] if (self.at is not None and name in self.at) else self.params[name]
            t = src.detach().to(self.dtype)
            self._cache[name] = t
        return t

    def weight(self, x: TensorRef | str) -> torch.Tensor:
        """Weights at θ, canonical view for a ref, whole tensor for a name (compute dtype)."""
        if isinstance(x, str):
            return self._param(x)
        return x.view(self._param(x.name))

    def note_approx(self, sector: str, iters: int, res: torch.Tensor, left: torch.Tensor) -> None:
        """Truncated CG of ``mode="approx"``: residual and error estimate stay tensors (no sync)."""
        info = self.info
        info["approx_iterations"] = max(info.get("approx_iterations", 0), iters)
        r = res.max() if res.numel() else res.new_zeros(())
        info["approx_residual"] = torch.maximum(info["approx_residual"], r) if "approx_residual" in info else r
        sq = left.square().sum()
        self._left_sq = self._left_sq + sq if hasattr(self, "_left_sq") else sq

    def note_cg(self, sector: str, iters: int, res: float) -> None:
        self.info["cg_iterations"] = max(self.info["cg_iterations"], iters)
        self.info["cg_residual"] = max(self.info["cg_residual"], res)
        if res > self.cg_tol:
            self.warn(
                f"gauge projection ({sector}): conjugate gradients stopped after {iters} iterations at relative "
                f"residual {res:.2e} > cg_tol={self.cg_tol:.1e}; raise cg_maxiter"
            )


def names_of(sec) -> list[str]:
    """Parameter names a sector object touches."""
    if isinstance(sec, DenseSector):
        return list(dict.fromkeys(r.name for r in sec.refs()))
    return sec.param_names()


def accessor(store: dict[str, torch.Tensor]):
    """``ref -> view`` into ``store`` (a name gives the whole tensor), as the sectors read and write."""
    def acc(x: TensorRef | str) -> torch.Tensor:
        if isinstance(x, str):
            return store[x]
        return x.view(store[x.name])

    return acc


def vertical_family(ctx: Context, family, work, record=None, coeffs=None, out=None) -> dict[str, torch.Tensor]:
    """Add the vertical part of ``work`` in ``family`` (``[(sector, prepared)]``, mutually orthogonal
    spans) into ``out`` (zeros over its names by default); with ``coeffs``, sum each unit's
    coefficients into it; ``record(sector, unit, coef, ‖v‖², ‖u‖²)`` per unit."""
    if out is None:
        names = [n for sec, _ in family for n in names_of(sec)]
        out = {n: torch.zeros_like(work[n]) for n in dict.fromkeys(names)}
    rec = record
    if coeffs is not None:
        def rec(sector, unit, coef, vsq, usq):
            key = (sector, unit)
            coeffs[key] = coeffs[key] + coef if key in coeffs else coef
            if record is not None:
                record(sector, unit, coef, vsq, usq)
    for sec, prep in family:
        sec.apply(ctx, prep, accessor(work), accessor(out), rec)
    return out
