"""Acting after real optimizer steps: the framework-free core of every training-loop integration.

The Lightning callbacks (:mod:`gaugeopt.integrations.lightning`), the Hugging Face Trainer
callbacks (:mod:`gaugeopt.integrations.transformers`) and loops written by hand (torchtitan,
``docs/integrations.md``) all do the same four things, implemented here once:

* **which optimizers** — :func:`~gaugeopt.fix.unwrap.owning_optimizers`: the optimizers that step
  the parameters an action touches (Muon for the matrices beside AdamW for the multipliers and
  biases: both), found by the one walk through the wrappers (:mod:`gaugeopt.fix.unwrap`): wrappers
  whose ``step()`` runs even when nothing is stepped are looked through (Accelerate's
  ``AcceleratedOptimizer`` reports ``step_was_skipped``; the optimizer it wraps is watched), and so
  are containers of optimizers (torchtitan's ``OptimizersContainer.optimizers``); a
  :class:`gaugeopt.GaugeOptimizer` is watched itself (its step is a whole projected round).
* **counting real steps** — :class:`StepCounter` counts with the integrations' one counter
  (:class:`~gaugeopt.integrations.schedule.Schedule`) and attaches ``register_step_pre_hook`` /
  ``register_step_post_hook`` to those optimizers, so it counts the steps they really take: a
  ``GradScaler`` that finds inf/NaN gradients does not call ``optimizer.step`` (no count, no
  action), gradient accumulation calls it once per ``k`` batches. With several owners a step is a
  *round*: it is complete when every owner has stepped since the last complete round (in a loop
  ``backward(); muon.step(); adamw.step()``, right after ``adamw.step()``); an owner whose step a
  ``GradScaler`` skipped keeps the round open until its next real step. A fix at the end of a round
  that closes in the middle of an iteration is still exact: the gradients not yet consumed travel
  with the rescale (:class:`~gaugeopt.fix.gaugefix.GaugeFixer`).
* **acting every N** — after every ``every``-th step (:meth:`StepCounter.should_run`) it acts in
  the post-hook, right after the step and before gradients are zeroed; the metrics wait in
  :meth:`StepCounter.pop_metrics` for the framework's logger.
* **checkpoints** — ``state_dict()`` holds the counters only; ``load_state_dict`` restores them,
  so a resumed run acts at the same steps as an uninterrupted one.

:class:`FixSteps` runs GaugeFix-LRM (one :class:`~gaugeopt.fix.gaugefix.GaugeFixer`, planned once)
after every ``every``-th step; :class:`ProjectSteps` projects every step with the functions of
:mod:`gaugeopt.projection.step` that :class:`gaugeopt.GaugeOptimizer` uses.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.integrations.steps import FixSteps
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    >>> model = gaugeopt.apply_lrm(GPT(cfg))
    >>> opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2))
    >>> fix = FixSteps(every=2).watch(model, opt)          # hooks opt; nothing else to call
    >>> x = torch.randint(0, 64, (2, 16))
    >>> for _ in range(4):
    ...     model(x, x)[1].backward(); opt.step(); opt.zero_grad()
    >>> fix.state_dict(), gaugeopt.qk_drift(model) < 1e-6, sorted(fix.pop_metrics())[:3]
    ({'optimizer_steps': 4, 'fixes': 2}, True, ['gauge/certificate/weakest_control', 'gauge/certificate/worst_valid', 'gauge/fixes'])
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.fix.gaugefix import GaugeFixer
from gaugeopt.fix.options import FixOptions, check_choice, resolve_options
from gaugeopt.fix.plan import plan_pairs
from gaugeopt.fix.unwrap import owning_optimizer, owning_optimizers, wrapped_chain
from gaugeopt.integrations.schedule import Schedule, check_every
from gaugeopt.trust.proof import CertificateReport
from gaugeopt.trust.gate import Gate
from gaugeopt.records.site import AttentionSite

__all__ = ["check_every", "owning_optimizer", "owning_optimizers", "StepCounter", "FixSteps", "ProjectSteps"]


# optimizer -> the counters attached to it, so that their hooks run in a fixed order (below)
_ATTACHED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[StepCounter]]" = weakref.WeakKeyDictionary()


class StepCounter:
    """Count the real steps of the optimizer that owns the attention parameters; act after every
    ``every``-th (:meth:`_act`, overridden by :class:`FixSteps` and :class:`ProjectSteps`).

    Args:
        every: act after optimizer steps ``every, 2·every, ...``.
        sites: attention sites (default: ``find_attention(model)`` at :meth:`bind`).
        prefix: prefix of the metric names.
        certify: prove the records automatically — at :meth:`bind` on an input gaugeopt makes up for
            the models it knows, else on the first training batch (:meth:`begin_certificate` when the
            batch starts, :meth:`finish_certificate` before the first action); ``False`` refuses
            records at :meth:`bind` unless the model was proved already (:func:`gaugeopt.certify`).
    """

    # Hooks on one optimizer run by this rank, then in the order attached: a projection (0) must
    # see the step the optimizer took, before a fix (1) moves the point along the orbit — else it
    # would take the fix for a vertical step and undo it.
    hook_rank = 1

    def __init__(self, every: int, sites: Sequence[AttentionSite] | None = None, prefix: str = "gauge/",
                 certify: bool = True) -> None:
        if not isinstance(certify, bool):
            raise GaugeError(f"certify={certify!r} must be True or False")
        self.certify = certify
        self.certificate: CertificateReport | None = None
        self._gate: Gate | None = None
        self.schedule = Schedule(every)
        self._given_sites = None if sites is None else list(sites)
        self.prefix = prefix
        self.sites: list[AttentionSite] = []
        self._module: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None  # the first of _optimizers
        self._optimizers: list[torch.optim.Optimizer] = []
        self._handles: list = []
        self._pending: dict[str, float] = {}

    # -- policy ----------------------------------------------------------------------------
    @property
    def every(self) -> int:
        """Act after optimizer steps ``every, 2·every, ...`` (the :attr:`schedule`'s)."""
        return self.schedule.every

    @property
    def optimizer_steps(self) -> int:
        """Real optimizer steps (rounds, with several owners) counted so far."""
        return self.schedule.steps

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self.schedule.steps = value

    def should_run(self, step: int) -> bool:
        """Whether to act after optimizer step ``step`` (1-based); override for other schedules."""
        return self.schedule.due(step)

    def runs_next(self) -> bool:
        """Whether the next optimizer step will be acted on (:meth:`should_run` of the next step)."""
        return self.should_run(self.optimizer_steps + 1)

    # -- wiring ----------------------------------------------------------------------------
    def bind(self, model: nn.Module) -> None:
        """Pass ``model``'s attention records (or the ``sites`` given) through the gate
        (:class:`~gaugeopt.trust.gate.Gate`: checked, and proved now or on the first training
        batch) and validate the options against them."""
        self._module = model
        self._gate = Gate(model, type(self).__name__, sites=self._given_sites, automatic=self.certify)
        self.sites = self._gate.sites
        self._take_certificate()
        self._validate(self.sites)

    def _validate(self, sites: list[AttentionSite]) -> None:
        pass

    def watched_params(self) -> list[torch.Tensor]:
        """Every tensor of the bound sites (weights, biases, multipliers of Q/K/V/O)."""
        return [ref.param for s in self.sites for _, ref in s.refs()]

    def check_conflicts(self, optimizers) -> None:
        """Refuse an optimizer that already does this callback's job (see the subclasses)."""

    def attach(self, optimizer) -> None:
        """Hook the steps of ``optimizer`` — one, or a list of the optimizers that own the parameters
        (removing earlier hooks); with other counters on the same optimizer, projections' hooks run
        before the others' whatever the order of attaching. Several optimizers step in rounds (module
        docstring)."""
        self.detach()
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        self._optimizers, self._optimizer = optimizers, optimizers[0]
        self.schedule.expect(len(optimizers))
        for opt in optimizers:
            peers = _ATTACHED.setdefault(opt, [])
            peers.append(self)
            for c in peers:
                c._unhook(opt)
            for c in sorted(peers, key=lambda c: c.hook_rank):  # stable: attach order within a rank
                c._handles += [
                    (opt, opt.register_step_pre_hook(c._pre_step)),
                    (opt, opt.register_step_post_hook(c._post_step)),
                ]

    def detach(self) -> None:
        """Remove the step hooks."""
        self._unhook()
        for opt in self._optimizers:
            if self in _ATTACHED.get(opt, ()):
                _ATTACHED[opt].remove(self)

    def _unhook(self, optimizer=None) -> None:
        keep = []
        for opt, h in self._handles:
            if optimizer is None or opt is optimizer:
                h.remove()
            else:
                keep.append((opt, h))
        self._handles = keep

    def watch(self, model: nn.Module | Sequence[nn.Module], optimizers) -> "StepCounter":
        """:meth:`bind` ``model`` (or a list of model parts), check ``optimizers`` (one or several)
        for conflicts and :meth:`attach` those owning the watched parameters; returns ``self``."""
        if isinstance(model, (list, tuple)):
            model = nn.ModuleList(model)
        self.bind(model)
        self.check_conflicts(optimizers)
        self.attach(owning_optimizers(optimizers, self.watched_params(), type(self).__name__))
        return self

    # -- the certificate -------------------------------------------------------------------
    def begin_certificate(self) -> None:
        """At the start of a training batch: record the real calls of the attention modules whose
        records still need a proof (nothing to do once they are proved)."""
        if self.certify and self._gate is not None:
            self._gate.record_next_forward()

    def finish_certificate(self) -> None:
        """Before every action: re-check the records (:meth:`Gate.ensure`, a few lookups when nothing
        changed) — proving them on the calls recorded since :meth:`begin_certificate` the first time,
        finding, checking and proving them again after model surgery. A record that fails raises
        :class:`GaugeError` naming the layer and the sector."""
        if self._gate is None:
            return
        changed = self._gate.ensure()
        self._take_certificate()
        if changed:
            self.sites = self._gate.sites
            self._validate(self.sites)

    def _take_certificate(self) -> None:
        report = self._gate.certificate
        if report is not None and report is not self.certificate:
            self.certificate = report
            self._pending.update({f"{self.prefix}{k}": v for k, v in report.as_dict().items()})

    # -- the hooks -------------------------------------------------------------------------
    def _pre_step(self, optimizer, args, kwargs) -> None:
        if self.schedule.opening:  # the first step of a round
            self._begin_round(optimizer, args, kwargs)

    def _post_step(self, optimizer, args, kwargs) -> None:
        self.finish_certificate()  # loops without a hook between the forward and the step
        if not self.schedule.stepped(id(optimizer)):
            return  # another owner has still to step in this round
        self._end_round(optimizer)
        if self.should_run(self.optimizer_steps):
            self._pending.update(self._act(optimizer))

    def _begin_round(self, optimizer, args, kwargs) -> None:
        """Before the first optimizer of a round steps (every step with one optimizer)."""

    def _end_round(self, optimizer) -> None:
        """After the last optimizer of a round stepped, before :meth:`_act`."""

    def _act(self, optimizer) -> dict[str, float]:
        return {}

    def pop_metrics(self) -> dict[str, float]:
        """The metrics of the actions since the last call (latest value per name), and forget them."""
        out, self._pending = self._pending, {}
        return out

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer_steps = int(state_dict["optimizer_steps"])


class FixSteps(StepCounter):
    """GaugeFix-LRM (:func:`gaugeopt.gauge_fix`) after every ``every``-th real optimizer step.

    Args:
        every: fix after optimizer steps ``every, 2·every, ...`` (paper 002: 1, 10, 100, 1000;
            100 gave the best validation loss).
        granularity: the one fix option that may be given by position.
        options: a :class:`~gaugeopt.fix.options.FixOptions`; keyword arguments replace its fields.
        sites: attention sites (default: ``find_attention(model)`` at :meth:`bind`).
        log_per_layer: also report per-layer drift and scale product.
        prefix: metric name prefix.
        certify: as :class:`StepCounter`.
        **fix_options: any field of :class:`~gaugeopt.fix.options.FixOptions` (``granularity``,
            ``transport_state``, ``vo``, ``vo_granularity``, ``mode``, ``unknown_state``,
            ``product_decay``, ``product_max``, ``eps``, ``backend``, ``rescale_frozen``), validated
            here; the refusals that depend on the model (``granularity="channel"`` under RoPE,
            ``mode="lrm"`` without multipliers) at :meth:`bind`.

    The options are :attr:`options` (a :class:`~gaugeopt.fix.options.FixOptions`, also readable as
    ``options["vo"]``). Metrics of each fix: ``{prefix}qk_drift_before``, ``{prefix}qk_drift_after``,
    ``{prefix}qk_scale_product_mean``/``_max``, ``{prefix}heads_fixed``, ``{prefix}fixes``, ...
    (:meth:`~gaugeopt.fix.report.GaugeFixReport.as_dict`).
    """

    def __init__(
        self,
        every: int = 100,
        granularity: str | None = None,
        *,
        options: FixOptions | None = None,
        sites: Sequence[AttentionSite] | None = None,
        log_per_layer: bool = False,
        prefix: str = "gauge/",
        certify: bool = True,
        **fix_options: Any,
    ) -> None:
        super().__init__(every, sites, prefix, certify)
        self.options = resolve_options(options, fix_options, type(self).__name__, granularity=granularity)
        self.log_per_layer = log_per_layer
        self.fixes = 0
        self.last_report = None
        self._fixer: GaugeFixer | None = None

    def _new_fixer(self, optimizers) -> GaugeFixer:
        """A :class:`~gaugeopt.fix.gaugefix.GaugeFixer` over the bound sites and ``optimizers``
        (planned once, kernel tables reused; the state is classified by :meth:`_end_round`)."""
        return GaugeFixer(self._module, optimizers, sites=self.sites, options=self.options, check_first_step=False)

    def _validate(self, sites: list[AttentionSite]) -> None:
        plan_pairs(sites, self.options)  # the refusals, now
        # bound to (new) sites: built again now when optimizers are attached (model surgery), else at attach
        self._fixer = self._new_fixer(self._optimizers) if self._optimizers else None

    def attach(self, optimizer) -> None:
        """Hook the owners' steps and build the fixer over them now, so that their state is
        classified at set-up (or right after their first step), not at step ``every``."""
        super().attach(optimizer)
        self._fixer = self._new_fixer(self._optimizers)
        self._state_checked = False

    def _fixer_for(self, optimizer) -> GaugeFixer:
        """The fixer over the attached optimizers (``optimizer`` when none was attached)."""
        if self._fixer is None:
            self._fixer = self._new_fixer(self._optimizers or [optimizer])
        return self._fixer

    def _end_round(self, optimizer) -> None:
        """After the first round, classify the state its steps created: an unknown key is refused
        now, not at step ``every``."""
        if not getattr(self, "_state_checked", True) and self._fixer is not None:
            self._state_checked = True
            self._fixer.check_state()

    def check_conflicts(self, optimizers) -> None:
        """A :class:`gaugeopt.GaugeOptimizer` with ``fix_every`` already fixes: refuse fixing twice."""
        for o in wrapped_chain(optimizers):
            if getattr(o, "fix_every", None):
                raise GaugeError(
                    f"the optimizer is a {type(o).__name__} with fix_every={o.fix_every} and {type(self).__name__} is "
                    "also active: the model would be fixed twice. Use one of them (fix_every=None, or drop the callback)"
                )

    def _act(self, optimizer) -> dict[str, float]:
        report = self._fixer_for(optimizer)()
        self.fixes += 1
        self.last_report = report
        out = report.as_dict(prefix=self.prefix, per_layer=self.log_per_layer)
        out[f"{self.prefix}fixes"] = float(self.fixes)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fixes": self.fixes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.fixes = int(state_dict.get("fixes", 0))


def _has_closure(args, kwargs) -> bool:
    return kwargs.get("closure") is not None or any(callable(a) for a in args)


class ProjectSteps(StepCounter):
    """Project every real optimizer step (or its gradient) off the gauge orbits.

    ``target="update"`` snapshots the gauge parameters in the step pre-hook and replaces the step
    taken by its horizontal part in the post-hook (:func:`~gaugeopt.projection.step.remove_vertical_update_`).
    ``target="grad"`` projects the gradients in the pre-hook — they are final there (accumulated,
    unscaled, clipped) unless the step evaluates a closure, as Lightning's does; such a framework
    calls :meth:`project_grads` once the closure has produced them.

    Args:
        mode: ``"exact"`` (Sylvester), ``"approx"`` (a few preconditioned CG steps, never leaving more
            vertical part than the step had) or ``"paper000"`` (paper 000 Algorithm 2, for comparison).
        target: ``"update"`` or ``"grad"``.
        sectors: ``"auto"`` or a subset of :data:`gaugeopt.projection.projector.SECTORS`.
        log_every: report ``{prefix}vertical_fraction_{target}`` (the fraction removed) every this
            many optimizer steps; reading it is the only host synchronisation.
        sites: attention sites (default: every gauge sector of the model).
        prefix: metric name prefix.
        **projector_kwargs: extra options for :class:`gaugeopt.GaugeProjector`.
    """

    hook_rank = 0  # before a fix on the same optimizer (StepCounter.attach)

    def __init__(
        self,
        mode: str = "exact",
        target: str = "update",
        *,
        sectors: str | Sequence[str] = "auto",
        log_every: int = 50,
        sites: Sequence[AttentionSite] | None = None,
        prefix: str = "gauge/",
        certify: bool = True,
        **projector_kwargs: Any,
    ) -> None:
        from gaugeopt.projection.projector import check_mode

        super().__init__(check_every(log_every, "log_every"), sites, prefix, certify)
        check_mode(mode, type(self).__name__)
        check_choice("target", target, ("update", "grad"))
        self.mode, self.target, self.sectors = mode, target, sectors
        self.projector_kwargs = projector_kwargs
        self.projector = None
        self._before: dict[str, torch.Tensor] | None = None
        self._norms = None

    def _validate(self, sites: list[AttentionSite]) -> None:
        from gaugeopt.projection.projector import GaugeProjector

        # sites=None unless given: "auto" then also covers every LRM layer's internal rescalings
        self.projector = GaugeProjector(self._module, self.sectors, self.mode, sites=self._given_sites,
                                        trainable_only=True, **self.projector_kwargs)

    def watched_params(self) -> list[torch.Tensor]:
        named = dict(self._module.named_parameters())
        return [named[n] for n in self.projector.param_names()]

    def check_conflicts(self, optimizers) -> None:
        """Refuse a :class:`gaugeopt.GaugeOptimizer`: projecting, every step would be projected
        twice; fixing (``project=None, fix_every=N``), its fixes run inside its step, and a
        projection of that step would take them for vertical motion and undo them."""
        from gaugeopt.integrations.optim import GaugeOptimizer

        for o in wrapped_chain(optimizers):
            if isinstance(o, GaugeOptimizer) and o.project is not None:
                raise GaugeError(
                    f"the optimizer is a GaugeOptimizer(project={o.project!r}) and {type(self).__name__} is also "
                    "active: every step would be projected twice. Use one of them"
                )
            if isinstance(o, GaugeOptimizer) and o.fix_every:
                raise GaugeError(
                    f"the optimizer is a GaugeOptimizer(project=None, fix_every={o.fix_every}) and "
                    f"{type(self).__name__} is also active: projecting its step would undo the fixes made inside "
                    f"it. Use GaugeOptimizer(optimizer, model, project='update', fix_every={o.fix_every}) alone, "
                    "or the plain optimizer with both callbacks"
                )

    def project_grads(self) -> None:
        """``g ← g − Π_vert(g)`` for the gauge parameters' gradients, now."""
        from gaugeopt.projection.step import remove_vertical_grad_

        self.finish_certificate()
        self._norms = remove_vertical_grad_(self.projector, self._module)

    def _begin_round(self, optimizer, args, kwargs) -> None:
        """Before the round's first step: snapshot the gauge parameters, or project the gradients
        (all of them: every owner's are final here)."""
        from gaugeopt.projection.step import snapshot

        if self.target == "update":
            self._before = snapshot(self.projector, self._module)
        elif not _has_closure(args, kwargs):
            self.project_grads()

    def _end_round(self, optimizer) -> None:
        """After the round's last step: project the whole update the owners took."""
        from gaugeopt.projection.step import remove_vertical_update_

        if self.target == "update" and self._before is not None:
            self._norms = remove_vertical_update_(self.projector, self._module, self._before)
            self._before = None

    def _act(self, optimizer) -> dict[str, float]:
        from gaugeopt.projection.step import vertical_fraction_of

        if self._norms is None:
            return {}
        return {f"{self.prefix}vertical_fraction_{self.target}": vertical_fraction_of(self._norms)}
