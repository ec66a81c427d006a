"""gaugeopt: gauge-aware training for transformers.

Attention has continuous symmetries (gauges): ``W_Q ← AᵀW_Q, W_K ← A⁻¹W_K`` and
``W_V ← CᵀW_V, W_O ← W_O C⁻ᵀ`` per head leave the function unchanged. gaugeopt finds them in
a model (:func:`find_attention`), fixes them while training (GaugeFix-LRM), projects
optimizer updates orthogonally to them, and canonicalises, compares and merges checkpoints.

The core imports only torch. Lightning callbacks live in :mod:`gaugeopt.callbacks`, Triton
kernels in :mod:`gaugeopt.kernels`.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)))
    >>> len(gaugeopt.find_attention(model)), gaugeopt.gauge_dimension(model, per_symmetry=True)["qk"]
    (2, 256)
"""

from .actions import invalid_gauge_transform, random_gauge_transform, relative_change
from .counting import gauge_dimension
from .errors import GaugeError
from .lrm import LRMLinear, apply_lrm, lrm_param_groups
from .rope import RopeSpec
from .structure import AttentionSite, find_attention, register_adapter, site_from_linears

__version__ = "0.1.0"

# Public names whose modules are loaded on first use (each imports only torch).
_LAZY = {
    "qk_drift": "gaugeopt.gaugefix",
    "gauge_fix": "gaugeopt.gaugefix",
    "GaugeProjected": "gaugeopt.optim",
    "vertical_fraction": "gaugeopt.diagnostics",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gaugeopt' has no attribute {name!r}")


__all__ = [
    *_LAZY,
    "AttentionSite",
    "GaugeError",
    "LRMLinear",
    "RopeSpec",
    "apply_lrm",
    "find_attention",
    "gauge_dimension",
    "invalid_gauge_transform",
    "lrm_param_groups",
    "random_gauge_transform",
    "register_adapter",
    "relative_change",
    "site_from_linears",
]
