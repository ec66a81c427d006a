"""The papers' procedures as written, for the errata tests (docs/errata.md): nothing here is gaugeopt's way.

* :func:`algorithm1_qr` — paper 000 Algorithm 1 (QR canonical slice), per head, in PyTorch layout
  (``W_Q[i] = (W_Q^{(i)})ᵀ``): ``W_Q^{(i)} = Q R`` with positive diagonal → ``A = R⁻¹``; likewise
  ``W_V``; then heads sorted by ``‖W_K^{(i)}‖_F`` descending. Biases travel covariantly
  (paper 000 Prop. 12), the output bias stays.
* :func:`algorithm3_merge` — paper 000 Algorithm 3 (000:1293–1311): Algorithm 1 on both models;
  Hungarian matching on ``D_ij = ‖W_Q1^(i) − W_Q2^(j)‖ + ‖W_K1^(i) − W_K2^(j)‖``; per head
  ``A_i = argmin ‖W_Q1^(i) − W_Q2^(i) A‖`` applied as ``(A_i, I_dv)``; average.
* :func:`paper003_rotation` — paper 003 §4.4 (003:150–158): one rotation ``g ∈ SO(d−1)`` fixing the
  all-ones vector, writers ``g·``, readers ``·gᵀ``, LayerNorms untouched, the tied head the rotated
  embedding.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import gaugeopt
from gaugeopt.structure.actions import act_qk, act_vo, permute_heads
from gaugeopt.structure.stream import find_stream


def algorithm1_qr(site) -> None:
    """Paper 000 Algorithm 1 on one site, in place (module docstring)."""
    wq, _ = site.effective("q")
    wv, _ = site.effective("v")
    A = torch.empty(site.h_kv, site.d_k, site.d_k, dtype=torch.float64)
    C = torch.empty(site.h_kv, site.d_v, site.d_v, dtype=torch.float64)
    for i in range(site.h):
        _, R = torch.linalg.qr(wq[i].mT)
        R = torch.sign(torch.diagonal(R))[:, None] * R
        A[i] = torch.linalg.inv(R)
        _, RV = torch.linalg.qr(wv[i].mT)
        RV = torch.sign(torch.diagonal(RV))[:, None] * RV
        C[i] = torch.linalg.inv(RV)
    act_qk(site, A)
    act_vo(site, C)
    wk, _ = site.effective("k")
    permute_heads(site, torch.argsort(wk.flatten(1).norm(dim=1), descending=True))


def algorithm3_merge(model_a: nn.Module, model_b: nn.Module) -> nn.Module:
    """Paper 000 Algorithm 3 as written (module docstring); returns the merged model."""
    from scipy.optimize import linear_sum_assignment

    a, b = copy.deepcopy(model_a), copy.deepcopy(model_b)
    for x, y in zip(gaugeopt.find_attention(a), gaugeopt.find_attention(b)):
        algorithm1_qr(x)
        algorithm1_qr(y)
        qa, ka = x.effective("q")[0], x.effective("k")[0]
        qb, kb = y.effective("q")[0], y.effective("k")[0]
        D = (qa[:, None] - qb[None]).flatten(2).norm(dim=2) + (ka[:, None] - kb[None]).flatten(2).norm(dim=2)
        _, col = linear_sum_assignment(D.numpy())
        permute_heads(y, torch.as_tensor(col))
        qb = y.effective("q")[0]
        act_qk(y, torch.stack([torch.linalg.lstsq(qb[i].mT, qa[i].mT).solution for i in range(y.h)]))
    merged = copy.deepcopy(a)
    sd_b = b.state_dict()
    with torch.no_grad():
        for k, t in merged.state_dict().items():
            if t.is_floating_point():
                t.copy_(0.5 * (t + sd_b[k]))
    return merged


def haar_rotation_fixing_ones(d: int, g: torch.Generator) -> torch.Tensor:
    """A Haar-random element of SO(d−1) acting on 1^⊥ (it fixes the all-ones vector)."""
    ones = torch.full((d, 1), d**-0.5, dtype=torch.float64)
    U = torch.linalg.qr(torch.cat([ones, torch.eye(d, dtype=torch.float64)[:, : d - 1]], 1))[0][:, 1:]
    Q, R = torch.linalg.qr(torch.randn(d - 1, d - 1, generator=g, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R))[None, :]
    if torch.det(Q) < 0:
        Q[:, 0] = -Q[:, 0]
    return U @ Q @ U.T + ones @ ones.T


@torch.no_grad()
def paper003_rotation(model: nn.Module, R: torch.Tensor) -> None:
    """Paper 003's residual rotation as written, in place: embeddings and writers rotated, every reader
    ``W ← W Rᵀ``, LayerNorms untouched (a tied head is the rotated embedding)."""
    st = find_stream(model)
    for ref in (st.token_embedding, st.position_embedding):
        if ref is not None:
            ref.get().copy_(ref.get() @ R.T)
    for w in st.writers():
        W, b = w.read()
        w.write(R @ W, None if b is None else R @ b)
    for norm in st.norms():
        for r in st.readers(norm):
            W, _ = r.read()
            r.write(W @ R.T)


def gram_rank(columns: torch.Tensor, rtol: float = 1e-10) -> int:
    s = torch.linalg.svdvals(columns)
    return int((s > rtol * s[0]).sum())


def lemma27_min_singular_value(d: int = 6, n: int = 200, seed: int = 0) -> float:
    """The linearised equivariance ``LN(Mx) = M LN(x)`` at ``M = I + E`` over ``n`` random ``x``
    (generic ``γ, β``): smallest over largest singular value of the map ``E ↦ (J_x E x − E LN(x))_x``."""
    g = torch.Generator().manual_seed(seed)
    gamma = 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)
    beta = 0.5 * torch.randn(d, generator=g, dtype=torch.float64)

    def ln(x):
        xc = x - x.mean(-1, keepdim=True)
        return gamma * xc / torch.sqrt((xc**2).mean(-1, keepdim=True)) + beta

    rows = []
    for x in torch.randn(n, d, generator=g, dtype=torch.float64):
        Jx = torch.autograd.functional.jacobian(ln, x)
        A = torch.einsum("ia,c->iac", Jx, x).reshape(d, d * d)
        A -= torch.einsum("ia,c->iac", torch.eye(d, dtype=torch.float64), ln(x)).reshape(d, d * d)
        rows.append(A)
    s = torch.linalg.svdvals(torch.cat(rows))
    return float(s[-1] / s[0])


def paper003_rotation_count(d: int) -> int:
    return (d - 1) * (d - 2) // 2
