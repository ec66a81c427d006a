"""The Triton backend of the gauge fix: plans → descriptor tables → one fused launch.

The kernel op (:mod:`gaugeopt.kernels.gaugefix`: kernel, launcher and plain-torch reference) knows
tensors, not models; this module turns :class:`~gaugeopt.fix.plan.PairPlan` s and the optimizer state
the host chose to transport into its :class:`~gaugeopt.kernels.gaugefix.spec.FixPair` descriptors, says why the kernel
cannot take a model (:func:`unsupported_reason`), and keeps the packed tables while no parameter
or state tensor is reallocated (:func:`storage_fingerprint`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from gaugeopt.distributed import is_dtensor, local_view
from gaugeopt.fix.plan import PairPlan, plan_parameters
from gaugeopt.fix.torch_backend import PairNumbers, StateMap

__all__ = ["TritonFix", "unsupported_reason", "storage_fingerprint"]


def unsupported_reason(plans: Sequence[PairPlan], state: StateMap) -> str | None:
    """Why the fused kernel cannot take these plans (``None`` when it can)."""
    from gaugeopt.kernels.gaugefix.spec import SUPPORTED_DTYPES

    if not plans:
        return "no plans (the model has no attention site to fix)"
    devices = set()
    for name, p in plan_parameters(plans).values():
        if is_dtensor(p):
            return f"{name} is a DTensor (FSDP2): the fused kernel edits local storage only"
        if p.dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {p.dtype}; the kernel supports {SUPPORTED_DTYPES}"
        devices.add(p.device)
        for t, k in state.get(id(p), ()):
            if k not in (1, 2):
                return f"the optimizer state of {name} moves with power {k}; the kernel takes powers 1 and 2"
            if is_dtensor(t):
                return f"the optimizer state of {name} is a DTensor (FSDP2)"
            if t.dtype not in SUPPORTED_DTYPES:
                return f"the optimizer state of {name} has dtype {t.dtype}"
    if len(devices) > 1:
        return f"parameters on several devices {sorted(map(str, devices))}"
    for plan in plans:
        members = plan.members_a + plan.members_b
        for m in members:
            if m.offset:
                return (f"{m.ref.name} is a QK-norm gain stored with offset {m.offset} (the gain is {m.offset} + w): "
                        "the fused kernel scales the stored tensor; the torch backend writes (w + offset)·s − offset")
            if not m.measured:
                return (f"{m.ref.name} travels with its gain without entering its scale (a LayerNorm bias); the "
                        "fused kernel measures every tensor it rescales")
        if len({m.ref.param.dtype for m in members}) > 1:
            return f"{plan.site.name}: the {plan.kind} tensors mix dtypes"
        sdt = {t.dtype for m in members for t, _ in state.get(id(m.ref.param), ())}
        if len(sdt) > 1:
            return f"{plan.site.name}: the optimizer state of the {plan.kind} tensors mixes dtypes {sorted(map(str, sdt))}"
    return None


def storage_fingerprint(plans: Sequence[PairPlan], state: StateMap) -> tuple:
    """What packed tables depend on: every parameter's and transported state tensor's storage."""
    fp = []
    for _, p in plan_parameters(plans).values():
        fp.append(local_view(p).data_ptr())
        fp.extend(local_view(t).data_ptr() for t, _ in state.get(id(p), ()))
        fp.append(-1)
    return tuple(fp)


def _fix_pair(plan: PairPlan, state: StateMap):
    from gaugeopt.kernels.gaugefix.spec import FixPair, FixTensor

    params, states = [], []
    for side_i, (_, members) in enumerate(plan.sides()):
        for m in members:
            p = m.ref.param
            params.append(FixTensor(m.ref.view(p.detach()), side_i, 0, m.columns))
            states += [FixTensor(m.ref.view(t), side_i, k, m.columns) for t, k in state.get(id(p), ())]
    return FixPair(params + states, plan.groups, plan.width, plan.slot.tolist(), plan.n_slots,
                   plan.a.repeat, plan.b.repeat)


class TritonFix:
    """The fix of ``plans`` in one fused launch per dtype group; same contract as
    :class:`~gaugeopt.fix.torch_backend.TorchFix`. Pack once, :meth:`run` many times while
    :func:`storage_fingerprint` is unchanged."""

    name = "triton"

    def __init__(self, plans: Sequence[PairPlan], state: StateMap, *, eps: float = 1e-12,
                 product_decay: float | None = None, product_max: float | None = None) -> None:
        from gaugeopt.kernels.gaugefix.fused import prepare

        self.plans = list(plans)
        self.fingerprint = storage_fingerprint(self.plans, state)
        self._prepared = prepare([_fix_pair(p, state) for p in self.plans], eps=eps,
                                 product_decay=product_decay, product_max=product_max)

    @torch.no_grad()
    def run(self) -> list[PairNumbers]:
        return [PairNumbers(*r) for r in self._prepared.run()]
