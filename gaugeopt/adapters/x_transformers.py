"""x-transformers' ``Attention``: recognised and refused with the reasons.

Its grouped-query attention is *tiled* — query head ``i`` reads KV head ``i % h_kv``, not
``i // (h / h_kv)`` as everywhere else in gaugeopt — its default rotary width is half the head,
and dozens of options (memory key/values, value residuals, gates, QK norms) change the group.
gaugeopt does not support it; the refusal says so instead of the generic "no adapter".

Example:
    >>> from gaugeopt.adapters.x_transformers import X_TRANSFORMERS_ATTENTION
    >>> X_TRANSFORMERS_ATTENTION
    'x_transformers.x_transformers.Attention'
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.records.site import AttentionSite

__all__ = ["X_TRANSFORMERS_ATTENTION", "refuse_x_transformers"]

X_TRANSFORMERS_ATTENTION = "x_transformers.x_transformers.Attention"


def refuse_x_transformers(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    raise GaugeError(
        f"{name}: x-transformers' Attention is not supported: its grouped-query attention is tiled (query head i "
        "reads KV head i % kv_heads, while gaugeopt's records assume i // (heads / kv_heads)), its rotary width "
        "defaults to half the head, and many of its options (num_mem_kv, value residuals, gates, qk_norm, talking "
        "heads) change the gauge group. Use a model from a supported library, or describe your own attention "
        "class with gaugeopt.AttentionSpec and certify it (docs/adapters.md)"
    )
