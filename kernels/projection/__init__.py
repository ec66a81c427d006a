"""The closed-form gauge projections as kernel ops: diagonal multiplier gauges and RoPE planes.

* :mod:`.spec` — what the ops take: :class:`DiagonalSite` (``lrm_qk``, ``lrm_vo``) and
  :class:`PlaneSite` of :class:`PlaneMember` s (``qk`` of a full-rotary layer), and the checks both
  implementations run first;
* :mod:`.fused` — the ``@triton.jit`` kernels, their launchers and :func:`project_diagonal`,
  :func:`project_planes` (every layer in one launch);
* :mod:`.naive` — :func:`project_diagonal_naive`, :func:`project_planes_naive`: the same in plain
  torch, layer by layer, with the formulas — the references the kernels are tested against.

The model-level host — which sectors go to the kernel, the sites described as these tensors —
is :mod:`gaugeopt.projection.routing` and :mod:`gaugeopt.projection.triton_backend`. Importing
this package does not import Triton; :func:`project_diagonal` and :func:`project_planes` do.

Example:
    >>> import torch
    >>> from gaugeopt.kernels.projection import DiagonalSite, project_diagonal_naive
    >>> r_q, r_k = torch.ones(1, 2), torch.ones(1, 2)
    >>> u_q, u_k = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    >>> v_q, v_k = torch.zeros(1, 2), torch.zeros(1, 2)
    >>> project_diagonal_naive([DiagonalSite(r_q, r_k, u_q, u_k, v_q, v_k, groups=1, repeat_a=1, repeat_b=1,
    ...                                      slot=[0, 1], n_slots=2)], rtol=1e-6)
    >>> v_q.tolist(), v_k.tolist()
    ([[0.5, -1.5]], [[-0.5, 1.5]])
"""

from __future__ import annotations

import importlib

from gaugeopt.kernels.projection.spec import (
    SUPPORTED_DTYPES, DiagonalSite, PlaneMember, PlaneSite, accumulation_dtype, check_diagonal, check_planes,
)

__all__ = ["SUPPORTED_DTYPES", "DiagonalSite", "PlaneMember", "PlaneSite", "accumulation_dtype", "check_diagonal",
           "check_planes", "project_diagonal", "project_planes", "project_diagonal_naive", "project_planes_naive"]

_LAZY = {"project_diagonal": "fused", "project_planes": "fused",
         "project_diagonal_naive": "naive", "project_planes_naive": "naive"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
