"""Conjugate gradients, once, for every iterative solve of the projection.

Two solves in :mod:`gaugeopt.projection` are conjugate gradients on a symmetric positive
semi-definite operator ``K``:

* the batched normal equations of the dense gauges with multipliers and GQA
  (:mod:`~gaugeopt.projection.dense`), and the Schur complement of ``lrm_internal``
  (:mod:`~gaugeopt.projection.multipliers`) — many independent small systems at once, through
  :func:`batched_pcg`;
* the joint projection of overlapping sector families (:mod:`~gaugeopt.projection.joint`) — one
  system whose vector is one buffer per family, on the parameters' devices.

They differ in how a vector is stored and how its inner products are taken, not in the
algorithm, so :func:`pcg` is written once against a small :class:`Space` (inner products per
system, ``y += a·x``, ``y ← x + b·y``, and the arithmetic of its scalars) and each solve brings
its own. The iteration, with ``Z = C⁻¹R`` (``Z = R`` without a preconditioner)::

    α = ⟨R, Z⟩ / ⟨D, K D⟩,   X += α D,   R −= α K D,   β = ⟨R, Z⟩_new / ⟨R, Z⟩,   D ← Z + β D

per system: the batched solves keep their scalars as tensors ``(B,)`` (:class:`TensorScalars`: no
host synchronisation unless a tolerance is asked for), the joint projection as Python floats
(:class:`HostScalars`: it reads every inner product on the host). **Stopping rule**: with ``tol``, a system stops when its recursive residual
``‖R‖ ≤ tol·scale`` (``scale`` = ``‖S‖`` unless the caller measures against something else),
checked before each iteration; without ``tol`` exactly ``maxiter`` iterations run. **Breakdown**
(``⟨D, K D⟩ ≤ 0`` for a system that has not converged): that system takes no step (``α = 0``),
is marked stalled and stops — reported through its residual, never hidden; the iteration is
counted. CG minimises the ``K``-norm of the error over ``x0 + 𝒦_j``; for normal equations
``K = GᵀG`` that norm is ``‖G(X − X*)‖``, the vertical part a projection with ``X`` would leave
behind, so no iterate leaves more than its start.

Example:
    >>> import torch
    >>> from gaugeopt.projection.cg import batched_pcg
    >>> A = torch.tensor([[[4.0, 1.0], [1.0, 3.0]]], dtype=torch.float64)
    >>> X, iters, res, _ = batched_pcg(lambda x: A @ x, torch.tensor([[[1.0], [2.0]]], dtype=torch.float64),
    ...                                lambda r: r, tol=1e-12, maxiter=10)
    >>> iters, bool(res.max() < 1e-12), [round(float(v), 6) for v in X.flatten()]
    (2, True, [0.090909, 0.636364])
"""

from __future__ import annotations

import math
from typing import Callable, Protocol, TypeVar

import torch

__all__ = ["Space", "TensorScalars", "HostScalars", "BatchedSpace", "pcg", "batched_pcg"]

V = TypeVar("V")


class TensorScalars:
    """Per-system scalars as tensors ``(B,)`` (no host synchronisation unless a tolerance is asked for)."""

    @staticmethod
    def div(a: torch.Tensor, b: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """``a / b`` where ``ok``, 0 elsewhere (nothing is divided by a zero)."""
        return torch.where(ok, a / torch.where(ok, b, torch.ones_like(b)), torch.zeros_like(a))

    @staticmethod
    def reference(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`relative` divides by, prepared once per solve."""
        return scale.clamp_min(torch.finfo(scale.dtype).tiny), scale > 0

    @staticmethod
    def relative(norm: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``norm / scale`` (0 where ``scale`` is 0)."""
        return TensorScalars.div(norm, *ref)

    sqrt = staticmethod(torch.sqrt)

    @staticmethod
    def any(mask: torch.Tensor) -> bool:
        return bool(mask.any())

    @staticmethod
    def not_(mask: torch.Tensor) -> torch.Tensor:
        return ~mask

    @staticmethod
    def false_like(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x, dtype=torch.bool)


class HostScalars:
    """One system's scalars as Python floats: for a space whose inner products are read on the host anyway."""

    @staticmethod
    def div(a: float, b: float, ok: bool) -> float:
        return a / b if ok else 0.0

    @staticmethod
    def reference(scale: float) -> float:
        return scale

    @staticmethod
    def relative(norm: float, scale: float) -> float:
        return norm / scale if scale > 0 else 0.0

    sqrt = staticmethod(math.sqrt)
    any = staticmethod(bool)

    @staticmethod
    def not_(mask: bool) -> bool:
        return not mask

    @staticmethod
    def false_like(x: float) -> bool:
        return False


class Space(Protocol[V]):
    """The vector operations :func:`pcg` needs, and its scalars (:class:`TensorScalars`, one entry per
    system, or :class:`HostScalars`)."""

    scalars: type

    def dot(self, x: V, y: V):
        """``⟨x, y⟩`` per system."""

    def norm(self, x: V):
        """``‖x‖`` per system (only read with a preconditioner; without one ``sqrt⟨R, R⟩`` is used)."""

    def axpy_(self, a, x: V, y: V, value: float = 1.0) -> None:
        """``y += value·a·x`` in place."""

    def xpby_(self, x: V, b, y: V) -> None:
        """``y ← x + b·y`` in place."""

    def clone(self, x: V) -> V:
        """A new vector equal to ``x``."""


class BatchedSpace:
    """Independent systems along the leading axis of one tensor; ``⟨X, Y⟩ = Σ X·Y`` over the others."""

    scalars = TensorScalars

    def __init__(self, like: torch.Tensor) -> None:
        self.B = like.shape[0]
        self.view = (self.B,) + (1,) * (like.dim() - 1)

    def dot(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * y).reshape(self.B, -1).sum(1)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(x.reshape(self.B, -1), dim=1)

    def axpy_(self, a: torch.Tensor, x: torch.Tensor, y: torch.Tensor, value: float = 1.0) -> None:
        y.addcmul_(a.reshape(self.view), x, value=value)

    def xpby_(self, x: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> None:
        y.mul_(b.reshape(self.view)).add_(x)

    def clone(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def pcg(
    space: Space[V],
    op: Callable[[V], V],
    X: V,
    R: V,
    *,
    precond: Callable[[V], V] | None = None,
    tol: float | None = None,
    scale,
    maxiter: int,
):
    """Conjugate gradients on ``K(X) = S`` from the iterate ``X`` and its residual ``R = S − K(X)``,
    both updated in place (see the module docstring for the iteration and the stopping rule).

    Args:
        space: the vector operations and scalars (:class:`BatchedSpace`, or the joint projection's).
        op: ``X -> K(X)``, symmetric positive semi-definite in ``space``'s inner product.
        X, R: the start and its residual (modified in place).
        precond: ``R -> C⁻¹ R`` with ``C`` SPD; ``None``: none (``Z = R``).
        tol: stop a system once ``‖R‖ ≤ tol·scale`` (one host synchronisation per iteration);
            ``None``: run exactly ``maxiter`` iterations without synchronising.
        scale: per system, what the residual is measured against (``‖S‖``, as a rule).
        maxiter: iteration cap.

    Returns:
        ``(iterations, relative residual, ⟨R, C⁻¹R⟩)`` per system at the last iterate.
    """
    S = space.scalars
    ref = S.reference(scale)
    Z = R if precond is None else precond(R)
    D = space.clone(Z)
    rz = space.dot(R, Z)
    res = S.relative(S.sqrt(rz) if precond is None else space.norm(R), ref)
    stalled = S.false_like(rz)
    it = 0
    while it < maxiter:
        if tol is not None and not S.any((res > tol) & S.not_(stalled)):
            break
        it += 1
        KD = op(D)
        dkd = space.dot(D, KD)
        go = dkd > 0
        if tol is not None:
            go = go & (res > tol) & S.not_(stalled)
            stalled = stalled | ((res > tol) & (dkd <= 0))  # breakdown: reported through the residual, not hidden
        alpha = S.div(rz, dkd, go)
        space.axpy_(alpha, D, X)
        space.axpy_(alpha, KD, R, value=-1.0)
        Z = R if precond is None else precond(R)
        rz_new = space.dot(R, Z)
        res = S.relative(S.sqrt(rz_new) if precond is None else space.norm(R), ref)
        beta = S.div(rz_new, rz, go & (rz > 0))
        space.xpby_(Z, beta, D)
        rz = rz_new
    return it, res, rz


def batched_pcg(
    op,
    S: torch.Tensor,
    precond,
    *,
    tol: float | None = None,
    maxiter: int,
    x0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """Preconditioned CG for a batch of independent symmetric PSD systems ``K(X) = S``.

    The leading axis indexes the systems; the others are flattened into one vector per system
    (:class:`BatchedSpace`), e.g. the LRM + GQA normal equations ``Σ_k P̂_k M Λ_k⁻² + Σ_k Γ_k⁻² M R̂_k = S``
    of the dense gauges or the Schur complement of ``lrm_internal``. A start ``x0`` is first
    replaced by its best multiple ``α·x0``, ``α = ⟨x0, S⟩ / ⟨x0, K x0⟩`` (0 when that is not
    positive): ``‖α x0 − X*‖²_K = ‖X*‖²_K − ⟨x0, S⟩²/⟨x0, K x0⟩ ≤ ‖X*‖²_K``, never worse than zero.

    Args:
        op: ``X -> K(X)``, symmetric PSD in the Frobenius product.
        S: right-hand sides ``(B, ...)`` (in the range of ``K``).
        precond: ``R -> C⁻¹ R`` with ``C`` SPD.
        tol: stop when every system has ``‖S − K(X)‖ ≤ tol·‖S‖`` (one host synchronisation per
            iteration); ``None``: run exactly ``maxiter`` iterations without synchronising.
        maxiter: iteration cap (the iteration count when ``tol`` is ``None``).
        x0: a starting guess (``None``: zero).

    Returns:
        ``(X, iterations, relative residual (B,), estimate (B,))`` where the estimate is
        ``sqrt(rᵀ C⁻¹ r)`` at the last iterate — the ``K``-norm of the error when ``C = K``, an
        estimate of it otherwise.
    """
    space = BatchedSpace(S)
    if x0 is None:
        X, R = torch.zeros_like(S), S.clone()
    else:
        Kx = op(x0)
        xKx, xS = space.dot(x0, Kx), space.dot(x0, S)
        alpha = TensorScalars.div(xS, xKx, xKx > 0).reshape(space.view)
        X, R = alpha * x0, torch.addcmul(S, alpha, Kx, value=-1.0)
    it, res, rz = pcg(space, op, X, R, precond=precond, tol=tol, scale=space.norm(S), maxiter=maxiter)
    return X, it, res, rz.clamp_min(0.0).sqrt()
