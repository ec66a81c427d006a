"""DTensor (FSDP2) helpers for the gauge fix: full statistics, shard-local in-place edits.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) every parameter, and every optimizer
state tensor of it, is a ``DTensor`` sharded on dim 0 — including 1-D multipliers and biases.
The gauge fix needs two things from them:

* **statistics over whole heads** — a head's row block can straddle two shards (rows sharded)
  or every shard can hold a slice of every row (HF ``Conv1D`` stores ``in×out``, so dim 0 is the
  input). :func:`full` turns a DTensor reduction (``Shard`` or ``Partial(sum)`` placements) into
  the full, replicated tensor with DTensor's own collectives; the statistics are tiny
  (one number per channel), so this costs one small all-gather/all-reduce per tensor. Every rank
  then holds bit-identical statistics and computes bit-identical factors;
* **in-place writes that reach the sharded fp32 master** — a plain tensor cannot be combined
  with a DTensor (``aten.mul_ got mixed torch.Tensor and DTensor``). :func:`local_factor` slices
  a replicated per-channel factor to this rank's shard (``distribute_tensor(..., src_data_rank=None)``,
  no communication) and :func:`local_view` gives the shard itself, so
  ``local_view(p).mul_(local_factor(f, p))`` edits the sharded parameter (and, the same way, the
  sharded Adam moments) in place.

Plain tensors (single process, DDP) pass through untouched: DDP ranks hold identical
replicas, and the fix is a deterministic local computation on each of them — no
rank-dependent reduction, so the ranks stay bit-identical.

Example (single process: the helpers are the identity on plain tensors):
    >>> import torch
    >>> from gaugeopt.distributed import full, local_factor, local_view
    >>> w = torch.ones(4, 3)
    >>> local_view(w).mul_(local_factor(torch.tensor([[1.0], [2.0], [3.0], [4.0]]), w)).sum().item()
    30.0
    >>> full((w * w).sum(1, keepdim=True)).flatten().tolist()
    [3.0, 12.0, 27.0, 48.0]
"""

from __future__ import annotations

import functools

import torch

from gaugeopt.errors import GaugeError

__all__ = ["is_dtensor", "full", "local_view", "local_factor", "all_reduce_max"]


@functools.lru_cache(maxsize=None)
def _dtensor_cls():
    """``DTensor``, imported once (this is asked for every tensor a gauge fix touches, every fix)."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed support
        return None
    return DTensor


def is_dtensor(t: torch.Tensor) -> bool:
    cls = _dtensor_cls()
    return cls is not None and isinstance(t, cls)


def full(t: torch.Tensor) -> torch.Tensor:
    """The full (replicated) value of ``t``: ``t.full_tensor()`` for a DTensor, ``t`` otherwise."""
    return t.full_tensor() if is_dtensor(t) else t


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (aliasing it), or ``t`` itself when it is not a DTensor."""
    return t.to_local() if is_dtensor(t) else t


def local_factor(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``factor`` (a replicated plain tensor broadcastable against ``like``) that
    multiplies this rank's shard of ``like``.

    ``factor`` has ``like``'s shape except for size-1 (broadcast) axes. A ``Shard(d)`` placement
    of ``like`` slices ``factor`` along ``d`` with DTensor's own chunking when ``factor`` has the
    full size there, and keeps it whole when ``factor`` broadcasts along ``d``.
    """
    factor = factor.to(device=local_view(like).device)
    if not is_dtensor(like):
        return factor
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if factor.dim() != like.dim():
        raise GaugeError(f"local_factor: factor of shape {tuple(factor.shape)} must have {like.dim()} axes like the tensor")
    placements = []
    for p in like.placements:
        if isinstance(p, Replicate):
            placements.append(Replicate())
        elif type(p) is Shard:
            placements.append(Shard(p.dim) if factor.shape[p.dim] == like.shape[p.dim] else Replicate())
        else:
            raise GaugeError(
                f"local_factor: placement {p} of a {tuple(like.shape)} DTensor is not supported (expected Shard(d) or "
                "Replicate, as FSDP2 and DDP produce); gather the parameter or fix the gauge before sharding it"
            )
    return distribute_tensor(factor, like.device_mesh, placements, src_data_rank=None).to_local()


def all_reduce_max(t: torch.Tensor, group=None) -> tuple[torch.Tensor, bool]:
    """The elementwise maximum of ``t`` over the ranks of ``group`` (the default group), and whether a
    reduction took place (``False`` without an initialised process group of more than one rank).

    NaN is not ordered, so a collective would treat it rank-dependently: it is sent as ``+inf``, which
    every rank then reads alike. The reduction runs on the device the backend needs (CUDA for NCCL) and
    the result comes back on ``t``'s device.

    Example (one process: nothing to reduce):
        >>> import torch
        >>> from gaugeopt.distributed import all_reduce_max
        >>> all_reduce_max(torch.tensor([1.0, float("nan")]))
        (tensor([1., nan]), False)
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return t, False
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    buf = torch.nan_to_num(t.detach().to(device=device, copy=True), nan=float("inf"), posinf=float("inf"),
                           neginf=float("-inf"))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return buf.to(t.device), True
