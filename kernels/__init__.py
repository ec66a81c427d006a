"""Triton kernels for gaugeopt (installed as ``gaugeopt.kernels``), each beside its torch reference.

* :mod:`.gaugefix_triton` — the fused GaugeFix: every pair of every layer balanced, and the
  optimizer state transported, in one launch per dtype group (:func:`~.gaugefix_triton.prepare`
  packs the descriptor tables once). Its host side and reference are :mod:`gaugeopt.fix.triton_backend`
  and :mod:`gaugeopt.fix.torch_backend`; :func:`gaugeopt.gauge_fix` chooses between them.
* :mod:`.projection_triton` — the closed-form projection sectors (``lrm_qk``, ``lrm_vo``,
  full-rotary ``qk``) of :class:`gaugeopt.GaugeProjector` in one launch
  (:func:`~.projection_triton.launch_diagonal`, :func:`~.projection_triton.launch_planes`; host side
  :mod:`gaugeopt.projection.triton_backend`).
* :mod:`.dispatch` — which implementation runs (``backend=``, ``GAUGEOPT_BACKEND``), and why.

Importing this package imports neither Triton nor a kernel module; they load on first use.
Design notes, dispatch rules and benchmarks: ``docs/kernels.md``.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "dispatch": "gaugeopt.kernels.dispatch",
    "gaugefix_triton": "gaugeopt.kernels.gaugefix_triton",
    "projection_triton": "gaugeopt.kernels.projection_triton",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        mod = importlib.import_module(_LAZY[name])
        return mod if mod.__name__.endswith(name) else getattr(mod, name)
    raise AttributeError(f"module 'gaugeopt.kernels' has no attribute {name!r}")
