"""QK-Clip after real optimizer steps: the step core of the Lightning, Hugging Face and plain-loop forms.

:class:`ClipSteps` is a :class:`~gaugeopt.integrations.steps.StepCounter` (the core the GaugeFix and
projection integrations share: the optimizer owning the attention parameters, its real steps counted
through its step hooks, counters in checkpoints). It adds one thing, a
:class:`~gaugeopt.clip.logits.LogitTracker` on the attention modules, switched on only for the
training forwards (gradients enabled) of a step that will be clipped — every micro-batch of it under
gradient accumulation; a validation loop under ``torch.no_grad`` is not read. After every
``every``-th real step, in the optimizer's step post-hook, it calls :func:`gaugeopt.qk_clip` with
those maxima (MAX-reduced across DDP ranks), the optimizer's state transported.

The maxima are those of the forward that produced the step's gradients, taken with the weights
before the step (Kimi K2's MuonClip and Megatron-LM measure them in the same forward); the clip
then acts on the stepped weights.

**With GaugeFix: clip the magnitude, then balance.** Hooks on one optimizer run in rank order: a
projection (0) sees the step the optimizer took, the clip (0.5) caps the heads' logits, GaugeFix (1)
balances the clipped rows' Q/K scales, whatever the order in which the callbacks were given.
:class:`gaugeopt.GaugeOptimizer` with ``fix_every`` fixes inside its own step, before any post-hook,
so it is refused here: use the GaugeFix callback (or :class:`~gaugeopt.integrations.steps.FixSteps`)
beside this one.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.integrations.clip import ClipSteps
    >>> from gaugeopt.integrations.steps import FixSteps
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)))
    >>> opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2))
    >>> fix = FixSteps(every=1).watch(model, opt)
    >>> clip = ClipSteps(tau=0.08).watch(model, opt)          # runs before the fix on every step
    >>> x = torch.randint(0, 64, (2, 16))
    >>> for _ in range(3):
    ...     model(x, x)[1].backward(); opt.step(); opt.zero_grad()
    >>> r = clip.last_report
    >>> clip.state_dict(), r.heads_over > 0, r.max_logit_after <= 0.08 + 1e-6, gaugeopt.qk_drift(model) < 1e-6
    ({'optimizer_steps': 3, 'clips': 3}, True, True, True)
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.clip.qk_clip import QKClipReport, clip_sites
from gaugeopt.fix.transport import UNKNOWN_STATE_POLICIES
from gaugeopt.fix.unwrap import wrapped_chain
from gaugeopt.integrations.steps import StepCounter
from gaugeopt.clip.logits import LogitTracker
from gaugeopt.records.site import AttentionSite

__all__ = ["ClipSteps"]


class ClipSteps(StepCounter):
    """QK-Clip (:func:`gaugeopt.qk_clip`) after every ``every``-th real optimizer step.

    Args:
        tau: the cap on each head's maximum logit (Kimi K2: 100).
        every: clip after optimizer steps ``every, 2·every, ...``; the logits are read only in the
            forwards of those steps.
        alpha: the query side's share of the rescale (0.5: both sides ``√η``).
        transport_state: transport the optimizer state of the rescaled tensors.
        unknown_state: ``"error"``, ``"reset"`` or ``"leave"`` for an optimizer without a state rule.
        sites: attention sites (default: ``find_attention(model)`` at :meth:`bind`).
        log_per_layer: also report each layer's largest maximum before the clip.
        prefix: metric name prefix.
        certify: as :class:`~gaugeopt.integrations.steps.StepCounter`.

    Metrics of each clip: ``{prefix}max_logit_before``, ``{prefix}max_logit_after`` (on the same batch),
    ``{prefix}heads_over``, ``{prefix}heads_rescaled``, ``{prefix}heads_skipped``, ``{prefix}min_factor``,
    ``{prefix}clips``.
    """

    hook_rank = 0.5  # after a projection (0), before GaugeFix (1): clip the magnitude, then balance

    def __init__(
        self,
        tau: float = 100.0,
        every: int = 1,
        *,
        alpha: float = 0.5,
        transport_state: bool = True,
        unknown_state: str = "error",
        sites: Sequence[AttentionSite] | None = None,
        log_per_layer: bool = False,
        prefix: str = "qk_clip/",
        certify: bool = True,
    ) -> None:
        super().__init__(every, sites, prefix, certify)
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
            raise GaugeError(f"tau={tau!r} must be a positive finite number (the largest logit a head may keep)")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise GaugeError(f"alpha={alpha!r} must be in [0, 1] (the query side's share of the rescale)")
        if unknown_state not in UNKNOWN_STATE_POLICIES:
            raise GaugeError(f"unknown_state={unknown_state!r} is not one of {UNKNOWN_STATE_POLICIES}")
        self.options = dict(tau=float(tau), alpha=float(alpha), transport_state=transport_state, unknown_state=unknown_state)
        self.log_per_layer = log_per_layer
        self.clips = 0
        self.last_report: QKClipReport | None = None
        self._tracker: LogitTracker | None = None

    # -- wiring ----------------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer``'s steps and the attention modules' forwards (read only in the training
        forwards of a clipping step); :meth:`detach` removes both."""
        super().attach(optimizer)  # detaches first
        self._tracker = LogitTracker(self.sites, active=self._measuring, grad_only=True)

    def _measuring(self) -> bool:
        return self.runs_next()

    def _close_tracker(self) -> None:
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def detach(self) -> None:
        """Remove the step hooks and the forward hooks."""
        super().detach()
        self._close_tracker()

    def check_conflicts(self, optimizers) -> None:
        """Refuse a :class:`gaugeopt.GaugeOptimizer` with ``fix_every``: it balances inside its own step,
        before this clip could run (the order must be clip, then balance)."""
        for o in wrapped_chain(optimizers):
            if getattr(o, "fix_every", None):
                raise GaugeError(
                    f"the optimizer is a {type(o).__name__} with fix_every={o.fix_every}, which balances the gauge "
                    f"inside its step, before {type(self).__name__} could clip; clip first and balance after: use "
                    "fix_every=None and the GaugeFix callback (or FixSteps) beside this one"
                )

    # -- the action ------------------------------------------------------------------------
    def _act(self, optimizer) -> dict[str, float]:
        maxima = self._tracker.pop() if self._tracker is not None else {}
        unread = [s for s in self.sites if s.name not in maxima]
        for s in unread:  # nothing read since the last clip (a step without a training forward): nothing to clip
            maxima[s.name] = torch.full((s.h,), -math.inf)
        opts = self.options
        owners = self._optimizers or [optimizer]
        # the records passed this counter's gate (re-checked in the step post-hook, before this action)
        report = clip_sites(self.sites, owners if opts["transport_state"] else None, maxima, opts["tau"], opts["alpha"],
                            transport_state=opts["transport_state"], unknown_state=opts["unknown_state"])
        self.clips += 1
        self.last_report = report
        out = report.as_dict(prefix=self.prefix)
        out[f"{self.prefix}clips"] = float(self.clips)
        if unread:
            out[f"{self.prefix}layers_unread"] = float(len(unread))
        if self.log_per_layer:
            for lc in report.layers:
                out[f"{self.prefix}max_logit_before/{lc.name}"] = max(
                    (m for m in lc.max_before if math.isfinite(m)), default=math.nan)
        return out

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "clips": self.clips}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.clips = int(state_dict.get("clips", 0))
