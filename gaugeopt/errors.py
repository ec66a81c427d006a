"""The one exception type gaugeopt raises when it refuses an input.

Every refusal (an attention layout it cannot prove it understands, a gauge action that
would change the function, a misconfigured callback) is a :class:`GaugeError` whose
message names the argument or model feature, the value seen and what to do instead.
"""

from __future__ import annotations

__all__ = ["GaugeError"]


class GaugeError(ValueError):
    """Raised when gaugeopt refuses a model, an argument or an operation.

    Subclasses :class:`ValueError` so that generic input-validation handlers catch it.

    Example:
        >>> import torch.nn as nn, gaugeopt
        >>> try:
        ...     gaugeopt.find_attention(nn.Linear(4, 4))
        ... except gaugeopt.GaugeError as e:
        ...     print("refused")
        refused
    """
