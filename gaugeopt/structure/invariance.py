"""Numerical checks that a model's gauge is what gaugeopt thinks it is.

Use these on your own architecture after registering an adapter: every valid gauge action
must leave the outputs unchanged to rounding, every invalid control must change them.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.structure.invariance import check_invariance, randomize_parameters
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, rope="split_half")).double()
    >>> randomize_parameters(model, torch.Generator().manual_seed(0))
    >>> x = torch.randint(0, 64, (2, 16))
    >>> report = check_invariance(model, lambda m: m(x)[0])
    >>> report["valid"] < 1e-12 and min(report["invalid"].values()) > 1e-3
    True
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn as nn

from gaugeopt.structure.actions import (
    applicable_invalid_kinds, invalid_gauge_transform, random_gauge_transform, relative_change,
)
from gaugeopt.errors import GaugeError
from gaugeopt.structure.lrm import LRMLinear
from gaugeopt.structure.registry import find_attention

__all__ = ["randomize_parameters", "check_invariance"]


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


def check_invariance(
    model: nn.Module,
    forward: Callable[[nn.Module], torch.Tensor],
    *,
    kinds: Sequence[str] | str = "all",
    invalid: Sequence[str] | None = None,
    trials: int = 3,
    generator: torch.Generator | None = None,
) -> dict:
    """Apply random valid and invalid gauge transforms to copies of ``model`` and measure outputs.

    Args:
        model: the model (not modified); float64 gives the sharpest separation.
        forward: ``model -> output tensor`` (e.g. ``lambda m: m(x).logits``).
        kinds: valid kinds for :func:`gaugeopt.random_gauge_transform`.
        invalid: invalid control kinds (default: all that apply to the model).
        trials: random valid transforms to try.

    Returns:
        ``{"valid": max relative change over the trials, "invalid": {kind: relative change}}``.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    sites = find_attention(model)
    with torch.no_grad():
        ref = forward(model)
        valid = 0.0
        for _ in range(trials):
            moved = random_gauge_transform(copy.deepcopy(model), kinds, generator=g)
            valid = max(valid, relative_change(ref, forward(moved)))
        if invalid is None:
            invalid = applicable_invalid_kinds(sites)
        bad = {}
        for kind in invalid:
            try:
                moved = invalid_gauge_transform(copy.deepcopy(model), kind, generator=g)
            except GaugeError:
                continue
            bad[kind] = relative_change(ref, forward(moved))
    return {"valid": valid, "invalid": bad}
