"""Lightning callbacks (``Trainer(callbacks=[GaugeFix(every=100)])``); see :mod:`gaugeopt.integrations.lightning`."""

from gaugeopt.integrations.lightning import GaugeFix, GaugeMonitor, GaugeProjection, QKClip

__all__ = ["GaugeFix", "GaugeMonitor", "GaugeProjection", "QKClip"]
