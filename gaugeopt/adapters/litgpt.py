"""litgpt's ``CausalSelfAttention`` (``litgpt.model``; never imports litgpt).

Fused ``qkv = [Q|K|V]`` with ``n_head`` query heads and ``n_query_groups`` KV heads (MHA, GQA and
MQA alike; litgpt 0.5 converts old checkpoints' per-group layout to this one on load), output
``proj``, heads of width ``head_size``. RoPE rotates the first ``rope_n_elem =
rotary_percentage · head_size`` coordinates of each head (litgpt's default ``rotary_percentage``
is 0.25): split-half planes, or interleaved ones with ``rope_interleave=True``. Biases
(``bias``/``attn_bias``), sliding windows, logit soft-capping, ``attention_scores_scalar`` and
YaRN's ``mscale`` act on the scores or are scalars: they keep the gauge. ``norm_qk=True`` is
recognised and refused (:mod:`gaugeopt.adapters.qk_norm`).

Example:
    >>> from gaugeopt.adapters.litgpt import LITGPT_SPEC
    >>> LITGPT_SPEC.qkv, LITGPT_SPEC.fused, LITGPT_SPEC.o
    ('qkv', 'concat', 'proj')
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.adapters import qk_norm as qkn
from gaugeopt.records.rope import NO_ROPE, RopeSpec
from gaugeopt.adapters.spec import AttentionSpec, QKNormSpec

__all__ = ["LITGPT_ATTENTION", "LITGPT_SPEC"]

LITGPT_ATTENTION = "litgpt.model.CausalSelfAttention"


def _rope(m: nn.Module) -> RopeSpec:
    cfg = m.config
    n = int(cfg.rope_n_elem)
    if n == 0:
        return NO_ROPE
    return RopeSpec("interleaved" if getattr(cfg, "rope_interleave", False) else "split_half", n)


def _qk_norm(m: nn.Module) -> QKNormSpec | None:
    cfg = m.config
    if not cfg.norm_qk:
        return None
    kind = "layer" if isinstance(m.norm_q, nn.LayerNorm) else "rms"
    return QKNormSpec(kind, "norm_q", "norm_k", eps="norm_q.eps",
                      gain_offset=1.0 if getattr(m.norm_q, "add_unit_offset", False) else 0.0,
                      scope="full" if cfg.norm_qk_type == "olmo2" else "head")


LITGPT_SPEC = AttentionSpec(
    qkv="qkv", o="proj", num_heads="config.n_head", num_kv_heads="config.n_query_groups", head_dim="config.head_size",
    rope=_rope, qk_norm=_qk_norm, on_qk_norm=qkn.litgpt, kind="litgpt",
)
