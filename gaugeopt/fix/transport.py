"""Optimizer-state transport for diagonal reparameterisations ``p ← s ⊙ p``: the mechanics.

A gauge fix that rescales a parameter coordinate-wise changes the coordinates the optimizer
works in. The loss is the same function of ``p' = s ⊙ p``, so its gradient there is
``(∂L/∂p) / s``, and each state entry is rewritten as if its whole history had been measured in the
new coordinates — ``exp_avg / s``, ``exp_avg_sq / s²``, a schedule-free ``z · s``, Adafactor's factors,
... The rules, one per optimizer class, are in :mod:`gaugeopt.fix.state_rules` (what is exact,
what is declared approximate, what is refused; docs/optimizers.md). This module applies them:

* :func:`plan_state` / :func:`classify_state` — what would happen to one parameter's state:
  ``"transported"`` (every move exact), ``"approximate"``, ``"no_state"`` (nothing that depends on
  the coordinates), or, for a state no rule can move, the caller's ``unknown_state``:
  ``"error"`` (default: :class:`~gaugeopt.GaugeError` naming the optimizer and the reason),
  ``"reset"`` (drop the parameter's state; the optimizer re-initialises it lazily — for a fused
  parameter the whole tensor, e.g. all of ``c_attn``) or ``"leave"`` (keep it stale, as paper 002 did);
* :func:`rescale_state` — do it, given the factor;
* :func:`param_owners` — which optimizer holds each rescaled parameter's state (exactly one, or
  :class:`GaugeError`), behind any wrapper (Lightning's, Accelerate's, :class:`gaugeopt.GaugeOptimizer`,
  torchtitan's container, lists: Muon beside AdamW); the walk through the wrappers is
  :mod:`gaugeopt.fix.unwrap`'s, re-exported here.

The factor ``s`` is given in *storage layout*, broadcastable against the parameter
(:func:`storage_factor` builds it from a factor in a :class:`~gaugeopt.records.site.TensorRef`'s
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

import torch

from gaugeopt.distributed import local_factor, local_view
from gaugeopt.errors import GaugeError
from gaugeopt.fix.state_rules import StateMove, StateRefused, register_state_rule, state_moves, state_rule
from gaugeopt.fix.unwrap import inner_optimizer, param_owners, unwrap_optimizer, unwrap_optimizers, wrapped_chain
from gaugeopt.records.pair import Member
from gaugeopt.records.site import TensorRef

__all__ = [
    "UNKNOWN_STATE_POLICIES",
    "register_state_rule",
    "state_rule",
    "plan_state",
    "rescale_state",
    "classify_state",
    "param_owners",
    "unwrap_optimizers",
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


def _check_policy(unknown_state: str) -> None:
    if unknown_state not in UNKNOWN_STATE_POLICIES:
        raise GaugeError(f"unknown_state={unknown_state!r} is not one of {UNKNOWN_STATE_POLICIES}")


def refusal_message(opt: torch.optim.Optimizer, name: str, reason: str) -> str:
    """The :class:`GaugeError` text for a state that cannot be moved (``reason`` from the rule)."""
    return (
        f"optimizer {type(opt).__qualname__} {reason} (parameter {name}), so its state cannot be transported after a "
        "gauge fix. Pass unknown_state='reset' (re-initialise the rescaled parameters' state), 'leave' (keep it stale, "
        "as paper 002 did), or transport_state=False; or teach it with "
        "gaugeopt.fix.transport.register_state_rule(cls, {key: power}) (docs/optimizers.md)"
    )


def plan_state(optimizer, param: torch.Tensor, *, unknown_state: str = "error", factor: torch.Tensor | None = None,
               name: str = "") -> tuple[str, list[StateMove]]:
    """``(outcome, moves)`` for ``param``'s state: outcome ``"no_state"`` (nothing that depends on the
    coordinates), ``"transported"`` (every move exact), ``"approximate"`` (at least one declared
    approximate), ``"reset"`` or ``"left"`` (unknown state under those policies); raises
    :class:`GaugeError` for unknown state under ``"error"``. ``factor`` is the factor, or any factor
    with the same structure (which coordinates share a value); ``None``: any diagonal."""
    _check_policy(unknown_state)
    opt = unwrap_optimizer(optimizer)
    try:
        moves = [m for m in state_moves(opt, param, factor) if m.moves_data or m.approximate]
    except StateRefused as refused:
        if unknown_state == "error":
            raise GaugeError(refusal_message(opt, name or f"of shape {tuple(param.shape)}", str(refused))) from None
        return ("reset" if unknown_state == "reset" else "left"), []
    if not moves:
        return "no_state", []
    return ("approximate" if any(m.approximate for m in moves) else "transported"), moves


def classify_state(optimizer, param: torch.Tensor, *, unknown_state: str = "error",
                   factor: torch.Tensor | None = None) -> str:
    """What :func:`rescale_state` would do, without doing it: ``"no_state"``, ``"transported"``,
    ``"approximate"``, ``"reset"`` or ``"left"``; raises :class:`GaugeError` for an unknown state under
    ``"error"``."""
    return plan_state(optimizer, param, unknown_state=unknown_state, factor=factor)[0]


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
        What happened: ``"transported"``, ``"approximate"``, ``"no_state"`` (nothing stored yet, or
        nothing that depends on the coordinates), ``"reset"`` or ``"left"``.
    """
    what, moves = plan_state(optimizer, param, unknown_state=unknown_state, factor=factor)
    opt = unwrap_optimizer(optimizer)
    if what == "reset":
        opt.state.pop(param, None)
    for m in moves:
        if m.apply is not None:
            m.apply(factor)
        elif m.power:
            rescale_tensor(m.tensor, factor, -m.power)
    return what


def transport_entries(optimizer, param: torch.Tensor) -> list[tuple[str, torch.Tensor, int]]:
    """``(key, tensor, k)`` for each state entry of ``param`` that a rescale divides by ``s**k``
    elementwise (``k ≠ 0``)."""
    _, moves = plan_state(optimizer, param, unknown_state="leave")
    return [(m.key, m.tensor, m.power) for m in moves if m.apply is None and m.power]


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

    A diagonal gauge factor is constant along :attr:`~gaugeopt.records.pair.Member.broadcast_axis`
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
