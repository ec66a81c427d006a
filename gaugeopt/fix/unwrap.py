"""The optimizers behind what a training stack calls "the optimizer": one walk through the wrappers.

What gaugeopt is handed is often not the :class:`torch.optim.Optimizer` that holds the state, nor the
object whose step hooks fire exactly when a step is taken. :func:`walk` follows the wrappers once and
returns one :class:`Path` per optimizer holding state; each path knows both answers. For each thing
handed: what holds the state (what a fix transports); what is hooked (what counts real steps).

* a torch optimizer — itself; itself;
* Lightning's ``LightningOptimizer`` (not an Optimizer: ``.optimizer`` / ``._optimizer``) — the
  one it wraps; the one it wraps;
* Accelerate's ``AcceleratedOptimizer`` (an Optimizer whose ``state`` is the inner one's) — the one
  it wraps; the one it wraps, since its own ``step`` runs also for the steps a ``GradScaler``
  skipped (it reports ``step_was_skipped``);
* :class:`gaugeopt.GaugeOptimizer`, over one optimizer or several (``.optimizers``) — each inner
  optimizer; the wrapper itself, whose step is one whole projected round (it declares
  ``steps_as_one_round``);
* a container of optimizers in ``.optimizers`` (torchtitan's ``OptimizersContainer``) — each member;
  each member;
* a list or tuple of any of these — each, once; each, once.

On top of the walk: :func:`unwrap_optimizers` / :func:`unwrap_optimizer` (the state holders),
:func:`param_owners` (which holder steps each parameter a gauge operation rescales: exactly one),
:func:`owning_optimizers` (the objects to hook for the parameters a training-loop integration
watches) and :func:`wrapped_chain` (every object on the way, for conflict checks).

Example:
    >>> import torch
    >>> from gaugeopt.fix.unwrap import walk
    >>> class LightningLike:                     # not an Optimizer: wraps one in .optimizer
    ...     def __init__(self, optimizer): self.optimizer = optimizer
    >>> adamw = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    >>> [(type(p.holder).__name__, type(p.stepper).__name__, len(p.objects)) for p in walk([LightningLike(adamw)])]
    [('AdamW', 'AdamW', 2)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from gaugeopt.errors import GaugeError

__all__ = [
    "Path",
    "walk",
    "inner_optimizer",
    "wrapped_chain",
    "unwrap_optimizers",
    "unwrap_optimizer",
    "param_owners",
    "owning_optimizers",
    "owning_optimizer",
]

_MAX_DEPTH = 8  # wrappers inside wrappers (and containers inside containers) followed at most


def inner_optimizer(wrapper):
    """What ``wrapper`` wraps through ``.optimizer`` or ``._optimizer`` (``None`` when nothing):
    Lightning's ``LightningOptimizer``, Accelerate's ``AcceleratedOptimizer``, :class:`gaugeopt.GaugeOptimizer`."""
    return getattr(wrapper, "optimizer", None) or getattr(wrapper, "_optimizer", None)


def _members(optimizer) -> list | None:
    """The optimizers a container holds in ``.optimizers`` (torchtitan's ``OptimizersContainer``,
    :class:`gaugeopt.GaugeOptimizer`), or ``None``."""
    parts = getattr(optimizer, "optimizers", None)
    if isinstance(parts, (list, tuple)) and parts and all(isinstance(o, torch.optim.Optimizer) for o in parts):
        return list(parts)
    return None


def _looks_through(obj) -> bool:
    """Whether ``obj``'s own step hooks would miscount: not an Optimizer, a wrapper whose ``step`` runs
    for skipped steps (``step_was_skipped``), or a container whose members step (unless its step is
    one whole round: ``steps_as_one_round``)."""
    if not isinstance(obj, torch.optim.Optimizer) or hasattr(obj, "step_was_skipped"):
        return True
    return not getattr(obj, "steps_as_one_round", False) and _members(obj) is not None


@dataclass(frozen=True)
class Path:
    """The objects from one handed optimizer (or wrapper) down to one optimizer holding state."""

    objects: tuple

    @property
    def holder(self) -> torch.optim.Optimizer:
        """The :class:`torch.optim.Optimizer` whose ``state`` holds the parameters' state."""
        return self.objects[-1]

    @property
    def stepper(self) -> torch.optim.Optimizer:
        """The outermost optimizer on the path whose step hooks fire exactly once per real step."""
        return next((o for o in self.objects if not _looks_through(o)), self.holder)


def _paths(obj, strict: bool, depth: int = 0) -> list[tuple]:
    path = [obj]
    for _ in range(_MAX_DEPTH + 1):
        if isinstance(obj, torch.optim.Optimizer):
            inner = getattr(obj, "optimizer", None)
            shares = isinstance(inner, torch.optim.Optimizer) and obj.state is inner.state
            if shares or (hasattr(obj, "step_was_skipped") and isinstance(inner_optimizer(obj), torch.optim.Optimizer)):
                obj = inner if shares else inner_optimizer(obj)
                path.append(obj)
                continue
            parts = _members(obj)
            if parts is not None and depth < _MAX_DEPTH:
                return [tuple(path) + rest for part in parts for rest in _paths(part, strict, depth + 1)]
            return [tuple(path)]
        inner = inner_optimizer(obj)
        if inner is None:
            break
        obj = inner
        path.append(obj)
    if not strict:
        return [tuple(path)]
    raise GaugeError(
        f"optimizer={type(obj).__qualname__} is not a torch.optim.Optimizer and wraps none (looked for "
        ".optimizer, ._optimizer and .optimizers); pass the optimizer(s) that train the model"
    )


def _items(optimizers) -> list:
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not items:
        raise GaugeError("optimizer=[] holds no optimizer; pass the optimizer(s) that train the model")
    return items


def walk(optimizers) -> list[Path]:
    """One :class:`Path` per optimizer holding state behind ``optimizers`` (one optimizer, a wrapper,
    a container, or a list or tuple of these), each holder once, in order; :class:`GaugeError` for
    an object that is not an optimizer and wraps none."""
    out: list[Path] = []
    for item in _items(optimizers):
        for objects in _paths(item, strict=True):
            if all(objects[-1] is not p.holder for p in out):
                out.append(Path(objects))
    return out


def wrapped_chain(optimizers) -> list:
    """Every object on the way from ``optimizers`` to the state holders (the wrappers, the containers,
    the holders), each once; never raises (for checks before the walk proper)."""
    items = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    out: list = []
    for item in items:
        for objects in _paths(item, strict=False):
            out += [o for o in objects if all(o is not q for q in out)]
    return out


def unwrap_optimizers(optimizers) -> list[torch.optim.Optimizer]:
    """The :class:`torch.optim.Optimizer` s holding the state behind ``optimizers``, each once, in order."""
    return [p.holder for p in walk(optimizers)]


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The one :class:`torch.optim.Optimizer` holding the state behind ``optimizer``. Where several
    hold state, use :func:`unwrap_optimizers` and :func:`param_owners`."""
    opts = unwrap_optimizers(optimizer)
    if len(opts) > 1:
        raise GaugeError(
            f"optimizer={type(optimizer).__qualname__} holds {len(opts)} optimizers "
            f"({', '.join(type(o).__name__ for o in opts)}); this function needs the one that holds the parameter's state"
        )
    return opts[0]


def _owners(paths: list[Path], wanted: Mapping[int, str], who: str, what: str) -> dict[int, Path]:
    """``id(param) → the path whose holder steps it``, for the parameters of ``wanted`` (``id → name``)
    that some holder steps; a parameter two holders step is a :class:`GaugeError`."""
    found: dict[int, list[Path]] = {}
    for path in paths:
        for g in path.holder.param_groups:
            for p in g["params"]:
                if id(p) in wanted:
                    found.setdefault(id(p), []).append(path)
    twice = [(wanted[pid], ps) for pid, ps in found.items() if len(ps) > 1]
    if twice:
        name, ps = twice[0]
        raise GaugeError(
            f"{who}: {len(twice)} parameter(s) {what} are in two optimizers, e.g. {name} in "
            f"{' and '.join(type(p.holder).__name__ for p in ps)}: it would be stepped twice per iteration (and its "
            "state moved twice). Put each parameter in exactly one optimizer"
        )
    return {pid: ps[0] for pid, ps in found.items()}


def param_owners(optimizers, params: Mapping[int, tuple[str, torch.Tensor]], who: str) -> dict[int, torch.optim.Optimizer]:
    """``id(param) → the optimizer holding its state``, for each of ``params`` (``id → (name, tensor)``).

    ``optimizers`` is anything :func:`walk` takes (Muon for the matrices beside AdamW for the rest, a
    container, a list). A parameter no optimizer steps, or two step, is a :class:`GaugeError`: its state
    could not be transported (none), or would be transported twice and the parameter stepped twice per
    iteration (two).
    """
    paths = walk(optimizers)
    owners = _owners(paths, {pid: name for pid, (name, _) in params.items()}, who, "the fix rescales")
    missing = [name for pid, (name, _) in params.items() if pid not in owners]
    if missing:
        names = ", ".join(type(p.holder).__name__ for p in paths)
        whose = "none of the" if len(missing) == len(params) else f"{len(params) - len(missing)} of the {len(params)}"
        them = f"the optimizer ({names}) steps" if len(paths) == 1 else f"the optimizers ({names}) step"
        raise GaugeError(
            f"{who}: {them} {whose} parameters the fix rescales; missing e.g. "
            f"{missing[:3]}; their optimizer state cannot be transported. Pass every optimizer that trains these "
            "parameters (a list: gauge_fix(model, [muon, adamw])), or transport_state=False to rescale the parameters alone"
        )
    return {pid: path.holder for pid, path in owners.items()}


def owning_optimizers(optimizers, params: Iterable[torch.Tensor], who: str) -> list[torch.optim.Optimizer]:
    """The objects to hook (:attr:`Path.stepper`) for the optimizers among ``optimizers`` that step any
    of ``params``, in order. None is a :class:`GaugeError`, and so is a tensor stepped by two (it
    would be updated twice per iteration)."""
    wanted = {id(p): f"a tensor of shape {tuple(p.shape)}" for p in params}
    paths = walk(optimizers)
    owning = {id(path.holder) for path in _owners(paths, wanted, who, "of the attention").values()}
    out: list[torch.optim.Optimizer] = []
    for path in paths:
        if id(path.holder) in owning and all(path.stepper is not o for o in out):
            out.append(path.stepper)
    if not out:
        raise GaugeError(
            f"{who}: no optimizer of this run updates the attention parameters it watches ({len(wanted)} tensors); "
            "pass the optimizer(s) that train the model (their param_groups must hold the Q/K/V/O tensors)"
        )
    return out


def owning_optimizer(optimizers, params: Iterable[torch.Tensor], who: str) -> torch.optim.Optimizer:
    """The one optimizer among ``optimizers`` that steps ``params`` (:func:`owning_optimizers` when
    several may)."""
    owners = owning_optimizers(optimizers, params, who)
    if len(owners) > 1:
        raise GaugeError(
            f"{who}: the attention parameters are split over {len(owners)} optimizers; this needs the one that steps "
            "them all (owning_optimizers and StepCounter.watch take several)"
        )
    return owners[0]
