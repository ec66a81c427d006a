"""The torch reference of the fused GaugeFix kernel: the core :func:`gaugeopt.gauge_fix` itself.

The kernel (:mod:`gaugeopt.kernels.gaugefix_triton`) must reproduce what the core computes —
per-channel mean squares (:func:`gaugeopt.fix.plan.read_mean_squares`), slot scales and factors
(:func:`gaugeopt.fix.gaugefix.balance_factors`), in-place rescale of parameters and optimizer
state (:func:`gaugeopt.fix.gaugefix.apply_factors`) — so the reference *is* the core, called
with the torch path forced, never a second implementation.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.kernels.gaugefix_reference import gauge_fix_reference
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)))
    >>> with torch.no_grad(): _ = model.transformer.h[0].attn.c_attn.row_mults[0].mul_(2.0)
    >>> round(gauge_fix_reference(model).max_drift_before, 4), gaugeopt.qk_drift(model) < 1e-6
    (0.6931, True)
"""

from __future__ import annotations

from gaugeopt.fix.gaugefix import GaugeFixReport, gauge_fix

__all__ = ["gauge_fix_reference"]


def gauge_fix_reference(model, optimizer=None, granularity: str = "auto", **kwargs) -> GaugeFixReport:
    """:func:`gaugeopt.gauge_fix` on the torch path (same arguments, same report)."""
    return gauge_fix(model, optimizer, granularity, **{**kwargs, "backend": "torch"})
