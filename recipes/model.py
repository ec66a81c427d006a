"""Build the recipe's model: the project's GPT (GPT-2 by default) with learnable multipliers.

``build_model(cfg)`` returns ``gaugeopt.models.GPT(cfg.gpt_config())`` initialised as GPT-2/nanoGPT
(normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2·n_layer), zero biases, tied
output head), then, when ``cfg.lrm`` is true, converts every linear layer to an
:class:`gaugeopt.LRMLinear` ``W = diag(r)·W̄·diag(c)`` with ``r = c = 1`` (Velikanov et al.; paper
002 eq. 1) — so the function at initialisation is the plain GPT's.  The fused ``c_attn`` gets one
``r``/``c`` pair per Q, K and V block, which the Q/K gauge and conditions A/B/C need.  The tied
output head keeps no multipliers (its weight is the embedding).  GPT-2 124M gains 165,888
multiplier parameters this way (paper 002: "170K").

Example::

    >>> from recipes.config import ModelConfig
    >>> from recipes.model import build_model, count_parameters
    >>> model = build_model(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    >>> counts = count_parameters(model)
    >>> counts["multipliers"]  # per layer: c_attn 3·32 + 3·32, attn c_proj 2·32, c_fc 4·32 + 32, mlp c_proj 32 + 4·32
    1152
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt import LRMLinear, apply_lrm
from gaugeopt.models import GPT

from .config import ModelConfig

__all__ = ["build_model", "count_parameters", "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (nanoGPT: 50257 → 50304)."""
    return -(-vocab_size // multiple) * multiple


def build_model(cfg: ModelConfig, vocab_size: int | None = None) -> GPT:
    """The GPT of ``cfg`` (LRM applied when ``cfg.lrm``).

    Args:
        cfg: architecture.
        vocab_size: overrides ``cfg.vocab_size`` (needed when that is ``None``: "from the data").
    """
    gpt_cfg = cfg.gpt_config(vocab_size)
    if gpt_cfg.vocab_size is None:
        raise ValueError("build_model: model.vocab_size is null; pass vocab_size (the data's, padded)")
    model = GPT(gpt_cfg)
    if cfg.lrm:
        apply_lrm(model)
    return model


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts: ``total`` (shared tensors once), ``multipliers`` (LRM r and c), ``base``."""
    mult_ids = {id(p) for m in model.modules() if isinstance(m, LRMLinear) for p in (*m.row_mults, *m.col_mults)}
    seen: dict[int, int] = {id(p): p.numel() for p in model.parameters()}
    mult = sum(n for i, n in seen.items() if i in mult_ids)
    total = sum(seen.values())
    return {"total": total, "multipliers": mult, "base": total - mult}
