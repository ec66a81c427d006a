"""The one conjugate-gradient loop (gaugeopt.projection.cg) behind the batched solves and the joint projection.

Checked in float64 against direct solves: the batched systems, the same loop over the joint
projection's block vectors (dicts of tensors, host scalars) giving the same iterates, the stopping
rule (tolerance relative to the given scale, checked before each iteration), breakdown reported
through the residual, and the property the approximate mode rests on: no iterate leaves more of
the normal equations' error (the vertical part) than its start.
"""

from __future__ import annotations

import pytest
import torch

from gaugeopt.projection.cg import BatchedSpace, batched_pcg, pcg
from gaugeopt.projection.joint import _Blocks, _Dicts

F64 = dict(dtype=torch.float64)


def _normal_equations(B: int = 3, n: int = 6, m: int = 9, seed: int = 0):
    """``K = GᵀG`` per system (rank-deficient when ``m < n``) and a right-hand side in its range."""
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(B, m, n, generator=g, **F64)
    K = G.mT @ G
    S = G.mT @ torch.randn(B, m, 1, generator=g, **F64)
    return G, K, S


def test_batched_pcg_solves_every_system_to_its_tolerance():
    G, K, S = _normal_equations()
    S[1] = 0  # a zero right-hand side: solved by zero, never divided by
    X, iters, res, _ = batched_pcg(lambda x: K @ x, S, lambda r: r, tol=1e-12, maxiter=50)
    assert iters <= 7 and bool((res <= 1e-12).all())
    assert torch.equal(X[1], torch.zeros_like(X[1]))
    torch.testing.assert_close(X[[0, 2]], torch.linalg.solve(K[[0, 2]], S[[0, 2]]), rtol=1e-9, atol=1e-10)


def test_the_same_loop_runs_on_the_joint_projections_vectors():
    """One system whose vector is two blocks of ``{name: tensor}`` (the joint projection's vectors on
    parameters spread over devices; scalars summed on the host) takes the same steps as the same
    system flattened into one batched tensor."""
    _, K, S = _normal_equations(B=1, n=16, m=24)
    K, S = K[0], S[0, :, 0]
    shapes = {"w": (2, 3), "b": (2,)}  # one block: 8 entries

    def blocks(v):
        out = []
        for half in v.split(8):
            w, b = half.split(6)
            out.append({"w": w.reshape(2, 3).clone(), "b": b.clone()})
        return out

    def flat(xs):
        return torch.cat([torch.cat([x["w"].reshape(-1), x["b"]]) for x in xs])

    flat_X, flat_R = torch.zeros(1, 16, **F64), S[None].clone()
    it_a, res_a, _ = pcg(BatchedSpace(flat_R), lambda x: (K @ x[0])[None], flat_X, flat_R, tol=1e-12,
                         scale=torch.linalg.vector_norm(S)[None], maxiter=5)
    X, R = blocks(torch.zeros(16, **F64)), blocks(S)
    space = _Blocks(_Dicts({n: torch.zeros(shape, **F64) for n, shape in shapes.items()}))
    it_b, res_b, _ = pcg(space, lambda xs: blocks(K @ flat(xs)), X, R, tol=1e-12, scale=float(torch.linalg.vector_norm(S)),
                         maxiter=5)
    assert it_a == it_b == 5
    torch.testing.assert_close(flat(X), flat_X[0], rtol=1e-12, atol=1e-14)
    assert float(res_b) == pytest.approx(float(res_a[0]), rel=1e-9) and float(res_b) > 1e-6  # 5 of 16 steps


def test_breakdown_stops_the_system_and_shows_in_its_residual():
    """An operator that vanishes on the right-hand side (K·S = 0): no step is taken, the system is
    marked stalled and stops, its residual stays 1 — reported, not hidden."""
    S = torch.tensor([[1.0, 0.0], [0.0, 1.0]], **F64)[:, :, None]  # system 0 breaks down, system 1 is fine
    K = torch.stack([torch.diag(torch.tensor([0.0, 1.0], **F64)), torch.eye(2, **F64)])
    X, iters, res, _ = batched_pcg(lambda x: K @ x, S, lambda r: r, tol=1e-12, maxiter=10)
    assert iters == 1 and float(res[0]) == 1.0 and float(res[1]) == 0.0
    assert torch.equal(X[0], torch.zeros_like(X[0])) and torch.equal(X[1], S[1])


@pytest.mark.parametrize("seed", range(4))
def test_no_iterate_leaves_more_vertical_part_than_its_start(seed):
    """Without a tolerance exactly ``maxiter`` steps run, and the error ``‖G(X − X*)‖`` (the vertical
    part a projection with ``X`` leaves) never grows — from zero and from a poor warm start."""
    G, K, S = _normal_equations(B=2, n=12, m=20, seed=seed)
    X_star = torch.linalg.lstsq(K, S).solution
    C = torch.diag_embed(1.0 / torch.diagonal(K, dim1=-2, dim2=-1))  # Jacobi preconditioner

    def left(X):
        return torch.linalg.vector_norm((G @ (X - X_star)).flatten(1), dim=1)

    bad_start = -5.0 * X_star + torch.randn(X_star.shape, generator=torch.Generator().manual_seed(seed), **F64)
    for x0 in (None, bad_start):
        previous = left(torch.zeros_like(S))
        for k in range(1, 13):  # n = 12: exact after 12 steps in exact arithmetic
            X, iters, _, _ = batched_pcg(lambda x: K @ x, S, lambda r: C @ r, maxiter=k, x0=x0)
            assert iters == k
            now = left(X)
            assert bool((now <= previous * (1 + 1e-12) + 1e-12).all()), (k, now, previous)
            previous = now
        assert float(previous.max()) < 1e-6 * float(left(torch.zeros_like(S)).max())
