"""Hugging Face ``Trainer`` callbacks: ``Trainer(..., callbacks=[GaugeFixCallback(every=100)])``.

* :class:`GaugeFixCallback` — GaugeFix-LRM after every ``every``-th optimizer step, with
  optimizer-state transport (:class:`gaugeopt.integrations.steps.FixSteps`).
* :class:`GaugeProjectionCallback` — gauge-orthogonal projection of every step (or gradient)
  (:class:`gaugeopt.integrations.steps.ProjectSteps`, the functions of :class:`gaugeopt.GaugeOptimizer`).
* :class:`QKClipCallback` — QK-Clip after every ``every``-th optimizer step
  (:class:`gaugeopt.integrations.clip.ClipSteps`); before GaugeFix when both are given.

The counting, the policy, the actions and the counters are the framework-free core's
(:mod:`gaugeopt.integrations.steps`, shared with the Lightning callbacks); this module only
wires it into the ``Trainer``:

**Where they act.** In ``Trainer._run_epoch`` the step is ``on_pre_optimizer_step`` →
``self.optimizer.step()`` → ``on_optimizer_step`` → scheduler → ``model.zero_grad()`` →
``on_step_end``. ``self.optimizer`` is Accelerate's ``AcceleratedOptimizer``, whose ``step()``
runs for every accumulation boundary — also when the fp16 ``GradScaler`` found inf gradients and
skipped the step (``accelerator.optimizer_step_was_skipped``), and ``on_optimizer_step`` fires
then too. So the callbacks hook the optimizer it wraps (``register_step_post_hook``): they count
and act only when a step was really taken, right after it and before gradients are zeroed. With
``gradient_accumulation_steps=k`` that is once per ``k`` batches.

**Logging.** After a step with an action the callback sets ``control.should_log``, so the Trainer
writes its log record for that step, and adds its metrics to that record in ``on_log``: to the
``logs`` every later ``on_log`` receives and to ``trainer.state.log_history``. At
``on_train_begin`` it moves itself ahead of the other callbacks in the Trainer's list (behind the
flow control only), so the ``report_to`` integrations (W&B, TensorBoard, ...) — which the Trainer
lists first — and any callback you pass receive the gauge metrics, also after a resume that
rebuilt the callback from its checkpoint (``restore_callback_states_from_checkpoint=True``, which
appends it last).

**Checkpoints.** Both are ``ExportableState`` callbacks: the Trainer stores their counters in each
checkpoint's ``trainer_state.json`` (``stateful_callbacks``); on ``train(resume_from_checkpoint=...)``
they restore them in ``on_train_begin`` (with or without ``restore_callback_states_from_checkpoint``,
which, when set, makes the Trainer build a fresh instance from the stored arguments), so a resumed
run acts at the same steps.

**Distributed and precision.** Under DDP (``accelerate launch`` / ``torchrun``) every rank fixes
its replica identically; ``bf16=True`` / ``fp16=True`` keep fp32 parameters, which the fix acts on.

Example:
    >>> from gaugeopt.integrations.transformers import GaugeFixCallback, GaugeProjectionCallback
    >>> cb = GaugeFixCallback(every=100)
    >>> cb.state()
    {'args': {'every': 100, 'granularity': 'auto', 'transport_state': True, 'vo': False, 'vo_granularity': 'head', 'mode': 'auto', 'unknown_state': 'error', 'product_decay': None, 'product_max': None, 'eps': 1e-12, 'backend': 'auto', 'rescale_frozen': False, 'log_per_layer': False, 'prefix': 'gauge/', 'certify': True}, 'attributes': {'optimizer_steps': 0, 'fixes': 0}}
    >>> GaugeProjectionCallback(target="grad").target
    'grad'
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from gaugeopt.errors import GaugeError
from gaugeopt.fix.options import FixOptions
from gaugeopt.integrations.clip import ClipSteps
from gaugeopt.integrations.steps import FixSteps, ProjectSteps, owning_optimizers
from gaugeopt.models.lrm import warn_unfolded_save

__all__ = ["GaugeFixCallback", "GaugeProjectionCallback", "QKClipCallback"]


def _log_before_the_loggers(callback: TrainerCallback, frame) -> None:
    """Move ``callback`` ahead of every other callback but the flow control in the Trainer's list.

    ``on_log`` runs the callbacks in list order, and a callback adds its metrics to the ``logs``
    the later ones receive; the ``report_to`` integrations (W&B, TensorBoard, ...) come first, and a
    callback rebuilt from a checkpoint (``restore_callback_states_from_checkpoint``) is appended
    last — both would log the record before the gauge metrics are in it. The Trainer gives a
    callback no handle on its list, so the list is taken from the ``CallbackHandler.call_event``
    frame that called ``on_train_begin``; moving the running callback *earlier* in the list it is
    iterating skips and repeats nothing. Without that frame (another caller), nothing moves.
    """
    handler = frame.f_locals.get("self") if frame is not None else None
    callbacks = getattr(handler, "callbacks", None)
    if type(handler).__name__ != "CallbackHandler" or not isinstance(callbacks, list) or callback not in callbacks:
        return
    callbacks.remove(callback)
    first = next((i for i, c in enumerate(callbacks) if type(c).__name__ != "DefaultFlowCallback"), len(callbacks))
    callbacks.insert(first, callback)


def _json_args(who: str, args: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments, checked to fit ``trainer_state.json`` (the Trainer rebuilds
    the callback from them when ``restore_callback_states_from_checkpoint`` is set)."""
    for name, value in args.items():
        try:
            json.dumps(value)
        except TypeError:
            raise GaugeError(
                f"{who}: {name}={value!r} cannot be stored in a Trainer checkpoint (trainer_state.json holds the "
                "callback's arguments as JSON); pass a number, string, list or None"
            ) from None
    return args


class _TrainerSide(TrainerCallback, ExportableState):
    """The Trainer's side of :class:`~gaugeopt.integrations.steps.StepCounter`."""

    _args: dict[str, Any]

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is not None:  # validate against the model when the Trainer is built, not at step N
            self.bind(model)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._restore(state)
        if model is not self._module:
            self.bind(model)
        self.check_conflicts(optimizer)
        self.attach(owning_optimizers(optimizer, self.watched_params(), type(self).__name__))
        _log_before_the_loggers(self, sys._getframe(1))

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin_certificate()  # the records' proof, on this step's forward, where gaugeopt needs one

    def on_step_end(self, args, state, control, **kwargs):
        if self._pending:
            control.should_log = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = self.pop_metrics()
        if metrics and logs is not None:
            logs.update(metrics)
            if state.log_history:  # Trainer.log appended this record just before on_log
                state.log_history[-1].update(metrics)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.detach()
        warn_unfolded_save(model, "trainer.save_model() / model.save_pretrained() after training")

    def on_save(self, args, state, control, model=None, **kwargs):
        warn_unfolded_save(model, "the Trainer's checkpoints (checkpoint-N/)")

    # -- checkpoints (ExportableState) -----------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"args": dict(self._args), "attributes": self.state_dict()}

    def _restore(self, state) -> None:
        saved = state.stateful_callbacks.get(type(self).__name__)
        if isinstance(saved, list):
            raise GaugeError(
                f"{type(self).__name__}: the Trainer has {len(saved)} of them; one is enough (two would act twice)"
            )
        if saved:
            self.load_state_dict(saved["attributes"])


class GaugeFixCallback(_TrainerSide, FixSteps):
    """Apply GaugeFix-LRM (:func:`gaugeopt.gauge_fix`) after every ``every``-th optimizer step.

    Arguments as :class:`gaugeopt.integrations.steps.FixSteps`: ``every=100``, the fix's options
    (keyword arguments, or ``options=FixOptions(...)``: :class:`gaugeopt.fix.options.FixOptions`),
    ``log_per_layer``, ``prefix``, ``certify`` — records of no built-in adapter are certified on the
    first step's forward; the sites are ``find_attention(trainer.model)``, found and checked when the
    ``Trainer`` is built. The checkpoint stores every option by name (``state()["args"]``).

    Logged at each fix's step: ``{prefix}qk_drift_before``, ``{prefix}qk_drift_after``,
    ``{prefix}qk_scale_product_mean``/``_max``, ``{prefix}heads_fixed``, ``{prefix}fixes``, ...

    Example:
        >>> from gaugeopt.integrations.transformers import GaugeFixCallback
        >>> GaugeFixCallback(every=20, granularity="head").options["granularity"]
        'head'
    """

    def __init__(
        self,
        every: int = 100,
        granularity: str | None = None,
        *,
        options: FixOptions | None = None,
        log_per_layer: bool = False,
        prefix: str = "gauge/",
        certify: bool = True,
        **fix_options: Any,
    ) -> None:
        FixSteps.__init__(self, every, granularity, options=options, log_per_layer=log_per_layer, prefix=prefix,
                          certify=certify, **fix_options)
        args = dict(every=every, **self.options.as_dict(), log_per_layer=log_per_layer, prefix=prefix, certify=certify)
        self._args = _json_args(type(self).__name__, args)


class GaugeProjectionCallback(_TrainerSide, ProjectSteps):
    """Project every optimizer step (or its gradient) off the gauge orbits: the Trainer form of
    :class:`gaugeopt.GaugeOptimizer`.

    Arguments as :class:`gaugeopt.integrations.steps.ProjectSteps` (``mode="exact"``,
    ``target="update"`` or ``"grad"``, ``sectors``, ``log_every=50``, ``prefix``, projector
    options). ``target="grad"`` projects in the optimizer's step pre-hook: after accumulation,
    AMP unscaling and the Trainer's gradient clipping.

    Logged every ``log_every`` steps: ``{prefix}vertical_fraction_{target}`` (the part removed).

    Example:
        >>> from gaugeopt.integrations.transformers import GaugeProjectionCallback
        >>> GaugeProjectionCallback(mode="approx", log_every=10).every
        10
    """

    def __init__(
        self,
        mode: str = "exact",
        target: str = "update",
        *,
        sectors: str | Sequence[str] = "auto",
        log_every: int = 50,
        prefix: str = "gauge/",
        certify: bool = True,
        **projector_kwargs: Any,
    ) -> None:
        args = dict(mode=mode, target=target, sectors=sectors if isinstance(sectors, str) else list(sectors),
                    log_every=log_every, prefix=prefix, certify=certify, **projector_kwargs)
        ProjectSteps.__init__(self, **args)
        self._args = _json_args(type(self).__name__, args)


class QKClipCallback(_TrainerSide, ClipSteps):
    """QK-Clip (:func:`gaugeopt.qk_clip`) after every ``every``-th optimizer step.

    Arguments as :class:`gaugeopt.integrations.clip.ClipSteps` (``tau=100``, ``every=1``, ``alpha``,
    ``transport_state``, ``unknown_state``, ``log_per_layer``, ``prefix="qk_clip/"``, ``certify``). The
    maxima are read in the training forwards of each clipping step (all ``gradient_accumulation_steps``
    micro-batches; not the evaluation loop), MAX-reduced across ranks; the clip runs right after the
    step, before ``GaugeFixCallback``'s balance when both are given.

    Example:
        >>> from gaugeopt.integrations.transformers import QKClipCallback
        >>> QKClipCallback(tau=50.0, every=2).state()["args"]["tau"]
        50.0
    """

    def __init__(
        self,
        tau: float = 100.0,
        every: int = 1,
        *,
        alpha: float = 0.5,
        transport_state: bool = True,
        unknown_state: str = "error",
        log_per_layer: bool = False,
        prefix: str = "qk_clip/",
        certify: bool = True,
    ) -> None:
        args = dict(tau=tau, every=every, alpha=alpha, transport_state=transport_state, unknown_state=unknown_state,
                    log_per_layer=log_per_layer, prefix=prefix, certify=certify)
        ClipSteps.__init__(self, **args)
        self._args = _json_args(type(self).__name__, args)
