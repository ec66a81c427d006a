"""The learnable-multiplier layer (LRM): ``W = diag(r) · W̄ · diag(c)`` without materialising ``W``.

Velikanov et al. (2026), as used by GaugeFix-LRM (paper 002, eq. 1). A linear layer keeps its
base matrix ``W̄`` (weight-decayed as usual) and learns a row scale ``r`` and a column scale
``c``, both initialised to 1:

    y = ((x ⊙ c) W̄ᵀ + b̄) ⊙ r          # O(tokens·d) extra work, never O(d²)

The bias sits inside the row scale, so ``[W̄ | b̄]`` is one augmented matrix whose rows ``r``
scales (docs/gauge_group.md): every diagonal gauge acts on the multipliers alone.

A fused projection (GPT-2's ``c_attn``) is split into blocks (Q, K, V) that each get their
own ``r`` and ``c`` — the Q/K gauge lives on ``r_Q`` vs ``r_K`` and the paper's conditions
decay them differently, so they must be separate parameters:

    y = concat_s ( ((x ⊙ c_s) W̄_sᵀ + b̄_s) ⊙ r_s )

This module is the layer alone, a building block of models like :mod:`gaugeopt.models.gpt`; it
imports nothing of gaugeopt but its errors, so every layer of the package may read it. Converting
a model's linear layers and grouping the multipliers for an optimizer read the attention records,
and live with them (:mod:`gaugeopt.adapters.apply_lrm`: :func:`gaugeopt.apply_lrm`,
:func:`gaugeopt.lrm_param_groups`).

Example:
    >>> import torch
    >>> from gaugeopt.models.lrm import LRMLinear
    >>> layer = LRMLinear(4, 6, split_sizes=(2, 4))
    >>> [tuple(r.shape) for r in layer.row_mults], layer.internal_gauge_dim
    ([(2,), (4,)], 14)
    >>> x = torch.randn(3, 4)
    >>> torch.allclose(layer(x), x @ layer.effective_weight().T + layer.bias)
    True
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gaugeopt.errors import GaugeError

__all__ = ["LRMLinear", "is_lrm"]


class LRMLinear(nn.Module):
    """A linear layer with learnable row and column multipliers (``nn.Linear`` layout).

    Args:
        in_features, out_features: as ``nn.Linear``.
        bias: learn a base bias ``b̄`` (scaled by ``r`` like the rows it belongs to).
        split_sizes: output blocks with separate multipliers (default: one block).

    Parameters:
        weight: ``W̄``, ``(out_features, in_features)``.
        bias: ``b̄``, ``(out_features,)`` or ``None``.
        row_mults: one ``(split_sizes[s],)`` vector ``r_s`` per block.
        col_mults: one ``(in_features,)`` vector ``c_s`` per block.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        split_sizes: Sequence[int] | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        sizes = tuple(split_sizes) if split_sizes is not None else (out_features,)
        if sum(sizes) != out_features or any(s <= 0 for s in sizes):
            raise GaugeError(f"LRMLinear: split_sizes={sizes} must be positive and sum to out_features={out_features}")
        self.split_sizes = sizes
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
        self.row_mults = nn.ParameterList([nn.Parameter(torch.ones(s, **factory)) for s in sizes])
        self.col_mults = nn.ParameterList([nn.Parameter(torch.ones(in_features, **factory)) for _ in sizes])
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_linear(cls, linear: nn.Module, split_sizes: Sequence[int] | None = None) -> "LRMLinear":
        """Convert an ``nn.Linear`` or HF ``Conv1D`` (multipliers = 1: same function)."""
        if type(linear) is nn.Linear:
            w = linear.weight.detach()
        elif _is_conv1d(linear):
            w = linear.weight.detach().t()  # Conv1D stores (in, out)
        else:
            raise GaugeError(f"LRMLinear.from_linear: cannot convert {type(linear).__qualname__}")
        out_f, in_f = w.shape
        new = cls(in_f, out_f, bias=linear.bias is not None, split_sizes=split_sizes, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight.copy_(w)
            if linear.bias is not None:
                new.bias.copy_(linear.bias.detach())
        new.weight.requires_grad_(linear.weight.requires_grad)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.split_sizes) == 1:
            return F.linear(x * self.col_mults[0], self.weight, self.bias) * self.row_mults[0]
        ws = self.weight.split(self.split_sizes, dim=0)
        bs = self.bias.split(self.split_sizes) if self.bias is not None else (None,) * len(ws)
        outs = [F.linear(x * c, w, b) * r for w, b, r, c in zip(ws, bs, self.row_mults, self.col_mults)]
        return torch.cat(outs, dim=-1)

    def row_multiplier(self) -> torch.Tensor:
        """All row multipliers concatenated, ``(out_features,)`` (a new tensor)."""
        return torch.cat(list(self.row_mults))

    def effective_weight(self) -> torch.Tensor:
        """``diag(r) · W̄ · diag(c)`` as a dense ``(out, in)`` matrix (for tools and tests only)."""
        ws = self.weight.split(self.split_sizes, dim=0)
        return torch.cat([r[:, None] * w * c[None, :] for w, r, c in zip(ws, self.row_mults, self.col_mults)])

    @property
    def internal_gauge_dim(self) -> int:
        """Dimension of the internal rescalings ``r ← r⊙t, W̄ ← W̄⊘(t⊗s), c ← c⊙s``: one ``t`` per
        output row and one ``s`` per input column of every multiplier block."""
        return self.out_features + self.in_features * len(self.split_sizes)

    def extra_repr(self) -> str:
        split = f", split_sizes={self.split_sizes}" if len(self.split_sizes) > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{split}"


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers")


def is_lrm(model: nn.Module) -> bool:
    """True when ``model`` contains at least one :class:`LRMLinear`."""
    return any(isinstance(m, LRMLinear) for m in model.modules())


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers")


def is_lrm(model: nn.Module) -> bool:
    """True when ``model`` contains at least one :class:`LRMLinear`."""
    return any(isinstance(m, LRMLinear) for m in model.modules())
