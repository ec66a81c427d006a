"""``GaugeOptimizer``: any ``torch.optim.Optimizer``, with its steps projected off the gauge orbits.

(``GaugeProjected`` is its former name, kept as an alias — the same class — for a release: next to
:class:`gaugeopt.GaugeProjector`, the projector it uses, the two names differed by two letters.)

AdamW's per-coordinate scaling and weight decay are not gauge-equivariant, so the step it
takes has a *vertical* part that moves along gauge orbits without changing the function
(docs/projection.md; measure it with :func:`gaugeopt.vertical_fraction`). The wrapper removes it:

``project="update"`` (default)
    snapshot the gauge parameters, let the inner optimizer step, and replace the step it
    took, ``Δ = θ_new − θ_old`` (gradient, momentum, weight decay and all), by its horizontal
    part at ``θ_old``: ``θ ← θ_new − Π_vert(Δ)`` (= ``θ_old + Π(Δ)``; subtracting from
    ``θ_new`` keeps every entry no generator touches bit-identical to the inner step).
``project="grad"``
    project the gradients before the inner step (paper 000 Algorithm 2's use). For a
    gauge-invariant loss this removes only rounding (paper 000 Prop. 38); the update itself
    stays non-equivariant.
``project=None`` (with ``fix_every=N``)
    no projection: GaugeFix alone, as a drop-in for the optimizer a loop already has. The inner
    step is taken unchanged; after every ``N``-th step the Q/K gauge is balanced and the inner
    optimizer's state transported. Every parameter the fix does not rescale (with multipliers:
    everything but ``r_Q``, ``r_K``) evolves bit-identically to the bare optimizer fed the same
    gradients.

Parameters outside every gauge sector (embeddings, MLPs, norms, output biases) are never
written: they evolve bit-identically to the unwrapped optimizer. The optimizer state (Adam
moments) is not touched. ``fix_every=N`` runs GaugeFix-LRM (paper 002) with the inner optimizer
after every ``N``-th step: one :class:`~gaugeopt.fix.gaugefix.GaugeFixer`, planned and validated
at construction; its latest report is :attr:`GaugeOptimizer.last_report` (``.as_dict()`` for a logger).

**Steps counted** are the steps the wrapper took: ``torch.amp.GradScaler.step`` calls
``optimizer.step`` only when the gradients are finite, so a step skipped after an overflow
neither counts nor fixes; with gradient accumulation the loop calls ``step`` once per ``k``
batches. The counters travel in ``state_dict`` (a resumed run fixes at the same steps).

**Several optimizers** (Muon for the 2-D matrices beside AdamW for embeddings, norms, biases and
multipliers): ``GaugeOptimizer([muon, adamw], model, ...)`` is *one* wrapper over all of them, because
a gauge direction can span tensors of both (the Q/K rows are Muon's, ``r_Q`` is AdamW's): ``step``
snapshots once, steps every inner optimizer in order (a closure is evaluated once, before), projects
the whole update they took together, and fixes after all of them stepped, transporting each
parameter's state in the optimizer that owns it. Its ``param_groups`` are the inner optimizers' groups
in order (one LR scheduler over them scales each group from its own base LR), ``state`` is a view of
their states, ``state_dict`` holds one entry per inner optimizer (``"optimizers"``); a
``GradScaler`` unscales every group and skips the whole step when any gradient is not finite. A
parameter in two inner optimizers is refused; ``add_param_group`` goes to an inner optimizer
(``wrapper.optimizers[i].add_param_group``).

The wrapper *is* the optimizer for the rest of the training stack: a subclass of
``torch.optim.Optimizer`` sharing the inner optimizer's ``param_groups``, ``state`` and
``defaults`` (LR schedulers and ``GradScaler.unscale_`` act on the inner groups);
``step(closure)``, ``zero_grad``, ``add_param_group``, ``state_dict``/``load_state_dict``
(the inner state plus a ``"gauge_projected"`` entry: counters and options), pickling,
``torch.amp.GradScaler`` (it reports ``_step_supports_amp_scaling = False``, so the scaler
unscales and skips inf steps itself) and Lightning's ``configure_optimizers``.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    >>> opt = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    >>> x = torch.randint(0, 64, (4, 16))
    >>> for _ in range(3):
    ...     opt.zero_grad()
    ...     loss = model(x, x)[1]
    ...     loss.backward()
    ...     opt.step()
    ...     sched.step()
    >>> opt.state_dict()["gauge_projected"]["step"]
    3

    GaugeFix alone, every 2 steps, with the optimizer the loop already has:

    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)))
    >>> opt = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, project=None, fix_every=2)
    >>> for _ in range(4):
    ...     model(x, x)[1].backward(); opt.step(); opt.zero_grad()
    >>> opt.state_dict()["gauge_projected"]["fixes"], opt.last_report.max_drift_after < 1e-6
    (2, True)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import MutableMapping
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.fix.gaugefix import GaugeFixer
from gaugeopt.fix.options import FixOptions, resolve_options
from gaugeopt.integrations.schedule import Schedule, check_every
from gaugeopt.projection.projector import PROJECTION_MODES, GaugeProjector, check_mode
from gaugeopt.projection.step import remove_vertical_grad_, remove_vertical_update_, snapshot, vertical_fraction_of

__all__ = ["GaugeOptimizer", "GaugeProjected"]

_PROJECT = ("update", "grad", None)
_STATE_KEY = "gauge_projected"


class _MergedState(MutableMapping):
    """``state`` of a wrapper over several optimizers: each parameter's entry lives in the optimizer
    that steps it."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def _owner(self, param) -> torch.optim.Optimizer:
        for o in self._optimizers:
            if param in o.state or any(q is param for g in o.param_groups for q in g["params"]):
                return o
        raise KeyError(param)

    def __getitem__(self, param):
        return self._owner(param).state[param]

    def __setitem__(self, param, value) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param) -> None:
        del self._owner(param).state[param]

    def __iter__(self) -> Iterator:
        for o in self._optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class GaugeOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` (or several) so that its steps on ``model`` are gauge-orthogonal.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over (at least) the gauge parameters, or a list of
            optimizers that together step them (Muon beside AdamW), each parameter in one.
        model: the model whose attention gauges are projected out.
        project: ``"update"`` (project the step actually taken), ``"grad"``, or ``None`` (no
            projection: GaugeFix alone; needs ``fix_every``).
        mode: ``"exact"`` (Sylvester), ``"approx"`` (a few preconditioned CG steps: never leaves more
            vertical part than the step had; ``approx_iters`` sets how many) or ``"paper000"``
            (paper 000 Algorithm 2, for comparison: it can add vertical part), see
            :mod:`gaugeopt.projection.projector`.
        fix_every: run GaugeFix (``gaugeopt.gauge_fix(model, optimizer=inner, **fix_kwargs)``)
            after every this many steps.
        sectors: ``"auto"`` or a subset of :data:`gaugeopt.projection.projector.SECTORS`.
        sites: attention sites to project (default all).
        fix_kwargs: the fix's options — a :class:`~gaugeopt.fix.options.FixOptions`, or a dict of
            its fields (``{"vo": True}``; also ``"options"``, ``"sites"``, ``"check_first_step"`` of
            :class:`~gaugeopt.fix.gaugefix.GaugeFixer`) —, validated here.
        **projector_kwargs: ``rtol``, ``dtype``, ``cg_tol``, ``joint_tol``, ... for
            :class:`~gaugeopt.projection.projector.GaugeProjector`.

    Attributes:
        last_vertical_fraction: ``‖Π_vert(x)‖/‖x‖`` of the last step's update (or gradient),
            over the gauge parameters; ``nan`` before the first step and with ``project=None``
            (read lazily: no host synchronisation in the step itself).
        last_report: the :class:`~gaugeopt.fix.report.GaugeFixReport` of the latest fix (``None``
            before the first).
        nonfinite_steps: steps left unprojected because the gauge parameters, their update or their
            gradients held a NaN or an infinity (each with a warning; ``last_vertical_fraction`` is
            ``nan`` after one). A projection would spread one bad entry over its whole head.

    Tensors that do not require gradients are never moved: the projection leaves out every gauge
    direction that would move one (``projector.frozen``), and the fix every pair with one
    (``last_report.frozen``; ``fix_kwargs={"rescale_frozen": True}`` to rescale them anyway).
    """

    _step_supports_amp_scaling = False  # GradScaler unscales and skips inf steps for us
    steps_as_one_round = True  # its step is one whole round of the inner optimizers: hooks watch it (fix.unwrap)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        project: str = "update",
        mode: str = "exact",
        fix_every: int | None = None,
        *,
        sectors: str | Sequence[str] = "auto",
        sites=None,
        fix_kwargs: FixOptions | dict | None = None,
        **projector_kwargs: Any,
    ) -> None:
        inner = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if not inner:
            raise GaugeError("GaugeOptimizer: optimizer=[] holds no optimizer; pass the optimizer(s) that train the model")
        for o in inner:
            if not isinstance(o, torch.optim.Optimizer):
                raise GaugeError(f"GaugeOptimizer: optimizer must be a torch.optim.Optimizer (or a list of them), got "
                                 f"{type(o).__name__}")
            if isinstance(o, GaugeOptimizer):
                raise GaugeError("GaugeOptimizer: the optimizer is already wrapped; wrap the inner optimizer(s) once")
        if len({id(o) for o in inner}) < len(inner):
            raise GaugeError("GaugeOptimizer: the same optimizer is listed twice; list each inner optimizer once")
        shared = {id(p) for p in _params(inner[0])}
        for o in inner[1:]:
            mine = {id(p) for p in _params(o)}
            if shared & mine:
                raise GaugeError("GaugeOptimizer: a parameter is in two of the inner optimizers; it would be stepped "
                                 "twice per step. Put each parameter in one optimizer")
            shared |= mine
        if project not in _PROJECT:
            raise GaugeError(f"GaugeOptimizer: project={project!r} is not one of {_PROJECT}")
        if project is None:
            if fix_every is None:
                raise GaugeError(
                    "GaugeOptimizer: project=None (no projection) with fix_every=None does nothing; pass fix_every=N "
                    "to run GaugeFix after every N-th step, or project='update'"
                )
            extra = [*projector_kwargs] + (["sectors"] if sectors != "auto" else [])
            if extra:
                raise GaugeError(
                    f"GaugeOptimizer: {extra} configure the projection, which project=None turns off; drop them or "
                    "pass project='update'"
                )
        check_mode(mode, "GaugeOptimizer")
        schedule = Schedule(fix_every, name="fix_every", optional=True, who="GaugeOptimizer")  # the steps counted
        if project == "grad" and any(isinstance(o, torch.optim.LBFGS) for o in inner):
            raise GaugeError(
                "GaugeOptimizer: project='grad' evaluates the closure once, but LBFGS re-evaluates it; use project='update'"
            )
        super().__init__([torch.zeros(())], {})  # placeholder: see the delegating properties below
        for key in ("_constructor_param_groups", "_constructor_state", "_constructor_defaults"):
            self.__dict__.pop(key, None)
        self.optimizers = inner
        self.__dict__["optimizer"] = inner[0] if len(inner) == 1 else None  # one inner optimizer: as before
        self._merged = _MergedState(inner) if len(inner) > 1 else None
        self.model = model
        self.project, self.mode, self._schedule = project, mode, schedule
        self.sectors, self.sites = sectors, sites
        self.fix_kwargs = {"options": fix_kwargs} if isinstance(fix_kwargs, FixOptions) else dict(fix_kwargs or {})
        self.projector_kwargs = projector_kwargs
        self._fixes = 0
        self.nonfinite_steps = 0
        self._last = None
        self.last_report = None
        self._projector: GaugeProjector | None = None
        self._fixer: GaugeFixer | None = None
        if project is not None:
            self._check_coverage()
        if fix_every is not None:
            self._fixer = self._make_fixer()  # plans the fix, checks its options and the optimizer now, not at step N
        else:
            _ = self.fix_options  # checked now, not at the first fix()

    # ------------------------------------------------------------------ torch.optim.Optimizer plumbing
    # The inner optimizer holds param_groups, state and defaults; the wrapper delegates to it. The
    # public constructor (hooks, step patching, whatever a torch release adds) runs on a placeholder
    # parameter first, while the setters below keep its writes away from the inner optimizer.
    def _inner(self):
        return self.__dict__.get("optimizers")

    def _single(self, what: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise GaugeError(f"GaugeOptimizer over {len(self.optimizers)} optimizers: set {what} on one of "
                             "wrapper.optimizers")
        return self.optimizer

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        if self.optimizer is not None:
            return self.optimizer.param_groups
        return [g for o in self.optimizers for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        if self._inner() is None:
            self.__dict__["_constructor_param_groups"] = value
        else:
            self._single("param_groups").param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state if self.optimizer is not None else self._merged

    @state.setter
    def state(self, value) -> None:
        if self._inner() is None:
            self.__dict__["_constructor_state"] = value
        else:
            self._single("state").state = value

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        """The inner optimizer's defaults (the first one's, over several)."""
        return self.optimizers[0].defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        if self._inner() is None:
            self.__dict__["_constructor_defaults"] = value
        else:
            self._single("defaults").defaults = value

    @property
    def projector(self) -> GaugeProjector:
        """The :class:`~gaugeopt.projection.projector.GaugeProjector` (built on first use, and again when
        the model's attention changed: surgery, a new layer). It leaves out every gauge direction that
        would move a tensor which does not require gradients (``projector.frozen`` lists them)."""
        if self._projector is not None and self._projector.gate.ensure():
            self._projector = None  # records changed since it was built: plan again on the model as it is
        if self._projector is None:
            self._projector = GaugeProjector(self.model, self.sectors, self.mode, sites=self.sites, trainable_only=True,
                                             **self.projector_kwargs)
        return self._projector

    def _check_coverage(self) -> None:
        """Every gauge parameter must be stepped by the inner optimizer (or nothing is coherent)."""
        managed = {id(p) for g in self.param_groups for p in g["params"]}
        params = dict(self.model.named_parameters())
        missing = [n for n in self.projector.param_names() if id(params[n]) not in managed]
        if missing:
            raise GaugeError(
                f"GaugeOptimizer: gauge parameters {missing[:4]}{' ...' if len(missing) > 4 else ''} are not in the "
                "optimizer; a projected step would move them. Add them to the optimizer, or restrict the projection "
                "with sites=[...] / sectors=(...)"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._inner() is None:  # the constructor's placeholder group
            return
        self._single("add_param_group").add_param_group(param_group)

    def _inner_step(self, closure, kwargs) -> Any:
        """Every inner optimizer steps (one: with the closure; several: the closure evaluated once, first)."""
        if self.optimizer is not None:
            return self.optimizer.step(closure, **kwargs) if closure is not None else self.optimizer.step(**kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step(**kwargs)
        return loss

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """One inner step, projected (unless ``project=None``), then GaugeFix when ``fix_every``
        says so; ``closure`` re-evaluates the loss as for any optimizer."""
        if self.project is None:
            loss = self._inner_step(closure, kwargs)
        elif self.project == "update":
            proj = self.projector
            before = snapshot(proj, self.model)
            loss = self._inner_step(closure, kwargs)
            self._last = remove_vertical_update_(proj, self.model, before)
            self.nonfinite_steps += self._last is None
        else:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._last = remove_vertical_grad_(self.projector, self.model)
            self.nonfinite_steps += self._last is None
            self._inner_step(None, kwargs)
        self._schedule.stepped()  # one call, one round: every inner optimizer stepped
        if self._schedule.steps == 1 and self._fixer is not None:
            self._fixer.check_state()  # the state the first step created: an unknown key is refused now
        if self._schedule.due():
            self.fix()
        return loss

    @property
    def last_vertical_fraction(self) -> float:
        """``‖Π_vert(x)‖/‖x‖`` of the last step's update (or gradient) over the gauge parameters."""
        return math.nan if self._last is None else vertical_fraction_of(self._last)

    @property
    def fix_every(self) -> int | None:
        """GaugeFix runs after every this many steps (``None``: never)."""
        return self._schedule.every

    @fix_every.setter
    def fix_every(self, value: int | None) -> None:
        self._schedule.every = check_every(value, "fix_every", optional=True, who="GaugeOptimizer")

    @property
    def fix_options(self) -> FixOptions:
        """The options :meth:`fix` runs with (from ``fix_kwargs``)."""
        given = {k: v for k, v in self.fix_kwargs.items() if k not in ("options", "sites", "check_first_step")}
        return resolve_options(self.fix_kwargs.get("options"), given, "GaugeOptimizer: fix_kwargs")

    def _make_fixer(self) -> GaugeFixer:
        kwargs = dict(self.fix_kwargs)
        if self.sites is not None:
            kwargs.setdefault("sites", self.sites)
        kwargs.setdefault("check_first_step", False)  # step() classifies after the first step itself
        return GaugeFixer(self.model, self.optimizer if self.optimizer is not None else self.optimizers, **kwargs)

    @property
    def fixer(self) -> GaugeFixer:
        """The :class:`~gaugeopt.fix.gaugefix.GaugeFixer` ``fix`` calls (built at construction
        with ``fix_every``, else on first use)."""
        if self._fixer is None:
            self._fixer = self._make_fixer()
        return self._fixer

    def fix(self):
        """Run ``gaugeopt.gauge_fix(model, optimizer=inner(s), **fix_kwargs)`` now; returns its report."""
        self.last_report = self.fixer()
        self._fixes += 1
        return self.last_report

    # ------------------------------------------------------------------ state
    def _own_state(self) -> dict:
        sectors = self.sectors if isinstance(self.sectors, str) else list(self.sectors)
        return {
            "version": 1,
            "step": self._schedule.steps,
            "fixes": self._fixes,
            "nonfinite_steps": self.nonfinite_steps,
            "project": self.project,
            "mode": self.mode,
            "fix_every": self.fix_every,
            "sectors": sectors,
        }

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if self.optimizer is not None:
            sd = dict(self.optimizer.state_dict())
        else:
            sd = {"state": {}, "param_groups": [], "optimizers": [o.state_dict() for o in self.optimizers]}
        sd[_STATE_KEY] = self._own_state()
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load the inner optimizer's state and the wrapper's counters.

        The options (``project``, ``mode``, ``fix_every``, ``sectors``) stay as constructed — the code
        that runs now decides —; a checkpoint written with other options is reported with a warning
        naming each difference. A plain state dict of the inner optimizer (no ``"gauge_projected"``
        entry) is accepted: counters then restart at 0.
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        sd = dict(state_dict)
        own = sd.pop(_STATE_KEY, None)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(sd)
        else:
            inner = sd.get("optimizers")
            if not isinstance(inner, (list, tuple)) or len(inner) != len(self.optimizers):
                raise GaugeError(
                    f"GaugeOptimizer.load_state_dict: this wrapper holds {len(self.optimizers)} optimizers; the state "
                    f"holds {len(inner) if isinstance(inner, (list, tuple)) else 'no'} ('optimizers'); load the state "
                    "a wrapper over the same optimizers saved")
            for o, s_ in zip(self.optimizers, inner):
                o.load_state_dict(s_)
        if own is not None:
            if own.get("project") not in _PROJECT or own.get("mode") not in PROJECTION_MODES:
                raise GaugeError(f"GaugeOptimizer.load_state_dict: unreadable options in {_STATE_KEY!r}: {own}")
            self._schedule.steps, self._fixes = int(own["step"]), int(own["fixes"])
            self.nonfinite_steps = int(own.get("nonfinite_steps", 0))
            mine = self._own_state()
            differ = [f"{k}: checkpoint {own[k]!r}, constructor {mine[k]!r}"
                      for k in ("project", "mode", "fix_every", "sectors") if k in own and own[k] != mine[k]]
            if differ:  # the code that runs now says what to do; the checkpoint only says what was done
                warnings.warn(
                    "GaugeOptimizer.load_state_dict: the checkpoint was written with other options ("
                    + "; ".join(differ) + "). The constructor's options are kept; the counters are restored",
                    RuntimeWarning, stacklevel=2,
                )
        else:
            self._schedule.steps = self._fixes = self.nonfinite_steps = 0
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "optimizers": self.optimizers,
            "optimizer": self.optimizer,
            "_merged": self._merged,
            "model": self.model,
            "project": self.project,
            "mode": self.mode,
            "fix_every": self.fix_every,
            "sectors": self.sectors,
            "sites": self.sites,
            "fix_kwargs": self.fix_kwargs,
            "projector_kwargs": self.projector_kwargs,
            "_steps": self._schedule.steps,
            "_fixes": self._fixes,
            "nonfinite_steps": self.nonfinite_steps,
            "_last": self._last,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "optimizers" not in state:  # pickled by a version that wrapped one optimizer only
            state["optimizers"], state["_merged"] = [state["optimizer"]], None
        self.__dict__.update({k: state[k] for k in ("optimizers", "optimizer", "_merged")})
        self.__dict__["_schedule"] = Schedule(state.pop("fix_every"), name="fix_every", optional=True)
        self._schedule.steps = state.pop("_steps")
        torch.optim.Optimizer.__setstate__(self, state)  # restores hooks and the step patch
        self._projector = None
        self._fixer = None
        self.last_report = None

    def __repr__(self) -> str:
        inner = "\n".join("    " + line for o in self.optimizers for line in repr(o).splitlines())
        return (
            f"GaugeOptimizer(project={self.project!r}, mode={self.mode!r}, fix_every={self.fix_every}, "
            f"sectors={self.sectors!r}, steps={self._schedule.steps},\n{inner}\n)"
        )


# The former name, kept for a release (docs/names.md): the same class, so isinstance checks, pickles and
# checkpoints made with either name keep working.
GaugeProjected = GaugeOptimizer


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]
