"""What the fused GaugeFix balances: tensors described by views, sides, powers — and the checks on them.

:class:`FixPair` is one pair of one layer (its Q/K or V/O gauge): the member tensors of both sides
as :class:`FixTensor` views, ``groups`` independent factors per slot, ``width`` channels and the
slot of each channel. The kernel (:mod:`.fused`) and the plain-torch reference (:mod:`.naive`)
take the same list of pairs and :func:`check_pairs` refuses, before anything is read or written,
what neither could do right.

Example:
    >>> import torch
    >>> from gaugeopt.kernels.gaugefix.spec import FixPair, FixTensor, check_pairs
    >>> r_q, r_k = torch.ones(2, 4), torch.ones(1, 4)   # 2 query heads read 1 KV head
    >>> pair = FixPair([FixTensor(r_q, 0), FixTensor(r_k, 1)], groups=1, width=4, slot=[0, 0, 1, 1],
    ...                n_slots=2, repeat_a=2, repeat_b=1)
    >>> check_pairs([pair])
    >>> FixTensor(r_k, 0).geometry   # (stride_head, stride_chan, stride_col, n_cols)
    (4, 1, 0, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gaugeopt.errors import GaugeError

__all__ = ["FixTensor", "FixPair", "SUPPORTED_DTYPES", "CHANGED_ULPS", "check_pairs", "accumulation_dtype"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CHANGED_ULPS = 4  # must equal gaugeopt.fix.balance.CHANGED_ULPS (a test checks it)


@dataclass
class FixTensor:
    """One tensor of one side of a pair.

    Attributes:
        view: ``(heads, width)`` (a multiplier or bias), ``(heads, width, n_cols)`` (rows), or
            ``(n_cols, heads, width)`` with ``columns=True`` (the O weight); it aliases the storage.
        side: 0 for side a (divided by ``g``), 1 for side b (multiplied).
        power: 0 for a parameter; ``k`` for an optimizer-state tensor divided by ``factor**k``.
        columns: the channels are the last two axes (the O weight).
    """

    view: torch.Tensor
    side: int
    power: int = 0
    columns: bool = False

    @property
    def geometry(self) -> tuple[int, int, int, int]:
        """``(stride_head, stride_chan, stride_col, n_cols)`` of the view."""
        v = self.view
        if v.dim() == 2:
            return v.stride(0), v.stride(1), 0, 1
        if self.columns:
            return v.stride(1), v.stride(2), v.stride(0), v.shape[0]
        return v.stride(0), v.stride(1), v.stride(2), v.shape[2]

    @property
    def heads_width(self) -> tuple[int, int]:
        """``(heads, width)`` of the view."""
        v = self.view
        return (v.shape[1], v.shape[2]) if (self.columns and v.dim() == 3) else (v.shape[0], v.shape[1])


@dataclass
class FixPair:
    """One pair to balance: its tensors (parameters first, then states), ``groups`` independent
    factors per slot, ``width`` channels, ``slot[c]`` the slot of channel ``c`` and the heads per
    group on each side (``repeat_a``, ``repeat_b``)."""

    tensors: list[FixTensor]
    groups: int
    width: int
    slot: list[int]
    n_slots: int
    repeat_a: int
    repeat_b: int

    @property
    def params(self) -> list[FixTensor]:
        return [t for t in self.tensors if t.power == 0]

    @property
    def states(self) -> list[FixTensor]:
        return [t for t in self.tensors if t.power != 0]


def accumulation_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Statistics and factors are computed in float64 for float64 parameters, in float32 otherwise."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def check_pairs(pairs: Sequence[FixPair]) -> None:
    """Raise :class:`~gaugeopt.GaugeError` naming the pair and tensor unless every pair is one the
    kernel and the reference balance right: both sides present, views of the stated shape, the
    slots a partition of the channels, supported dtypes (one per pair's parameters, one per its
    states), state powers 1 or 2, one device."""
    if not pairs:
        raise GaugeError("gauge fix kernel: pairs is empty; describe at least one pair")
    devices = set()
    for i, pair in enumerate(pairs):
        where = f"gauge fix kernel: pairs[{i}]"
        if pair.groups < 1 or pair.width < 1 or pair.repeat_a < 1 or pair.repeat_b < 1:
            raise GaugeError(f"{where}: groups={pair.groups}, width={pair.width}, repeat_a={pair.repeat_a}, "
                             f"repeat_b={pair.repeat_b} must all be positive")
        if len(pair.slot) != pair.width or not all(0 <= s < pair.n_slots for s in pair.slot) \
                or len(set(pair.slot)) != pair.n_slots:
            raise GaugeError(f"{where}: slot={list(pair.slot)} must give each of the {pair.width} channels one of "
                             f"n_slots={pair.n_slots} slots, every slot used")
        if {t.side for t in pair.params} != {0, 1}:
            raise GaugeError(f"{where}: each side (0 and 1) needs at least one parameter tensor (power 0)")
        if any(t.power not in (0, 1, 2) for t in pair.tensors):
            raise GaugeError(f"{where}: state powers {sorted({t.power for t in pair.tensors})}; the kernel takes 1 and 2")
        if any(t.power != 0 for t in pair.tensors[:len(pair.params)]):
            raise GaugeError(f"{where}: list the parameters (power 0) before the optimizer state")
        for t in pair.tensors:
            heads, width = t.heads_width
            want = pair.groups * (pair.repeat_a if t.side == 0 else pair.repeat_b)
            if t.view.dim() not in (2, 3) or width != pair.width or heads != want:
                raise GaugeError(f"{where}: a side-{t.side} tensor has shape {tuple(t.view.shape)} "
                                 f"(columns={t.columns}); expected {want} heads of width {pair.width}")
            if t.view.dtype not in SUPPORTED_DTYPES:
                raise GaugeError(f"{where}: a tensor has dtype {t.view.dtype}; supported: {SUPPORTED_DTYPES}")
            devices.add(t.view.device)
        for what, group in (("parameters", pair.params), ("states", pair.states)):
            if len({t.view.dtype for t in group}) > 1:
                raise GaugeError(f"{where}: the {what} mix dtypes {sorted(str(t.view.dtype) for t in group)}")
    if len(devices) > 1:
        raise GaugeError(f"gauge fix kernel: tensors on several devices {sorted(map(str, devices))}")
