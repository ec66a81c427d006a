"""Gauge-orthogonal projection of gradients and optimizer updates, and its diagnostics.

* :mod:`.projector` — :class:`GaugeProjector`: sectors, modes, the joint projection;
* :mod:`.dense` — the ``qk``/``vo`` sectors (Sylvester, RoPE planes);
* :mod:`.multipliers` — the learnable-multiplier sectors;
* :mod:`.sylvester` — batched Sylvester solves and the pseudo-inverse rule;
* :mod:`.diagnostics` — vertical fraction, Fisher–Rao split, holonomy.
"""

from gaugeopt.projection.projector import MODES, SECTORS, Decomposition, GaugeProjector

__all__ = ["Decomposition", "GaugeProjector", "MODES", "SECTORS"]
