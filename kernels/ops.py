"""Public entry points that route each operation to its Triton kernel or its torch reference.

Each function takes the arguments of the torch operation plus ``backend`` (``"auto"``,
``"triton"`` or ``"torch"``; see :mod:`gaugeopt.kernels.dispatch`), decides once per call and
records why (:func:`gaugeopt.kernels.dispatch.explain`).

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.kernels import dispatch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)))
    >>> report = gaugeopt.gauge_fix(model)           # CPU tensors: the torch reference runs
    >>> dispatch.last_decision("gauge_fix").backend
    'torch'
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn as nn

from gaugeopt.fix.plan import PairPlan, plan_pairs
from gaugeopt.errors import GaugeError
from gaugeopt.fix.gaugefix import GaugeFixReport
from gaugeopt.structure.site import AttentionSite, find_attention

from . import dispatch

__all__ = ["try_fused_gauge_fix", "FusedGaugeFix", "fused_vertical", "fused_project"]


def _gaugefix_unsupported(plans, optimizer):
    def check() -> str | None:
        from .gaugefix_triton import unsupported_reason

        return unsupported_reason(plans, optimizer)

    return check


def try_fused_gauge_fix(
    plans: Sequence[PairPlan],
    optimizer=None,
    *,
    backend: str = "auto",
    unknown_state: str = "error",
    product_decay: float | None = None,
    product_max: float | None = None,
    eps: float = 1e-12,
) -> GaugeFixReport | None:
    """Run the fused GaugeFix kernel on ``plans`` if the dispatch picks Triton, else return ``None``.

    The hook for :func:`gaugeopt.gauge_fix`: call it right after planning and fall through to
    the torch body when it returns ``None``. ``optimizer=None`` means no state transport.

    Raises:
        GaugeError: Triton was forced (argument or ``GAUGEOPT_BACKEND``) and cannot run.
    """
    plans = list(plans)
    device = plans[0].a.members[0][1].param.device if plans else None
    if device is None:
        raise GaugeError("try_fused_gauge_fix: no plans (the model has no attention site to fix)")
    d = dispatch.choose("gauge_fix", device, backend=backend, module="gaugefix_triton",
                        unsupported=_gaugefix_unsupported(plans, optimizer))
    if d.backend == "torch":
        return None
    from .gaugefix_triton import gauge_fix_triton

    return gauge_fix_triton(plans, optimizer, unknown_state=unknown_state, product_decay=product_decay,
                            product_max=product_max, eps=eps)


class FusedGaugeFix:
    """:func:`gaugeopt.gauge_fix`, planned once and dispatched once: call it after optimizer steps.

    Finds the sites and plans at construction, decides the backend once (the decision and its
    reason: ``.decision``), and on the Triton path keeps the packed descriptor tables while the
    parameters' and the optimizer state's storage stay put (checked each call by
    :func:`gaugeopt.kernels.gaugefix_triton.fingerprint`), so a call is one launch plus the
    report. Arguments as :func:`gaugeopt.gauge_fix`, plus ``backend``.

    Example:
        >>> import torch, gaugeopt
        >>> from gaugeopt.kernels import FusedGaugeFix
        >>> from gaugeopt.models import GPT, GPTConfig
        >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)))
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> fix = FusedGaugeFix(model, opt)
        >>> fix.decision.backend, fix().max_drift_after < 1e-6
        ('torch', True)
    """

    def __init__(
        self,
        model: nn.Module | None,
        optimizer=None,
        granularity: str = "auto",
        *,
        sites: Sequence[AttentionSite] | None = None,
        vo: bool = False,
        vo_granularity: str = "head",
        mode: str = "auto",
        transport_state: bool = True,
        unknown_state: str = "error",
        product_decay: float | None = None,
        product_max: float | None = None,
        eps: float = 1e-12,
        backend: str = "auto",
    ) -> None:
        if model is None and sites is None:
            raise GaugeError("FusedGaugeFix: pass a model or sites=find_attention(model)")
        self.sites = find_attention(model) if sites is None else list(sites)
        self.plans = plan_pairs(self.sites, kinds=("qk", "vo") if vo else ("qk",), granularity=granularity,
                                vo_granularity=vo_granularity, mode=mode)
        self.optimizer = optimizer
        self._torch_kw = dict(granularity=granularity, sites=self.sites, vo=vo, vo_granularity=vo_granularity, mode=mode,
                              transport_state=transport_state, unknown_state=unknown_state,
                              product_decay=product_decay, product_max=product_max, eps=eps)
        self._triton_kw = dict(unknown_state=unknown_state, product_decay=product_decay, product_max=product_max, eps=eps)
        self._state_opt = optimizer if transport_state else None
        device = self.plans[0].a.members[0][1].param.device
        self.decision = dispatch.choose("gauge_fix", device, backend=backend, module="gaugefix_triton",
                                        unsupported=_gaugefix_unsupported(self.plans, self._state_opt))
        self._prepared = None
        self._fingerprint = None

    def __call__(self) -> GaugeFixReport:
        if self.decision.backend == "torch":
            from .gaugefix_reference import gauge_fix_reference

            kw = dict(self._torch_kw)
            return gauge_fix_reference(None, self.optimizer, kw.pop("granularity"), **kw)
        from .gaugefix_triton import fingerprint, prepare_fix

        fp = fingerprint(self.plans, self._state_opt)
        if self._prepared is None or not self._prepared.reusable or fp != self._fingerprint:
            self._prepared = prepare_fix(self.plans, self._state_opt, **self._triton_kw)
            self._fingerprint = fingerprint(self.plans, self._state_opt)  # after a "reset" dropped state
        return self._prepared.run()


# ---------------------------------------------------------------------- projection (closed forms)
def _projection_choice(model, tensors, sector, sites, backend):
    sites = find_attention(model) if sites is None else list(sites)
    if not isinstance(tensors, Mapping):
        raise GaugeError(f"tensors must be a {{name: tensor}} mapping (names of model.named_parameters()), got {type(tensors).__name__}")
    device = next(iter(model.parameters())).device

    def check() -> str | None:
        from .projection_triton import unsupported_reason

        return unsupported_reason(sites, sector, tensors)

    return sites, dispatch.choose(f"project_{sector}", device, backend=backend, module="projection_triton", unsupported=check)


def fused_vertical(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    sector: str,
    *,
    sites: Sequence[AttentionSite] | None = None,
    rtol: float | None = None,
    backend: str = "auto",
) -> dict[str, torch.Tensor]:
    """Vertical part of ``tensors`` in one closed-form ``sector`` (``"lrm_qk"``, ``"lrm_vo"``,
    or ``"qk"`` under full-rotary RoPE): ``GaugeProjector(model, sectors=(sector,)).vertical``,
    fused into one launch on CUDA. Other sectors (dense Sylvester) always take torch under
    ``"auto"`` and are refused when Triton is forced."""
    sites, d = _projection_choice(model, tensors, sector, sites, backend)
    if d.backend == "triton":
        from .projection_triton import vertical_triton

        return vertical_triton(sites, sector, tensors, rtol=rtol)
    from .projection_reference import vertical_reference

    return vertical_reference(model, tensors, sector, sites=sites, rtol=rtol)


def fused_project(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    sector: str,
    *,
    sites: Sequence[AttentionSite] | None = None,
    rtol: float | None = None,
    inplace: bool = False,
    backend: str = "auto",
) -> dict[str, torch.Tensor]:
    """Horizontal part ``u − u_vert`` of ``tensors`` in one closed-form ``sector``:
    ``GaugeProjector(model, sectors=(sector,)).project(tensors, inplace=inplace)`` (a dict with
    every input key plus the sector's parameters)."""
    sites, d = _projection_choice(model, tensors, sector, sites, backend)
    if d.backend == "triton":
        from .projection_triton import vertical_triton

        out = vertical_triton(sites, sector, tensors, rtol=rtol, subtract=True, inplace=inplace)
        return {**tensors, **out}
    from .projection_reference import project_reference

    return project_reference(model, tensors, sector, sites=sites, rtol=rtol, inplace=inplace)
