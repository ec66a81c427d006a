"""The torch backend of the gauge fix: mean squares, factors, in-place rescale — tensor ops only.

The host (:class:`gaugeopt.fix.gaugefix.GaugeFixer`) plans, validates, classifies the optimizer
state and assembles the report; a backend only computes the numbers and writes the rescaled
values. This one reads every side's per-channel mean squares (:func:`~gaugeopt.fix.drift.read_mean_squares`,
DTensor-aware; the multipliers of all layers in one stacked read), stacks plans of equal shape
along a layer axis for one batched :func:`~gaugeopt.fix.balance.balance_factors` each, and
rescales each member's rows in place with one ``foreach`` call per kind of tensor, and the
transported optimizer state by the gauge part of the factor (:mod:`gaugeopt.fix.transport`).
It runs anywhere torch does: CPU, CUDA, FSDP2 shards.

The Triton backend (:mod:`gaugeopt.fix.triton_backend`) computes the same :class:`PairNumbers`
in one launch; the tests compare every field of the two.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.fix.balance import balance_factors
from gaugeopt.fix.drift import read_mean_squares, slot_rms
from gaugeopt.fix.plan import PairPlan
from gaugeopt.distributed import is_dtensor
from gaugeopt.fix.transport import rescale_param, rescale_tensor, storage_factor

__all__ = ["PairNumbers", "StateMap", "SpecialMap", "TorchFix", "measured_scales", "plan_batches"]

# parameter id -> [(state tensor, power k)]: the state a rescale p ← s ⊙ p divides by s**k
StateMap = dict[int, list[tuple[torch.Tensor, int]]]
# parameter id -> [apply(s)]: state moved by a function of the storage-layout factor s (factored moments)
SpecialMap = dict[int, list[Callable[[torch.Tensor], None]]]


@dataclass
class PairNumbers:
    """What a backend reports for one plan (tensors ``(groups, n_slots)``; ``changed`` and ``skipped``:
    ``(groups,)`` bool, ``skipped`` for groups left alone in some slot because a scale was not finite)."""

    drift_before: torch.Tensor
    drift_after: torch.Tensor
    product_before: torch.Tensor
    product_after: torch.Tensor
    changed: torch.Tensor
    skipped: torch.Tensor


def plan_batches(plans: Sequence[PairPlan]) -> list[list[int]]:
    """Indices of ``plans`` grouped into batches whose statistics stack along a layer axis (equal
    shapes, modes, member roles, dtype and device: every layer of a model, as a rule)."""
    batches: dict[tuple, list[int]] = defaultdict(list)
    for k, plan in enumerate(plans):
        roles = tuple(m.role for _, ms in plan.sides() for m in ms)
        p0 = plan.members_a[0].ref.param
        batches[plan.batch_key() + (plan.mode, roles, p0.dtype, p0.device)].append(k)
    return list(batches.values())


@torch.no_grad()
def measured_scales(plans: Sequence[PairPlan], batches: Sequence[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(s_a, s_b)`` per plan, each ``(groups, n_slots)``, read from the stored tensors now — after a
    fix, what the writes (rounded to the parameters' dtype) really left; one stacked read per batch."""
    out: list = [None] * len(plans)
    for ks in batches:
        first = plans[ks[0]]
        ms_a, ms_b = _mean_squares(plans, ks, "a"), _mean_squares(plans, ks, "b")
        slot = first.slot.to(ms_a.device)
        s_a, s_b = slot_rms(ms_a, slot, first.n_slots), slot_rms(ms_b, slot, first.n_slots)
        for row, k in enumerate(ks):
            out[k] = (s_a[row], s_b[row])
    return out


class TorchFix:
    """The fix of ``plans`` in torch: :meth:`run` rescales in place and returns one
    :class:`PairNumbers` per plan.

    Plans of equal shape (every layer of a model, as a rule) form a batch: their statistics are
    stacked along a layer axis, balanced in one :func:`~gaugeopt.fix.balance.balance_factors`
    call, and every tensor of the batch is rescaled through its member's view (only the rows
    the gauge acts on; a fused QKV weight's other rows are not touched) — 32- and 64-bit
    tensors by one ``torch._foreach_mul_`` per kind of tensor, 16-bit ones computed in float32
    and rounded once. Sharded (DTensor) parameters are rescaled shard-locally through a
    storage-layout factor (:func:`~gaugeopt.fix.transport.storage_factor`). No host
    synchronisation.

    Args:
        plans: the pairs to balance.
        state: the optimizer state to transport, per parameter (empty: parameters only).
        special: state moved by a function of the parameter's storage-layout factor (Adafactor's
            factors, Adam-mini's per-block means); such a fix takes the storage-layout path.
        eps, product_decay, product_max: as :func:`gaugeopt.gauge_fix`.
    """

    name = "torch"

    def __init__(self, plans: Sequence[PairPlan], state: StateMap, *, special: SpecialMap | None = None,
                 eps: float = 1e-12, product_decay: float | None = None, product_max: float | None = None) -> None:
        self.plans = list(plans)
        self.state = state
        self.special = dict(special or {})
        self.options = dict(eps=eps, product_decay=product_decay, product_max=product_max)
        sharded = bool(self.special)
        for plan in self.plans:
            for _, members in plan.sides():
                for m in members:
                    p = m.ref.param
                    # DTensor shards, and gains stored with an offset ((w + offset)·s − offset is affine),
                    # take the storage-layout path
                    sharded |= is_dtensor(p) or any(is_dtensor(t) for t, _ in state.get(id(p), ())) or bool(m.offset)
        self._batches = plan_batches(self.plans)
        self._sharded = sharded
        self._slots = {}
        self._jobs = None if sharded else [self._view_jobs(ks) for ks in self._batches]

    def _view_jobs(self, ks: list[int]) -> dict:
        """The in-place rescales of one batch, built once (the views stay valid while the storage
        does; :class:`~gaugeopt.fix.gaugefix.GaugeFixer` builds a new backend when it moves):
        ``{(side, kind, axis, dtype): (views, rows)}`` with ``kind`` 1 for a parameter (factor
        ``gauge·magnitude``) and ``-k`` for a state entry divided by ``gauge**k``."""
        jobs: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        for side_i, side in enumerate("ab"):
            for row, k in enumerate(ks):
                plan = self.plans[k]
                for m in (plan.members_a if side == "a" else plan.members_b):
                    p = m.ref.param
                    axis = m.broadcast_axis
                    for t, kind in ((p.detach(), 1), *((t, -power) for t, power in self.state.get(id(p), ()))):
                        v = m.ref.view(t)
                        views, rows = jobs[(side_i, kind, axis, v.dtype)]
                        views.append(v)
                        rows.append(row)
        return dict(jobs)

    @torch.no_grad()
    def run(self) -> list[PairNumbers]:
        plans = self.plans
        # read every statistic first (a fused parameter holds several sides), then balance and rescale
        stats = [(_mean_squares(plans, ks, "a"), _mean_squares(plans, ks, "b")) for ks in self._batches]
        results: list = [None] * len(plans)
        for ks, (ms_a, ms_b) in zip(self._batches, stats):
            first = plans[ks[0]]
            key = (ks[0], ms_a.device, ms_a.dtype)
            if key not in self._slots:
                slot = first.slot.to(ms_a.device)
                self._slots[key] = (slot, torch.nn.functional.one_hot(slot, first.n_slots).to(ms_a.dtype))
            slot, onehot = self._slots[key]
            bal = balance_factors(ms_a, ms_b, slot, first.n_slots, onehot=onehot, **self.options)
            self._rescale(ks, bal.gauge_a, bal.gauge_b, bal.magnitude)
            per_plan = zip(*(t.unbind(0) for t in (bal.drift_before, bal.drift_after, bal.product_before,
                                                    bal.product_after, bal.changed, bal.skipped)))
            for k, fields in zip(ks, per_plan):
                results[k] = PairNumbers(*fields)
        return results

    def _apply(self, factors: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Rescale with given ``(gauge_a, gauge_b, magnitude)`` per plan (each ``(groups, width)``)."""
        for ks in self._batches:
            self._rescale(ks, *(torch.stack([factors[k][i] for k in ks]) for i in range(3)))

    def _rescale(self, ks: list[int], gauge_a, gauge_b, magnitude) -> None:
        if self._sharded:
            self._apply_storage(ks, gauge_a, gauge_b, magnitude)
        else:
            self._apply_views(self._jobs[self._batches.index(ks)], ks, gauge_a, gauge_b, magnitude)

    def _apply_views(self, jobs: dict, ks: list[int], gauge_a, gauge_b, magnitude) -> None:
        """Side a by ``gauge_a·magnitude``, side b by ``gauge_b·magnitude``, through each member's
        view; the state of each parameter by the gauge part alone (times ``gauge**-k``: a
        multiplication by the small factor's power, which a CPU vectorises where it does not
        vectorise a broadcast division). One stacked operation per kind of factor, one
        ``_foreach_mul_`` per kind of tensor."""
        first = self.plans[ks[0]]
        gauges = (_per_head(gauge_a, first.a.repeat), _per_head(gauge_b, first.b.repeat))  # (L, heads, width)
        mags = (_per_head(magnitude, first.a.repeat), _per_head(magnitude, first.b.repeat))
        for (side_i, kind, axis, dtype), (views, rows) in jobs.items():
            f = gauges[side_i] * mags[side_i] if kind == 1 else gauges[side_i].pow(kind)
            if axis is not None:
                f = f.unsqueeze(axis + 1)
            per_row = f.to(dtype).unbind(0) if dtype not in _HALF else f.unbind(0)
            factors = [per_row[r] for r in rows]
            if dtype in _HALF:  # computed in float32, rounded once
                for v, fac in zip(views, factors):
                    rescale_tensor(v, fac, 1)
            else:
                torch._foreach_mul_(views, factors)

    def _apply_storage(self, ks: list[int], gauge_a, gauge_b, magnitude) -> None:
        """The same through one storage-layout factor per parameter (shard-local for a DTensor)."""
        per_param: dict[int, list] = {}
        for row, k in enumerate(ks):
            plan = self.plans[k]
            for (side, members), gauge in zip(plan.sides(), (gauge_a[row], gauge_b[row])):
                g_side, m_side = side.expand(gauge), side.expand(magnitude[row])  # (heads, width)
                for member in members:
                    p = member.ref.param
                    entry = per_param.setdefault(id(p), [p, None, None, member.offset])
                    if entry[3] != member.offset:
                        raise GaugeError(f"{member.ref.name}: members of one parameter with different gain offsets")
                    entry[1] = storage_factor(member, g_side * m_side, out=entry[1])
                    entry[2] = storage_factor(member, g_side, out=entry[2])
        for pid, (p, f_param, f_gauge, offset) in per_param.items():
            rescale_param(p, f_param, offset)
            for t, k in self.state.get(pid, ()):
                rescale_tensor(t, f_gauge, -k)
            for apply in self.special.get(pid, ()):
                apply(f_gauge)


def _per_head(t: torch.Tensor, k: int) -> torch.Tensor:
    """``(L, groups, width) → (L, groups·k, width)``: each group's factor for each of its heads."""
    return t if k == 1 else t.repeat_interleave(k, dim=1)


_HALF = (torch.float16, torch.bfloat16)


def _mean_squares(plans: Sequence[PairPlan], ks: list[int], side: str) -> torch.Tensor:
    """``(L, groups, repeat, width)`` mean squares of one side of a batch of plans; the multipliers
    of every layer are read in one stacked operation."""
    first = plans[ks[0]]
    members = first.members_a if side == "a" else first.members_b
    s = getattr(first, side)
    if first.mode == "lrm" and len(ks) > 1 and not any(is_dtensor(plans[k].members_a[0].ref.param) for k in ks):
        ref_of = (lambda pl: pl.members_a[0].ref) if side == "a" else (lambda pl: pl.members_b[0].ref)
        x = torch.stack([ref_of(plans[k]).view(ref_of(plans[k]).param.detach()) for k in ks])
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        return (x * x).reshape(len(ks), s.heads // s.repeat, s.repeat, -1)
    return torch.stack([
        read_mean_squares(getattr(plans[k], side), plans[k].members_a if side == "a" else plans[k].members_b)
        for k in ks
    ]) if members else None
