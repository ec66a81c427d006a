"""GaugeFix-LRM: function-preserving rebalancing of the Q/K (and V/O) gauge, with state transport.

* :mod:`.options` — :class:`FixOptions`, the fix's options in one object, validated once;
* :mod:`.plan` — which tensors form each side of a pair, which channels share a scale;
* :mod:`.drift` — drift and scale product (paper 002 eq. 3);
* :mod:`.balance` — the factors, a pure function of per-channel mean squares;
* :mod:`.gaugefix` — :class:`GaugeFixer` and :func:`gauge_fix`: validation, state, the report;
* :mod:`.torch_backend`, :mod:`.triton_backend` — the two backends that compute the numbers;
* :mod:`.report` — :class:`GaugeFixReport`;
* :mod:`.qk_clip` — QK-Clip (:func:`gaugeopt.qk_clip`): cap each head's maximum logit by rescaling its
  query and key side through the records (a deliberate change of function, with the same state transport);
* :mod:`.transport` — optimizer-state transport for diagonal rescales (DTensor-aware through
  :mod:`gaugeopt.distributed`), several optimizers per model;
* :mod:`.state_rules` — how each optimizer's state moves: exact, declared approximate, or refused.
"""

from gaugeopt.fix.drift import qk_drift, vo_drift
from gaugeopt.fix.gaugefix import GaugeFixer, gauge_fix
from gaugeopt.fix.options import FixOptions
from gaugeopt.fix.report import GaugeFixReport

__all__ = ["FixOptions", "GaugeFixReport", "GaugeFixer", "gauge_fix", "qk_drift", "vo_drift"]
