"""torchmetrics metrics of gauge drift and vertical fraction: their public import path (docs/names.md).

The code lives in :mod:`gaugeopt.integrations.metrics`, which holds the same objects; import from here.
"""

from gaugeopt.integrations.metrics import QKDriftMetric, ScaleProductMetric, VerticalFractionMetric

__all__ = ["QKDriftMetric", "ScaleProductMetric", "VerticalFractionMetric"]
