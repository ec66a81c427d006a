"""Which sectors a projector hands to the fused Triton kernels, decided once per kind of input.

:class:`~gaugeopt.projection.projector.GaugeProjector` projects the closed-form sectors
(:data:`~gaugeopt.projection.triton_backend.FUSED_SECTORS`: ``lrm_qk``, ``lrm_vo`` and the ``qk``
sector of full-rotary RoPE layers) in one Triton launch when the dispatch
(:mod:`gaugeopt.kernels.dispatch`) picks Triton, and everything else in torch. A sector goes to
the kernel only

* when it is projected on its own: no ``lrm_internal`` among the requested sectors (it overlaps
  them all: a joint projection), and no ``qk`` beside ``key_bias`` (they share ``b̄_K``);
* at the model's own weights (no ``at=``) and in the inputs' dtype (no explicit ``dtype=``);
* when the dispatch says so for these tensors (CUDA, Triton importable, supported dtypes, one
  device, no DTensor — :func:`~gaugeopt.projection.triton_backend.unsupported_reason`).

The last rule depends on the field only through each tensor's dtype, device and type, and on the
requested backend (the argument, or ``GAUGEOPT_BACKEND``). :class:`KernelRoute` decides once per
such signature and keeps the decisions: a training loop that projects the same kind of field
every step pays for one decision, not one per sector per step. A reused decision is recorded
again (:func:`gaugeopt.kernels.dispatch.last_decision` names the path that ran).

Example:
    >>> import torch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.projection.projector import GaugeProjector
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, rope="split_half"))
    >>> proj = GaugeProjector(model)
    >>> proj.route.split({}, ("qk", "vo"), at=None, dtype=None)  # CPU tensors: torch
    ([], ('qk', 'vo'))
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from gaugeopt.kernels import dispatch
from gaugeopt.projection import joint
from gaugeopt.projection.triton_backend import FUSED_SECTORS, fused_refs, unsupported_reason
from gaugeopt.records.site import AttentionSite

__all__ = ["KernelRoute"]


def _signature(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.dtype, t.device, type(t))


class KernelRoute:
    """The fused-kernel decisions of one projector.

    Args:
        sites: the projector's attention sites.
        params: ``{name: parameter}`` of the model.
        device: where the parameters live (the dispatch's device).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (as :class:`~gaugeopt.projection.projector.GaugeProjector`).
    """

    def __init__(self, sites: Sequence[AttentionSite], params: Mapping[str, torch.Tensor], device: torch.device,
                 backend: str) -> None:
        self.sites, self.params, self.device, self.backend = list(sites), params, device, backend
        self._names: dict[str, list[str]] = {}  # the tensors each fused sector reads: its decision depends on them
        self._decided: dict[tuple, dict[str, dispatch.Decision]] = {}

    def split(self, given: Mapping[str, torch.Tensor | None], secs: tuple[str, ...], *, at, dtype) -> tuple[
            list[str], tuple[str, ...]]:
        """``(fused, rest)``: the sectors the kernel projects now, and the others (torch, in order)."""
        if at is not None or dtype is not None or any(s in joint.OVERLAPPING for s in secs):
            return [], secs
        candidates = tuple(s for s in secs if s in FUSED_SECTORS and not (s == "qk" and "key_bias" in secs))
        if not candidates:
            return [], secs
        for s in candidates:
            if s not in self._names:
                self._names[s] = [r.name for r in fused_refs(self.sites, s)]
        names = dict.fromkeys(n for s in candidates for n in self._names[s])
        key = (candidates, dispatch.requested_backend(self.backend), dispatch.interpreter_requested(),
               tuple((_signature(self.params[n]), _signature(given.get(n))) for n in names))
        decisions = self._decided.get(key)
        if decisions is None:
            decisions = {s: dispatch.choose(f"project_{s}", self.device, backend=self.backend, module="projection.fused",
                                            unsupported=lambda s=s: unsupported_reason(self.sites, s, given))
                         for s in candidates}
            self._decided[key] = decisions
        else:
            for d in decisions.values():
                dispatch.remember(d)
        fused = [s for s in candidates if decisions[s].backend == "triton"]
        return fused, tuple(s for s in secs if s not in fused)
