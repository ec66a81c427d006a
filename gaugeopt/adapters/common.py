"""Checks shared by the adapters."""

from __future__ import annotations

from gaugeopt.errors import GaugeError
from gaugeopt.adapters.spec import require_stock_forward

__all__ = ["refuse", "require_stock_forward"]


def refuse(name: str, feature: str, hint: str = "") -> GaugeError:
    msg = f"{name}: {feature} changes the attention gauge group and is not handled by this adapter"
    return GaugeError(msg + (f"; {hint}" if hint else ""))
