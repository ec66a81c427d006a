"""The projected optimizer step, shared by :class:`gaugeopt.GaugeOptimizer` and the Lightning
callback :class:`gaugeopt.callbacks.GaugeProjection`, and the one definition of the vertical fraction.

``project="update"``: snapshot the gauge parameters, let the optimizer step, and replace the step it
took, ``Δ = θ_new − θ_old``, by its horizontal part at ``θ_old``: ``θ ← θ_new − Π_vert(Δ)``
(subtracting from ``θ_new`` keeps every entry no generator touches bit-identical to the inner step).
``project="grad"``: ``g ← g − Π_vert(g)`` before the step.

The vertical fraction of a vector field ``u`` is ``‖Π_vert u‖ / ‖u‖`` (Euclidean, ``‖u‖`` over every
tensor of the field). :func:`squared_norms` returns the two squared norms as float64 device tensors —
no host synchronisation until someone reads the fraction (:func:`vertical_fraction_of`).

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.projection.step import squared_norms, vertical_fraction_of
    >>> vertical_fraction_of(squared_norms({"w": torch.tensor([3.0])}, {"w": torch.tensor([3.0, 4.0])}))
    0.6
"""

from __future__ import annotations

import math
import warnings
from typing import Mapping

import torch
import torch.nn as nn

from gaugeopt.projection.projector import GaugeProjector

__all__ = ["all_finite", "snapshot", "remove_vertical_update_", "remove_vertical_grad_", "squared_norms", "vertical_fraction_of"]


def squared_norms(vertical: Mapping[str, torch.Tensor], field: Mapping[str, torch.Tensor | None]):
    """``(‖Π_vert u‖², ‖u‖²)`` as float64 tensors (``field`` entries may be ``None``: zero)."""
    zero = torch.zeros((), dtype=torch.float64)
    tot = sum((_sq(t) for t in field.values() if t is not None), zero)
    v = sum((_sq(t) for t in vertical.values()), zero)
    return v, tot


def _sq(t: torch.Tensor) -> torch.Tensor:
    """``‖t‖²`` accumulated in float64 without a float64 copy of ``t`` (this runs every projected step)."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float64).square()


def vertical_fraction_of(norms) -> float:
    """``sqrt(v / tot)`` from :func:`squared_norms` (``0.0`` for a zero field, ``nan`` for a step that
    was not projected: ``norms`` is ``None`` or not finite)."""
    if norms is None:
        return math.nan
    v, tot = (float(x) for x in norms)
    if not (math.isfinite(v) and math.isfinite(tot)):
        return math.nan
    return math.sqrt(v / tot) if tot > 0 else 0.0


def all_finite(tensors) -> bool:
    """Whether every entry of every tensor is finite (one host synchronisation)."""
    flags = [torch.isfinite(t).all() for t in tensors if t is not None]
    return bool(torch.stack(flags).all()) if flags else True


_NONFINITE = (
    "gaugeopt: a projected step met a NaN or infinite value in the gauge parameters, their update or their gradients; "
    "the step was left as the optimizer took it (not projected), so the non-finite entries do not spread through "
    "the projection. The wrapper's nonfinite_steps counts such steps"
)


def snapshot(proj: GaugeProjector, model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the gauge parameters (the point ``θ_old`` an update is projected at)."""
    params = dict(model.named_parameters())
    return {n: params[n].detach().clone() for n in proj.param_names()}


@torch.no_grad()
def remove_vertical_update_(proj: GaugeProjector, model: nn.Module, before: dict[str, torch.Tensor]):
    """``θ ← θ − Π_vert(θ − θ_old)`` at ``θ_old = before``; returns :func:`squared_norms` of ``Δ``, or
    ``None`` (with a warning, nothing changed) when ``Δ`` or ``θ_old`` holds a NaN or an infinity."""
    params = dict(model.named_parameters())
    delta = {n: params[n].detach() - before[n] for n in before}
    if not all_finite([*delta.values(), *before.values()]):
        warnings.warn(_NONFINITE, RuntimeWarning, stacklevel=3)
        return None
    vert = proj.vertical(delta, at=before)
    for n, v in vert.items():
        params[n].sub_(v.to(params[n].dtype))
    return squared_norms(vert, delta)


@torch.no_grad()
def remove_vertical_grad_(proj: GaugeProjector, model: nn.Module):
    """``g ← g − Π_vert(g)`` for the gauge parameters' gradients; returns :func:`squared_norms` of ``g``, or
    ``None`` (with a warning, nothing changed) when a gradient or a parameter holds a NaN or an infinity."""
    params = dict(model.named_parameters())
    grads = {n: params[n].grad for n in proj.param_names()}
    if not all_finite([*grads.values(), *(params[n].detach() for n in grads)]):
        warnings.warn(_NONFINITE, RuntimeWarning, stacklevel=3)
        return None
    vert = proj.vertical(grads)
    norms = squared_norms(vert, grads)  # of g itself: the loop below updates these tensors in place
    for n, v in vert.items():
        p = params[n]
        if p.grad is None:
            p.grad = -v.to(p.dtype)
        else:
            p.grad.sub_(v.to(p.grad.dtype))
    return norms
