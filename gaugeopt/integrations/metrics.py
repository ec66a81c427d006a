"""torchmetrics metrics for the gauge: drift, scale product, vertical fraction.

Each reduces correctly across DDP ranks (``dist_reduce_fx``):

==========================  =====================================  ======================
metric                      value                                  across ranks / updates
==========================  =====================================  ======================
:class:`QKDriftMetric`      ``max |log(s_Q/s_K)|`` (paper 002 eq. 3)  max
:class:`ScaleProductMetric` mean ``s_Q·s_K`` over heads              sum / count
:class:`VerticalFractionMetric` ``sqrt(Σ‖u_vert‖² / Σ‖u‖²)``          sums of squares
==========================  =====================================  ======================

The vertical fraction of several vectors (ranks' gradients, successive updates) is the ratio
of the *summed* squared norms, not the mean of ratios, so it is the vertical fraction of the
concatenated vector and independent of how the work is split over ranks.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.metrics import QKDriftMetric
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)))
    >>> m = QKDriftMetric()
    >>> m.update(model); m.update(torch.tensor(0.25))
    >>> float(m.compute())
    0.25
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn
from torchmetrics import Metric

from gaugeopt.fix.drift import drift_table, qk_drift

__all__ = ["QKDriftMetric", "ScaleProductMetric", "VerticalFractionMetric"]


class QKDriftMetric(Metric):
    """Largest Q/K drift seen (over updates and ranks). ``update(model)`` measures a model
    (paper 002 eq. 3, KV groups under GQA); ``update(tensor)`` takes precomputed drifts."""

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, granularity: str = "head", **kwargs) -> None:
        super().__init__(**kwargs)
        self.granularity = granularity
        self.add_state("value", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, model_or_drift: nn.Module | torch.Tensor) -> None:
        if isinstance(model_or_drift, nn.Module):
            d = torch.tensor(qk_drift(model_or_drift, granularity=self.granularity), dtype=torch.float64)
        else:
            d = torch.as_tensor(model_or_drift).max()
        self.value = torch.maximum(self.value, d.detach().to(self.value))

    def compute(self) -> torch.Tensor:
        return self.value


class ScaleProductMetric(Metric):
    """Mean gauge-invariant product ``s_Q·s_K`` over heads (and updates, and ranks)."""

    full_state_update = False
    is_differentiable = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, model_or_products: nn.Module | torch.Tensor) -> None:
        if isinstance(model_or_products, nn.Module):
            p = torch.cat([t.product.flatten() for t in drift_table(model_or_products)])
        else:
            p = torch.as_tensor(model_or_products).flatten()
        self.total += p.detach().to(self.total).sum()
        self.count += p.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp_min(1)


class VerticalFractionMetric(Metric):
    """``‖u_vert‖/‖u‖`` of all vectors seen, from summed squared norms.

    ``update(model, tensors)`` projects ``tensors`` (``{name: tensor}`` as in
    ``named_parameters()``: a gradient or an update) with a :class:`gaugeopt.GaugeProjector`
    (built once per model; ``sectors`` as there);
    ``update(vertical_sq=..., total_sq=...)`` takes precomputed squared norms.
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    def __init__(self, sectors: str = "auto", **kwargs) -> None:
        super().__init__(**kwargs)
        self.sectors = sectors
        self._projector = self._projector_model = None
        self.add_state("vertical_sq", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total_sq", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self,
        model: nn.Module | None = None,
        tensors: Mapping[str, torch.Tensor] | None = None,
        *,
        vertical_sq: torch.Tensor | float | None = None,
        total_sq: torch.Tensor | float | None = None,
    ) -> None:
        if model is not None:
            from gaugeopt.projection.projector import GaugeProjector
            from gaugeopt.projection.step import squared_norms

            if self._projector is None or self._projector_model is not model:
                self._projector, self._projector_model = GaugeProjector(model, self.sectors, "exact"), model
            given = {n: t for n, t in dict(tensors).items() if t is not None}
            vertical_sq, total_sq = squared_norms(self._projector.vertical(given), given)
        self.vertical_sq += torch.as_tensor(vertical_sq, dtype=torch.float64).to(self.vertical_sq.device)
        self.total_sq += torch.as_tensor(total_sq, dtype=torch.float64).to(self.total_sq.device)

    def compute(self) -> torch.Tensor:
        return (self.vertical_sq / self.total_sq.clamp_min(torch.finfo(torch.float64).tiny)).sqrt()
