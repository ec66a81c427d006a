"""Small dense linear-algebra helpers shared by the gauge actions and projectors."""

from __future__ import annotations

import torch

__all__ = ["random_orthogonal", "random_well_conditioned"]


def random_orthogonal(n: int, d: int, *, generator=None, dtype=torch.float64) -> torch.Tensor:
    """``n`` Haar-random orthogonal matrices ``(n, d, d)`` (QR of a Gaussian, signs fixed)."""
    g = torch.randn(n, d, d, generator=generator, dtype=dtype)
    q, r = torch.linalg.qr(g)
    sign = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    sign[sign == 0] = 1
    return q * sign.unsqueeze(-2)


def random_well_conditioned(
    n: int, d: int, *, log_scale: float = 0.5, generator=None, dtype=torch.float64
) -> torch.Tensor:
    """``n`` random invertible matrices ``U·diag(exp(u))·V`` with ``u ~ U(-log_scale, log_scale)``.

    Their condition number is at most ``exp(2·log_scale)`` (≈ 2.7 by default), so a gauge
    action by them is exact to a few ulps and far from singular.
    """
    u = random_orthogonal(n, d, generator=generator, dtype=dtype)
    v = random_orthogonal(n, d, generator=generator, dtype=dtype)
    s = torch.exp((torch.rand(n, d, generator=generator, dtype=dtype) * 2 - 1) * log_scale)
    return u @ torch.diag_embed(s) @ v
