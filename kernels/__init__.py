"""Triton kernels for gaugeopt (installed as ``gaugeopt.kernels``), each beside its torch reference.

* the fused GaugeFix (:mod:`.gaugefix_triton`; reference :mod:`.gaugefix_reference`):
  :func:`gaugeopt.gauge_fix` takes it on CUDA through :func:`try_fused_gauge_fix`;
  :class:`FusedGaugeFix` plans and dispatches once and reuses the packed tables across calls.
* :func:`fused_vertical`, :func:`fused_project` — the closed-form projection sectors
  (``lrm_qk``, ``lrm_vo``, full-rotary ``qk``) of :class:`gaugeopt.projection.projector.GaugeProjector`
  in one launch (:mod:`.projection_triton`; reference :mod:`.projection_reference`).
* :mod:`.dispatch` — which implementation runs (``backend=``, ``GAUGEOPT_BACKEND``), and why.

Importing this package imports neither Triton nor a kernel module; they load on first use.
Design notes, dispatch rules and benchmarks: ``docs/kernels.md``.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "try_fused_gauge_fix": "gaugeopt.kernels.ops",
    "FusedGaugeFix": "gaugeopt.kernels.ops",
    "fused_vertical": "gaugeopt.kernels.ops",
    "fused_project": "gaugeopt.kernels.ops",
    "dispatch": "gaugeopt.kernels.dispatch",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        mod = importlib.import_module(_LAZY[name])
        return mod if mod.__name__.endswith(name) else getattr(mod, name)
    raise AttributeError(f"module 'gaugeopt.kernels' has no attribute {name!r}")
