"""Lightning callbacks: ``Trainer(callbacks=[GaugeFix(every=100)])``.

* :class:`GaugeFix` — paper 002's GaugeFix-LRM after every ``every``-th *optimizer step*,
  with optimizer-state transport, logging drift before/after and the scale product.
* :class:`GaugeProjection` — gauge-orthogonal projection of the update (or the gradient), the
  callback form of :class:`gaugeopt.GaugeProjected`.
* :class:`GaugeMonitor` — measures only (drift, scale product, vertical fraction of the last
  update) every ``every`` optimizer steps; cheap enough to leave on.

All three call the framework-free cores (:func:`gaugeopt.gauge_fix`,
:mod:`gaugeopt.projection.projector`, :func:`gaugeopt.vertical_fraction`); nothing is re-implemented here.

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

Example:
    >>> import lightning.pytorch as pl
    >>> from gaugeopt.callbacks import GaugeFix, GaugeMonitor
    >>> trainer = pl.Trainer(callbacks=[GaugeFix(every=100), GaugeMonitor(every=50)],
    ...                      accelerator="cpu", logger=False, enable_checkpointing=False,
    ...                      enable_progress_bar=False, enable_model_summary=False)
"""

from __future__ import annotations

from typing import Any, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gaugeopt.fix.drift import drift_table, product_stats, worst
from gaugeopt.fix.gaugefix import GaugeFixer
from gaugeopt.fix.plan import MODES, check_choice, check_fix_options
from gaugeopt.errors import GaugeError
from gaugeopt.structure.site import AttentionSite
from gaugeopt.structure.registry import find_attention

__all__ = ["GaugeFix", "GaugeMonitor", "GaugeProjection"]


def _check_every(every: Any) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        raise GaugeError(f"every={every!r} must be a positive integer number of optimizer steps")
    return every


class _StepCounter(Callback):
    """Shared machinery: find the sites at ``setup``, hook the optimizer(s) owning them at
    ``on_fit_start``, count their steps, log pending metrics at ``on_train_batch_end``."""

    every: int

    def __init__(self, every: int, sites: Sequence[AttentionSite] | None, prefix: str) -> None:
        self.every = _check_every(every)
        self._given_sites = None if sites is None else list(sites)
        self.prefix = prefix
        self.optimizer_steps = 0
        self.sites: list[AttentionSite] = []
        self._module: pl.LightningModule | None = None
        self._handles: list = []
        self._pending: dict[str, float] = {}

    # -- policy ----------------------------------------------------------------------------
    def should_run(self, step: int) -> bool:
        """Whether to act after optimizer step ``step`` (1-based); override for other schedules."""
        return step % self.every == 0

    # -- hooks -----------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._module = pl_module
        self.sites = self._given_sites if self._given_sites is not None else find_attention(pl_module)
        self._validate(self.sites)

    def _validate(self, sites: list[AttentionSite]) -> None:  # pragma: no cover - overridden
        pass

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_conflicts(trainer)
        self._optimizer = self._owning_optimizer(trainer)
        self._remove_hooks()
        self._handles.append(self._optimizer.register_step_pre_hook(self._pre_step))
        self._handles.append(self._optimizer.register_step_post_hook(self._post_step))

    def _check_conflicts(self, trainer: pl.Trainer) -> None:
        pass

    def _owning_optimizer(self, trainer: pl.Trainer) -> torch.optim.Optimizer:
        """The one optimizer that steps the attention parameters. Split over several, a fix would
        transport only one optimizer's state and a projection would see only part of the step."""
        wanted = {id(ref.param) for s in self.sites for _, ref in s.refs()}
        owners = [
            opt for opt in trainer.optimizers
            if wanted & {id(p) for g in opt.param_groups for p in g["params"]}
        ]
        if not owners:
            raise GaugeError(
                f"{type(self).__name__}: no optimizer of this run updates the attention parameters it watches "
                f"({len(wanted)} tensors in {len(self.sites)} layers); check configure_optimizers"
            )
        if len(owners) > 1:
            raise GaugeError(
                f"{type(self).__name__}: the attention parameters are split over {len(owners)} optimizers; keep every "
                "Q/K/V/O tensor (weights, biases, multipliers) in one optimizer (other parameters may use others)"
            )
        return owners[0]

    def _pre_step(self, optimizer, args, kwargs) -> None:
        pass

    def _post_step(self, optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1
        if self.should_run(self.optimizer_steps):
            self._pending.update(self._act(optimizer))

    def _act(self, optimizer) -> dict[str, float]:  # pragma: no cover - overridden
        return {}

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._pending:
            pl_module.log_dict(self._pending, on_step=True, on_epoch=False, sync_dist=False)
            self._pending = {}

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer_steps = int(state_dict["optimizer_steps"])


class GaugeFix(_StepCounter):
    """Apply GaugeFix-LRM (:func:`gaugeopt.gauge_fix`) after every ``every``-th optimizer step.

    Args:
        every: fix after optimizer steps ``every, 2·every, ...`` (paper 002: 1, 10, 100, 1000;
            100 gave the best validation loss).
        granularity: ``"auto"`` (per RoPE plane under RoPE, per head otherwise), ``"head"``,
            ``"channel"`` (refused under RoPE, at ``setup``) or ``"plane"``.
        transport_state: transport Adam/SGD state with the rescale (``False``: paper 002's setting).
        vo, vo_granularity: also balance V/O.
        mode: ``"auto"``, ``"lrm"`` or ``"plain"`` (see :func:`gaugeopt.gauge_fix`).
        unknown_state: policy for optimizers without a state rule: ``"error"``, ``"reset"``, ``"leave"``.
        product_decay, product_max: magnitude control of ``s_Q·s_K`` (changes the function on purpose).
        sites: attention sites (default: ``find_attention(pl_module)`` at ``setup``).
        log_per_layer: also log per-layer drift and scale product.
        prefix: metric name prefix.

    Logged (at the batch of each fix): ``{prefix}qk_drift_before``, ``{prefix}qk_drift_after``,
    ``{prefix}qk_scale_product_mean``/``_max``, ``{prefix}fixes`` (and ``vo_*`` with ``vo=True``).

    Example:
        >>> from gaugeopt.callbacks import GaugeFix
        >>> GaugeFix(every=100).every
        100
    """

    def __init__(
        self,
        every: int = 100,
        granularity: str = "auto",
        *,
        transport_state: bool = True,
        vo: bool = False,
        vo_granularity: str = "head",
        mode: str = "auto",
        unknown_state: str = "error",
        product_decay: float | None = None,
        product_max: float | None = None,
        sites: Sequence[AttentionSite] | None = None,
        log_per_layer: bool = False,
        prefix: str = "gauge/",
    ) -> None:
        super().__init__(every, sites, prefix)
        check_fix_options(granularity=granularity, vo_granularity=vo_granularity, mode=mode, unknown_state=unknown_state,
                          product_decay=product_decay, product_max=product_max)
        self.options = dict(
            granularity=granularity, transport_state=transport_state, vo=vo, vo_granularity=vo_granularity,
            mode=mode, unknown_state=unknown_state, product_decay=product_decay, product_max=product_max,
        )
        self.log_per_layer = log_per_layer
        self.fixes = 0
        self.last_report = None
        self._fixer: GaugeFixer | None = None

    def _validate(self, sites: list[AttentionSite]) -> None:
        GaugeFixer(None, None, sites=sites, **{**self.options, "transport_state": False})  # plans, refusals

    def _fixer_for(self, optimizer) -> GaugeFixer:
        """One :class:`~gaugeopt.fix.gaugefix.GaugeFixer` per fit: planned once, kernel tables reused."""
        want = optimizer if self.options["transport_state"] else None
        if self._fixer is None or self._fixer.optimizer is not want:
            self._fixer = GaugeFixer(None, want, sites=self.sites, **self.options)
        return self._fixer

    def _check_conflicts(self, trainer: pl.Trainer) -> None:
        for opt in trainer.optimizers:
            if getattr(opt, "fix_every", None):
                raise GaugeError(
                    f"the optimizer is a {type(opt).__name__} with fix_every={opt.fix_every} and the GaugeFix callback "
                    "is also active: the model would be fixed twice. Use one of them (fix_every=None, or drop the callback)"
                )

    def _act(self, optimizer) -> dict[str, float]:
        report = self._fixer_for(optimizer)()
        self.fixes += 1
        self.last_report = report
        out = report.as_dict(prefix=self.prefix, per_layer=self.log_per_layer)
        out[f"{self.prefix}fixes"] = float(self.fixes)
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fixes": self.fixes}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.fixes = int(state_dict.get("fixes", 0))

    def apply(self, pl_module: pl.LightningModule | torch.nn.Module, optimizer=None):
        """Run one fix now (for manual loops); returns the :class:`~gaugeopt.fix.gaugefix.GaugeFixReport`."""
        sites = self.sites or find_attention(pl_module)
        return GaugeFixer(None, optimizer if self.options["transport_state"] else None, sites=sites, **self.options)()


class GaugeMonitor(_StepCounter):
    """Measure the gauge every ``every`` optimizer steps, changing nothing.

    Logs ``{prefix}qk_drift`` (paper 002 eq. 3), ``{prefix}qk_scale_product`` (mean ``s_Q·s_K``
    over heads) and, with ``vertical_fraction=True``, ``{prefix}vertical_fraction`` of the
    update the optimizer just applied (``‖Δθ_vert‖/‖Δθ‖`` over the attention parameters; the
    parameters are snapshotted only right before a measured step).

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
    ) -> None:
        super().__init__(every, sites, prefix)
        check_choice("mode", mode, MODES)
        self.mode = mode
        self.measure_vertical = vertical_fraction
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._projector = None

    def _params(self) -> dict[str, torch.Tensor]:
        """The parameters an update is measured on: every parameter of a gauge sector."""
        from gaugeopt.projection.projector import GaugeProjector

        if self._projector is None:
            self._projector = GaugeProjector(self._module, "auto", "exact", sites=self._given_sites)
        named = dict(self._module.named_parameters())
        return {n: named[n] for n in self._projector.param_names()}

    def _pre_step(self, optimizer, args, kwargs) -> None:
        if self.measure_vertical and self.should_run(self.optimizer_steps + 1):
            self._snapshot = {n: p.detach().clone() for n, p in self._params().items()}

    def _act(self, optimizer) -> dict[str, float]:
        tables = drift_table(None, self.sites, mode=self.mode)
        out = {
            f"{self.prefix}qk_drift": worst(t.drift for t in tables),
            f"{self.prefix}qk_scale_product": product_stats(t.product for t in tables)[0],
        }
        if self._snapshot is not None:
            from gaugeopt.projection.diagnostics import vertical_fraction

            update = {n: p.detach() - self._snapshot[n] for n, p in self._params().items()}
            out[f"{self.prefix}vertical_fraction"] = float(
                vertical_fraction(self._module, update, projector=self._projector, at=self._snapshot)
            )
            self._snapshot = None
        return out


class GaugeProjection(_StepCounter):
    """Project every optimizer step (or gradient) off the gauge orbits: the callback form of
    :class:`gaugeopt.GaugeProjected`, sharing its step functions.

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
        projector_kwargs: extra options for :class:`gaugeopt.GaugeProjector`.

    Example:
        >>> from gaugeopt.callbacks import GaugeProjection
        >>> GaugeProjection(mode="approx", target="grad").target
        'grad'
    """

    def __init__(
        self,
        mode: str = "exact",
        target: str = "update",
        *,
        sectors: str | Sequence[str] = "auto",
        log_every: int = 50,
        sites: Sequence[AttentionSite] | None = None,
        prefix: str = "gauge/",
        **projector_kwargs: Any,
    ) -> None:
        from gaugeopt.projection.projector import check_mode

        super().__init__(log_every, sites, prefix)
        check_mode(mode, "GaugeProjection")
        check_choice("target", target, ("update", "grad"))
        self.mode, self.target, self.sectors = mode, target, sectors
        self.projector_kwargs = projector_kwargs
        self.projector = None
        self._before: dict[str, torch.Tensor] | None = None

    def _validate(self, sites: list[AttentionSite]) -> None:
        from gaugeopt.projection.projector import GaugeProjector

        # sites=None unless given: "auto" then also covers every LRM layer's internal rescalings
        self.projector = GaugeProjector(self._module, self.sectors, self.mode, sites=self._given_sites, **self.projector_kwargs)

    def _check_conflicts(self, trainer: pl.Trainer) -> None:
        from gaugeopt.integrations.optim import GaugeProjected

        for opt in trainer.optimizers:
            if isinstance(opt, GaugeProjected):
                raise GaugeError(
                    "the optimizer is already a GaugeProjected and the GaugeProjection callback is also active: every "
                    "step would be projected twice. Use one of them"
                )

    def _pre_step(self, optimizer, args, kwargs) -> None:
        from gaugeopt.projection.step import snapshot

        if self.target == "update":
            self._before = snapshot(self.projector, self._module)

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Lightning evaluates the closure (forward, backward) *inside* optimizer.step, after the
        # step pre-hooks; this hook runs once the gradients exist (accumulated, AMP-unscaled),
        # before clipping and the step.
        from gaugeopt.projection.step import remove_vertical_grad_

        if self.target == "grad" and optimizer is self._optimizer:
            self._norms = remove_vertical_grad_(self.projector, self._module)

    def _post_step(self, optimizer, args, kwargs) -> None:
        from gaugeopt.projection.step import remove_vertical_update_

        if self.target == "update" and self._before is not None:
            self._norms = remove_vertical_update_(self.projector, self._module, self._before)
            self._before = None
        super()._post_step(optimizer, args, kwargs)

    def _act(self, optimizer) -> dict[str, float]:
        from gaugeopt.projection.step import vertical_fraction_of

        return {f"{self.prefix}vertical_fraction_{self.target}": vertical_fraction_of(self._norms)}
