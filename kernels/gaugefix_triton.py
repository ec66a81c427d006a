"""GaugeFix in one Triton launch: statistics, factors, parameter and Adam-state rescale, drift.

The torch core (:func:`gaugeopt.gauge_fix`) reads the per-channel mean squares of every side,
stacks them, calls :func:`gaugeopt.fix.gaugefix.balance_factors` and rescales parameters and
optimizer state tensor by tensor — hundreds of small launches for a GPT-2. Here one program
owns one KV group ``j`` of one plan (a layer's Q/K or V/O gauge) and does all of it::

    pass 1  acc[c]  = Σ_{heads of j on side a} Σ_x X[head, c, x]²        (float32, float64 for fp64)
            s_a[s]  = sqrt( Σ_{c∈s} acc[c] / len_a / (|s|·n_a) )          likewise s_b
            g       = sqrt((s_a + ε)/(s_b + ε)),   m = magnitude factor      (eq. 4, paper 002)
    pass 2  X_a ← X_a · m/g,  X_b ← X_b · m·g                                (every member tensor)
            M_a ← M_a / (1/g)^k,  M_b ← M_b / g^k                            (state, k = 1 or 2)
    out     drift before/after, scale product before/after, "changed" per slot

``X[head, c, x]`` is a member's canonical view (``(heads, width, n_cols)``: the row block and
its bias, or the multiplier with ``n_cols = 1``); the O side of V/O is the column block.
A group's statistics must be complete before any write, and groups never share memory, so
one program per group needs no cross-program synchronisation and the launch needs no host
synchronisation at all. Parameters and states are reached through a **descriptor table**
(int64 base address, side, strides, columns, state power) rather than by packing them into a
buffer: packing would cost a copy in and out of every weight in plain mode, the table costs a
few hundred bytes. The pointer element type is a compile-time constant, hence one launch per
(parameter dtype, state dtype, layout) group — in practice one launch per model.

Precision: reductions and factors in float32 (float64 for float64 parameters), one rounding
per stored element (the factor is not rounded to a bf16/fp16 parameter's dtype before the
product), IEEE-rounded division and square root (``div_rn``/``sqrt_rn``) so that the factors
match the torch core to the last bits in float32.

Example (on CUDA tensors; on CPU only with ``TRITON_INTERPRET=1`` set before this module is
imported, which is how ``tests/test_kernels_interpreter.py`` runs it):
    >>> import torch, gaugeopt
    >>> from gaugeopt.fix.plan import plan_pairs
    >>> from gaugeopt.kernels.gaugefix_triton import gauge_fix_triton
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)))
    >>> with torch.no_grad(): _ = model.transformer.h[0].attn.c_attn.row_mults[0].mul_(2.0)
    >>> report = gauge_fix_triton(plan_pairs(gaugeopt.find_attention(model)))
    >>> round(report.max_drift_before, 4), gaugeopt.qk_drift(model) < 1e-6
    (0.6931, True)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from gaugeopt.fix.distributed import is_dtensor
from gaugeopt.fix.plan import PairPlan
from gaugeopt.errors import GaugeError
from gaugeopt.fix.gaugefix import GaugeFixReport, PairRecord, check_fix_options
from gaugeopt.fix.transport import _shaped_keys, classify_state, state_rule, unwrap_optimizer

__all__ = ["gauge_fix_triton", "prepare_fix", "PreparedFix", "fingerprint", "unsupported_reason", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# descriptor table fields (int64): one row per (plan, member tensor); parameters first, then states
_D_ADDR, _D_SIDE, _D_SH, _D_SC, _D_SX, _D_NCOLS, _D_POW = range(7)
_DF = 8
# plan table fields (int64): one row per plan
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
def _gaugefix_kernel(
    unit_tab,  # (n_units, 2) int64: plan, KV group
    plan_tab,  # (n_plans, _PF) int64
    desc_tab,  # (n_desc, _DF) int64
    slot_tab,  # (Σ width,) int32: slot of each channel, per plan
    scal,  # (4,) ACC: eps, magnitude (sqrt(1 - decay)), product_max, smallest normal
    out,  # (4, n_out) ACC
    unit_changed,  # (n_units,) int32: 1 when some factor of the group differs from 1
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
        drow = desc_tab + d * 8
        side = tl.load(drow + 1)
        sh = tl.load(drow + 2)
        sc = tl.load(drow + 3)
        sx = tl.load(drow + 4)
        ncols = tl.load(drow + 5)
        n = tl.where(side == 0, n_a, n_b)
        base = tl.load(drow + 0).to(tl.pointer_type(PARAM_T)) + j * n * sh
        offs = c[:, None] * (1 if LAYOUT == 2 else sc) + xr[None, :] * (1 if LAYOUT == 1 else sx)  # unit stride spelled out
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
    inv_g = _div(tl.full([BLOCK_C], 1.0, ACC_T), g, IEEE32)
    product = s_a * s_b
    mag = tl.full([BLOCK_C], 1.0, ACC_T) * mag0
    if HAS_MAX:
        pmax = tl.load(scal + 2)
        tiny = tl.load(scal + 3)
        cap = _div(tl.full([BLOCK_C], 1.0, ACC_T) * pmax, tl.maximum(product * mag * mag, tiny), IEEE32)
        mag = mag * _sqrt(tl.minimum(cap, 1.0), IEEE32)
    new_a = _div(mag * s_a, g, IEEE32)
    new_b = mag * s_b * g
    drift_before = tl.abs(tl.log(_div(s_a + eps, s_b + eps, IEEE32)))
    drift_after = tl.abs(tl.log(_div(new_a + eps, new_b + eps, IEEE32)))
    o = out_off + j * n_slots + s_idx
    tl.store(out + o, drift_before, mask=smask)
    tl.store(out + n_out + o, drift_after, mask=smask)
    tl.store(out + 2 * n_out + o, product, mask=smask)
    tl.store(out + 3 * n_out + o, new_a * new_b, mask=smask)
    changed = tl.max(tl.where(smask & (inv_g * mag != 1.0), 1, 0), axis=0)
    tl.store(unit_changed + u, changed.to(tl.int32))

    # ---- per-channel factors: parameters by gauge·magnitude, state by the gauge alone
    fpa = tl.sum(tl.where(onehot, (inv_g * mag)[None, :], 0.0), axis=1)
    fpb = tl.sum(tl.where(onehot, (g * mag)[None, :], 0.0), axis=1)
    fsa = tl.sum(tl.where(onehot, inv_g[None, :], 0.0), axis=1)
    fsb = tl.sum(tl.where(onehot, g[None, :], 0.0), axis=1)

    # ---- pass 2: parameters
    for d in range(d0, d1):
        drow = desc_tab + d * 8
        side = tl.load(drow + 1)
        sh = tl.load(drow + 2)
        sc = tl.load(drow + 3)
        sx = tl.load(drow + 4)
        ncols = tl.load(drow + 5)
        n = tl.where(side == 0, n_a, n_b)
        f = tl.where(side == 0, fpa, fpb)[:, None]
        base = tl.load(drow + 0).to(tl.pointer_type(PARAM_T)) + j * n * sh
        offs = c[:, None] * (1 if LAYOUT == 2 else sc) + xr[None, :] * (1 if LAYOUT == 1 else sx)  # unit stride spelled out
        for hh in range(0, n):
            for x0 in range(0, ncols, BLOCK_X):
                m = cmask[:, None] & ((x0 + xr) < ncols)[None, :]
                ptr = base + (hh * sh + x0 * sx) + offs
                v = tl.load(ptr, mask=m, other=0.0).to(ACC_T)
                tl.store(ptr, (v * f).to(PARAM_T), mask=m)

    # ---- pass 2: optimizer state, M ← M / f^k
    for d in range(d1, d2):
        drow = desc_tab + d * 8
        side = tl.load(drow + 1)
        sh = tl.load(drow + 2)
        sc = tl.load(drow + 3)
        sx = tl.load(drow + 4)
        ncols = tl.load(drow + 5)
        power = tl.load(drow + 6)
        n = tl.where(side == 0, n_a, n_b)
        f = tl.where(side == 0, fsa, fsb)
        f = tl.where(cmask, tl.where(power == 2, f * f, f), 1.0)[:, None]  # 1 on padding: no 0/0
        base = tl.load(drow + 0).to(tl.pointer_type(STATE_T)) + j * n * sh
        offs = c[:, None] * (1 if LAYOUT == 2 else sc) + xr[None, :] * (1 if LAYOUT == 1 else sx)  # unit stride spelled out
        for hh in range(0, n):
            for x0 in range(0, ncols, BLOCK_X):
                m = cmask[:, None] & ((x0 + xr) < ncols)[None, :]
                ptr = base + (hh * sh + x0 * sx) + offs
                v = tl.load(ptr, mask=m, other=0.0).to(ACC_T)
                tl.store(ptr, _div(v, f, IEEE32).to(STATE_T), mask=m)


# ---------------------------------------------------------------------- host: packing
@dataclass
class _Desc:
    """One member tensor of one side: its canonical view and geometry."""

    view: torch.Tensor  # (heads, width), (heads, width, n_cols), or (n_cols, h, d_v) for the O columns
    role: str  # "q.weight", "k.row_mult", "o.weight", ...
    side: int  # 0: a (Q or V), 1: b (K or O)
    power: int  # 0 for a parameter; k for a state entry divided by f**k

    @property
    def geometry(self) -> tuple[int, int, int, int]:
        return _geometry(self.view, self.role)


def _geometry(view: torch.Tensor, role: str) -> tuple[int, int, int, int]:
    """(stride_head, stride_chan, stride_col, n_cols) of a member's canonical view."""
    if view.dim() == 2:  # (heads, width): multiplier or bias
        return view.stride(0), view.stride(1), 0, 1
    if role == "o.weight":  # (d, h, d_v): the columns W_O[:, i, c] are the "rows"
        return view.stride(1), view.stride(2), view.stride(0), view.shape[0]
    return view.stride(0), view.stride(1), view.stride(2), view.shape[2]


def _layouts(sc: int, sx: int, n_cols: int) -> set[int]:
    ok = {_GENERIC}
    if sx == 1 or n_cols == 1:
        ok.add(_COLS_CONTIG)
    if sc == 1:
        ok.add(_CHANS_CONTIG)
    return ok


def unsupported_reason(plans: Sequence[PairPlan], optimizer=None) -> str | None:
    """Why the fused kernel cannot take these plans (``None`` when it can)."""
    if not plans:
        return "no plans (the model has no attention site to fix)"
    devices = set()
    for plan in plans:
        for side in (plan.a, plan.b):
            for role, ref in side.members:
                p = ref.param
                if is_dtensor(p):
                    return f"{ref.name} is a DTensor (FSDP2): the fused kernel edits local storage only"
                if p.dtype not in SUPPORTED_DTYPES:
                    return f"{ref.name} has dtype {p.dtype}; the kernel supports {SUPPORTED_DTYPES}"
                devices.add(p.device)
        if len({ref.param.dtype for s in (plan.a, plan.b) for _, ref in s.members}) > 1:
            return f"{plan.site.name}: the {plan.kind} tensors mix dtypes"
    if len(devices) > 1:
        return f"parameters on several devices {sorted(map(str, devices))}"
    if optimizer is not None:
        opt = unwrap_optimizer(optimizer)
        for plan in plans:
            sdt = set()
            for side in (plan.a, plan.b):
                for _, ref in side.members:
                    for key, v in (opt.state.get(ref.param) or {}).items():
                        if torch.is_tensor(v) and v.dim() > 0 and v.shape == ref.param.shape:
                            if is_dtensor(v):
                                return f"the state {key!r} of {ref.name} is a DTensor (FSDP2)"
                            if v.dtype not in SUPPORTED_DTYPES:
                                return f"the state {key!r} of {ref.name} has dtype {v.dtype}"
                            sdt.add(v.dtype)
            if len(sdt) > 1:
                return f"{plan.site.name}: the optimizer state of the {plan.kind} tensors mixes dtypes {sorted(map(str, sdt))}"
    return None


def _classify(plans: Sequence[PairPlan], optimizer, unknown_state: str) -> dict[str, list[str]]:
    """The state outcome of every parameter (raises before any write, like the torch core);
    drops the state of ``"reset"`` parameters now (the kernel never reads it)."""
    outcome: dict[str, list[str]] = {"transported": [], "reset": [], "left": []}
    if optimizer is None:
        return outcome
    params: dict[int, tuple[torch.Tensor, str]] = {}
    for plan in plans:
        for side in (plan.a, plan.b):
            for _, ref in side.members:
                params.setdefault(id(ref.param), (ref.param, ref.name))
    whats = [(p, name, classify_state(optimizer, p, unknown_state=unknown_state)) for p, name in params.values()]
    opt = unwrap_optimizer(optimizer)
    for p, name, what in whats:
        if what == "reset":
            opt.state.pop(p, None)
        if what in outcome:
            outcome[what].append(name)
    return outcome


def _plan_descs(plan: PairPlan, optimizer, transported: set[str]) -> tuple[list[_Desc], list[_Desc]]:
    """Parameter and state descriptors of one plan."""
    params, states = [], []
    opt = unwrap_optimizer(optimizer) if optimizer is not None else None
    rule = state_rule(opt) if opt is not None else None
    for side_i, side in enumerate((plan.a, plan.b)):
        for role, ref in side.members:
            p = ref.param
            params.append(_Desc(ref.view(p.detach()), role, side_i, 0))
            if opt is None or ref.name not in transported:
                continue
            state = opt.state[p]
            for key in _shaped_keys(state, p):
                if rule[key]:
                    states.append(_Desc(ref.view(state[key]), role, side_i, rule[key]))
    return params, states


# ---------------------------------------------------------------------- host: launch
def _layout_of(descs: list[_Desc]) -> int:
    ok = {_GENERIC, _COLS_CONTIG, _CHANS_CONTIG}
    for dsc in descs:
        _, sc, sx, ncols = dsc.geometry
        ok &= _layouts(sc, sx, ncols)
    return _COLS_CONTIG if _COLS_CONTIG in ok else (_CHANS_CONTIG if _CHANS_CONTIG in ok else _GENERIC)


@dataclass
class _Launch:
    """Packed tables of one (parameter dtype, state dtype, layout) group of plans."""

    members: list[int]  # plan indices
    unit_tab: torch.Tensor
    plan_tab: torch.Tensor
    desc_tab: torch.Tensor
    slot_tab: torch.Tensor
    out_offsets: list[int]
    unit_offsets: list[int]
    n_out: int
    param_dtype: torch.dtype
    state_dtype: torch.dtype
    layout: int
    block_c: int
    block_x: int


def _to_device(rows, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host table on ``device`` without a host synchronisation (pinned, non-blocking)."""
    t = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _pack(members: list[int], plans: Sequence[PairPlan], descs, layout: int, device) -> _Launch:
    plan_rows, desc_rows, slot_vals, unit_rows, out_offsets, unit_offsets = [], [], [], [], [], []
    n_out, max_width, max_cols = 0, 1, 1
    for gi, k in enumerate(members):
        plan, (pdesc, sdesc) = plans[k], descs[k]
        d0 = len(desc_rows)
        for dsc in pdesc + sdesc:
            sh, sc, sx, ncols = dsc.geometry
            desc_rows.append([dsc.view.data_ptr(), dsc.side, sh, sc, sx, ncols, dsc.power, 0])
            max_cols = max(max_cols, ncols)
        # row length of a side: columns summed over its members ([W | b]: d + 1; multiplier: 1)
        len_a = sum(d.geometry[3] for d in pdesc if d.side == 0)
        len_b = sum(d.geometry[3] for d in pdesc if d.side == 1)
        max_width = max(max_width, plan.width)
        plan_rows.append([d0, d0 + len(pdesc), d0 + len(pdesc) + len(sdesc), plan.width, plan.n_slots,
                          len(slot_vals), n_out, plan.a.n, plan.b.n, len_a, len_b, 0])
        slot_vals.extend(plan.slot.tolist())
        unit_offsets.append(len(unit_rows))
        unit_rows.extend([gi, j] for j in range(plan.h_kv))
        out_offsets.append(n_out)
        n_out += plan.h_kv * plan.n_slots
    first_p, first_s = descs[members[0]]
    pdt = first_p[0].view.dtype
    block_c = triton.next_power_of_2(max_width)
    return _Launch(
        members,
        _to_device(unit_rows, torch.int64, device), _to_device(plan_rows, torch.int64, device),
        _to_device(desc_rows, torch.int64, device), _to_device(slot_vals, torch.int32, device),
        out_offsets, unit_offsets, n_out, pdt, first_s[0].view.dtype if first_s else pdt, layout,
        block_c, min(triton.next_power_of_2(max_cols), max(1, _TILE_ELEMS // block_c)),
    )


def _run(pk: _Launch, scal: torch.Tensor, has_max: bool) -> tuple[torch.Tensor, torch.Tensor]:
    acc = scal.dtype
    out = torch.empty(_N_OUT, pk.n_out, dtype=acc, device=scal.device)
    changed = torch.empty(pk.unit_tab.shape[0], dtype=torch.int32, device=scal.device)
    _gaugefix_kernel[(pk.unit_tab.shape[0],)](
        pk.unit_tab, pk.plan_tab, pk.desc_tab, pk.slot_tab, scal, out, changed, pk.n_out,
        PARAM_T=_TL[pk.param_dtype], STATE_T=_TL[pk.state_dtype], ACC_T=_TL[acc], IEEE32=acc == torch.float32,
        LAYOUT=pk.layout, HAS_MAX=has_max, BLOCK_C=pk.block_c, BLOCK_X=pk.block_x,
        num_warps=4 if pk.block_c * pk.block_x <= 2048 else 8,
    )
    return out, changed


def fingerprint(plans: Sequence[PairPlan], optimizer) -> tuple:
    """What the packed tables depend on: every parameter's storage and its state tensors' storage.

    Equal fingerprints mean a :class:`PreparedFix` can run again without re-packing."""
    opt = unwrap_optimizer(optimizer) if optimizer is not None else None
    seen, fp = set(), []
    for plan in plans:
        for side in (plan.a, plan.b):
            for _, ref in side.members:
                p = ref.param
                if id(p) in seen:
                    continue
                seen.add(id(p))
                fp.append(p.data_ptr())
                st = opt.state.get(p) if opt is not None else None
                if st:
                    fp.extend((k, v.data_ptr()) for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0)
                fp.append(-1)
    return tuple(fp)


@dataclass
class PreparedFix:
    """A fused GaugeFix packed for given plans, optimizer state and options: :meth:`run` launches it.

    Valid while :func:`fingerprint` of the same plans and optimizer is unchanged (parameters and
    state not reallocated); :class:`gaugeopt.kernels.FusedGaugeFix` checks that before reusing it.
    """

    plans: list[PairPlan]
    outcome: dict[str, list[str]]
    launches: list[tuple[_Launch, torch.Tensor]]  # (packed group, scalars)
    has_max: bool
    reusable: bool  # False after a "reset"/"leave" outcome: the next call must re-classify

    def run(self) -> GaugeFixReport:
        records: list = [None] * len(self.plans)
        flags, order = [], []
        for pk, scal in self.launches:
            out, changed = _run(pk, scal, self.has_max)
            for k, off, u0 in zip(pk.members, pk.out_offsets, pk.unit_offsets):
                h_kv, ns = self.plans[k].h_kv, self.plans[k].n_slots
                records[k] = [out[i, off:off + h_kv * ns].view(h_kv, ns) for i in range(_N_OUT)]
                flags.append(changed[u0:u0 + h_kv].sum().reshape(1))
                order.append(k)
        fixed = dict(zip(order, torch.cat(flags).tolist()))  # the one device->host copy (the report's ints)
        report = GaugeFixReport(**{k: list(v) for k, v in self.outcome.items()})
        for k, plan in enumerate(self.plans):
            db, da, pb, pa = records[k]
            report.pairs.append(PairRecord(
                plan.site.name, plan.site.layer_index, plan.kind, plan.mode, plan.granularity,
                db, da, pb, pa, int(fixed[k]) * (plan.site.n_rep if plan.kind == "qk" else 1),
            ))
        return report


def prepare_fix(
    plans: Sequence[PairPlan],
    optimizer=None,
    *,
    unknown_state: str = "error",
    product_decay: float | None = None,
    product_max: float | None = None,
    eps: float = 1e-12,
) -> PreparedFix:
    """Validate, classify the optimizer state (raising before any write, like the core) and pack
    the descriptor tables of ``plans``; see :func:`gauge_fix_triton` for the arguments."""
    check_fix_options(unknown_state, product_decay, product_max, eps)
    plans = list(plans)
    why = unsupported_reason(plans, optimizer)
    if why is not None:
        raise GaugeError(f"gauge_fix_triton cannot run these plans: {why}; use the torch path (backend='torch')")
    outcome = _classify(plans, optimizer, unknown_state)
    transported = set(outcome["transported"])
    descs = [_plan_descs(plan, optimizer, transported) for plan in plans]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, (pdesc, sdesc) in enumerate(descs):
        sdt = sdesc[0].view.dtype if sdesc else None
        groups[(pdesc[0].view.dtype, sdt, _layout_of(pdesc + sdesc))].append(k)
    device = descs[0][0][0].view.device
    mag0 = 1.0 if product_decay is None else (1.0 - product_decay) ** 0.5
    launches = []
    for (pdt, _, layout), members in groups.items():
        acc = torch.float64 if pdt == torch.float64 else torch.float32
        scal = _to_device([eps, mag0, product_max or 0.0, torch.finfo(acc).tiny], acc, device)
        launches.append((_pack(members, plans, descs, layout, device), scal))
    return PreparedFix(plans, outcome, launches, product_max is not None,
                       reusable=not (outcome["reset"] or outcome["left"]))


def gauge_fix_triton(
    plans: Sequence[PairPlan],
    optimizer=None,
    *,
    unknown_state: str = "error",
    product_decay: float | None = None,
    product_max: float | None = None,
    eps: float = 1e-12,
) -> GaugeFixReport:
    """Fused GaugeFix of ``plans`` (:func:`gaugeopt.fix.plan.plan_pairs`), in place.

    Same semantics and report as the torch core (:func:`gaugeopt.gauge_fix` after planning;
    pass ``optimizer=None`` for ``transport_state=False``). One kernel launch per
    (parameter dtype, state dtype, layout) group; the tables go to the device without a host
    synchronisation; the only device→host copy is the final one of the per-group "changed"
    flags that fill the report's integer ``heads_fixed``.

    Args:
        plans: pairs to balance; every tensor on one device (CUDA, or CPU under
            ``TRITON_INTERPRET=1``), no DTensor, one dtype per plan.
        optimizer: whose state to transport (Adam/AdamW/SGD/... rules of :mod:`gaugeopt.fix.transport`).
        unknown_state, product_decay, product_max, eps: as :func:`gaugeopt.gauge_fix`.

    Returns:
        :class:`gaugeopt.fix.gaugefix.GaugeFixReport`; its per-pair tensors are views of one
        ``(4, Σ h_kv·n_slots)`` output tensor per launch (float32, float64 for float64 parameters).
    """
    return prepare_fix(plans, optimizer, unknown_state=unknown_state, product_decay=product_decay,
                       product_max=product_max, eps=eps).run()
