"""The flat-direction meter: how many parameter directions leave a small model's outputs unchanged.

:func:`flat_directions` measures, at the model's current float64 parameters θ, the numerical
nullity of the Jacobian ``J = ∂ outputs / ∂θ`` over *all* parameters (tied tensors once) — the
directions along which the outputs do not move to first order, for these inputs — and
attributes them to the symmetries gaugeopt knows (:mod:`gaugeopt.flat.attribution`).

**Method** (float64, small models only):

1. ``J``: the outputs (default: the logits) of every example, one example (row of the inputs)
   at a time by reverse mode (``torch.func.jacrev`` over a flat parameter vector through
   ``functional_call``). Rows: every output of every example.
2. ``G = JᵀJ``; ``σ_max`` by power iteration; the number ``k₀`` of singular values below
   ``count_rtol·σ_max`` by Sylvester's inertia (``LDLᵀ`` of ``G − μI``); a block of ``k₀ + extra``
   vectors by shift-inverted subspace iteration with ``(G + μ'I)⁻¹`` (Cholesky); then
   Rayleigh–Ritz **with J itself** (SVD of ``J·V``), so the small singular values are not squared:
   null ones come out at ``1e-13…1e-15·σ_max`` instead of the ``~1e-8`` floor of ``G``'s eigenvalues.
3. The rank: the tolerance is the geometric mean of the two singular values across the *lowest*
   ratio ``σ_{k+1}/σ_k ≥ min_gap`` (default ``1e3``; the largest ratio when none is) in that refined
   tail, with values clamped at ``sigma_floor`` so that rounding noise among exact zeros is not
   mistaken for a gap — unless ``tol`` is given. The lowest, not the largest: exact zeros sit at
   rounding level (``≲ 1e-12·σ_max``), while a near-symmetry — the global rescale of the residual
   stream, broken only by the norms' ``ε`` — can sit alone at ``~1e-9`` with a still larger ratio
   above it; it is not a symmetry. :class:`FlatReport` states both sides of the chosen gap, their
   ratio and the largest other ratio.
4. Columns of ``J`` that are exactly zero — coordinates the inputs never read (an unused token's
   embedding row) — are reported separately (:attr:`FlatReport.unused`); they are flat for
   these inputs, not symmetries.

**Data.** A position contributes at most ``d_model`` new directions for the parameters below the
head, so the inputs must hold more positions × ``d_model`` than there are parameters, and use every
token id and position: :func:`covering_tokens` builds such a batch. *Saturation is proved, not
assumed*: the known sectors are exact symmetries, so ``nullity ≥ dim span(sectors)`` for any
data; a zero unexplained remainder means more data cannot lower the nullity.

**Cost.** ``J`` is ``outputs×n`` and ``G`` ``n×n``, in float64: memory grows like outputs × parameters
plus parameters², time like outputs × parameters². Before it starts, the meter estimates its peak
memory (:mod:`gaugeopt.flat.cost`, calibrated on measured runs) and refuses — with the amount,
the memory available and what to do — a run that would not fit in the memory available now
(``MemAvailable``; ``max_memory`` to set a cap), or a model above ``max_params`` (default 10,000):
measure a small model of the same architecture, or count at scale with
:func:`gaugeopt.gauge_dimension` (``convention="complete"``). A run that takes more than 10 s prints
its stages on stderr, with a heartbeat during long single steps.

**Float32 steps.** A model whose computation rounds through float32 (Hugging Face's RMSNorms) moves
its exact symmetries by float32 rounding (``~1e-7``), so they drop out of the measured null space; the
report labels such families "EXACT UP TO FLOAT32 ROUNDING" (not "EXPECTED EXACT BUT IS NOT") and says
the nullity is then a lower bound. To measure them, pass ``forward_context``: a context the meter
enters around every forward (and never while it finds the model's records), such as one that computes
those steps in float64.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.trust.invariance import randomize_parameters
    >>> from gaugeopt.flat.meter import covering_tokens, flat_directions
    >>> cfg = GPTConfig(vocab_size=7, block_size=4, n_layer=1, n_head=2, n_embd=4, bias=False, norm="rmsnorm",
    ...                 mlp="swiglu", mlp_hidden=4, rope="split_half")
    >>> model = GPT(cfg).double().eval()
    >>> randomize_parameters(model, torch.Generator().manual_seed(0))
    >>> report = flat_directions(model, covering_tokens(7, 4, 24), progress=False)
    >>> report.nullity, report.remainder, gaugeopt.gauge_dimension(model, "complete")
    (24, 0, 24)
    >>> {r.name: r.in_null for r in report.sectors}
    {'qk': 4, 'vo': 8, 'norm_gain': 8, 'mlp_scale': 4}
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, Callable, ContextManager

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.flat.attribution import attribute as _attribute
from gaugeopt.flat.cost import (
    MemoryEstimate,
    Progress,
    available_memory,
    check_memory,
    chunk_rows,
    estimate_memory,
    too_large_message,
)
from gaugeopt.flat.report import FlatReport, SectorRow, r_factor

__all__ = ["FlatReport", "SectorRow", "MemoryEstimate", "flat_directions", "preflight", "covering_tokens", "suggested_sequences",
           "measure", "r_factor", "estimate_memory", "available_memory", "check_memory", "too_large_message",
           "DEFAULT_MAX_PARAMS"]

DEFAULT_MAX_PARAMS = 10_000


def covering_tokens(vocab: int, length: int, n_sequences: int, seed: int = 0) -> torch.Tensor:
    """``(n_sequences, length)`` token ids whose first ``⌈vocab/length⌉`` rows hold every id once
    (so no embedding row is unused); the rest are uniform random.

    Example:
        >>> x = covering_tokens(10, 4, 5)
        >>> tuple(x.shape), sorted(set(x[:3].flatten().tolist())) == list(range(10))
        ((5, 4), True)
    """
    if n_sequences * length < vocab:
        raise GaugeError(f"covering_tokens: {n_sequences} sequences of length {length} cannot hold all {vocab} token ids; "
                         f"pass n_sequences >= {math.ceil(vocab / length)}")
    g = torch.Generator().manual_seed(seed)
    k = -(-vocab // length)
    first = torch.randperm(vocab, generator=g)
    cover = torch.cat([first, torch.randint(0, vocab, (k * length - vocab,), generator=g)]).reshape(k, length)
    rest = torch.randint(0, vocab, (max(n_sequences - k, 0), length), generator=g)
    return torch.cat([cover, rest])[:n_sequences]


def suggested_sequences(model: nn.Module, vocab: int, length: int, factor: float = 2.0) -> int:
    """Sequences of ``length`` tokens for a language model: ``factor`` times as many positions ×
    ``d_model`` as parameters (a position adds at most ``d_model`` directions below the head), plus
    the ``⌈vocab/length⌉`` that hold every token id (:func:`covering_tokens`)."""
    from gaugeopt.adapters.find import find_attention

    d = find_attention(model)[0].d_model
    n = sum(p.numel() for p in model.parameters())
    return math.ceil(factor * n / (length * d)) + math.ceil(vocab / length)


def _default_outputs(out: Any) -> torch.Tensor:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


# ---------------------------------------------------------------------- the Jacobian and its spectrum
def _jacobian(model: nn.Module, examples: list[tuple], total: int, outputs: Callable, progress: Progress):
    """``J (total, n)``, filled one example at a time: one forward, then reverse mode for a chunk of the
    example's outputs at a time (:func:`~gaugeopt.flat.cost.chunk_rows`), written straight into ``J`` (no per-example copies)."""
    from torch.func import functional_call, vjp, vmap

    named = list(model.named_parameters())
    names, shapes = [n for n, _ in named], [p.shape for _, p in named]
    sizes = [p.numel() for _, p in named]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])
    J = torch.empty(total, theta.numel(), dtype=theta.dtype)
    chunk = chunk_rows(theta.numel())

    def f(th, args):
        params = {n: t.view(s) for n, t, s in zip(names, th.split(sizes), shapes)}
        return outputs(functional_call(model, params, args)).reshape(-1)

    done, t0 = 0, time.perf_counter()
    with warnings.catch_warnings():  # "no batching rule for ..._backward": a performance note from vmap
        warnings.simplefilter("ignore", UserWarning)
        for args in examples:
            out, pull = vjp(lambda th, args=args: f(th, args), theta)
            m = out.numel()
            for s in range(0, m, chunk):
                k = min(chunk, m - s)
                e = torch.zeros(k, m, dtype=out.dtype)
                e[torch.arange(k), torch.arange(s, s + k)] = 1.0
                J[done + s: done + s + k] = vmap(pull)(e)[0].detach()
            done += m
            left = (time.perf_counter() - t0) * (total - done) / done
            progress(f"Jacobian, {done:,} of {total:,} rows" + (f", about {left:.0f} s left" if left >= 1 else ""))
    return J, names, sizes


def _shifted_copy(G: torch.Tensor, shift: float) -> torch.Tensor:
    """``G + shift·I`` as a column-major copy (``G`` is symmetric): LAPACK then factorises it in place
    without a second ``n×n`` buffer."""
    A = G.clone()
    A.diagonal().add_(shift)
    return A.mT


def _inertia_below(G: torch.Tensor, mu: float) -> int:
    """Eigenvalues of the symmetric ``G`` below ``mu`` (Sylvester: the negative inertia of ``LDLᵀ`` of ``G − μI``)."""
    n = G.shape[0]
    A = _shifted_copy(G, -mu)
    piv = torch.empty(n, dtype=torch.int32)
    torch.linalg.ldl_factor(A, out=(A, piv))
    piv, d, off = piv.tolist(), torch.diagonal(A).tolist(), torch.diagonal(A, -1).tolist()
    del A
    neg, i = 0, 0
    while i < n:
        if piv[i] > 0:
            neg += d[i] < 0
            i += 1
        else:  # a 2×2 block (lower storage)
            a, b, c = d[i], off[i], d[i + 1]
            neg += 1 if a * c - b * b < 0 else (2 if a < 0 else 0)
            i += 2
    return neg


def measure(
    J: torch.Tensor,
    *,
    tol: float | None = None,
    count_rtol: float = 1e-5,
    extra: int = 48,
    shift_rtol: float = 1e-6,
    iters: int = 5,
    sigma_floor: float = 1e-13,
    min_gap: float = 1e3,
    progress: Callable[..., None] | None = None,
    memory: tuple[MemoryEstimate, float | None] | None = None,
) -> dict:
    """The spectrum near zero of ``J`` (float64) and its numerical rank (module docstring, steps 2–3).

    Memory: ``J``, the Gram matrix ``G`` and one ``n×n`` factor at a time (factorised in place),
    ``n×b`` blocks, and ``J @ V`` only as its ``b×b`` triangular factor (:func:`r_factor`). With
    ``memory=(estimate, max_memory)`` the run is checked again once the block ``b`` is known
    (:func:`~gaugeopt.flat.cost.check_memory`).

    Returns a dict: ``sigma_max``, ``tail`` (relative, ascending), ``nullity``, ``tol``,
    ``sigma_kept``, ``sigma_null``, ``gap``, ``second_gap``, ``null`` (an orthonormal basis of the
    null space, ``(n, nullity)``), ``above`` (the next few singular directions), ``inertia_count``.
    """
    say = progress or (lambda *a, **k: None)
    m, n = J.shape
    say(f"Gram matrix JᵀJ ({n:,}×{n:,} from {m:,} rows)", force=True)
    G = J.T @ J
    v = torch.randn(n, dtype=J.dtype, generator=torch.Generator().manual_seed(0))
    lam = 0.0
    for _ in range(200):
        w = G @ v
        new = float(w.norm())
        v = w / new
        if abs(new - lam) <= 1e-10 * new:
            break
        lam = new
    smax = math.sqrt(new)
    say(f"LDLᵀ of the {n:,}×{n:,} Gram matrix (counting its small eigenvalues)", force=True)
    count = _inertia_below(G, (count_rtol * smax) ** 2)
    b = min(n, count + extra)
    if memory is not None and b > memory[0].block:  # a larger null space than expected: is there room for it?
        check_memory(estimate_memory(n, m, 1, b), memory[1], held=(J.numel() + G.numel()) * 8)
    mu = (shift_rtol * smax) ** 2
    say(f"Cholesky factor and subspace iteration ({count:,} small singular values, block of {b:,})", force=True)
    while True:
        L = _shifted_copy(G, mu)
        info = torch.empty((), dtype=torch.int32)
        torch.linalg.cholesky_ex(L, out=(L, info))
        if int(info) == 0:
            break
        mu *= 10
    del G
    V = torch.linalg.qr(torch.randn(n, b, dtype=J.dtype, generator=torch.Generator().manual_seed(1)))[0]
    for _ in range(iters):  # (G + μI)⁻¹ V by two triangular solves on the in-place factor
        V = torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L, V, upper=False), upper=True)
        V = torch.linalg.qr(V)[0]
    del L
    say("Rayleigh–Ritz with J", force=True)
    R = r_factor(J, V)  # Rayleigh–Ritz with J: singular values unsquared
    _, S, Wh = torch.linalg.svd(R, full_matrices=True)
    if S.numel() < b:  # fewer outputs than block vectors: the missing singular values are exact zeros
        S = torch.cat([S, S.new_zeros(b - S.numel())])
    order = torch.argsort(S)
    S, W = S[order], Wh.mT[:, order]
    rel = S / smax
    lr = torch.log10(rel.clamp_min(sigma_floor))
    gaps = lr[1:] - lr[:-1]
    second = float("nan")
    if tol is None:  # the lowest ratio ≥ min_gap, else the largest: zeros sit at rounding level, and a
        big = torch.nonzero(gaps >= math.log10(min_gap)).flatten()  # near-symmetry (σ ~ 1e-9) is not one
        i = int(big[0]) if big.numel() else int(torch.argmax(gaps))
        tol = float(10 ** (0.5 * (lr[i] + lr[i + 1])))
        others = torch.cat([gaps[:i], gaps[i + 1:]])
        if others.numel():
            second = float(10 ** others.max())
    k = int((rel < tol).sum())
    if k >= b:
        raise GaugeError(f"flat_directions: all {b} computed directions are below tol={tol:.1e}; raise count_rtol or extra")
    return {
        "sigma_max": smax, "tail": rel, "nullity": k, "tol": tol, "sigma_kept": float(rel[k]),
        "sigma_null": float(rel[k - 1]) if k else 0.0, "gap": float(rel[k] / rel[k - 1].clamp_min(1e-300)) if k else float("inf"),
        "second_gap": second, "null": V @ W[:, :k], "above": V @ W[:, k:k + 4], "inertia_count": count,
    }


def _expected_block(model: nn.Module, n: int, rows: int, width: int, extra: int) -> int:
    """The subspace block the spectrum will need: the nullity expected plus ``extra``. On generic weights
    the nullity is the complete count (``n/2`` when the model cannot be counted), unless the data is too
    little: a position's outputs (``width`` of them, through the head) reach the parameters below the
    head through ``d_model`` numbers, so ``rank J ≤ positions·d_model + width·(d_model + 1)``."""
    from gaugeopt.flat.counting import gauge_dimension

    try:
        expected = int(gauge_dimension(model, "complete"))
    except GaugeError:
        expected = n // 2
    bound = n - rows
    try:
        from gaugeopt.adapters.find import find_attention

        d = find_attention(model)[0].d_model
        bound = max(bound, n - (rows // width) * d - width * (d + 1))
    except (GaugeError, IndexError):
        pass  # no attention record: only the number of rows bounds the rank
    return min(n, max(expected, bound) + extra)


# ---------------------------------------------------------------------- the public entry point
def preflight(
    model: nn.Module,
    *example_inputs: Any,
    outputs: Callable[[Any], torch.Tensor] | None = None,
    max_params: int = DEFAULT_MAX_PARAMS,
    max_memory: float | None = None,
    forward_context: Callable[[], ContextManager] | None = None,
    extra: int = 48,
) -> tuple[MemoryEstimate, int]:
    """What :func:`flat_directions` checks before it starts, without starting: float64 parameters,
    example inputs, ``max_params`` and the memory (:func:`~gaugeopt.flat.cost.check_memory`).
    Returns the memory estimate and the number of outputs per example (one forward of one example).

    Raises:
        GaugeError: as :func:`flat_directions`.
    """
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float64]
    if bad:
        raise GaugeError(f"flat_directions: parameter {bad[0]} is {dict(model.named_parameters())[bad[0]].dtype}; "
                         "the meter resolves singular values down to 1e-15·σ_max only in float64: call model.double() first")
    if not example_inputs:
        raise GaugeError("flat_directions: pass example inputs (e.g. covering_tokens(vocab, length, n_sequences))")
    n = sum(p.numel() for p in model.parameters())
    lead = example_inputs[0].shape[0]
    with torch.no_grad(), (forward_context or contextlib.nullcontext)():
        out = (outputs or _default_outputs)(model(*(a[:1] if isinstance(a, torch.Tensor) else a for a in example_inputs)))
    per_example = out.numel()
    rows = lead * per_example
    need = estimate_memory(n, rows, per_example, _expected_block(model, n, rows, out.shape[-1] if out.dim() else 1, extra))
    if n > max_params:
        raise GaugeError(too_large_message(n, max_params, need))
    check_memory(need, max_memory)
    return need, per_example


def flat_directions(
    model: nn.Module,
    *example_inputs: Any,
    outputs: Callable[[Any], torch.Tensor] | None = None,
    tol: float | None = None,
    attribute: bool = True,
    max_params: int = DEFAULT_MAX_PARAMS,
    max_memory: float | None = None,
    progress: bool | Callable[[str], None] | None = None,
    forward_context: Callable[[], ContextManager] | None = None,
    **kw: Any,
) -> FlatReport:
    """Measure the flat directions of ``model`` at its current parameters, and attribute them.

    Args:
        model: a float64 model (``model.double()``), in eval mode for a deterministic forward.
        example_inputs: positional inputs with a leading example dimension; each row is one
            example (its own block of ``J``). For a language model: token ids that use every token
            and position, with more positions × ``d_model`` than parameters (:func:`covering_tokens`).
        outputs: ``model output → tensor`` (default ``.logits``, else ``[0]`` of a tuple, else the output).
        tol: relative tolerance ``σ/σ_max`` for the rank (default: across the largest gap).
        attribute: attribute the null space to the known sectors (:mod:`gaugeopt.flat.attribution`).
        max_params: refuse larger models (the method is dense: ``n²`` memory, ``rows·n²`` time).
        max_memory: refuse when :func:`estimate_memory` says the run needs more bytes than this
            (default: the memory available now, :func:`available_memory`; ``math.inf`` never refuses).
        progress: ``True`` prints stage lines on stderr from the start, ``False`` nothing, a callable
            receives them (also from a heartbeat thread during long steps); ``None`` prints once the
            run has taken 10 s.
        forward_context: a context-manager factory entered around every forward the meter runs (the
            Jacobian, the finite checks) and never while it finds the model's records — e.g. one that
            computes a float32 step in float64 (Hugging Face's RMSNorms), which gaugeopt's adapters
            would refuse as a patched forward. Without it, families hidden only by a float32 step are
            labelled as such (:attr:`SectorRow.float32`).
        **kw: ``count_rtol``, ``extra``, ``shift_rtol``, ``iters``, ``sigma_floor``, ``min_gap`` of :func:`measure`;
            ``angle_tol``, ``exact_tol``, ``seed`` of :func:`gaugeopt.flat.attribution.attribute`.

    Returns:
        :class:`FlatReport`; ``str(report.table())`` prints it.

    Raises:
        GaugeError: a parameter that is not float64, too many parameters, more memory needed than
            is available (the message says how much and what to do), or no example inputs.
    """
    need, per_example = preflight(model, *example_inputs, outputs=outputs, max_params=max_params, max_memory=max_memory,
                                  forward_context=forward_context, extra=kw.get("extra", 48))
    n, lead, rows = need.n_params, example_inputs[0].shape[0], need.n_rows
    context = forward_context or contextlib.nullcontext
    # one reverse-mode pass per example: a batch would backpropagate every output through every example
    examples = [tuple(a[i:i + 1] if isinstance(a, torch.Tensor) else a for a in example_inputs) for i in range(lead)]
    meas_kw = {k: kw.pop(k) for k in ("count_rtol", "extra", "shift_rtol", "iters", "sigma_floor", "min_gap") if k in kw}
    prog = Progress(progress)
    try:
        prog(f"{n:,} parameters, Jacobian {lead * per_example:,} rows; {need.describe()}", force=True)
        t0 = time.perf_counter()
        with context():
            J, names, sizes = _jacobian(model, examples, lead * per_example, outputs or _default_outputs, prog)
        t1 = time.perf_counter()
        res = measure(J, tol=tol, progress=prog, memory=(need, max_memory), **meas_kw)
        t2 = time.perf_counter()
        rep = _report(model, J, names, sizes, lead, res, meas_kw, {"jacobian": t1 - t0, "spectrum": t2 - t1})
        if attribute:
            prog(f"nullity {rep.nullity} at tol {rep.tol:.1e}; attributing", force=True)
            run_inputs = tuple(a[: min(lead, 8)] if isinstance(a, torch.Tensor) else a for a in example_inputs)
            _attribute(rep, model, run_inputs, outputs or _default_outputs, progress=prog, forward_context=forward_context,
                       **kw)
            rep.timings["attribution"] = time.perf_counter() - t2
    finally:
        prog.close()
    return rep


def _report(model, J, names, sizes, lead, res, meas_kw, timings) -> FlatReport:
    read = torch.zeros(J.shape[1], dtype=torch.bool)
    step = chunk_rows(J.shape[1], 1 << 24)
    for s in range(0, J.shape[0], step):  # by row chunks: a whole-J mask would cost J's size again
        read |= (J[s:s + step] != 0).any(0)
    dead = torch.nonzero(~read).flatten().tolist()
    return FlatReport(
        n_params=J.shape[1], n_outputs=J.shape[0], n_examples=lead, rank=J.shape[1] - res["nullity"],
        nullity=res["nullity"], tol=res["tol"], sigma_max=res["sigma_max"], sigma_kept=res["sigma_kept"],
        sigma_null=res["sigma_null"], gap=res["gap"], second_gap=res["second_gap"], tail=res["tail"],
        inertia_count=res["inertia_count"], count_rtol=meas_kw.get("count_rtol", 1e-5),
        unused=[_coord_name(names, sizes, model, i) for i in dead], unused_index=dead, names=names, sizes=sizes,
        null_basis=res["null"], jacobian=J, above_basis=res["above"], timings=timings,
    )


def _coord_name(names: list[str], sizes: list[int], model: nn.Module, i: int) -> str:
    params = dict(model.named_parameters())
    off = 0
    for nm, sz in zip(names, sizes):
        if i < off + sz:
            idx = torch.unravel_index(torch.tensor(i - off), params[nm].shape)
            return f"{nm}[{', '.join(str(int(j)) for j in idx)}]"
        off += sz
    return str(i)
