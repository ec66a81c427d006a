"""Lightning callbacks (``Trainer(callbacks=[GaugeFix(every=100)])``): their public import path (docs/names.md).

The code lives in :mod:`gaugeopt.integrations.lightning`, which holds the same objects; import from here.
"""

from gaugeopt.integrations.lightning import GaugeFix, GaugeMonitor, GaugeProjection, QKClip

__all__ = ["GaugeFix", "GaugeMonitor", "GaugeProjection", "QKClip"]
