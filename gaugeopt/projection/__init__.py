"""Gauge-orthogonal projection of gradients and optimizer updates, and its diagnostics.

* :mod:`.projector` — :class:`GaugeProjector`: sectors, modes, inputs and outputs;
* :mod:`.context` — one projection call (the point θ, precision, solver facts) as the sectors see it;
* :mod:`.joint` — the joint projection of overlapping sector families;
* :mod:`.routing` — which sectors go to the fused Triton kernels, decided once per kind of input;
  :mod:`.triton_backend` — the sites described as the kernel op's tensors;
* :mod:`.dense` — the ``qk``/``vo`` sectors (Sylvester, RoPE planes);
* :mod:`.multipliers` — the learnable-multiplier sectors; :mod:`.bias` — the bias sectors;
* :mod:`.sylvester` — batched Sylvester solves and the pseudo-inverse rule; :mod:`.cg` — the one
  conjugate-gradient loop (batched normal equations and the joint projection);
* :mod:`.step` — the projected optimizer step; :mod:`.diagnostics` — vertical fraction, Fisher–Rao
  split, holonomy.
"""

from gaugeopt.projection import projector as _projector
from gaugeopt.projection.projector import PROJECTION_MODES, Decomposition, GaugeProjector

__all__ = ["Decomposition", "GaugeProjector", "PROJECTION_MODES", "SECTORS"]


def __getattr__(name: str):
    """``SECTORS``: the projectable sectors of the registry, read when asked (a sector registered later is in it)."""
    if name == "SECTORS":
        return _projector.projectable()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
