"""Attribution of a measured null space to the symmetries gaugeopt knows.

For each sector (:func:`gaugeopt.flat.symmetries.symmetry_families`, all units of a sector
together) :func:`attribute` forms its generator matrix — the derivatives of the sector's finite
action at the identity, by the complex step on a complex copy of the model (``apply(iε·e_j)``,
``Im θ / ε`` with ``ε = 1e-20``: exact to rounding, no cancellation) — and measures:

* ``dim``: the rank of the generators (``gens`` columns);
* ``in null``: how much of that span lies in the measured null space ``N`` — the principal angles
  between the two, counted where the sine is ``≤ angle_tol``;
* ``leak = ‖J Q‖₂/σ_max`` over an orthonormal basis ``Q`` of the span (first-order output change);
* ``finite``: the relative change of the outputs after one finite element (random ``t``,
  ``N(0, 0.3²)`` per coordinate; a rotation by at most one radian) on a copy of the model.

A sector whose family claims a symmetry and whose finite change is ``≤ exact_tol`` is *exact*:
its span joins the running sum of the exact spans (``cum dim``), whose intersection with ``N``
(``cum∩N``) leaves ``left = nullity − cum∩N`` null directions unexplained. Unused coordinates
(all-zero Jacobian columns) come first. Families that are not symmetries (residual rotations
under a tied head, the key-bias shift on RoPE-rotated channels), and any family that claims to be
one but fails the finite check, are listed apart (``FlatReport.near_flat``)
with the smallest singular value of ``J`` on their span outside ``N``. A family that claims a symmetry and
moves the outputs only by float32 rounding (``≤`` :data:`FLOAT32_TOL`) in a model that computes a step in
float32 (its records' ``float32_steps``: Hugging Face's RMSNorms) is labelled with that step
(``SectorRow.float32``) instead: exact in float64 arithmetic, hidden from the measured null space by the
float32 step. With a ``forward_context`` the forwards run inside it and no such label is given.

Example:
    >>> import torch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.trust.invariance import randomize_parameters
    >>> from gaugeopt.flat.meter import covering_tokens, flat_directions
    >>> model = GPT(GPTConfig(vocab_size=7, block_size=4, n_layer=1, n_head=1, n_embd=4)).double().eval()
    >>> randomize_parameters(model, torch.Generator().manual_seed(0))
    >>> rep = flat_directions(model, covering_tokens(7, 4, 40), progress=False)
    >>> [(r.name, r.in_null, r.cum_in_null) for r in rep.sectors][:4]
    [('qk', 16, 16), ('vo', 16, 32), ('key_bias', 4, 36), ('value_bias', 4, 40)]
    >>> rep.remainder, [r.name for r in rep.near_flat]
    (0, ['embedding_shift', 'residual_rotation'])
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable, ContextManager

import torch
import torch.nn as nn

from gaugeopt.transforms import relative_change
from gaugeopt.flat.symmetries import Family, symmetry_families
from gaugeopt.flat.report import FlatReport, SectorRow, r_factor


def _left_singular(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, σ)`` of the thin SVD of ``M`` (columns of ``U`` by decreasing ``σ``). LAPACK's divide-and-conquer SVD
    can fail to converge on a matrix with many repeated (near-zero) singular values — a residual of a subspace
    mostly explained is one — and then the symmetric eigendecomposition of ``MᵀM`` (which always converges) gives
    the same left singular vectors for the singular values well above ``sqrt(eps)·σ_max``, the ones read here."""
    try:
        U, sv, _ = torch.linalg.svd(M, full_matrices=False)
        return U, sv
    except torch.linalg.LinAlgError:
        w, V = torch.linalg.eigh(M.T @ M)
        w, V = w.flip(0).clamp_min(0), V.flip(1)
        sv = w.sqrt()
        return (M @ V) / sv.clamp_min(torch.finfo(M.dtype).tiny), sv


def _leading_left_singular_vectors(M: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` leading left singular vectors of ``M`` (:func:`_left_singular`)."""
    return _left_singular(M)[0][:, :k]

__all__ = ["attribute", "generator_matrix", "COMPLEX_STEP", "FLOAT32_TOL"]

COMPLEX_STEP = 1e-20
# what a float32 step inside a float64 model leaves of an exact symmetry: float32 rounding (~6e-8) amplified
# by the layers after it (measured: 1e-7–1e-6 on the HF Llama/Qwen3/OLMo 2/Gemma 3 test models)
FLOAT32_TOL = 1e-5


def _float32_steps(model: nn.Module) -> str:
    """What ``model`` computes in float32 even in float64 (its attention records' and residual stream's
    ``float32_steps``), ``""`` for nothing."""
    from gaugeopt.errors import GaugeError
    from gaugeopt.adapters.find import find_attention
    from gaugeopt.flat.stream import find_stream

    steps = dict.fromkeys(s.float32_steps for s in find_attention(model) if s.float32_steps)
    try:
        if find_stream(model).float32_steps:
            steps[find_stream(model).float32_steps] = None
    except GaugeError:
        pass  # no stream record: the attention records say what they know
    return "; ".join(steps)


def _complex_copy(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "casting complex values to real" notes from buffers
        return copy.deepcopy(model).to(torch.complex128)


def generator_matrix(model: nn.Module, families: list[Family], params: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(n_params, Σ dim)`` generators of ``families`` (built on the complex model whose
    ``named_parameters()`` are ``params``), in the order of ``params``, by the complex step."""
    saved = {n: p.detach().clone() for n, p in params.items()}
    cols = []
    with torch.no_grad():
        for fam in families:
            for j in range(fam.dim):
                t = torch.zeros(fam.dim, dtype=torch.complex128)
                t[j] = 1j * COMPLEX_STEP
                fam.apply(t)
                cols.append(torch.cat([p.detach().imag.reshape(-1) for p in params.values()]) / COMPLEX_STEP)
                for n, p in params.items():
                    p.copy_(saved[n])
    if not cols:
        return torch.zeros(sum(p.numel() for p in params.values()), 0, dtype=torch.float64)
    return torch.stack(cols, 1)


def _finite_change(model: nn.Module, key: tuple[str, bool], run: Callable[[nn.Module], torch.Tensor],
                   ref: torch.Tensor, seed: int, context: Callable[[], ContextManager]) -> float:
    """Relative output change after one random element of every family with ``(name, exact) == key``
    (the records found outside ``context``, the forward run inside it)."""
    moved = copy.deepcopy(model)
    fams, _ = symmetry_families(moved)
    g = torch.Generator().manual_seed(seed)
    name = key[0]
    with torch.no_grad():
        for f in fams:
            if (f.name, f.exact) != key:
                continue
            t = 0.3 * torch.randn(f.dim, generator=g, dtype=torch.float64)
            if name == "residual_rotation":
                t = t / max(1.0, float(t.norm()))  # a rotation by at most one radian
            f.apply(t)
    with context():
        return relative_change(ref, run(moved))


def _orth(A: torch.Tensor, rtol: float = 1e-10) -> torch.Tensor:
    if A.shape[1] == 0:
        return A
    U, s, _ = torch.linalg.svd(A, full_matrices=False)
    if s.numel() == 0 or float(s[0]) == 0:
        return A[:, :0]
    return U[:, s > rtol * s[0]]


def _smallest_singular_value(R: torch.Tensor) -> float:
    """The smallest singular value of ``J Q`` from its factor ``R`` (``b`` columns, possibly fewer rows)."""
    s = torch.linalg.svdvals(R)
    return 0.0 if s.numel() < R.shape[1] else float(s.min())


def _sines(Q: torch.Tensor, N: torch.Tensor) -> torch.Tensor:
    """Sines of the principal angles from span(Q) to span(N) (both orthonormal), ascending."""
    if Q.shape[1] == 0:
        return Q.new_zeros(0)
    return torch.sort(torch.linalg.svdvals(Q - N @ (N.T @ Q))).values


@torch.no_grad()
def attribute(
    report: FlatReport,
    model: nn.Module,
    inputs: tuple,
    outputs: Callable[[Any], torch.Tensor],
    *,
    angle_tol: float = 1e-6,
    exact_tol: float = 1e-12,
    float32_tol: float = FLOAT32_TOL,
    seed: int = 0,
    progress: Callable[..., None] | None = None,
    forward_context: Callable[[], ContextManager] | None = None,
) -> FlatReport:
    """Fill ``report.sectors``, ``near_flat``, ``remainder``, ``explained`` and ``remainder_loads``
    (module docstring). ``inputs`` are the model's positional inputs for the finite checks;
    ``forward_context`` (see :func:`gaugeopt.flat_directions`) is entered around every forward, never
    while records are found."""
    N, J, smax = report.null_basis, report.jacobian, report.sigma_max
    context = forward_context or contextlib.nullcontext
    cplx = _complex_copy(model)
    params = dict(cplx.named_parameters())
    fams, report.note = symmetry_families(cplx)
    float32 = "" if forward_context is not None else _float32_steps(model)
    if forward_context is not None:
        report.note = "; ".join(x for x in (report.note, "forwards measured inside the given forward_context (any float32 "
                                                           "step above is what the model computes without it)") if x)

    def run(m: nn.Module) -> torch.Tensor:
        return outputs(m(*inputs))

    with context():
        ref = run(model)
    groups: dict[tuple[str, bool], list[Family]] = {}  # a sector's exact and inexact units apart
    for f in fams:
        groups.setdefault((f.name, f.exact), []).append(f)
    entries: list[tuple[str, torch.Tensor, float, bool, str]] = []
    if report.unused_index:
        A = torch.zeros(report.n_params, len(report.unused_index), dtype=torch.float64)
        A[report.unused_index, torch.arange(len(report.unused_index))] = 1.0
        entries.append(("unused", A, 0.0, True, "coordinates the inputs never read (all-zero Jacobian column)"))
    for k, (key, members) in enumerate(groups.items()):
        name = key[0]
        if progress is not None:
            progress(f"attribution, sector {k + 1}/{len(groups)} ({name})")
        A = generator_matrix(cplx, members, params)
        fin = _finite_change(model, key, run, ref, seed, context)
        notes = dict.fromkeys(f.why for f in members)
        entries.append((name, A, fin, members[0].exact, "; ".join(notes)))
    Qcum = torch.zeros(report.n_params, 0, dtype=torch.float64)
    rows, near = [], []
    for name, A, fin, expected, note in entries:
        Q = _orth(A)
        sines = _sines(Q, N)
        inn = int((sines <= angle_tol).sum())
        leak = float(torch.linalg.matrix_norm(r_factor(J, Q), 2) / smax) if Q.shape[1] else 0.0
        row = SectorRow(name, A.shape[1], Q.shape[1], inn, float(sines[:inn].max()) if inn else float("nan"), leak, fin,
                        expected and fin <= exact_tol, expected, note=note)
        if not row.exact and expected and float32 and fin <= float32_tol:
            row.float32 = float32  # exact in float64 arithmetic, limited by the model's float32 step
        if not row.exact:
            Qp = _orth(Q - N @ (N.T @ Q))
            if Qp.shape[1]:
                row.sigma_perp = float(_smallest_singular_value(r_factor(J, Qp)) / smax)
            near.append(row)
            continue
        R = Q - Qcum @ (Qcum.T @ Q)
        R = R - Qcum @ (Qcum.T @ R)
        U, sv = _left_singular(R)
        Qcum = torch.cat([Qcum, U[:, sv > 1e-8]], 1)
        cos = torch.linalg.svdvals(Qcum.T @ N)
        row.cum_dim, row.cum_in_null = Qcum.shape[1], int((cos >= 1 - 0.5 * angle_tol**2).sum())
        row.remainder = report.nullity - row.cum_in_null
        rows.append(row)
    report.sectors, report.near_flat = rows, near
    report.remainder = rows[-1].remainder if rows else report.nullity
    report.explained = Qcum.shape[1]
    if report.remainder:
        Rn = N - Qcum @ (Qcum.T @ N)
        Ur = _leading_left_singular_vectors(Rn, report.remainder)
        loads, off = {}, 0
        for nm, sz in zip(report.names, report.sizes):
            loads[nm] = float((Ur[off:off + sz] ** 2).sum()) / report.remainder
            off += sz
        report.remainder_loads = dict(sorted(((k, v) for k, v in loads.items() if v > 1e-3), key=lambda kv: -kv[1]))
    return report
