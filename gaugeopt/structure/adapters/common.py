"""Checks shared by the adapters."""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.errors import GaugeError


def require_stock_forward(name: str, module: nn.Module) -> None:
    """Refuse a module whose ``forward`` is not the one its class defines.

    An adapter is written against one ``forward``; an instance-level override or a patched
    class method may compute something else (extra scaling, per-head norms, adapters), and
    the gauge would then silently change the function.
    """
    cls = type(module)
    if "forward" in vars(module):
        raise GaugeError(f"{name}: forward was overridden on the instance; gaugeopt cannot vouch for its gauge group")
    fwd = getattr(cls, "forward", None)
    if fwd is None or getattr(fwd, "__module__", None) != cls.__module__ or not fwd.__qualname__.startswith(cls.__name__ + "."):
        where = f"{getattr(fwd, '__module__', '?')}.{getattr(fwd, '__qualname__', '?')}"
        raise GaugeError(
            f"{name}: {cls.__qualname__}.forward is {where}, not the implementation the adapter was written for "
            "(patched by another library?); register your own adapter with gaugeopt.register_adapter"
        )


def refuse(name: str, feature: str, hint: str = "") -> GaugeError:
    msg = f"{name}: {feature} changes the attention gauge group and is not handled by this adapter"
    return GaugeError(msg + (f"; {hint}" if hint else ""))
