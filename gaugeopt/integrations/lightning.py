"""Lightning callbacks: ``Trainer(callbacks=[GaugeFix(every=100)])``.

* :class:`GaugeFix` — paper 002's GaugeFix-LRM after every ``every``-th *optimizer step*,
  with optimizer-state transport, logging drift before/after and the scale product.
* :class:`GaugeProjection` — gauge-orthogonal projection of the update (or the gradient), the
  callback form of :class:`gaugeopt.GaugeOptimizer`.
* :class:`QKClip` — QK-Clip (:func:`gaugeopt.qk_clip`) after every ``every``-th optimizer step, on
  the maxima of that step's training forwards; before GaugeFix when both are given.
* :class:`GaugeMonitor` — measures only (drift, scale product, vertical fraction of the last
  update) every ``every`` optimizer steps; cheap enough to leave on.

All of them call the framework-free cores (:mod:`gaugeopt.integrations.steps` for the step counting,
the fix and the projection — shared with the Hugging Face Trainer callbacks —,
:func:`gaugeopt.vertical_fraction`); nothing is re-implemented here.

**Counting optimizer steps.** The callbacks attach ``register_step_post_hook`` to the
optimizer(s) holding the attention parameters, so they count the steps the optimizer really
took: gradient accumulation (``accumulate_grad_batches``), steps skipped by the AMP grad scaler
after an overflow (``scaler.step`` does not call ``optimizer.step``), several optimizers (only
the one owning the attention counts) and manual optimization (``opt.step()`` in your
``training_step`` fires the same hook — nothing else to call) are all counted right. The fix
runs inside the hook, right after the step; metrics are logged at the next
``on_train_batch_end`` through ``pl_module.log`` so any logger receives them.

**Distributed.** Under DDP every rank runs the same fix on identical replicas (bit-identical
results, no communication); under FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) the core
reduces the per-head sums across shards and writes the local shards of the fp32 parameters and
of the optimizer state.

**Checkpoints.** ``state_dict`` holds the step and fix counters only; a resumed run continues
bit-identically (on CPU) to an uninterrupted one.

**Certificate.** No record is used before it is proved on the model as it is now
(:mod:`gaugeopt.trust.gate`, ``docs/trust.md``). With ``certify=True`` (the default) the
callback proves the records at ``setup`` on an input gaugeopt makes up for the models it knows, or
else records each attention module's real call during the first training batch's forward — the batch
exactly as your ``training_step`` feeds it — and proves the records before the first optimizer step.
A record that fails stops the run with a :class:`~gaugeopt.errors.GaugeError` naming the layer and
sector. With ``certify=False`` records without a proof are refused at ``setup`` unless the model was
certified already (``gaugeopt.certify(model, example_batch)``).

Example:
    >>> import lightning.pytorch as pl
    >>> from gaugeopt.callbacks import GaugeFix, GaugeMonitor
    >>> trainer = pl.Trainer(callbacks=[GaugeFix(every=100), GaugeMonitor(every=50)],
    ...                      accelerator="cpu", logger=False, enable_checkpointing=False,
    ...                      enable_progress_bar=False, enable_model_summary=False)
"""

from __future__ import annotations

from typing import Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gaugeopt.fix.drift import drift_table, product_stats, worst
from gaugeopt.fix.gaugefix import GaugeFixer
from gaugeopt.fix.options import FIX_MODES, check_choice
from gaugeopt.integrations.clip import ClipSteps
from gaugeopt.integrations.steps import FixSteps, ProjectSteps, StepCounter, owning_optimizers
from gaugeopt.models.lrm import warn_unfolded_save
from gaugeopt.records.site import AttentionSite
from gaugeopt.adapters.find import find_attention

__all__ = ["GaugeFix", "GaugeMonitor", "GaugeProjection", "QKClip"]


class _StepCounter(StepCounter, Callback):
    """Lightning's side of :class:`~gaugeopt.integrations.steps.StepCounter`: find the sites at
    ``setup``, hook the optimizer owning them at ``on_fit_start``, log pending metrics at
    ``on_train_batch_end``; counting, policy and state are the core's."""

    # -- hooks -----------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.bind(pl_module)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_conflicts(trainer.optimizers)
        self.attach(owning_optimizers(trainer.optimizers, self.watched_params(), type(self).__name__))

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.begin_certificate()

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # the closure has run the forward (recording the attention calls) but not yet the step
        self.finish_certificate()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = self.pop_metrics()
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        warn_unfolded_save(pl_module, "Lightning's checkpoint")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.detach()


class GaugeFix(FixSteps, _StepCounter):
    """Apply GaugeFix-LRM (:func:`gaugeopt.gauge_fix`) after every ``every``-th optimizer step.

    Arguments as :class:`gaugeopt.integrations.steps.FixSteps`: ``every=100``, the fix's options
    (keyword arguments, or ``options=FixOptions(...)``: :class:`gaugeopt.fix.options.FixOptions`),
    ``sites`` — default ``find_attention(pl_module)`` at ``setup`` —, ``log_per_layer``, ``prefix``,
    ``certify``; ``granularity="channel"`` on a RoPE model is refused at ``setup``.

    Logged (at the batch of each fix): ``{prefix}qk_drift_before``, ``{prefix}qk_drift_after``,
    ``{prefix}qk_scale_product_mean``/``_max``, ``{prefix}fixes`` (and ``vo_*`` with ``vo=True``).

    Example:
        >>> from gaugeopt.callbacks import GaugeFix
        >>> GaugeFix(every=100).every
        100
    """

    def apply(self, pl_module: pl.LightningModule | torch.nn.Module, optimizer=None):
        """Run one fix now (for manual loops); returns the :class:`~gaugeopt.fix.gaugefix.GaugeFixReport`."""
        return GaugeFixer(pl_module, optimizer, sites=self.sites or None, options=self.options)()


class GaugeMonitor(_StepCounter):
    """Measure the gauge every ``every`` optimizer steps, changing nothing.

    Logs ``{prefix}qk_drift`` (paper 002 eq. 3), ``{prefix}qk_scale_product`` (mean ``s_Q·s_K``
    over heads) and, with ``vertical_fraction=True``, ``{prefix}vertical_fraction`` of the
    update the optimizer just applied (``‖Δθ_vert‖/‖Δθ‖`` over the attention parameters; the
    parameters are snapshotted only right before a measured step). ``certify`` as :class:`GaugeFix`.

    Example:
        >>> from gaugeopt.callbacks import GaugeMonitor
        >>> GaugeMonitor(every=10).every
        10
    """

    def __init__(
        self,
        every: int = 100,
        *,
        vertical_fraction: bool = True,
        mode: str = "auto",
        sites: Sequence[AttentionSite] | None = None,
        prefix: str = "gauge/",
        certify: bool = True,
    ) -> None:
        super().__init__(every, sites, prefix, certify)
        check_choice("mode", mode, FIX_MODES)
        self.mode = mode
        self.measure_vertical = vertical_fraction
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._projector = None

    def _projector_for_updates(self):
        """The projector an update is measured with (every gauge sector), built once."""
        from gaugeopt.projection.projector import GaugeProjector

        if self._projector is None:
            self._projector = GaugeProjector(self._module, "auto", "exact", sites=self._given_sites)
        return self._projector

    def _begin_round(self, optimizer, args, kwargs) -> None:
        if self.measure_vertical and self.runs_next():
            from gaugeopt.projection.step import snapshot

            self._snapshot = snapshot(self._projector_for_updates(), self._module)

    def _act(self, optimizer) -> dict[str, float]:
        tables = drift_table(None, self.sites, mode=self.mode)
        out = {
            f"{self.prefix}qk_drift": worst(t.drift for t in tables),
            f"{self.prefix}qk_scale_product": product_stats(t.product for t in tables)[0],
        }
        if self._snapshot is not None:
            from gaugeopt.projection.diagnostics import vertical_fraction

            named = dict(self._module.named_parameters())
            update = {n: named[n].detach() - before for n, before in self._snapshot.items()}
            out[f"{self.prefix}vertical_fraction"] = float(
                vertical_fraction(self._module, update, projector=self._projector, at=self._snapshot)
            )
            self._snapshot = None
        return out


class GaugeProjection(ProjectSteps, _StepCounter):
    """Project every optimizer step (or gradient) off the gauge orbits: the callback form of
    :class:`gaugeopt.GaugeOptimizer`, sharing its step functions.

    Args:
        mode: ``"exact"`` (Sylvester), ``"approx"`` (a few preconditioned CG steps, never leaving
            more vertical part than there was; ``approx_iters=`` in ``projector_kwargs``) or
            ``"paper000"`` (paper 000 Algorithm 2, for comparison), see :mod:`gaugeopt.projection.projector`.
        target: ``"update"`` (project the step the optimizer actually took, weight decay and
            all) or ``"grad"`` (project the gradients in ``on_before_optimizer_step``: after
            accumulation and AMP unscaling, before gradient clipping).
        sectors: ``"auto"`` or a subset of :data:`gaugeopt.projection.projector.SECTORS`.
        log_every: log ``{prefix}vertical_fraction_{target}`` (the fraction removed) every this
            many optimizer steps; reading it is the only host synchronisation.
        sites: attention sites (default: ``find_attention(pl_module)``).
        certify: prove the records at ``setup`` or on the first training batch (as :class:`GaugeFix`).
        projector_kwargs: extra options for :class:`gaugeopt.GaugeProjector`.

    Example:
        >>> from gaugeopt.callbacks import GaugeProjection
        >>> GaugeProjection(mode="approx", target="grad").target
        'grad'
    """

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Lightning evaluates the closure (forward, backward) *inside* optimizer.step, after the
        # step pre-hooks; this hook runs once the gradients exist (accumulated, AMP-unscaled),
        # before clipping and the step.
        super().on_before_optimizer_step(trainer, pl_module, optimizer)  # the certificate first
        if self.target == "grad" and self.schedule.opening and any(optimizer is o for o in self._optimizers):
            self.project_grads()  # the round's first step: every owner's gradients are final


class QKClip(ClipSteps, _StepCounter):
    """QK-Clip (:func:`gaugeopt.qk_clip`) after every ``every``-th optimizer step.

    Arguments as :class:`gaugeopt.integrations.clip.ClipSteps` (``tau=100``, ``every=1``, ``alpha=0.5``,
    ``transport_state``, ``unknown_state``, ``sites``, ``log_per_layer``, ``prefix="qk_clip/"``,
    ``certify``). The maxima are read in the training forwards of each clipping step (every
    micro-batch under ``accumulate_grad_batches``; not the validation loop), MAX-reduced across DDP
    ranks, and the clip runs in the optimizer's step post-hook. With ``GaugeFix`` in the same
    ``Trainer`` the clip runs first, then the balance, whatever the order of the callbacks.

    Logged at each clip: ``{prefix}max_logit_before``, ``{prefix}max_logit_after``, ``{prefix}heads_over``,
    ``{prefix}heads_rescaled``, ``{prefix}heads_skipped``, ``{prefix}min_factor``, ``{prefix}clips``.

    Example:
        >>> from gaugeopt.callbacks import GaugeFix, QKClip
        >>> callbacks = [QKClip(tau=100.0), GaugeFix(every=100)]   # clip the magnitude, then balance
        >>> callbacks[0].options["tau"], callbacks[0].every
        (100.0, 1)
    """
