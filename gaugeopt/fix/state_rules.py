"""How each optimizer's per-parameter state moves under a diagonal reparameterisation ``p ← s ⊙ p``.

The loss is the same function of ``p' = s ⊙ p``, so the gradient in the new coordinates is
``g / s`` and every statistic an optimizer keeps is rewritten as if its whole history had been
measured there (docs/optimizers.md). A *rule* says, for one optimizer class, what happens to each
state entry of one parameter::

    gradient averages          exp_avg, momentum_buffer, grad_avg, prev     ← t / s        (power 1)
    averages of squares        exp_avg_sq, square_avg, sum, variance        ← t / s²       (power 2)
    points of parameter space  schedule-free z, ASGD ax                     ← t · s        (power −1)
    coordinate-free            step, mu_product, RMSprop's normalised steps  untouched     (power 0)
    factored second moments    Adafactor's row/column factors, Adam-mini's per-block means (below)

A rule returns :class:`StateMove` s — the tensors to move, each *exact* or *approximate* with the
reason — or raises :class:`StateRefused` with the reason it cannot be moved (the caller then applies
its ``unknown_state`` policy). Every tensor entry of the state must be accounted for: a key the rule
does not list refuses, so an optimizer that grows a new statistic is never half-transported.
Approximate moves are declared, never silent:

* an ``eps`` inside an accumulated statistic (Adamax's ``|g| + eps``, RMSprop's momentum of
  ``g / (√v + eps)``, the Hugging Face Adafactor's ``g² + eps₀``) is not a function of the
  coordinates: the move is exact when that ``eps`` is 0, and off by a relative ``≈ eps·|s − 1| / |g|``
  otherwise;
* a factored second moment ``v̂ = r cᵀ / mean(r)`` (Adafactor): a rescale of the rows moves ``r``
  exactly (``r / s²``), while the column factor — a mean over rows of ``g²/s²`` — is not a function of
  the factors; it is set to the value a rank-one ``v`` would give (``c · mean(r/s²) / mean(r)``), which
  makes the preconditioner ``v̂`` itself move exactly (``v̂ / s²``) and leaves the future column
  averages approximate. Columns likewise, the other way round.

Refused (the caller's ``unknown_state`` policy applies): quantised states (8-bit or 4-bit blocks:
bitsandbytes, torchao), whose codes would dequantise to other values; a coupled L2 term
(``Adam(weight_decay>0)``, ``SGD(weight_decay>0)``: ``g + λp`` enters the moments, a mix of a
gradient, which moves as ``1/s``, and a weight, which moves as ``s``, that the state cannot separate —
measured, dividing it by ``s`` continues *worse* than leaving it stale); LBFGS's curvature pairs.

Optimizers from other packages are matched by their import path along the MRO (gaugeopt never
imports them): schedule-free AdamW/RAdam/SGD, Adam-mini, the Hugging Face Adafactor, bitsandbytes,
torchao. Teach another one with :func:`register_state_rule`.

Example:
    >>> import torch
    >>> from gaugeopt.fix.state_rules import state_moves
    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> opt = torch.optim.RMSprop([p], momentum=0.9, centered=True)
    >>> p.grad = torch.tensor([1.0, -2.0, 0.5]); opt.step()
    >>> [(m.key, m.power, m.approximate is not None) for m in state_moves(opt, p)]
    [('square_avg', 2, False), ('grad_avg', 1, False), ('momentum_buffer', 0, True)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from gaugeopt.distributed import is_dtensor
from gaugeopt.errors import GaugeError

__all__ = [
    "StateMove",
    "StateRefused",
    "StateContext",
    "register_state_rule",
    "state_rule",
    "state_moves",
]


@dataclass
class StateMove:
    """One state tensor (or a pair of factors) and how it moves.

    Attributes:
        key: the state key (``"row_var+col_var"`` for a factored pair).
        tensor: for a power move, the tensor shaped like the parameter (a view of the stored one).
        power: ``t ← t / s**power`` (``0``: untouched, exact as it stands).
        apply: for any other move, ``apply(s)`` with ``s`` the storage-layout factor, broadcastable
            against the parameter; it writes the entry in place.
        approximate: why the move is not exact (``None`` when it is).
    """

    key: str
    tensor: torch.Tensor | None = None
    power: int = 0
    apply: Callable[[torch.Tensor], None] | None = None
    approximate: str | None = None

    @property
    def moves_data(self) -> bool:
        return self.apply is not None or (self.tensor is not None and self.power != 0)


class StateRefused(Exception):
    """A rule's refusal: the reason the state of one parameter cannot be moved."""


@dataclass
class StateContext:
    """What a rule sees: the optimizer, the parameter's group and state, and ``probe`` — a factor
    with the structure the fix will use (random values per scale slot, storage layout; ``None``
    when unknown: any diagonal)."""

    optimizer: torch.optim.Optimizer
    group: dict
    param: torch.Tensor
    state: dict
    probe: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return type(self.optimizer).__qualname__


Rule = Callable[[StateContext], list[StateMove]]
_RULES: dict[Any, Rule] = {}  # class, or "module.QualName" for classes of other packages


def register_state_rule(cls: type | str, rule: Mapping[str, int] | Rule) -> None:
    """Declare how ``cls``'s per-parameter state transforms under ``p ← s ⊙ p``.

    Args:
        cls: the optimizer class (subclasses inherit the rule), or its import path
            ``"package.module.Class"`` for a class gaugeopt should not import.
        rule: ``{key: k}`` meaning ``state[key] ← state[key] / s**k`` for a tensor shaped like the
            parameter (any integer: ``1`` for gradient averages, ``2`` for averages of squared
            gradients, ``-1`` for points of parameter space, ``0`` for coordinate-free entries);
            every tensor key the optimizer keeps must be listed (``step`` may be left out). Or a
            callable ``rule(ctx: StateContext) -> list[StateMove]`` (raising :class:`StateRefused`).
    """
    if not isinstance(cls, (type, str)):
        raise GaugeError(f"register_state_rule expects an optimizer class or its import path, got {cls!r}")
    if isinstance(rule, Mapping):
        bad = {k: v for k, v in rule.items() if isinstance(v, bool) or not isinstance(v, int)}
        if bad:
            raise GaugeError(f"register_state_rule({_label(cls)}): powers must be integers, got {bad}")
        rule = powers(dict(rule))
    elif not callable(rule):
        raise GaugeError(f"register_state_rule({_label(cls)}): rule must be {{key: power}} or a callable, got {rule!r}")
    _RULES[cls] = rule


def _label(cls) -> str:
    return cls if isinstance(cls, str) else cls.__qualname__


def state_rule(optimizer) -> Rule | None:
    """The rule for ``optimizer``'s class: the first class along its MRO registered by class or by path."""
    for cls in type(optimizer).__mro__:
        if cls in _RULES:
            return _RULES[cls]
        path = f"{cls.__module__}.{cls.__qualname__}"
        if path in _RULES:
            return _RULES[path]
    return None


def state_moves(optimizer: torch.optim.Optimizer, param: torch.Tensor, probe: torch.Tensor | None = None) -> list[StateMove]:
    """The moves of ``param``'s state in ``optimizer`` (``[]`` without state); raises
    :class:`StateRefused` when it cannot be moved (no rule, a key the rule does not cover, quantised
    blocks, a factor structure the rule cannot follow, an optimizer class refused whatever its state)."""
    rule = state_rule(optimizer)
    if getattr(rule, "refuses", None):
        raise StateRefused(rule.refuses)
    state = optimizer.state.get(param)
    if not state:
        return []
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and _quantised(value):
            kind = type(value).__name__ if type(value) is not torch.Tensor else f"{value.dtype} codes"
            raise StateRefused(
                f"stores {key!r} as {kind} (quantised blocks, as 8-bit/4-bit optimizers keep them): rescaling "
                "the codes would change what they dequantise to, so the state cannot be transported exactly")
    if rule is None:
        raise StateRefused("has no state rule")
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), {})
    return rule(StateContext(optimizer, group, param, state, probe))


def _quantised(t: torch.Tensor) -> bool:
    if is_dtensor(t):
        return not t.is_floating_point()
    return type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_floating_point()


# ---------------------------------------------------------------------- building blocks
def _shaped(ctx: StateContext, key: str) -> torch.Tensor:
    """``state[key]`` as a tensor shaped like the parameter (a view), or :class:`StateRefused`."""
    t, p = ctx.state[key], ctx.param
    if tuple(t.shape) == tuple(p.shape):
        return t
    if t.numel() == p.numel() and t.is_contiguous() and not is_dtensor(t):
        return t.view(p.shape)
    raise StateRefused(f"keeps {key!r} with shape {tuple(t.shape)} for a parameter of shape {tuple(p.shape)}")


def powers(rule: dict[str, int], approximate: Callable[[StateContext, str], str | None] | None = None) -> Rule:
    """A rule of elementwise powers ``{key: k}``; ``approximate(ctx, key)`` says why a key's move
    is not exact for this parameter group (``None``: exact)."""

    def apply(ctx: StateContext) -> list[StateMove]:
        unknown = [k for k, v in ctx.state.items() if torch.is_tensor(v) and k not in rule and k != "step"]
        if unknown:
            raise StateRefused(f"keeps state keys {unknown} that its rule does not cover")
        moves = []
        for key, k in rule.items():
            v = ctx.state.get(key)
            if not torch.is_tensor(v):
                continue
            if v.dim() == 0:
                if k:
                    raise StateRefused(f"keeps {key!r} as one number, which a per-coordinate rescale cannot move")
                continue
            why = approximate(ctx, key) if approximate is not None else None
            moves.append(StateMove(key, _shaped(ctx, key), k, approximate=why))
        return moves

    return apply


def _coupled_decay(ctx: StateContext) -> None:
    """Refuse a coupled L2 term: ``g + λp`` in the moments mixes a covector (moves as ``1/s``) and a
    vector (moves as ``s``), which the state cannot separate."""
    wd = float(ctx.group.get("weight_decay", 0.0) or 0.0)
    if wd and not bool(ctx.group.get("decoupled_weight_decay", False)):
        raise StateRefused(
            f"adds weight_decay={wd}·p to the gradient before it enters its moments (coupled L2): they mix the "
            "gradient, which moves as 1/s, with the weight, which moves as s, and cannot be separated. Use the "
            "decoupled form (AdamW, or decoupled_weight_decay=True), weight_decay=0 on the rescaled parameters")


def _adam_like(ctx: StateContext, key: str) -> str | None:
    _coupled_decay(ctx)
    return None


def _adagrad(ctx: StateContext) -> list[StateMove]:
    """``sum = c + Σ g²`` with ``c = initial_accumulator_value``: ``sum ← (sum − c)/s² + c``, exact."""
    _coupled_decay(ctx)
    moves = powers({"sum": 2})(ctx)
    c = float(ctx.group.get("initial_accumulator_value", 0.0) or 0.0)
    if not c or not moves:
        return moves
    t = moves[0].tensor
    if is_dtensor(t):
        raise StateRefused(f"keeps a sharded 'sum' with initial_accumulator_value={c}, moved only unsharded")

    @torch.no_grad()
    def move(s: torch.Tensor) -> None:
        t.sub_(c).div_(s.to(t.dtype) ** 2).add_(c)

    return [StateMove("sum", apply=move)]


def _adamax(ctx: StateContext, key: str) -> str | None:
    eps = float(ctx.group.get("eps", 0.0))
    _coupled_decay(ctx)
    if key == "exp_inf" and eps:
        return (f"exp_inf = max(β₂·exp_inf, |g| + eps) with eps={eps}: exact only for eps=0, else off by at most "
                "eps·|1 − 1/s| per entry")
    return None


def _rmsprop(ctx: StateContext, key: str) -> str | None:
    eps = float(ctx.group.get("eps", 0.0))
    _coupled_decay(ctx)
    if key == "momentum_buffer" and eps and ctx.group.get("momentum", 0):
        return (f"the momentum holds steps g/(√v + eps), scale-free only for eps=0; with eps={eps} each past step "
                "is off by a relative eps·|s − 1|/(√v + s·eps)")
    return None


# ---------------------------------------------------------------------- factored second moments
def _factor_axes(ctx: StateContext) -> tuple[bool, bool]:
    """Whether the fix's factor varies along the last two axes (rows, columns) of a matrix."""
    p = ctx.param
    if ctx.probe is None:
        return True, True
    f = ctx.probe.expand(p.shape)
    rows = bool((f != f[..., :1, :]).any())
    cols = bool((f != f[..., :, :1]).any())
    return rows, cols


def factored(row: str, col: str, row_keepdim: bool, full: str, others: Rule | None = None) -> Rule:
    """A rule for a factored second moment ``v̂ = r cᵀ / mean(r)`` (Adafactor): ``row`` holds the
    means over the last axis, ``col`` over the second to last (``row_keepdim``: torch keeps the reduced
    axis, ``(…, R, 1)`` and ``(…, 1, C)``; Hugging Face drops it); ``full`` is the key of the
    unfactored moment of 1-D parameters (power 2). ``others`` handles the remaining keys."""

    def apply(ctx: StateContext) -> list[StateMove]:
        st = ctx.state
        moves = [] if others is None else others(ctx)
        known = {row, col, full, "step", "RMS"} | {m.key for m in moves}  # RMS(p): recomputed at every step
        unknown = [k for k, v in st.items() if torch.is_tensor(v) and k not in known]
        if unknown:
            raise StateRefused(f"keeps state keys {unknown} that its rule does not cover")
        v = st.get(full)
        if torch.is_tensor(v) and v.dim() > 0:
            moves.append(StateMove(full, _shaped(ctx, full), 2, approximate=_eps_in_square(ctx)))
        r, c = st.get(row), st.get(col)
        if not (torch.is_tensor(r) and torch.is_tensor(c)):
            return moves
        if is_dtensor(r) or is_dtensor(ctx.param):
            raise StateRefused("keeps factored second moments of a sharded (DTensor) parameter, which are not transported")
        rows, cols = _factor_axes(ctx)
        rk = r if row_keepdim else r.unsqueeze(-1)   # (..., R, 1)
        ck = c if row_keepdim else c.unsqueeze(-2)   # (..., 1, C)
        if rows and cols:
            raise StateRefused(f"keeps factored second moments ({row!r}, {col!r}) and the fix rescales both rows and "
                               "columns of this matrix: neither factor can be moved")
        why = None
        if rows:
            why = (f"{col!r} (a mean over rows of g²) is not a function of the factors after a row rescale: set "
                   "to its rank-one value, which moves the preconditioner r·cᵀ/mean(r) exactly and the future "
                   "column averages approximately")
        elif cols:
            why = (f"{row!r} (a mean over columns of g²) is not a function of the factors after a column rescale: "
                   "set to its rank-one value (see docs/optimizers.md)")
        eps = _eps_in_square(ctx)
        why = why or eps

        @torch.no_grad()
        def move(s: torch.Tensor) -> None:
            f2 = s.expand(ctx.param.shape).to(rk.dtype) ** 2
            if rows or not cols:  # s constant along the columns: the row factor moves exactly
                s_r = f2[..., :, :1]                                  # (..., R, 1)
                ratio = (rk / s_r).mean(dim=-2, keepdim=True) / rk.mean(dim=-2, keepdim=True)
                rk.div_(s_r)
                if rows:
                    ck.mul_(ratio)
                else:  # a scalar rescale: the columns see the same factor
                    ck.div_(f2[..., :1, :])
            else:
                s_c = f2[..., :1, :]                                  # (..., 1, C)
                ratio = (ck / s_c).mean(dim=-1, keepdim=True) / ck.mean(dim=-1, keepdim=True)
                ck.div_(s_c)
                rk.mul_(ratio)

        moves.append(StateMove(f"{row}+{col}", apply=move, approximate=why))
        return moves

    return apply


def _eps_in_square(ctx: StateContext) -> str | None:
    eps = ctx.group.get("eps")
    if isinstance(eps, (tuple, list)) and "decay_rate" in ctx.group and eps[0]:  # Hugging Face: g² + eps₀
        return (f"eps[0]={eps[0]} is added to every squared gradient: exact only for eps[0]=0, else off by a relative "
                f"≈ eps[0]·|s² − 1|/g²")
    return None


def _hf_adafactor_others(ctx: StateContext) -> list[StateMove]:
    ea = ctx.state.get("exp_avg")
    if not torch.is_tensor(ea):
        return []
    if ctx.group.get("scale_parameter", True):
        raise StateRefused("with beta1 and scale_parameter=True keeps exp_avg, an average of updates scaled by "
                           "each past RMS(p), which a rescale does not determine; pass scale_parameter=False (its "
                           "exp_avg is then coordinate-free) or beta1=None")
    return [StateMove("exp_avg", _shaped(ctx, "exp_avg"), 0)]


# ---------------------------------------------------------------------- per-block second moments (Adam-mini)
def _adam_mini(ctx: StateContext) -> list[StateMove]:
    st = ctx.state
    moves = powers({"m": 1, "v": 2})(  # "m" may be stored as a (blocks, numel) view of the parameter
        StateContext(ctx.optimizer, ctx.group, ctx.param, {k: v for k, v in st.items() if k in ("m", "v")}, ctx.probe))
    vmean = st.get("vmean")
    unknown = [k for k, v in st.items() if torch.is_tensor(v) and k not in ("m", "v", "vmean", "step")]
    if unknown:
        raise StateRefused(f"keeps state keys {unknown} that its rule does not cover")
    if not torch.is_tensor(vmean):
        return moves
    p = ctx.param
    blocks = max(1, vmean.numel())
    if p.numel() % blocks or is_dtensor(p):
        raise StateRefused(f"keeps 'vmean' with {blocks} blocks for a parameter of {p.numel()} entries")
    if ctx.probe is None:
        raise StateRefused("keeps one second moment per block ('vmean'), movable only by a factor constant on each block")
    f = ctx.probe.expand(p.shape).reshape(blocks, -1)
    if bool((f != f[:, :1]).any()):
        raise StateRefused(
            f"keeps one second moment per block ('vmean': {blocks} block(s) of {p.numel() // blocks} entries — one per "
            "head for q/k projections, one per row or one per tensor elsewhere) and the fix's slots split a block: "
            "use granularity='head' with separate q_proj/k_proj weights (mode='plain'), or unknown_state='reset'")

    @torch.no_grad()
    def move(s: torch.Tensor) -> None:
        per_block = s.expand(p.shape).reshape(blocks, -1)[:, 0].to(vmean.dtype)
        vmean.div_((per_block ** 2).reshape(vmean.shape))

    return moves + [StateMove("vmean", apply=move)]


def _refuse(reason: str) -> Rule:
    """A class refused whatever its state holds (and before it holds any)."""
    def apply(ctx: StateContext) -> list[StateMove]:
        raise StateRefused(reason)

    apply.refuses = reason
    return apply


# ---------------------------------------------------------------------- the built-in rules
_ADAM = {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2, "mu_product": 0}
for _cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam):
    _RULES[_cls] = powers(_ADAM, _adam_like)
_RULES[torch.optim.SGD] = powers({"momentum_buffer": 1}, _adam_like)
_RULES[torch.optim.Adagrad] = _adagrad
_RULES[torch.optim.Adamax] = powers({"exp_avg": 1, "exp_inf": 1}, _adamax)
_RULES[torch.optim.RMSprop] = powers({"square_avg": 2, "grad_avg": 1, "momentum_buffer": 0}, _rmsprop)
_RULES[torch.optim.ASGD] = powers({"ax": -1, "eta": 0, "mu": 0}, _adam_like)
_RULES[torch.optim.Rprop] = powers({"prev": 1, "step_size": 0})
_RULES[torch.optim.Muon] = powers({"momentum_buffer": 1})
_RULES[torch.optim.Adafactor] = factored("row_var", "col_var", True, "variance")
_RULES[torch.optim.LBFGS] = _refuse(
    "keeps flattened curvature pairs over all its parameters (old_dirs, old_stps, d), which no per-parameter rule moves")
_RULES["transformers.optimization.Adafactor"] = factored(
    "exp_avg_sq_row", "exp_avg_sq_col", False, "exp_avg_sq", others=_hf_adafactor_others)
# schedule-free: z is a point of parameter space (like the weight); the weights seen in train mode (y)
# and eval mode (x, a combination of y and z) then both move like the weight
for _path in ("schedulefree.adamw_schedulefree.AdamWScheduleFree", "schedulefree.radam_schedulefree.RAdamScheduleFree",
              "schedulefree.adamw_schedulefree_closure.AdamWScheduleFreeClosure",
              "schedulefree.radam_schedulefree_closure.RAdamScheduleFreeClosure"):
    _RULES[_path] = powers({"z": -1, "exp_avg_sq": 2})
for _path in ("schedulefree.sgd_schedulefree.SGDScheduleFree", "schedulefree.sgd_schedulefree_closure.SGDScheduleFreeClosure"):
    _RULES[_path] = powers({"z": -1})
_RULES["adam_mini.adam_mini.Adam_mini"] = _adam_mini
_QUANTISED = ("keeps quantised (8-bit/4-bit) blocks for large parameters: rescaling the codes would change what they "
              "dequantise to. Use a full-precision optimizer with gauge fixes, unknown_state='reset' (re-initialise the "
              "rescaled parameters' state) or transport_state=False")
for _path in ("bitsandbytes.optim.optimizer.Optimizer8bit", "torchao.optim.adam._AdamBase"):
    _RULES[_path] = _refuse(_QUANTISED)
