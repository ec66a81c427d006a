"""Generic random parameters, so that no gauge check passes by accident.

A freshly initialised model is too symmetric to test a gauge claim (zero biases, unit gains and
multipliers hide layout errors): :func:`randomize_parameters` gives every parameter a generic
value first. The numerical check of a record itself is :func:`gaugeopt.certify`.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.trust.invariance import randomize_parameters
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)))
    >>> randomize_parameters(model, torch.Generator().manual_seed(0))
    >>> bool((model.transformer.h[0].attn.c_attn.row_mults[0] != 1).all())
    True
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gaugeopt.models.lrm import LRMLinear

__all__ = ["randomize_parameters"]


@torch.no_grad()
def randomize_parameters(model: nn.Module, generator: torch.Generator | None = None, *, multiplier_spread: float = 0.3) -> None:
    """Give every parameter a generic random value, so that no gauge check passes by accident.

    Matrices get ``N(0, 1/fan_in)`` (attention scores of order one, so an invalid gauge
    visibly changes the softmax), embeddings ``N(0, 1)``, biases ``N(0, 0.5²)``, norm gains
    ``1 + N(0, 0.1²)`` and LRM multipliers ``exp(N(0, spread²))`` — zero biases and unit
    multipliers would hide layout bugs.
    """
    mult_ids = {id(p) for m in model.modules() if isinstance(m, LRMLinear) for p in (*m.row_mults, *m.col_mults)}
    for name, p in model.named_parameters():
        z = torch.randn(p.shape, generator=generator, dtype=torch.float64)
        owner = _owner(model, name)
        kind = type(owner).__name__.lower()
        if id(p) in mult_ids:
            v = torch.exp(z * multiplier_spread)
        elif isinstance(owner, nn.Embedding):
            v = z
        elif "norm" in kind:
            v = 1 + 0.1 * z if name.endswith("weight") else 0.1 * z
        elif p.dim() >= 2:
            fan_in = p.shape[0] if kind == "conv1d" else p.shape[-1]
            v = z / fan_in**0.5
        else:
            v = 0.5 * z
        p.copy_(v.to(p))


def _owner(model: nn.Module, name: str) -> nn.Module:
    parent = name.rpartition(".")[0]
    return model.get_submodule(parent) if parent else model
