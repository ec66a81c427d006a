"""Triton kernels for gaugeopt (installed as ``gaugeopt.kernels``): one folder per op, each with its
plain-torch reference beside the kernel.

* :mod:`.gaugefix` — the fused GaugeFix: every pair of every layer balanced, and the optimizer
  state transported, in one launch per dtype group (``gaugefix.prepare`` packs the descriptor
  tables once); ``gaugefix.fix_naive`` is the same in plain torch. Its model-level host is
  :mod:`gaugeopt.fix.triton_backend` (the torch backend for any device is
  :mod:`gaugeopt.fix.torch_backend`); :func:`gaugeopt.gauge_fix` chooses between them.
* :mod:`.projection` — the closed-form projection sectors (``lrm_qk``, ``lrm_vo``, full-rotary
  ``qk``) of :class:`gaugeopt.GaugeProjector` in one launch (``projection.project_diagonal``,
  ``projection.project_planes``, and their ``_naive`` references); model-level host
  :mod:`gaugeopt.projection.triton_backend`, routed by :mod:`gaugeopt.projection.routing`.
* :mod:`.dispatch` — which implementation runs (``backend=``, ``GAUGEOPT_BACKEND``), and why.

Each op folder holds ``spec.py`` (what the op takes, and the checks), ``fused.py`` (the
``@triton.jit`` kernel, its launcher, the public function) and ``naive.py`` (the reference).
The kernels know tensors, not models: nothing here imports gaugeopt beyond ``gaugeopt.errors``.
Importing this package imports neither Triton nor a kernel module; they load on first use.
Design notes, dispatch rules and benchmarks: ``docs/kernels.md``.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "dispatch": "gaugeopt.kernels.dispatch",
    "gaugefix": "gaugeopt.kernels.gaugefix",
    "projection": "gaugeopt.kernels.projection",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    raise AttributeError(f"module 'gaugeopt.kernels' has no attribute {name!r}")
