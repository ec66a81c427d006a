"""What the closed-form projection kernels take: one layer's tensors as views, and the checks on them.

* :class:`DiagonalSite` — a diagonal multiplier gauge (``lrm_qk``: ``r_Q`` vs ``r_K``; ``lrm_vo``:
  ``r_V`` vs ``c_O``) of one layer: the two sides' multipliers, the field ``u`` and the output
  at the same positions, and the slot (channel or RoPE plane) of each channel.
* :class:`PlaneSite` — the RoPE-plane ``qk`` sector of one full-rotary layer: the member tensors of
  each side (rows ``[W̄ | b̄]`` of the query heads, of the key head) as :class:`PlaneMember` s, the
  optional row multipliers (the twists) and the planes ``(p, q)``.

The field and the output of a tensor are addressed with the parameter's strides, so they must
have them (:func:`check_diagonal`, :func:`check_planes` say so before anything is read). The
kernels (:mod:`.fused`) and the plain-torch references (:mod:`.naive`) take the same lists.

Example:
    >>> import torch
    >>> from gaugeopt.kernels.projection.spec import DiagonalSite, check_diagonal
    >>> r_q, r_k = torch.ones(4, 6), torch.ones(2, 6)      # 4 query heads in 2 KV groups, d_k = 6
    >>> site = DiagonalSite(r_q, r_k, torch.zeros(4, 6), torch.zeros(2, 6), torch.zeros(4, 6), torch.zeros(2, 6),
    ...                     groups=2, repeat_a=2, repeat_b=1, slot=[0, 1, 2, 0, 1, 2], n_slots=3)
    >>> check_diagonal([site])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from gaugeopt.errors import GaugeError

__all__ = ["SUPPORTED_DTYPES", "DiagonalSite", "PlaneMember", "PlaneSite", "accumulation_dtype", "check_diagonal",
           "check_planes"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass
class DiagonalSite:
    """One layer of a diagonal multiplier gauge, per KV group ``j`` and slot ``m``:
    ``t = (Σ a·u_a − Σ b·u_b) / (Σ a² + Σ b²)``, ``v_a = t·a``, ``v_b = −t·b``.

    Attributes:
        a, b: ``(groups·repeat_a, width)`` and ``(groups·repeat_b, width)`` multipliers.
        u_a, u_b: the field at the same entries (the same shapes and strides).
        out_a, out_b: where ``v`` (or ``u − v``) is written (the same shapes and strides).
        groups: independent coefficients per slot (KV groups).
        repeat_a, repeat_b: heads per group on each side.
        slot: ``(width,)`` slot of each channel (a channel, or a RoPE plane's two channels).
        n_slots: number of slots.
    """

    a: torch.Tensor
    b: torch.Tensor
    u_a: torch.Tensor
    u_b: torch.Tensor
    out_a: torch.Tensor
    out_b: torch.Tensor
    groups: int
    repeat_a: int
    repeat_b: int
    slot: Sequence[int]
    n_slots: int

    @property
    def width(self) -> int:
        return self.a.shape[1]


@dataclass
class PlaneMember:
    """One tensor of one side: ``param`` rows ``(heads, width, n_cols)`` (a weight's head blocks) or
    ``(heads, width)`` (a bias), the field ``u`` and the output with the same shape and strides."""

    param: torch.Tensor
    u: torch.Tensor
    out: torch.Tensor


@dataclass
class PlaneSite:
    """The RoPE commutant ``a·I + b·J`` per plane and KV group of one layer (formula in :mod:`.naive`).

    Attributes:
        a, b: side A's members (the query heads' rows and biases), side B's (the key head's).
        twist_a, twist_b: ``(heads, width)`` row multipliers of each side (``None``: none).
        planes: the rows ``(p, q)`` of each RoPE plane (every channel in one plane).
        groups: KV groups; ``repeat_a``, ``repeat_b``: heads per group on each side.
    """

    a: list[PlaneMember]
    b: list[PlaneMember]
    planes: Sequence[tuple[int, int]]
    groups: int
    repeat_a: int
    repeat_b: int
    twist_a: torch.Tensor | None = None
    twist_b: torch.Tensor | None = None
    width: int = field(init=False)

    def __post_init__(self) -> None:
        self.width = self.a[0].param.shape[1] if self.a else 0


def accumulation_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """float64 when any input is float64, float32 otherwise: the dtype of every reduction and solve."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_triple(where: str, p: torch.Tensor, u: torch.Tensor, o: torch.Tensor, dtypes: list, devices: set) -> None:
    for what, t in (("field", u), ("output", o)):
        if tuple(t.shape) != tuple(p.shape) or t.stride() != p.stride():
            raise GaugeError(f"{where}: the {what} has shape {tuple(t.shape)} and strides {t.stride()}; the kernel "
                             f"addresses it with the parameter's {tuple(p.shape)}, {p.stride()} (copy it to that layout)")
    for t in (p, u, o):
        if t.dtype not in SUPPORTED_DTYPES:
            raise GaugeError(f"{where}: dtype {t.dtype} is not supported ({SUPPORTED_DTYPES})")
        devices.add(t.device)
    dtypes.append((p.dtype, u.dtype, o.dtype))


def _check_sites(op: str, sites: Sequence, check_site) -> None:
    """Run ``check_site(where, site, dtypes, devices)`` on each site, then the checks across them: one
    parameter dtype and one field dtype (the output's) per launch, one device."""
    if not sites:
        raise GaugeError(f"{op}: sites is empty")
    dtypes: list = []
    devices: set = set()
    for i, s in enumerate(sites):
        check_site(f"{op}: sites[{i}]", s, dtypes, devices)
    if len({d[0] for d in dtypes}) > 1 or len({d[1:] for d in dtypes}) > 1 or any(d[1] != d[2] for d in dtypes):
        raise GaugeError(f"{op}: one launch takes one parameter dtype and one field dtype (the output's); got "
                         f"{sorted({tuple(map(str, d)) for d in dtypes})}")
    if len(devices) > 1:
        raise GaugeError(f"{op}: tensors on several devices {sorted(map(str, devices))}")


def _diagonal_site(where: str, s: DiagonalSite, dtypes: list, devices: set) -> None:
    for side, p, rep in (("a", s.a, s.repeat_a), ("b", s.b, s.repeat_b)):
        if p.dim() != 2 or p.shape[0] != s.groups * rep or p.shape[1] != s.width:
            raise GaugeError(f"{where}: side {side} has shape {tuple(p.shape)}; expected ({s.groups}·{rep}, {s.width})")
    if len(s.slot) != s.width or not all(0 <= m < s.n_slots for m in s.slot):
        raise GaugeError(f"{where}: slot={list(s.slot)} must give each of the {s.width} channels a slot < {s.n_slots}")
    _check_triple(f"{where} side a", s.a, s.u_a, s.out_a, dtypes, devices)
    _check_triple(f"{where} side b", s.b, s.u_b, s.out_b, dtypes, devices)


def _plane_site(where: str, s: PlaneSite, dtypes: list, devices: set) -> None:
    if not s.a or not s.b:
        raise GaugeError(f"{where}: each side needs at least one member")
    if sorted(c for pq in s.planes for c in pq) != list(range(s.width)):
        raise GaugeError(f"{where}: planes={list(s.planes)} must cover each of the {s.width} channels once")
    for side, members, rep, tw in (("a", s.a, s.repeat_a, s.twist_a), ("b", s.b, s.repeat_b, s.twist_b)):
        heads = s.groups * rep
        for k, m in enumerate(members):
            p = m.param
            if p.dim() not in (2, 3) or p.shape[0] != heads or p.shape[1] != s.width:
                raise GaugeError(f"{where}: member {k} of side {side} has shape {tuple(p.shape)}; expected "
                                 f"({heads}, {s.width}[, columns])")
            _check_triple(f"{where} side {side} member {k}", p, m.u, m.out, dtypes, devices)
        if tw is not None and (tuple(tw.shape) != (heads, s.width) or tw.dtype != members[0].param.dtype):
            raise GaugeError(f"{where}: twist_{side} has shape {tuple(tw.shape)} and dtype {tw.dtype}; expected "
                             f"({heads}, {s.width}) in the parameters' dtype")


def check_diagonal(sites: Sequence[DiagonalSite]) -> None:
    """Raise :class:`~gaugeopt.GaugeError` naming the site unless the kernel and the reference can take
    ``sites``: shapes ``(groups·repeat, width)``, a slot per channel, the parameter's strides for the
    field and the output, one parameter dtype and one field dtype, one device."""
    _check_sites("project_diagonal", sites, _diagonal_site)


def check_planes(sites: Sequence[PlaneSite]) -> None:
    """Raise :class:`~gaugeopt.GaugeError` naming the site unless the kernel and the reference can take
    ``sites``: members ``(groups·repeat, width[, n_cols])``, planes that cover every channel once,
    twists ``(heads, width)`` in the parameters' dtype, the parameter's strides for the field and the
    output, one parameter dtype and one field dtype, one device."""
    _check_sites("project_planes", sites, _plane_site)
