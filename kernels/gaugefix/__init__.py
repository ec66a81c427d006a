"""GaugeFix as one kernel op: balance every pair of every layer and transport the optimizer state.

* :mod:`.spec` — what to balance: :class:`FixTensor` views and :class:`FixPair` s, and the checks
  both implementations run first;
* :mod:`.fused` — the ``@triton.jit`` kernel and its launcher: :func:`prepare` packs the
  descriptor tables once, ``PreparedFix.run()`` launches (one launch per dtype group);
* :mod:`.naive` — :func:`fix_naive`, the same numbers and writes in plain torch, pair by pair:
  the reference the kernel is tested against (``tests/kernels/kernels_interpreter_cases.py``).

The formula is in :mod:`.naive`'s docstring. The model-level host — plans into pairs, the state
rules, the report, the choice of backend — is :mod:`gaugeopt.fix` (``triton_backend`` builds the
pairs, ``torch_backend`` is the model-level torch path for every device and for DTensor shards).
Importing this package does not import Triton; :func:`prepare` does.

Example:
    >>> import torch
    >>> from gaugeopt.kernels.gaugefix import FixPair, FixTensor, fix_naive
    >>> w_q, w_k = torch.full((2, 3, 5), 4.0), torch.ones(2, 3, 5)   # plain rows (heads, d_k, d_model)
    >>> pair = FixPair([FixTensor(w_q, 0), FixTensor(w_k, 1)], groups=2, width=3, slot=[0, 0, 0],
    ...                n_slots=1, repeat_a=1, repeat_b=1)
    >>> _ = fix_naive([pair])
    >>> w_q[0, 0, 0].item(), w_k[0, 0, 0].item()   # both scales now 2: g = sqrt(4 / 1)
    (2.0, 2.0)
"""

from __future__ import annotations

import importlib

from gaugeopt.kernels.gaugefix.spec import CHANGED_ULPS, SUPPORTED_DTYPES, FixPair, FixTensor, check_pairs

__all__ = ["CHANGED_ULPS", "SUPPORTED_DTYPES", "FixPair", "FixTensor", "check_pairs", "prepare", "PreparedFix",
           "fix_naive"]

_LAZY = {"prepare": "fused", "PreparedFix": "fused", "fix_naive": "naive"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
