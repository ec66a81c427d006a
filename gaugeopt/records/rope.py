"""Rotary position embeddings: which coordinates form a rotation plane, and the commutant.

RoPE rotates each *plane* of a query/key head by a position-dependent angle. Two layouts
exist in the wild and a gauge library must not confuse them (docs/gauge_group.md):

* ``"interleaved"`` — planes ``(2m, 2m+1)`` (GPT-J, Meta's original LLaMA code);
* ``"split_half"``  — planes ``(m, m + r/2)`` (Hugging Face ``rotate_half``, GPT-NeoX).

With partial rotary (``rotary_dim = r < d_k``) only the first ``r`` coordinates rotate;
the remaining ``d_k - r`` keep the full ``GL`` symmetry.

A Q/K gauge factor ``A`` preserves the attention scores under RoPE iff it commutes with every
rotation, i.e. on each plane it is ``a·I + b·J`` (a complex scalar), with ``J`` the plane's
rotation generator. In the coordinates ``(x_p, x_q)`` of a plane ``(p, q)`` that is the block
``[[a, -b], [b, a]]``. Its orthogonal part — what survives a weight-free norm of each head (Llama 4's
L2 norm) — is a rotation ``cos φ·I + sin φ·J`` on each plane and ``O(d_k − r)`` on the rest
(:func:`orthogonal_commutant_basis`, :func:`random_orthogonal_commutant`).

Example:
    >>> from gaugeopt.records.rope import RopeSpec
    >>> RopeSpec("split_half", 4).planes(6)
    [(0, 2), (1, 3)]
    >>> RopeSpec("interleaved", 4).planes(6)
    [(0, 1), (2, 3)]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gaugeopt.errors import GaugeError

__all__ = ["RopeSpec", "NO_ROPE", "commutant_basis", "commutator_size", "orthogonal_commutant_basis", "plane_index",
           "random_commutant", "random_orthogonal_commutant"]

_KINDS = ("none", "interleaved", "split_half")


@dataclass(frozen=True)
class RopeSpec:
    """How a layer applies rotary embeddings to its query/key heads.

    Attributes:
        kind: ``"none"``, ``"interleaved"`` or ``"split_half"``.
        rotary_dim: number of rotated coordinates per head (even); ``0`` when ``kind="none"``.
    """

    kind: str = "none"
    rotary_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise GaugeError(f"RopeSpec.kind={self.kind!r} is not one of {_KINDS}")
        if self.kind == "none" and self.rotary_dim != 0:
            raise GaugeError(f"RopeSpec(kind='none') takes rotary_dim=0, got {self.rotary_dim}")
        if self.kind != "none" and (self.rotary_dim <= 0 or self.rotary_dim % 2):
            raise GaugeError(f"RopeSpec.rotary_dim must be a positive even number, got {self.rotary_dim}")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def check_head_dim(self, d_k: int) -> None:
        if self.rotary_dim > d_k:
            raise GaugeError(f"rotary_dim={self.rotary_dim} exceeds the head width d_k={d_k}")

    def planes(self, d_k: int) -> list[tuple[int, int]]:
        """Index pairs ``(p, q)`` of the rotation planes inside one head of width ``d_k``."""
        self.check_head_dim(d_k)
        r = self.rotary_dim
        if self.kind == "interleaved":
            return [(2 * m, 2 * m + 1) for m in range(r // 2)]
        if self.kind == "split_half":
            return [(m, m + r // 2) for m in range(r // 2)]
        return []

    def n_slots(self, d_k: int) -> int:
        """Channel sets that share one diagonal scale: ``r/2`` planes plus ``d_k − r`` free channels
        (``d_k`` without RoPE); the ids :func:`plane_index` assigns."""
        self.check_head_dim(d_k)
        return self.rotary_dim // 2 + d_k - self.rotary_dim

    def qk_gauge_dim(self, d_k: int) -> int:
        """Dimension of the Q/K gauge group of one KV group: ``d_k²`` without RoPE,
        ``r + (d_k - r)²`` with ``r`` rotated coordinates (two per plane)."""
        self.check_head_dim(d_k)
        r = self.rotary_dim
        return r + (d_k - r) ** 2

    def orthogonal_gauge_dim(self, d_k: int) -> int:
        """Dimension of the orthogonal part of that group: ``r/2`` plane rotations plus
        ``(d_k − r)(d_k − r − 1)/2`` for ``SO`` of the non-rotary block."""
        self.check_head_dim(d_k)
        f = d_k - self.rotary_dim
        return self.rotary_dim // 2 + f * (f - 1) // 2


NO_ROPE = RopeSpec()


def plane_index(rope: RopeSpec, d_k: int) -> torch.Tensor:
    """Long tensor ``(d_k,)`` mapping each coordinate to its plane id; the ``d_k - r``
    non-rotary coordinates get ids ``r/2, r/2+1, ...`` (one each).

    Channels with the same id must share a diagonal scale for a diagonal gauge to commute
    with RoPE; that is the "per plane" granularity of GaugeFix.
    """
    idx = torch.empty(d_k, dtype=torch.long)
    planes = rope.planes(d_k)
    for m, (p, q) in enumerate(planes):
        idx[p] = m
        idx[q] = m
    rest = [c for c in range(d_k) if c >= rope.rotary_dim]
    for n, c in enumerate(rest):
        idx[c] = len(planes) + n
    return idx


def commutant_basis(rope: RopeSpec, d_k: int, dtype=torch.float64) -> torch.Tensor:
    """An orthonormal basis ``(n, d_k, d_k)`` of the Lie algebra of matrices commuting with
    the RoPE rotations: ``I`` and ``J`` on each plane (normalised), and every elementary
    matrix of the non-rotary block. ``n = rope.qk_gauge_dim(d_k)``."""
    basis = []
    for p, q in rope.planes(d_k):
        eye = torch.zeros(d_k, d_k, dtype=dtype)
        eye[p, p] = eye[q, q] = 2**-0.5
        jay = torch.zeros(d_k, d_k, dtype=dtype)
        jay[q, p] = 2**-0.5
        jay[p, q] = -(2**-0.5)
        basis += [eye, jay]
    free = list(range(rope.rotary_dim, d_k))
    for a in free:
        for b in free:
            e = torch.zeros(d_k, d_k, dtype=dtype)
            e[a, b] = 1.0
            basis.append(e)
    if not basis:
        return torch.zeros(0, d_k, d_k, dtype=dtype)
    return torch.stack(basis)


def orthogonal_commutant_basis(rope: RopeSpec, d_k: int, dtype=torch.float64) -> torch.Tensor:
    """An orthonormal basis ``(n, d_k, d_k)`` of the antisymmetric matrices commuting with the RoPE
    rotations (the Lie algebra of the orthogonal commutant): ``J`` on each plane and ``E_ab − E_ba``
    (``a < b``) on the non-rotary block. ``n = rope.orthogonal_gauge_dim(d_k)``."""
    basis = []
    for p, q in rope.planes(d_k):
        jay = torch.zeros(d_k, d_k, dtype=dtype)
        jay[q, p] = 2**-0.5
        jay[p, q] = -(2**-0.5)
        basis.append(jay)
    free = list(range(rope.rotary_dim, d_k))
    for i, a in enumerate(free):
        for b in free[i + 1:]:
            e = torch.zeros(d_k, d_k, dtype=dtype)
            e[b, a] = 2**-0.5
            e[a, b] = -(2**-0.5)
            basis.append(e)
    if not basis:
        return torch.zeros(0, d_k, d_k, dtype=dtype)
    return torch.stack(basis)


def random_orthogonal_commutant(rope: RopeSpec, d_k: int, n: int, *, generator=None,
                                dtype=torch.float64) -> torch.Tensor:
    """``n`` random orthogonal matrices ``(n, d_k, d_k)`` in the RoPE commutant: ``exp(X)`` with ``X``
    a random combination (``N(0, 1)`` coefficients) of :func:`orthogonal_commutant_basis`."""
    basis = orthogonal_commutant_basis(rope, d_k, dtype)
    if basis.shape[0] == 0:
        return torch.eye(d_k, dtype=dtype).expand(n, d_k, d_k).clone()
    coef = torch.randn(n, basis.shape[0], generator=generator, dtype=dtype)
    return torch.linalg.matrix_exp(torch.einsum("nk,kab->nab", coef, basis))
def commutator_size(rope: RopeSpec, d_k: int, A: torch.Tensor) -> float:
    """``max |A·J − J·A| / max |A|`` over the plane generators ``J`` of ``rope`` and the matrices ``A
    (..., d_k, d_k)`` (real or complex): zero exactly when every ``A`` commutes with the rotations."""
    if not rope.active:
        return 0.0
    A = A.detach()
    J = commutant_basis(rope, d_k, dtype=torch.float64)[1 : rope.rotary_dim : 2].to(A.device, A.dtype)
    comm = A[..., None, :, :] @ J - J @ A[..., None, :, :]
    return float(comm.abs().amax() / A.abs().amax().clamp_min(1e-300))


def random_commutant(
    rope: RopeSpec, d_k: int, n: int, *, log_scale: float = 0.5, generator=None, dtype=torch.float64
) -> torch.Tensor:
    """``n`` random well-conditioned invertible matrices ``(n, d_k, d_k)`` in the RoPE commutant.

    Each plane gets ``ρ·(cos φ·I + sin φ·J)`` with ``log ρ ~ U(-log_scale, log_scale)`` and
    ``φ ~ U(-π, π)``; the non-rotary block gets ``U·diag(exp(u))·V`` with random orthogonal
    ``U, V``. Without RoPE the whole matrix is of the latter form.
    """
    from gaugeopt.linalg import random_well_conditioned

    out = torch.zeros(n, d_k, d_k, dtype=dtype)
    for p, q in rope.planes(d_k):
        rho = torch.exp((torch.rand(n, generator=generator, dtype=dtype) * 2 - 1) * log_scale)
        phi = (torch.rand(n, generator=generator, dtype=dtype) * 2 - 1) * torch.pi
        a, b = rho * torch.cos(phi), rho * torch.sin(phi)
        out[:, p, p] = a
        out[:, q, q] = a
        out[:, q, p] = b
        out[:, p, q] = -b
    r = rope.rotary_dim
    if d_k > r:
        out[:, r:, r:] = random_well_conditioned(n, d_k - r, log_scale=log_scale, generator=generator, dtype=dtype)
    return out
