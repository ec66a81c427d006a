"""Row views of one side of a gauge pair, and the per-group sums the dense and plane solves share.

A side of a :class:`~gaugeopt.records.pair.GaugePair` (the query heads' rows and biases, the key
head's, the V rows, the O columns) is read from any tensor store — the weights at θ, the vector
field, the output — as :class:`Rows`: the weight's canonical rows ``(heads, n, m)`` (the O columns
transposed, a view) and the bias ``(heads, n)``. Heads are grouped ``k`` per KV group:
:func:`grouped_sum` sums a group's heads, :func:`per_head` hands a group's value to each of them.

Example:
    >>> import torch
    >>> from gaugeopt.projection.rows import grouped_sum, per_head
    >>> x = torch.arange(6.0).reshape(6, 1)          # 6 heads, 3 per group
    >>> grouped_sum(x, 3).flatten().tolist(), per_head(torch.tensor([[1.0], [2.0]]), 3).flatten().tolist()
    ([3.0, 12.0], [1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gaugeopt.records.pair import PairSide

__all__ = ["Rows", "rows", "sel", "sel_rows", "grouped_sum", "per_head", "zero_coef"]


@dataclass
class Rows:
    """One side of one site in some tensor store: rows ``(heads, n, m)`` and bias ``(heads, n)``."""

    W: torch.Tensor
    b: torch.Tensor | None


def rows(side: PairSide, acc) -> Rows:
    """``side`` read through ``acc`` (``ref -> tensor`` of a store)."""
    return Rows(side.rows(acc(side.weight)), None if side.bias is None else acc(side.bias))


def sel(t: torch.Tensor | None, idx: slice, dim: int = 1):
    """``t`` restricted to the rows ``idx`` along ``dim`` (a view)."""
    return None if t is None else t[(slice(None),) * dim + (idx,)]


def sel_rows(r: Rows, idx) -> Rows:
    """The rows ``idx`` of a side, weight and bias (views)."""
    return Rows(sel(r.W, idx), sel(r.b, idx))


def grouped_sum(t: torch.Tensor, k: int) -> torch.Tensor:
    """``(heads, ...) → (heads / k, ...)``: the sum over the ``k`` heads of each group."""
    return t if k == 1 else t.reshape(t.shape[0] // k, k, *t.shape[1:]).sum(1)


def per_head(t: torch.Tensor, k: int) -> torch.Tensor:
    """``(groups, ...) → (groups·k, ...)``: the group's value for each of its ``k`` heads."""
    return t if k == 1 else t[:, None].expand(t.shape[0], k, *t.shape[1:]).reshape(-1, *t.shape[1:])


def zero_coef(pt) -> torch.Tensor:
    """Zero Lie-algebra coordinates ``(groups, n, n)`` of one site at θ (``pt``: a dense sector's point)."""
    return torch.zeros(pt.st.groups, pt.st.n, pt.st.n, dtype=pt.A.W.dtype, device=pt.A.W.device)
