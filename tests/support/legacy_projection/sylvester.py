"""Batched solvers for the normal equations of gauge-orthogonal projection (docs/projection.md).

Projecting a vector field off the gauge directions of one KV group is a least-squares problem
whose normal equations are a Sylvester equation (paper 000, Remark 51)

    P X + X R = S,        P, R symmetric positive semi-definite (n × n),

solved here for a whole batch of groups at once (every KV group of every layer) from the
eigendecompositions ``P = U diag(λ) Uᵀ``, ``R = V diag(μ) Vᵀ``:

    X = U [(Uᵀ S V) ⊘ (λ_a + μ_b)] Vᵀ.

The operator ``X ↦ P X + X R`` has eigenvalues ``λ_a + μ_b`` with eigenvectors ``u_a v_bᵀ``, so
this is its exact inverse — and, with the pseudo-inverse rule below, its Moore–Penrose inverse.

**Pseudo-inverse rule** (one rule for every solver in this module). Eigenvalues of a Gram
operator are clamped at 0 (rounding can make them slightly negative); an eigenvalue ``≤ rtol ·
(largest eigenvalue of the same block)`` is a non-direction: its coefficient is set to 0
instead of being divided by. A block whose Gram operator is zero gives a zero solution. Nothing
is ever divided by zero, so finite inputs never give NaN. The default ``rtol`` is
``1000·ε(dtype)`` (2.2e-13 in float64, 1.2e-4 in float32): Gram eigenvalues computed in
floating point carry errors of order ``n·ε·λ_max``. The minimum-norm solution this rule gives
solves the normal equations whenever the right-hand side comes from a vector field (it then
lies in the range of the Gram operator), so the projection stays exact on rank-deficient
weights (a dead channel, a zero head).

With learnable multipliers (LRM) and GQA the normal equations of the dense gauge in ``W̄``
coordinates become a sum of more than two Kronecker products (:func:`twisted_cg`), which has no
direct ``O(n³)`` solution; they are solved by conjugate gradients preconditioned with the exact
Sylvester inverse of the nearest two-term operator, to a stated relative residual.

Example:
    >>> import torch
    >>> from gaugeopt.projection.sylvester import SylvesterInverse
    >>> g = torch.Generator().manual_seed(0)
    >>> a, b = torch.randn(5, 4, 6, generator=g, dtype=torch.float64), torch.randn(5, 4, 7, generator=g, dtype=torch.float64)
    >>> P, R = a @ a.mT, b @ b.mT
    >>> S = torch.randn(5, 4, 4, generator=g, dtype=torch.float64)
    >>> X = SylvesterInverse(P, R)(S)
    >>> bool(torch.allclose(P @ X + X @ R, S, atol=1e-10))
    True
"""

from __future__ import annotations

import torch

__all__ = ["default_rtol", "SylvesterInverse", "psd_solve", "psd_pinv_apply", "twisted_cg", "GRAM_EIG"]

# How the batched eigendecompositions of the Gram matrices P = F Fᵀ are computed:
# "eigh" (torch.linalg.eigh of P), "svd" (singular values/vectors of the tall factor Fᵀ), or
# "auto": "svd" on CUDA for n > 32, "eigh" otherwise. cuSOLVER's batched Jacobi eigh only covers
# n <= 32; above that torch loops over the batch (measured on an H200: 220 ms for 288 matrices
# of 64×64, against 1.8 ms for the batched gesvda SVD of their 769×64 factors). Tests override it.
GRAM_EIG = "auto"


def default_rtol(dtype: torch.dtype) -> float:
    """The default relative eigenvalue threshold of the pseudo-inverse rule: ``1000·ε(dtype)``."""
    return 1000.0 * torch.finfo(dtype).eps


def _eigh_clamped(mats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lam, vec = torch.linalg.eigh(mats)
    return lam.clamp_min(0.0), vec


class SylvesterInverse:
    """The (pseudo-)inverse of ``X ↦ P X + X R`` for a batch of PSD pairs.

    Both eigendecompositions come from ONE batched ``torch.linalg.eigh`` call on
    ``cat([P, R])``; applying the inverse afterwards costs four batched ``n×n`` matmuls.

    Args:
        P, R: ``(G, n, n)`` symmetric PSD.
        rtol: pseudo-inverse threshold relative to ``λ_max + μ_max`` of each group.
        regularize: instead of zeroing sub-threshold denominators, clamp them up to the
            threshold (an SPD operator, as a preconditioner needs).
    """

    def __init__(
        self,
        P: torch.Tensor,
        R: torch.Tensor,
        rtol: float | None = None,
        *,
        regularize: bool = False,
        factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        rtol = default_rtol(P.dtype) if rtol is None else rtol
        self.rtol = rtol
        G = P.shape[0]
        if factors is not None and gram_eig_backend(P, factors) == "svd":
            lam, vec = _gram_eig_svd(torch.cat(_pad_width(*factors), 0))  # P = F_P F_Pᵀ, R = F_R F_Rᵀ
        else:
            lam, vec = _eigh_clamped(torch.cat([P, R], 0))
        self.lam, self.U = lam[:G], vec[:G]
        self.mu, self.V = lam[G:], vec[G:]
        den = self.lam[:, :, None] + self.mu[:, None, :]  # (G, n, n): eigenvalues λ_a + μ_b
        top = den.flatten(1).amax(1)[:, None, None]
        thr = rtol * top
        if regularize:
            floor = torch.maximum(thr, torch.full_like(thr, torch.finfo(den.dtype).tiny))
            self.inv = 1.0 / torch.maximum(den, floor)
        else:
            keep = den > thr
            self.inv = torch.where(keep, 1.0 / torch.where(keep, den, torch.ones_like(den)), torch.zeros_like(den))
            self.dropped = int((~keep).sum())

    def __call__(self, S: torch.Tensor) -> torch.Tensor:
        """``X`` with ``P X + X R = S`` (minimum-norm least squares under the threshold)."""
        core = self.U.mT @ S @ self.V
        return self.U @ (core * self.inv) @ self.V.mT

    def left_pinv(self, S: torch.Tensor) -> torch.Tensor:
        """``P⁺ S`` (pseudo-inverse rule relative to ``λ_max``)."""
        return psd_pinv_apply(self.lam, self.U, S, side="left", rtol=self.rtol)

    def right_pinv(self, S: torch.Tensor) -> torch.Tensor:
        """``S R⁺``."""
        return psd_pinv_apply(self.mu, self.V, S, side="right", rtol=self.rtol)


def gram_eig_backend(P: torch.Tensor, factors) -> str:
    """``"svd"`` or ``"eigh"`` for Gram matrices ``P (G, n, n)`` with tall factors available."""
    if GRAM_EIG in ("eigh", "svd"):
        choice = GRAM_EIG
    else:
        choice = "svd" if (P.is_cuda and P.shape[-1] > 32) else "eigh"
    if choice == "svd" and any(f.shape[-1] < f.shape[-2] for f in factors):
        return "eigh"  # the factor is wide, not tall: nothing to gain
    return choice


def _pad_width(*mats: torch.Tensor) -> list[torch.Tensor]:
    """Zero-pad ``(G, n, m_i)`` factors to a common width (zero columns leave ``F Fᵀ`` unchanged)."""
    m = max(f.shape[-1] for f in mats)
    return [torch.nn.functional.pad(f, (0, m - f.shape[-1])) for f in mats]


# cuSOLVER's batched gesvda indexes the whole batch with 32-bit offsets: keep every call's
# batch × rows × cols well below 2³¹ (a LLaMA-7B stack in one call is 2³⁰ elements and fails
# with CUSOLVER_STATUS_INVALID_VALUE).
_GESVDA_MAX_ELEMENTS = 2**27


def _gram_eig_svd(F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition of ``F Fᵀ`` from the SVD of the tall ``Fᵀ = U S Vᵀ``: ``(S², V)``."""
    Ft = F.mT
    driver = "gesvda" if Ft.is_cuda else None
    chunk = max(1, _GESVDA_MAX_ELEMENTS // max(1, Ft.shape[-1] * Ft.shape[-2]))
    parts = [torch.linalg.svd(c, full_matrices=False, driver=driver)[1:] for c in Ft.split(chunk, dim=0)]
    S = torch.cat([p[0] for p in parts])
    Vh = torch.cat([p[1] for p in parts])
    return S.square(), Vh.mT


def _pinv_values(lam: torch.Tensor, rtol: float) -> torch.Tensor:
    thr = rtol * lam.amax(-1, keepdim=True)
    keep = lam > thr
    return torch.where(keep, 1.0 / torch.where(keep, lam, torch.ones_like(lam)), torch.zeros_like(lam))


def psd_pinv_apply(lam: torch.Tensor, vec: torch.Tensor, S: torch.Tensor, *, side: str, rtol: float | None = None) -> torch.Tensor:
    """``A⁺ S`` (``side="left"``) or ``S A⁺`` (``"right"``) for ``A = vec·diag(lam)·vecᵀ``."""
    rtol = default_rtol(S.dtype) if rtol is None else rtol
    inv = _pinv_values(lam, rtol)
    if side == "left":
        return vec @ (inv[..., :, None] * (vec.mT @ S))
    return ((S @ vec) * inv[..., None, :]) @ vec.mT


def psd_solve(G: torch.Tensor, b: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """Minimum-norm solution of ``G c = b`` for a batch of small PSD Gram matrices.

    Args:
        G: ``(..., k, k)`` symmetric PSD.
        b: ``(..., k)``.
        rtol: pseudo-inverse threshold relative to the largest eigenvalue of each block.
    """
    rtol = default_rtol(G.dtype) if rtol is None else rtol
    lam, vec = _eigh_clamped(G)
    inv = _pinv_values(lam, rtol)
    return (vec @ (inv * (vec.mT @ b[..., None])[..., 0])[..., None])[..., 0]


def twisted_cg(
    op,
    S: torch.Tensor,
    precond,
    *,
    tol: float,
    maxiter: int,
) -> tuple[torch.Tensor, int, float]:
    """Batched preconditioned conjugate gradients for an SPD (or PSD, consistent) operator.

    Used for the LRM + GQA normal equations ``Σ_k P̂_k M Λ_k⁻² + Σ_k Γ_k⁻² M R̂_k = S``.

    Args:
        op: ``M (G, n, n) -> K(M)``, symmetric positive semi-definite in the Frobenius product.
        S: right-hand sides ``(G, n, n)`` (in the range of ``op``).
        precond: ``R -> C⁻¹ R`` with ``C`` SPD.
        tol: stop when every group has ``‖S − K(M)‖ ≤ tol·‖S‖``.
        maxiter: iteration cap.

    Returns:
        ``(M, iterations, max relative residual)``.
    """
    dot = lambda a, b: (a * b).flatten(1).sum(1)  # noqa: E731
    M = torch.zeros_like(S)
    norm_s = S.flatten(1).norm(dim=1)
    active = norm_s > 0
    if not bool(active.any()):
        return M, 0, 0.0
    R = S.clone()
    Z = precond(R)
    D = Z.clone()
    rz = dot(R, Z)
    tiny = torch.finfo(S.dtype).tiny

    def rel(r):
        return torch.where(active, r.flatten(1).norm(dim=1) / norm_s.clamp_min(tiny), torch.zeros_like(norm_s))

    res = rel(R)
    stalled = torch.zeros_like(active)
    it = 0
    while it < maxiter and bool(((res > tol) & ~stalled).any()):
        it += 1
        KD = op(D)
        dkd = dot(D, KD)
        go = (res > tol) & ~stalled & (dkd > 0)
        stalled = stalled | ((res > tol) & (dkd <= 0))  # breakdown: reported through the residual, not hidden
        alpha = torch.where(go, rz / torch.where(go, dkd, torch.ones_like(dkd)), torch.zeros_like(dkd))
        M = M + alpha[:, None, None] * D
        R = R - alpha[:, None, None] * KD
        res = rel(R)
        Z = precond(R)
        rz_new = dot(R, Z)
        ok = go & (rz > 0)
        beta = torch.where(ok, rz_new / torch.where(ok, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        D = Z + beta[:, None, None] * D
        rz = rz_new
    return M, it, float(res.max())
