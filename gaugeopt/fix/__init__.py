"""GaugeFix-LRM: function-preserving rebalancing of the Q/K (and V/O) gauge, with state transport.

* :mod:`.plan` — which tensors form each side of a pair and which channels share a scale;
  drift metrics;
* :mod:`.gaugefix` — :func:`gauge_fix` and its report;
* :mod:`.transport` — optimizer-state transport for diagonal rescales;
* :mod:`.distributed` — DTensor (FSDP2) helpers.
"""

from gaugeopt.fix.gaugefix import GaugeFixReport, gauge_fix
from gaugeopt.fix.plan import qk_drift, vo_drift

__all__ = ["GaugeFixReport", "gauge_fix", "qk_drift", "vo_drift"]
