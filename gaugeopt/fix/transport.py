"""Optimizer-state transport for diagonal reparameterisations ``p ← s ⊙ p``.

A gauge fix that rescales a parameter coordinate-wise changes the coordinates the optimizer
works in. The loss is the same function of the new parameter ``p' = s ⊙ p``, so by the chain
rule its gradient is ``∂L/∂p' = (∂L/∂p) / s``. Every moment an optimizer keeps is a sum of
past gradients (or of their squares), so the state *in the new coordinates* is (docs/gaugefix.md)::

    exp_avg        ← exp_avg / s           (Adam, AdamW, NAdam, RAdam)
    exp_avg_sq     ← exp_avg_sq / s²       max_exp_avg_sq ← max_exp_avg_sq / s²
    momentum_buffer← momentum_buffer / s   (SGD)
    sum            ← sum / s²              (Adagrad)
    step, mu_product, ...                  untouched (they do not depend on the coordinates)

This is exact for diagonal actions: the next step is the step the optimizer would have taken
had its whole gradient history been measured in the new coordinates (a test checks it against
an optimizer run from scratch on a reparameterised copy). It is *not* exact when the
optimizer adds a coupled L2 term ``weight_decay · p`` to the gradient (``Adam(weight_decay>0)``,
``SGD(weight_decay>0)``): that penalty is not gauge invariant; nor for ``Adagrad`` with a non-zero
``initial_accumulator_value`` (a constant that is not a sum of squared gradients). Decoupled
weight decay (AdamW) acts on ``p`` directly and is unaffected.

Known optimizers are recognised by class (first match along the MRO, so subclasses inherit the
rule) **and** by their state keys: a state tensor shaped like the parameter under a key the rule
does not list makes the optimizer "unknown" for that parameter. For unknown optimizers the caller
chooses (``unknown_state``):

* ``"error"`` (default): raise :class:`~gaugeopt.GaugeError` naming the optimizer and the keys;
* ``"reset"``: drop the parameter's state (the optimizer re-initialises it lazily, as at step 0;
  for a fused parameter this resets the whole tensor, e.g. all of ``c_attn``);
* ``"leave"``: keep the stale state (what the paper did; biased right after every fix).

Wrappers are looked through (:func:`unwrap_optimizer`): Lightning's ``LightningOptimizer``,
Accelerate's ``AcceleratedOptimizer``, :class:`gaugeopt.GaugeProjected`, torchtitan's
one-optimizer ``OptimizersContainer``. Teach a new optimizer with :func:`register_state_rule`.

The factor ``s`` is given in *storage layout*, broadcastable against the parameter
(:func:`storage_factor` builds it from a factor in a :class:`~gaugeopt.structure.site.TensorRef`'s
canonical view). Parameters and state that are DTensors (FSDP2) are rescaled shard-locally.

Example:
    >>> import torch
    >>> from gaugeopt.fix.transport import rescale_state
    >>> p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    >>> opt = torch.optim.Adam([p])
    >>> p.grad = torch.tensor([0.5, -1.0]); opt.step()
    >>> s = torch.tensor([2.0, 0.5])
    >>> with torch.no_grad(): _ = p.mul_(s)
    >>> rescale_state(opt, p, s)
    'transported'
    >>> opt.state[p]["exp_avg"]
    tensor([ 0.0250, -0.2000])
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch

from gaugeopt.distributed import local_factor, local_view
from gaugeopt.errors import GaugeError
from gaugeopt.structure.pair import Member
from gaugeopt.structure.site import TensorRef

__all__ = [
    "UNKNOWN_STATE_POLICIES",
    "register_state_rule",
    "state_rule",
    "rescale_state",
    "classify_state",
    "rescale_param",
    "rescale_tensor",
    "storage_factor",
    "reduced_ref",
    "transport_entries",
    "unwrap_optimizer",
    "inner_optimizer",
    "wrapped_chain",
]

UNKNOWN_STATE_POLICIES = ("error", "reset", "leave")

# state key -> power k: the entry is divided by s**k (0: untouched, coordinate-free).
_RULES: dict[type, dict[str, int]] = {}


def register_state_rule(cls: type, rule: Mapping[str, int]) -> None:
    """Declare how ``cls``'s per-parameter state transforms under ``p ← s ⊙ p``.

    ``rule[key] = k`` means ``state[key] ← state[key] / s**k`` (``k = 1`` for gradient averages,
    ``2`` for averages of squared gradients, ``0`` for coordinate-free entries). Keys holding
    scalars (``step``) need not be listed.
    """
    if not isinstance(cls, type):
        raise GaugeError(f"register_state_rule expects an optimizer class, got {cls!r}")
    bad = {k: v for k, v in rule.items() if v not in (0, 1, 2)}
    if bad:
        raise GaugeError(f"register_state_rule({cls.__qualname__}): powers must be 0, 1 or 2, got {bad}")
    _RULES[cls] = dict(rule)


_ADAM = {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2}
for _cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam):
    register_state_rule(_cls, _ADAM)
register_state_rule(torch.optim.SGD, {"momentum_buffer": 1})
register_state_rule(torch.optim.Adagrad, {"sum": 2})


def inner_optimizer(wrapper):
    """What ``wrapper`` wraps through ``.optimizer`` or ``._optimizer`` (``None`` when nothing):
    Lightning's ``LightningOptimizer``, Accelerate's ``AcceleratedOptimizer``, :class:`gaugeopt.GaugeProjected`."""
    return getattr(wrapper, "optimizer", None) or getattr(wrapper, "_optimizer", None)


def wrapped_chain(optimizer) -> list:
    """``optimizer`` and every object it wraps (:func:`inner_optimizer`, at most 8 levels)."""
    chain = [optimizer]
    for _ in range(8):
        inner = inner_optimizer(chain[-1])
        if inner is None:
            break
        chain.append(inner)
    return chain


def unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    """The :class:`torch.optim.Optimizer` holding the state.

    Follows ``.optimizer`` / ``._optimizer`` through wrappers: objects that are not optimizers
    (Lightning's ``LightningOptimizer``) and optimizers whose ``state`` *is* the wrapped one's
    (Accelerate's ``AcceleratedOptimizer``, :class:`gaugeopt.GaugeProjected`). A container holding
    its optimizers in ``.optimizers`` (torchtitan's ``OptimizersContainer``) resolves to its one
    optimizer; with several, pass the one that steps the parameters (a container's own ``state``
    is empty: nothing would be transported).
    """
    for _ in range(9):
        if isinstance(optimizer, torch.optim.Optimizer):
            inner = getattr(optimizer, "optimizer", None)
            if isinstance(inner, torch.optim.Optimizer) and optimizer.state is inner.state:
                optimizer = inner
                continue
            parts = getattr(optimizer, "optimizers", None)
            if isinstance(parts, (list, tuple)) and parts and all(isinstance(o, torch.optim.Optimizer) for o in parts):
                if len(parts) > 1:
                    raise GaugeError(
                        f"optimizer={type(optimizer).__qualname__} holds {len(parts)} optimizers in .optimizers; pass "
                        "the one that steps the attention parameters (its own state is empty)"
                    )
                optimizer = parts[0]
                continue
            return optimizer
        inner = inner_optimizer(optimizer)
        if inner is None:
            break
        optimizer = inner
    raise GaugeError(
        f"optimizer={type(optimizer).__qualname__} is not a torch.optim.Optimizer and wraps none "
        "(looked for .optimizer and ._optimizer); pass the optimizer that holds the state"
    )


def state_rule(optimizer: torch.optim.Optimizer) -> dict[str, int] | None:
    """The registered rule for ``optimizer``'s class (first match along the MRO), or ``None``."""
    for cls in type(optimizer).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def _check_policy(unknown_state: str) -> None:
    if unknown_state not in UNKNOWN_STATE_POLICIES:
        raise GaugeError(f"unknown_state={unknown_state!r} is not one of {UNKNOWN_STATE_POLICIES}")


def classify_state(optimizer, param: torch.Tensor, *, unknown_state: str = "error") -> str:
    """What :func:`rescale_state` would do, without doing it: ``"no_state"``, ``"transported"``,
    ``"reset"`` or ``"left"``; raises :class:`GaugeError` for an unknown state under ``"error"``."""
    _check_policy(unknown_state)
    opt = unwrap_optimizer(optimizer)
    state = opt.state.get(param)
    if not state:
        return "no_state"
    rule = state_rule(opt)
    unknown = [k for k in _shaped_keys(state, param) if rule is None or k not in rule]
    if not unknown:
        return "transported"
    if unknown_state == "error":
        what = "has no state rule" if rule is None else f"keeps state keys {unknown} that its rule does not cover"
        raise GaugeError(
            f"optimizer {type(opt).__qualname__} {what}, so its state cannot be transported after a gauge fix. "
            "Pass unknown_state='reset' (re-initialise the rescaled parameters' state), 'leave' (keep it stale, "
            "as paper 002 did), or transport_state=False; or teach it with "
            "gaugeopt.fix.transport.register_state_rule(cls, {key: power})"
        )
    return "reset" if unknown_state == "reset" else "left"


def _shaped_keys(state: dict, param: torch.Tensor) -> list[str]:
    """State entries shaped like the parameter (the per-coordinate statistics)."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == tuple(param.shape)]


@torch.no_grad()
def rescale_state(
    optimizer,
    param: torch.Tensor,
    factor: torch.Tensor,
    *,
    unknown_state: str = "error",
) -> str:
    """Transport ``optimizer``'s state of ``param`` after ``param ← factor ⊙ param``.

    Args:
        optimizer: a :class:`torch.optim.Optimizer` (or a wrapper of one).
        param: the parameter (a key of ``optimizer.state``; a DTensor under FSDP2).
        factor: ``s`` in storage layout, broadcastable against ``param`` (a plain tensor,
            replicated: it is sliced to the local shard of a DTensor state).
        unknown_state: ``"error"``, ``"reset"`` or ``"leave"`` for an optimizer (or state key)
            without a rule, see the module docstring.

    Returns:
        What happened: ``"transported"``, ``"no_state"`` (nothing stored yet), ``"reset"`` or
        ``"left"``.
    """
    what = classify_state(optimizer, param, unknown_state=unknown_state)
    opt = unwrap_optimizer(optimizer)
    if what == "reset":
        opt.state.pop(param, None)
    elif what == "transported":
        for _, t, k in transport_entries(opt, param):
            rescale_tensor(t, factor, -k)
    return what


def transport_entries(optimizer, param: torch.Tensor) -> list[tuple[str, torch.Tensor, int]]:
    """``(key, tensor, k)`` for each state entry of ``param`` that a rescale divides by ``s**k``
    (``k ≥ 1``), for an optimizer whose state :func:`classify_state` calls ``"transported"``."""
    opt = unwrap_optimizer(optimizer)
    state, rule = opt.state.get(param) or {}, state_rule(opt) or {}
    return [(key, state[key], rule[key]) for key in _shaped_keys(state, param) if rule.get(key)]


@torch.no_grad()
def rescale_param(param: torch.Tensor, factor: torch.Tensor, offset: float = 0.0) -> None:
    """``param ← factor ⊙ param`` in place (shard-locally for a DTensor), ``factor`` in storage
    layout and broadcastable against ``param``.

    With ``offset`` (a QK-norm gain stored as ``gain − offset``, Gemma's ``1 + w``) the scaled value
    is ``param + offset``: ``param ← (param + offset) ⊙ factor − offset``, computed in at least
    float32 and rounded once. Its derivative is still ``factor``, so the optimizer state is
    transported exactly as for ``offset = 0``."""
    if not offset:
        rescale_tensor(param, factor, 1)
        return
    t = local_view(param)
    f = local_factor(factor, param)
    cdt = torch.promote_types(t.dtype, torch.float32)
    t.copy_((t.to(cdt) + offset) * f.to(cdt) - offset)


@torch.no_grad()
def rescale_tensor(t: torch.Tensor, factor: torch.Tensor, power: int) -> None:
    """``t ← t · factor**power`` in place (shard-locally for a DTensor), ``factor`` replicated in
    storage layout; 16-bit tensors are computed in float32 and rounded once."""
    _scale_(local_view(t), local_factor(factor, t), power)


def _scale_(t: torch.Tensor, factor: torch.Tensor, power: int) -> None:
    """``t ← t · factor^power`` in place, computed in at least float32 and rounded once: a
    bf16/fp16 tensor must not see a factor already rounded to 8 or 11 bits."""
    if t.dtype in (torch.float16, torch.bfloat16):
        t.copy_(t.float() * factor.float() ** power)
    elif power == 1:
        t.mul_(factor.to(t.dtype))
    else:
        f = factor.to(t.dtype)
        t.div_(f if power == -1 else f ** -power)


# ---------------------------------------------------------------------- layout helpers
def reduced_ref(member: Member) -> tuple[TensorRef, int | None, tuple[int, ...]]:
    """The member's "one value per channel" layout.

    A diagonal gauge factor is constant along :attr:`~gaugeopt.structure.pair.Member.broadcast_axis`
    of a weight (the input axis of a Q/K/V weight, the output axis of the O weight); 1-D tensors
    (biases, multipliers) have none.

    Returns:
        ``(rref, storage_axis, storage_shape)``: ``rref.view(t)`` maps a tensor of
        ``storage_shape`` (the parameter's shape with ``storage_axis`` set to 1) to the
        canonical view with the broadcast axis of size 1.
    """
    ref = member.ref
    shape = tuple(ref.param.shape)
    canon_axis = member.broadcast_axis
    if len(shape) == 1 or canon_axis is None:
        return ref, None, shape
    if len(shape) != 2:
        raise GaugeError(f"{ref.name}: expected a 1-D or 2-D parameter, got shape {shape}")
    # the canonical view is storage (transposed for in×out layouts) with rows split into heads:
    # its last axis is the storage's input axis, its first (O columns: the model width) the output axis
    storage_axis = (0 if ref.transpose else 1) if canon_axis == len(ref.shape) - 1 else (1 if ref.transpose else 0)
    rshape = list(ref.shape)
    rshape[canon_axis] = 1
    sshape = list(shape)
    sshape[storage_axis] = 1
    return replace(ref, shape=tuple(rshape)), storage_axis, tuple(sshape)


def storage_factor(member: Member, factor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Write a canonical per-channel factor into a storage-layout factor for ``member.ref.param``.

    Args:
        member: where the factor applies.
        factor: one value per channel, ``(heads, width)`` of the member's side.
        out: an existing storage factor of the same parameter to multiply into (several members
            can point into one fused parameter); a new one of ones otherwise.

    Returns:
        The storage factor (shape of the parameter with the broadcast axis set to 1).
    """
    rref, _, sshape = reduced_ref(member)
    if out is None:
        out = torch.ones(sshape, dtype=factor.dtype, device=factor.device)
    region = rref.view(out)
    region.mul_(factor.reshape(region.shape))  # (heads, width) -> (heads, width, 1) or (1, h, d_v)
    return out
