"""GaugeFix in one Triton launch: statistics, factors, parameter and Adam-state rescale, drift.

The torch backend (:mod:`gaugeopt.fix.torch_backend`) reads the per-channel mean squares of every
side, stacks them, balances them and rescales parameters and optimizer state tensor by tensor —
hundreds of small launches for a GPT-2. Here one program owns one group ``j`` of one pair (a
layer's Q/K or V/O gauge) and does all of it::

    pass 1  acc[c]  = Σ_{heads of j on side a} Σ_x X[head, c, x]²        (float32, float64 for fp64)
            s_a[s]  = sqrt( Σ_{c∈s} acc[c] / len_a / (|s|·n_a) )          likewise s_b
            g       = sqrt((s_a + ε)/(s_b + ε)),   m = magnitude factor      (eq. 4, paper 002)
    pass 2  X_a ← X_a · m/g,  X_b ← X_b · m·g                                (every member tensor)
            M_a ← M_a / (1/g)^k,  M_b ← M_b / g^k                            (state, k = 1 or 2)
    out     drift before/after, scale product before/after, "changed" per group
            (|m/g − 1| > 4·ε_mach in some slot: the rule of gaugeopt.fix.balance.changed_groups)

``X[head, c, x]`` is a tensor's view as ``(heads, width, n_cols)`` rows: the row block and its
bias, or the multiplier with ``n_cols = 1``; an O weight is read through its columns. A group's
statistics must be complete before any write, and groups never share memory, so one program per
group needs no cross-program synchronisation and the launch needs no host synchronisation at all.
Tensors are reached through a **descriptor table** (int64 base address, side, strides, columns,
state power) rather than by packing them into a buffer: packing would cost a copy in and out of
every weight in plain mode, the table costs a few hundred bytes. The pointer element type is a
compile-time constant, hence one launch per (parameter dtype, state dtype, layout) group — in
practice one launch per model.

Precision: reductions and factors in float32 (float64 for float64 parameters), one rounding per
stored element (the factor is not rounded to a bf16/fp16 parameter's dtype before the product),
IEEE-rounded division and square root (``div_rn``/``sqrt_rn``) so that the factors match the
torch backend to the last bits in float32.

This module is the kernel and its launcher: :func:`prepare` checks the pairs
(:func:`~.spec.check_pairs`) and packs the tables once, :meth:`PreparedFix.run` launches. What to
balance is described in :mod:`.spec`; the same numbers and writes in plain torch, pair by pair,
are :func:`.naive.fix_naive` (the kernel's reference in the tests). The host side that turns a
model's plans into pairs (state classification, the report) is :mod:`gaugeopt.fix.triton_backend`.

Example (on CUDA tensors; on CPU only with ``TRITON_INTERPRET=1`` set before this module is
imported, which is how ``tests/kernels/kernels_interpreter_cases.py`` runs it):
    >>> import torch
    >>> from gaugeopt.kernels.gaugefix import FixPair, FixTensor, prepare
    >>> r_q, r_k = torch.full((2, 4), 2.0), torch.full((1, 4), 0.5)   # 2 query heads read 1 KV head
    >>> pair = FixPair([FixTensor(r_q, 0, 0), FixTensor(r_k, 1, 0)], groups=1, width=4, slot=[0, 0, 0, 0],
    ...                n_slots=1, repeat_a=2, repeat_b=1)
    >>> (numbers,) = prepare([pair]).run()
    >>> r_q[0, 0].item(), r_k[0, 0].item(), round(float(numbers[0][0, 0]), 4), bool(numbers[4][0])
    (1.0, 1.0, 1.3863, True)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import torch
import triton
import triton.language as tl

from gaugeopt.kernels.gaugefix.spec import CHANGED_ULPS, FixPair, FixTensor, accumulation_dtype, check_pairs

__all__ = ["PreparedFix", "prepare"]

# descriptor table fields (int64): one row per (pair, tensor); parameters first, then states
_D_ADDR, _D_SIDE, _D_SH, _D_SC, _D_SX, _D_NCOLS, _D_POW = range(7)
_DF = 8
# pair table fields (int64): one row per pair
_P_D0, _P_D1, _P_D2, _P_WIDTH, _P_NSLOTS, _P_SLOT, _P_OUT, _P_NA, _P_NB, _P_LENA, _P_LENB = range(11)
_PF = 12
# layouts of the (channel, column) tile, a compile-time constant per launch
_GENERIC, _COLS_CONTIG, _CHANS_CONTIG = 0, 1, 2
_N_OUT = 4  # drift_before, drift_after, product_before, product_after

# elements of one (channel, column) tile: BLOCK_X = min(next_pow2(columns), _TILE_ELEMS // BLOCK_C)
_TILE_ELEMS = 4096

_TL = {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---------------------------------------------------------------------- device code
@triton.jit
def _div(a, b, IEEE32: tl.constexpr):
    if IEEE32:
        return tl.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _sqrt(a, IEEE32: tl.constexpr):
    if IEEE32:
        return tl.sqrt_rn(a)
    else:
        return tl.sqrt(a)


@triton.jit
def _desc(desc_tab, d, n_a, n_b):
    """One descriptor row: (address, side, stride_head, stride_chan, stride_col, n_cols, power, heads per group)."""
    drow = desc_tab + d * 8
    side = tl.load(drow + 1)
    n = tl.where(side == 0, n_a, n_b)
    return (tl.load(drow + 0), side, tl.load(drow + 2), tl.load(drow + 3), tl.load(drow + 4), tl.load(drow + 5),
            tl.load(drow + 6), n)


@triton.jit
def _tile(c, xr, sc, sx, LAYOUT: tl.constexpr):
    """Offsets of a (channel, column) tile; a unit stride is spelled out so the compiler can vectorise."""
    return c[:, None] * (1 if LAYOUT == 2 else sc) + xr[None, :] * (1 if LAYOUT == 1 else sx)


@triton.jit
def _rescale(desc_tab, d, j, n_a, n_b, f_a, f_b, c, cmask, xr, T: tl.constexpr, ACC_T: tl.constexpr,
             IEEE32: tl.constexpr, LAYOUT: tl.constexpr, STATE: tl.constexpr, BLOCK_X: tl.constexpr):
    """Pass 2 on one tensor of group ``j``: a parameter times its side's factor, or (``STATE``) an
    optimizer-state tensor divided by the factor to its power."""
    addr, side, sh, sc, sx, ncols, power, n = _desc(desc_tab, d, n_a, n_b)
    f = tl.where(side == 0, f_a, f_b)
    if STATE:
        f = tl.where(cmask, tl.where(power == 2, f * f, f), 1.0)  # 1 on padding: no 0/0
    f = f[:, None]
    base = addr.to(tl.pointer_type(T)) + j * n * sh
    offs = _tile(c, xr, sc, sx, LAYOUT)
    for hh in range(0, n):
        for x0 in range(0, ncols, BLOCK_X):
            m = cmask[:, None] & ((x0 + xr) < ncols)[None, :]
            ptr = base + (hh * sh + x0 * sx) + offs
            v = tl.load(ptr, mask=m, other=0.0).to(ACC_T)
            if STATE:
                v = _div(v, f, IEEE32)
            else:
                v = v * f
            tl.store(ptr, v.to(T), mask=m)


@triton.jit
def _gaugefix_kernel(
    unit_tab,  # (n_units, 2) int64: plan, KV group
    plan_tab,  # (n_plans, _PF) int64
    desc_tab,  # (n_desc, _DF) int64
    slot_tab,  # (Σ width,) int32: slot of each channel, per plan
    scal,  # (5,) ACC: eps, magnitude (sqrt(1 - decay)), product_max, smallest normal, "changed" tolerance
    out,  # (4, n_out) ACC
    unit_changed,  # (n_units,) int32: bit 0 when some factor of the group differs from 1, bit 1 when a slot was not finite
    n_out,
    PARAM_T: tl.constexpr,
    STATE_T: tl.constexpr,
    ACC_T: tl.constexpr,
    IEEE32: tl.constexpr,
    LAYOUT: tl.constexpr,
    HAS_MAX: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    u = tl.program_id(0)
    p = tl.load(unit_tab + 2 * u)
    j = tl.load(unit_tab + 2 * u + 1)
    prow = plan_tab + p * 12
    d0 = tl.load(prow + 0)
    d1 = tl.load(prow + 1)
    d2 = tl.load(prow + 2)
    width = tl.load(prow + 3)
    n_slots = tl.load(prow + 4)
    slot_off = tl.load(prow + 5)
    out_off = tl.load(prow + 6)
    n_a = tl.load(prow + 7)
    n_b = tl.load(prow + 8)
    len_a = tl.load(prow + 9).to(ACC_T)
    len_b = tl.load(prow + 10).to(ACC_T)

    c = tl.arange(0, BLOCK_C)  # channels of the head (d_k or d_v)
    cmask = c < width
    xr = tl.arange(0, BLOCK_X)  # columns (d_model for rows, 1 for multipliers and biases)

    # ---- pass 1: per-channel sums of squares over the group's heads and every member
    acc_a = tl.zeros([BLOCK_C], dtype=ACC_T)
    acc_b = tl.zeros([BLOCK_C], dtype=ACC_T)
    for d in range(d0, d1):
        addr, side, sh, sc, sx, ncols, power, n = _desc(desc_tab, d, n_a, n_b)
        base = addr.to(tl.pointer_type(PARAM_T)) + j * n * sh
        offs = _tile(c, xr, sc, sx, LAYOUT)
        acc = tl.zeros([BLOCK_C], dtype=ACC_T)
        for hh in range(0, n):
            for x0 in range(0, ncols, BLOCK_X):
                m = cmask[:, None] & ((x0 + xr) < ncols)[None, :]
                v = tl.load(base + (hh * sh + x0 * sx) + offs, mask=m, other=0.0).to(ACC_T)
                acc += tl.sum(v * v, axis=1)
        acc_a += tl.where(side == 0, acc, 0.0)
        acc_b += tl.where(side == 0, 0.0, acc)

    # ---- slot scales (a one-hot reduction: head = one slot, channel = identity, RoPE planes)
    slot = tl.load(slot_tab + slot_off + c, mask=cmask, other=-1)
    s_idx = tl.arange(0, BLOCK_C)
    onehot = slot[:, None] == s_idx[None, :]  # (BLOCK_C channels, BLOCK_C slots)
    count = tl.sum(onehot.to(ACC_T), axis=0)
    smask = s_idx < n_slots
    ms_a = _div(acc_a, len_a, IEEE32)
    ms_b = _div(acc_b, len_b, IEEE32)
    den_a = tl.where(smask, count * n_a.to(ACC_T), 1.0)
    den_b = tl.where(smask, count * n_b.to(ACC_T), 1.0)
    s_a = _sqrt(_div(tl.sum(tl.where(onehot, ms_a[:, None], 0.0), axis=0), den_a, IEEE32), IEEE32)
    s_b = _sqrt(_div(tl.sum(tl.where(onehot, ms_b[:, None], 0.0), axis=0), den_b, IEEE32), IEEE32)

    # ---- factors (eq. 4) and magnitude control
    eps = tl.load(scal + 0)
    mag0 = tl.load(scal + 1)
    g = _sqrt(_div(s_a + eps, s_b + eps, IEEE32), IEEE32)
    # a NaN/Inf weight makes its slot's scale non-finite: that slot keeps factor 1 (nothing spreads)
    finite = (g == g) & (g > 0.0) & (g < float("inf"))
    g = tl.where(finite, g, 1.0)
    inv_g = _div(tl.full([BLOCK_C], 1.0, ACC_T), g, IEEE32)
    product = s_a * s_b
    mag = tl.full([BLOCK_C], 1.0, ACC_T) * mag0
    if HAS_MAX:
        pmax = tl.load(scal + 2)
        tiny = tl.load(scal + 3)
        cap = _div(tl.full([BLOCK_C], 1.0, ACC_T) * pmax, tl.maximum(product * mag * mag, tiny), IEEE32)
        mag = mag * _sqrt(tl.minimum(cap, 1.0), IEEE32)
    mag = tl.where(finite, mag, 1.0)
    new_a = _div(mag * s_a, g, IEEE32)
    new_b = mag * s_b * g
    drift_before = tl.abs(tl.log(_div(s_a + eps, s_b + eps, IEEE32)))
    drift_after = tl.abs(tl.log(_div(new_a + eps, new_b + eps, IEEE32)))
    o = out_off + j * n_slots + s_idx
    tl.store(out + o, drift_before, mask=smask)
    tl.store(out + n_out + o, drift_after, mask=smask)
    tl.store(out + 2 * n_out + o, product, mask=smask)
    tl.store(out + 3 * n_out + o, new_a * new_b, mask=smask)
    tol = tl.load(scal + 4)
    changed = tl.max(tl.where(smask & (tl.abs(inv_g * mag - 1.0) > tol), 1, 0), axis=0)
    skipped = tl.max(tl.where(smask, tl.where(finite, 0, 2), 0), axis=0)
    tl.store(unit_changed + u, (changed + skipped).to(tl.int32))

    # ---- per-channel factors: parameters by gauge·magnitude, state by the gauge alone
    fpa = tl.sum(tl.where(onehot, (inv_g * mag)[None, :], 0.0), axis=1)
    fpb = tl.sum(tl.where(onehot, (g * mag)[None, :], 0.0), axis=1)
    fsa = tl.sum(tl.where(onehot, inv_g[None, :], 0.0), axis=1)
    fsb = tl.sum(tl.where(onehot, g[None, :], 0.0), axis=1)

    # ---- pass 2: parameters by gauge·magnitude, then the optimizer state, M ← M / f^k
    for d in range(d0, d1):
        _rescale(desc_tab, d, j, n_a, n_b, fpa, fpb, c, cmask, xr, PARAM_T, ACC_T, IEEE32, LAYOUT, False, BLOCK_X)
    for d in range(d1, d2):
        _rescale(desc_tab, d, j, n_a, n_b, fsa, fsb, c, cmask, xr, STATE_T, ACC_T, IEEE32, LAYOUT, True, BLOCK_X)


# ---------------------------------------------------------------------- host: layouts
def _layouts(sc: int, sx: int, n_cols: int) -> set[int]:
    ok = {_GENERIC}
    if sx == 1 or n_cols == 1:
        ok.add(_COLS_CONTIG)
    if sc == 1:
        ok.add(_CHANS_CONTIG)
    return ok


def _layout_of(tensors: list[FixTensor]) -> int:
    ok = {_GENERIC, _COLS_CONTIG, _CHANS_CONTIG}
    for t in tensors:
        _, sc, sx, ncols = t.geometry
        ok &= _layouts(sc, sx, ncols)
    return _COLS_CONTIG if _COLS_CONTIG in ok else (_CHANS_CONTIG if _CHANS_CONTIG in ok else _GENERIC)


# ---------------------------------------------------------------------- host: launch
@dataclass
class _Launch:
    """Packed tables of one (parameter dtype, state dtype, layout) group of pairs."""

    members: list[int]  # pair indices
    unit_tab: torch.Tensor
    plan_tab: torch.Tensor
    desc_tab: torch.Tensor
    slot_tab: torch.Tensor
    scal: torch.Tensor
    out_offsets: list[int]
    unit_offsets: list[int]
    n_out: int
    param_dtype: torch.dtype
    state_dtype: torch.dtype
    layout: int
    block_c: int
    block_x: int
    has_max: bool


def _to_device(rows, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host table on ``device`` without a host synchronisation (pinned, non-blocking)."""
    t = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _pack(members: list[int], pairs: Sequence[FixPair], layout: int, scal: torch.Tensor, has_max: bool) -> _Launch:
    device = scal.device
    plan_rows, desc_rows, slot_vals, unit_rows, out_offsets, unit_offsets = [], [], [], [], [], []
    n_out, max_width, max_cols = 0, 1, 1
    for gi, k in enumerate(members):
        pair = pairs[k]
        pdesc, sdesc = pair.params, pair.states
        d0 = len(desc_rows)
        for dsc in pdesc + sdesc:
            sh, sc, sx, ncols = dsc.geometry
            desc_rows.append([dsc.view.data_ptr(), dsc.side, sh, sc, sx, ncols, dsc.power, 0])
            max_cols = max(max_cols, ncols)
        # row length of a side: columns summed over its tensors ([W | b]: d + 1; multiplier: 1)
        len_a = sum(d.geometry[3] for d in pdesc if d.side == 0)
        len_b = sum(d.geometry[3] for d in pdesc if d.side == 1)
        max_width = max(max_width, pair.width)
        plan_rows.append([d0, d0 + len(pdesc), d0 + len(pdesc) + len(sdesc), pair.width, pair.n_slots,
                          len(slot_vals), n_out, pair.repeat_a, pair.repeat_b, len_a, len_b, 0])
        slot_vals.extend(pair.slot)
        unit_offsets.append(len(unit_rows))
        unit_rows.extend([gi, j] for j in range(pair.groups))
        out_offsets.append(n_out)
        n_out += pair.groups * pair.n_slots
    first = pairs[members[0]]
    pdt = first.params[0].view.dtype
    sdt = first.states[0].view.dtype if first.states else pdt
    block_c = triton.next_power_of_2(max_width)
    return _Launch(
        members,
        _to_device(unit_rows, torch.int64, device), _to_device(plan_rows, torch.int64, device),
        _to_device(desc_rows, torch.int64, device), _to_device(slot_vals, torch.int32, device), scal,
        out_offsets, unit_offsets, n_out, pdt, sdt, layout,
        block_c, min(triton.next_power_of_2(max_cols), max(1, _TILE_ELEMS // block_c)), has_max,
    )


def _run(pk: _Launch) -> tuple[torch.Tensor, torch.Tensor]:
    acc = pk.scal.dtype
    out = torch.empty(_N_OUT, pk.n_out, dtype=acc, device=pk.scal.device)
    changed = torch.empty(pk.unit_tab.shape[0], dtype=torch.int32, device=pk.scal.device)
    _gaugefix_kernel[(pk.unit_tab.shape[0],)](
        pk.unit_tab, pk.plan_tab, pk.desc_tab, pk.slot_tab, pk.scal, out, changed, pk.n_out,
        PARAM_T=_TL[pk.param_dtype], STATE_T=_TL[pk.state_dtype], ACC_T=_TL[acc], IEEE32=acc == torch.float32,
        LAYOUT=pk.layout, HAS_MAX=pk.has_max, BLOCK_C=pk.block_c, BLOCK_X=pk.block_x,
        num_warps=4 if pk.block_c * pk.block_x <= 2048 else 8,
    )
    return out, changed


@dataclass
class PreparedFix:
    """Packed tables for given pairs: :meth:`run` launches (valid while no tensor is reallocated)."""

    pairs: list[FixPair]
    launches: list[_Launch] = field(default_factory=list)

    def run(self) -> list[tuple[torch.Tensor, ...]]:
        """Rescale in place; per pair ``(drift_before, drift_after, product_before, product_after)``,
        each ``(groups, n_slots)``, then ``changed`` and ``skipped`` (a slot with a non-finite scale, left
        alone), each ``(groups,)`` bool — device tensors, no host sync."""
        results: list = [None] * len(self.pairs)
        for pk in self.launches:
            out, changed = _run(pk)
            for k, off, u0 in zip(pk.members, pk.out_offsets, pk.unit_offsets):
                g, ns = self.pairs[k].groups, self.pairs[k].n_slots
                flags = changed[u0:u0 + g]
                results[k] = tuple(out[i, off:off + g * ns].view(g, ns) for i in range(_N_OUT)) + (
                    (flags & 1) != 0, (flags & 2) != 0)
        return results


def prepare(
    pairs: Sequence[FixPair],
    *,
    eps: float = 1e-12,
    product_decay: float | None = None,
    product_max: float | None = None,
) -> PreparedFix:
    """Pack the descriptor tables of ``pairs`` (every tensor on one device, one dtype per pair's
    parameters and one per its states) into one launch per (dtype, layout) group.

    Args:
        pairs: what to balance (:class:`~.spec.FixPair`; checked by :func:`~.spec.check_pairs`).
        eps: added to both scales in the factor ``g = sqrt((s_a + eps)/(s_b + eps))``.
        product_decay: shrink the scale product ``s_a·s_b`` by ``1 − product_decay`` per fix.
        product_max: cap the scale product at this value.

    Returns:
        A :class:`PreparedFix`, valid while no tensor is reallocated.
    """
    pairs = list(pairs)
    check_pairs(pairs)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, pair in enumerate(pairs):
        sdt = pair.states[0].view.dtype if pair.states else None
        groups[(pair.params[0].view.dtype, sdt, _layout_of(pair.tensors))].append(k)
    device = pairs[0].params[0].view.device
    mag0 = 1.0 if product_decay is None else (1.0 - product_decay) ** 0.5
    prepared = PreparedFix(pairs)
    for (pdt, _, layout), members in groups.items():
        acc = accumulation_dtype(pdt)
        fi = torch.finfo(acc)
        scal = _to_device([eps, mag0, product_max or 0.0, fi.tiny, CHANGED_ULPS * fi.eps], acc, device)
        prepared.launches.append(_pack(members, pairs, layout, scal, product_max is not None))
    return prepared
