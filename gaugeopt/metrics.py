"""torchmetrics metrics of gauge drift and vertical fraction; see :mod:`gaugeopt.integrations.metrics`."""

from gaugeopt.integrations.metrics import QKDriftMetric, ScaleProductMetric, VerticalFractionMetric

__all__ = ["QKDriftMetric", "ScaleProductMetric", "VerticalFractionMetric"]
