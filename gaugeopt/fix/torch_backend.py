"""The torch backend of the gauge fix: mean squares, factors, in-place rescale — tensor ops only.

The host (:class:`gaugeopt.fix.gaugefix.GaugeFixer`) plans, validates, classifies the optimizer
state and assembles the report; a backend only computes the numbers and writes the rescaled
values. This one reads every side's per-channel mean squares (:func:`~gaugeopt.fix.drift.read_mean_squares`,
DTensor-aware), stacks plans of equal shape along a layer axis for one batched
:func:`~gaugeopt.fix.balance.balance_factors` each, and rescales every parameter once (several
members can share a fused parameter: their factors are merged into one storage-layout factor)
and its transported optimizer state by the gauge part of the factor (:mod:`gaugeopt.fix.transport`).
It runs anywhere torch does: CPU, CUDA, FSDP2 shards.

The Triton backend (:mod:`gaugeopt.fix.triton_backend`) computes the same :class:`PairNumbers`
in one launch; the tests compare every field of the two.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.fix.balance import balance_factors
from gaugeopt.fix.drift import read_mean_squares
from gaugeopt.fix.plan import PairPlan
from gaugeopt.fix.transport import rescale_param, rescale_tensor, storage_factor

__all__ = ["PairNumbers", "StateMap", "TorchFix"]

# parameter id -> [(state tensor, power k)]: the state a rescale p ← s ⊙ p divides by s**k
StateMap = dict[int, list[tuple[torch.Tensor, int]]]


@dataclass
class PairNumbers:
    """What a backend reports for one plan (tensors ``(groups, n_slots)``; ``changed``: ``(groups,)`` bool)."""

    drift_before: torch.Tensor
    drift_after: torch.Tensor
    product_before: torch.Tensor
    product_after: torch.Tensor
    changed: torch.Tensor


class TorchFix:
    """The fix of ``plans`` in torch: :meth:`run` rescales in place and returns one
    :class:`PairNumbers` per plan.

    Args:
        plans: the pairs to balance.
        state: the optimizer state to transport, per parameter (empty: parameters only).
        eps, product_decay, product_max: as :func:`gaugeopt.gauge_fix`.
    """

    name = "torch"

    def __init__(self, plans: Sequence[PairPlan], state: StateMap, *, eps: float = 1e-12,
                 product_decay: float | None = None, product_max: float | None = None) -> None:
        self.plans = list(plans)
        self.state = state
        self.options = dict(eps=eps, product_decay=product_decay, product_max=product_max)

    @torch.no_grad()
    def run(self) -> list[PairNumbers]:
        plans = self.plans
        # read every statistic first (a fused parameter holds several sides), then balance in batches
        stats = [(read_mean_squares(p.a, p.members_a), read_mean_squares(p.b, p.members_b)) for p in plans]
        batches: dict[tuple, list[int]] = defaultdict(list)
        for k, plan in enumerate(plans):
            batches[plan.batch_key() + (stats[k][0].dtype, stats[k][0].device)].append(k)
        results: list = [None] * len(plans)
        for members in batches.values():
            first = plans[members[0]]
            bal = balance_factors(
                torch.stack([stats[k][0] for k in members]), torch.stack([stats[k][1] for k in members]),
                first.slot, first.n_slots, **self.options,
            )
            for row, k in enumerate(members):
                results[k] = (bal, row)
        self._apply([(b.gauge_a[r], b.gauge_b[r], b.magnitude[r]) for b, r in results])
        return [
            PairNumbers(b.drift_before[r], b.drift_after[r], b.product_before[r], b.product_after[r], b.changed[r])
            for b, r in results
        ]

    def _apply(self, factors: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Side a by ``gauge_a·magnitude``, side b by ``gauge_b·magnitude`` (per group, repeated over
        the side's heads); the state of each parameter by the gauge part alone."""
        per_param: dict[int, list] = {}
        for plan, (fa, fb, mag) in zip(self.plans, factors):
            for (side, members), gauge in zip(plan.sides(), (fa, fb)):
                g_side, m_side = side.expand(gauge), side.expand(mag)  # (heads, width)
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
