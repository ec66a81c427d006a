"""The options of a gauge fix: one frozen object, validated once, documented field by field.

Every entry point that fixes takes the same options — :func:`gaugeopt.gauge_fix`,
:class:`~gaugeopt.fix.gaugefix.GaugeFixer`, the step core
:class:`~gaugeopt.integrations.steps.FixSteps` and the callbacks built on it (Lightning's
``GaugeFix``, the Hugging Face ``GaugeFixCallback``), :class:`gaugeopt.GaugeOptimizer`'s
``fix_kwargs`` — and the planning and drift functions take the fields they read
(:func:`~gaugeopt.fix.plan.plan_pairs`, :func:`~gaugeopt.fix.drift.drift_table`). Each accepts them

* as keyword arguments, as it always did: ``gauge_fix(model, opt, granularity="head", vo=True)``;
* as one :class:`FixOptions`: ``gauge_fix(model, opt, options=opts)`` — built once, checked once,
  passed to every place that fixes (a callback and a manual fix with the same settings);
* as both: the keyword arguments replace those fields of ``options``
  (``gauge_fix(model, opt, options=opts, vo=False)`` is ``options=opts.replace(vo=False)``).

A wrong value is a :class:`~gaugeopt.GaugeError` naming the field, raised when the options are
built (before any model is read); a name that is not a field is a ``TypeError`` naming the entry
point. ``FixOptions`` is also a read-only mapping of its fields
(``opts["vo"]``, ``dict(opts)``, ``**opts``).

Example:
    >>> from gaugeopt.fix.options import FixOptions
    >>> opts = FixOptions(granularity="head", vo=True)
    >>> opts.kinds, opts["vo_granularity"], opts.replace(vo=False).kinds
    (('qk', 'vo'), 'head', ('qk',))
    >>> FixOptions(granularity="row")
    Traceback (most recent call last):
    ...
    gaugeopt.errors.GaugeError: granularity='row' is not one of ('auto', 'head', 'channel', 'plane')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Collection, Mapping

from gaugeopt.errors import GaugeError
from gaugeopt.fix.transport import UNKNOWN_STATE_POLICIES
from gaugeopt.kernels.dispatch import BACKENDS

__all__ = ["FixOptions", "GRANULARITIES", "VO_GRANULARITIES", "FIX_MODES", "FIELDS", "check_choice", "resolve_options"]

GRANULARITIES = ("auto", "head", "channel", "plane")
VO_GRANULARITIES = ("head", "channel")
FIX_MODES = ("auto", "lrm", "plain")


def check_choice(name: str, value, choices) -> None:
    """Raise :class:`GaugeError` naming the accepted values when ``value`` is not one of them."""
    if value not in choices:
        raise GaugeError(f"{name}={value!r} is not one of {choices}")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise GaugeError(f"{name}={value!r} must be True or False")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class FixOptions:
    """How a gauge fix balances, what it rescales and what happens to the optimizer state.

    Attributes:
        granularity: which Q/K channels share one scale (a *slot*): ``"auto"`` (per RoPE plane
            under RoPE, per head otherwise; for QK-norm gains the finest slots the gain gauge
            allows), ``"head"`` (one per KV group, paper 002), ``"channel"`` (refused under RoPE,
            where scaling the two coordinates of a rotation plane apart changes ``q·k``) or
            ``"plane"`` (one per RoPE plane and one per non-rotary channel) —
            :mod:`gaugeopt.fix.plan`.
        transport_state: transport the optimizer state of every rescaled tensor with the rescale
            (``exp_avg/s``, ``exp_avg_sq/s²``, ...; :mod:`gaugeopt.fix.transport`). ``False``
            rescales the parameters alone and leaves the state stale, as paper 002 did.
        vo: also balance V/O (``r_V`` against ``c_O``; without multipliers the ``W_V`` rows
            against the ``W_O`` columns).
        vo_granularity: the V/O slots, ``"head"`` or ``"channel"`` (RoPE does not act on values).
        mode: what a side's scale is measured on and what the factor rescales: ``"auto"``
            (learnable multipliers where present, the QK-norm gains on a QK-norm site, else the
            stored rows and biases), ``"lrm"`` (refuses a layer without multipliers) or
            ``"plain"`` (the stored rows and biases).
        unknown_state: what to do with optimizer state no rule can move: ``"error"`` (refuse,
            naming the optimizer and the way out), ``"reset"`` (drop the rescaled parameters'
            state) or ``"leave"`` (keep it stale).
        product_decay: ``λ ∈ [0, 1)``: shrink each slot's scale product ``s_Q·s_K`` by
            ``(1 − λ)``, symmetrically — changes the function on purpose (``None``: off).
        product_max: cap each slot's ``s_Q·s_K`` at this value (``> 0``), symmetrically —
            changes the function on purpose (``None``: off).
        eps: ``ε`` of paper 002's eq. 4, ``g = sqrt((s_Q + ε)/(s_K + ε))`` (``> 0``; it keeps
            ``g`` finite for an all-zero slot).
        backend: ``"auto"`` (the fused Triton kernel on CUDA tensors when Triton is importable,
            the torch backend otherwise; ``GAUGEOPT_BACKEND`` overrides it), ``"triton"`` or
            ``"torch"`` to force one (forcing Triton where it cannot run is a
            :class:`~gaugeopt.GaugeError`).
        rescale_frozen: also rescale tensors that do not require gradients (default: a pair with
            a frozen tensor is left out and listed in ``report.frozen``).
    """

    granularity: str = "auto"
    transport_state: bool = True
    vo: bool = False
    vo_granularity: str = "head"
    mode: str = "auto"
    unknown_state: str = "error"
    product_decay: float | None = None
    product_max: float | None = None
    eps: float = 1e-12
    backend: str = "auto"
    rescale_frozen: bool = False

    def __post_init__(self) -> None:
        check_choice("granularity", self.granularity, GRANULARITIES)
        check_choice("vo_granularity", self.vo_granularity, VO_GRANULARITIES)
        check_choice("mode", self.mode, FIX_MODES)
        check_choice("unknown_state", self.unknown_state, UNKNOWN_STATE_POLICIES)
        check_choice("backend", self.backend, BACKENDS)
        for flag in ("transport_state", "vo", "rescale_frozen"):
            _check_flag(flag, getattr(self, flag))
        if not (isinstance(self.eps, (int, float)) and self.eps > 0):
            raise GaugeError(f"eps={self.eps!r} must be > 0 (paper 002 uses 1e-12); it keeps g finite for an all-zero head")
        decay = self.product_decay
        if decay is not None and not (_is_number(decay) and 0.0 <= decay < 1.0):
            raise GaugeError(f"product_decay={decay!r} must be in [0, 1): the product is multiplied by 1 - product_decay")
        if self.product_max is not None and not (_is_number(self.product_max) and self.product_max > 0):
            raise GaugeError(f"product_max={self.product_max!r} must be > 0")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The pairs the fix balances: ``("qk",)``, or ``("qk", "vo")`` with :attr:`vo`."""
        return ("qk", "vo") if self.vo else ("qk",)

    def replace(self, **changes: Any) -> "FixOptions":
        """A copy with ``changes`` applied (validated like the original)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """``{field: value}`` in field order."""
        return {name: getattr(self, name) for name in FIELDS}

    # a read-only mapping of the fields: opts["vo"], dict(opts), **opts
    def keys(self) -> tuple[str, ...]:
        return FIELDS

    def __getitem__(self, name: str) -> Any:
        if name not in FIELDS:
            raise KeyError(name)
        return getattr(self, name)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(FixOptions))


def resolve_options(
    options: FixOptions | None,
    fields: Mapping[str, Any],
    who: str,
    *,
    granularity: str | None = None,
    base: FixOptions | None = None,
    accepted: Collection[str] = FIELDS,
) -> FixOptions:
    """The options of one call: ``options`` (``None``: ``base``, else the defaults) with the call's
    keyword arguments ``fields`` replacing those fields.

    Args:
        options: a :class:`FixOptions` or ``None``.
        fields: the keyword arguments the entry point received.
        who: the entry point, for the messages.
        granularity: the entry point's positional ``granularity`` (``None``: not given).
        base: the options when ``options`` is ``None`` (default ``FixOptions()``; the drift
            metrics measure per head).
        accepted: the fields this entry point reads (a ``TypeError`` names any other keyword).
    """
    if granularity is not None:
        fields = {**fields, "granularity": granularity}
    unknown = [k for k in fields if k not in accepted]
    if unknown:
        raise TypeError(f"{who}: unexpected keyword argument {unknown[0]!r}; the fix options it takes are "
                        f"{', '.join(accepted)} (gaugeopt.fix.options.FixOptions)")
    if options is None:
        options = base if base is not None else FixOptions()
    elif not isinstance(options, FixOptions):
        raise GaugeError(f"{who}: options={options!r} must be a gaugeopt.fix.options.FixOptions (or None); "
                         "pass keyword arguments for single fields")
    return options.replace(**fields) if fields else options
