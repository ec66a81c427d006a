"""The torch reference of the fused projection kernels: :class:`gaugeopt.projection.projector.GaugeProjector`.

:mod:`gaugeopt.kernels.projection_triton` fuses the closed-form sectors — ``lrm_qk``,
``lrm_vo`` (:class:`gaugeopt.projection.multipliers.DiagonalSector`) and ``qk`` under full-rotary RoPE
(the plane closed form of :mod:`gaugeopt.projection.dense`) — so the reference is the core projector
restricted to that one sector, never a second implementation.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.kernels.projection_reference import vertical_reference
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))).double()
    >>> u = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    >>> sorted(vertical_reference(model, u, "lrm_qk"))[:1]
    ['transformer.h.0.attn.c_attn.row_mults.0']
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn as nn

from gaugeopt.projection.projector import GaugeProjector
from gaugeopt.structure.site import AttentionSite

__all__ = ["vertical_reference", "project_reference"]


def vertical_reference(model: nn.Module, tensors: Mapping[str, torch.Tensor], sector: str, *,
                       sites: Sequence[AttentionSite] | None = None, rtol: float | None = None) -> dict[str, torch.Tensor]:
    """``GaugeProjector(model, sectors=(sector,)).vertical(tensors)``."""
    return GaugeProjector(model, sectors=(sector,), sites=sites, rtol=rtol).vertical(tensors)


def project_reference(model: nn.Module, tensors: Mapping[str, torch.Tensor], sector: str, *,
                      sites: Sequence[AttentionSite] | None = None, rtol: float | None = None,
                      inplace: bool = False) -> dict[str, torch.Tensor]:
    """``GaugeProjector(model, sectors=(sector,)).project(tensors, inplace=inplace)``."""
    return GaugeProjector(model, sectors=(sector,), sites=sites, rtol=rtol).project(tensors, inplace=inplace)
