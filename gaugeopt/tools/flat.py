"""The flat-direction meter: how many parameter directions leave a small model's outputs unchanged.

:func:`flat_directions` measures, at the model's current float64 parameters θ, the numerical
nullity of the Jacobian ``J = ∂ outputs / ∂θ`` over *all* parameters (tied tensors once) — the
directions along which the outputs do not move to first order, for these inputs — and
attributes them to the symmetries gaugeopt knows (:mod:`gaugeopt.tools.attribution`).

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

**Limits.** ``G`` is ``n×n`` and ``J`` is ``outputs×n`` in float64, so the meter refuses models
above ``max_params`` (default 10,000: ~1 GB) with a :class:`~gaugeopt.errors.GaugeError` saying
what to do instead — measure a small model of the same architecture, or count at scale with
:func:`gaugeopt.gauge_dimension` (``convention="complete"``). A model whose computation rounds
through float32 (Hugging Face's ``LlamaRMSNorm``) buries its null space at ``~1e-7``: compute
those steps in float64 first (docs/model_tools.md).

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.structure.invariance import randomize_parameters
    >>> from gaugeopt.tools.flat import covering_tokens, flat_directions
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

import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError

__all__ = ["FlatReport", "SectorRow", "flat_directions", "covering_tokens", "suggested_sequences", "measure",
           "too_large_message", "DEFAULT_MAX_PARAMS"]

DEFAULT_MAX_PARAMS = 10_000


@dataclass
class SectorRow:
    """One line of the attribution (:mod:`gaugeopt.tools.attribution`).

    Attributes:
        name: the sector (all its units together).
        generators: number of generators (columns); ``dim``: the rank of their span.
        in_null: ``dim(span ∩ null space)``: principal angles to the measured null space with
            sine ``≤ angle_tol``; ``max_sin`` the largest of those.
        leak: ``‖J Q‖₂/σ_max`` over an orthonormal basis ``Q`` of the span (first-order change).
        finite: relative output change after one finite group element (random ``t``).
        exact: expected to be a symmetry and measured so (``finite ≤ exact_tol``).
        expected: the family claims to be a symmetry.
        sigma_perp: for inexact sectors, the smallest ``σ/σ_max`` of ``J`` on their span outside
            the null space — how nearly flat their flattest combination is.
        cum_dim, cum_in_null, remainder: over this and the earlier exact sectors: the span's
            dimension, the null directions inside it, and ``nullity − cum_in_null``.
        note: why the family is (or is not) a symmetry.
    """

    name: str
    generators: int
    dim: int
    in_null: int
    max_sin: float
    leak: float
    finite: float
    exact: bool
    expected: bool = True
    sigma_perp: float = float("nan")
    cum_dim: int = 0
    cum_in_null: int = 0
    remainder: int = 0
    note: str = ""


@dataclass
class FlatReport:
    """What :func:`flat_directions` measured (all singular values relative to ``sigma_max``).

    Attributes:
        n_params, n_outputs, n_examples: sizes of the problem (``J`` is ``n_outputs × n_params``).
        rank, nullity: numerical rank of ``J`` at :attr:`tol` and ``n_params − rank``.
        tol: the relative tolerance used; ``sigma_kept`` the smallest kept value, ``sigma_null``
            the largest null one, ``gap = sigma_kept / sigma_null``, ``second_gap`` the largest other
            ratio in the tail.
        tail: the refined singular values of the block, ascending.
        unused: names of the coordinates with an all-zero Jacobian column (never read by the inputs);
            ``unused_index`` their flat indices.
        sectors: the exact sectors, in order, with cumulative spans (:class:`SectorRow`);
            ``near_flat`` the families that are not symmetries (listed to show how far they are).
        remainder: null directions outside every exact sector's span (``None`` before attribution);
            ``explained``: dimension of the exact sectors' span.
        remainder_loads: parameter → share of the unexplained null space (where it lives).
        note: what the attribution could not cover (e.g. no stream description for the model).
        timings: seconds per stage.
    """

    n_params: int
    n_outputs: int
    n_examples: int
    rank: int
    nullity: int
    tol: float
    sigma_max: float
    sigma_kept: float
    sigma_null: float
    gap: float
    second_gap: float
    tail: torch.Tensor
    inertia_count: int
    count_rtol: float
    unused: list[str]
    unused_index: list[int]
    names: list[str]
    sizes: list[int]
    null_basis: torch.Tensor = field(repr=False)
    jacobian: torch.Tensor | None = field(default=None, repr=False)
    above_basis: torch.Tensor | None = field(default=None, repr=False)
    sectors: list[SectorRow] = field(default_factory=list)
    near_flat: list[SectorRow] = field(default_factory=list)
    remainder: int | None = None
    explained: int | None = None
    remainder_loads: dict[str, float] = field(default_factory=dict)
    note: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def saturated(self) -> bool:
        """Every null direction lies in the span of exact symmetries: more data cannot lower the nullity."""
        return self.remainder == 0

    def table(self) -> str:
        """The report as text (what ``gaugeopt flat`` prints)."""
        out = [
            f"parameters {self.n_params:,}  outputs {self.n_outputs:,} ({self.n_examples} examples)  rank {self.rank:,}  "
            f"nullity {self.nullity:,}" + (f" (of which {len(self.unused)} unused coordinates)" if self.unused else ""),
            f"tolerance sigma/sigma_max = {self.tol:.1e}: null <= {self.sigma_null:.2e}, kept >= {self.sigma_kept:.2e}, "
            f"gap x{self.gap:.1e} (largest other ratio in the tail x{self.second_gap:.1e}); sigma_max = {self.sigma_max:.3e}",
        ]
        if self.gap < 1e3:
            out.append(f"WARNING: the gap is only x{self.gap:.0f}: the rank is ill-determined (too little data, or near-symmetries)")
        if self.sectors or self.near_flat:
            out.append(f"{'sector':<20}{'gens':>6}{'dim':>6}{'in null':>8}{'max sin':>10}{'leak':>10}{'finite':>10}"
                       f"{'cum dim':>9}{'cum∩N':>7}{'left':>6}  note")
            for r in self.sectors:
                out.append(f"{r.name:<20}{r.generators:>6}{r.dim:>6}{r.in_null:>8}{_e(r.max_sin):>10}{_e(r.leak):>10}"
                           f"{_e(r.finite):>10}{r.cum_dim:>9}{r.cum_in_null:>7}{r.remainder:>6}  {r.note}")
            for r in self.near_flat:
                why = f"EXPECTED EXACT BUT IS NOT: {r.note}" if r.expected else f"not a symmetry: {r.note}"
                out.append(f"{r.name:<20}{r.generators:>6}{r.dim:>6}{r.in_null:>8}{_e(r.max_sin):>10}{_e(r.leak):>10}"
                           f"{_e(r.finite):>10}{'':>22}  {why}; flattest direction sigma/sigma_max {_e(r.sigma_perp)}")
        if self.remainder is not None:
            out.append(f"unexplained remainder of the null space: {self.remainder}"
                       + (" (saturated: more data cannot lower the nullity)" if self.remainder == 0 else ""))
            if self.remainder_loads:
                out.append("  it lives on: " + ", ".join(f"{k} {v:.2f}" for k, v in list(self.remainder_loads.items())[:8]))
        if self.note:
            out.append(f"note: {self.note}")
        return "\n".join(out)


def _e(x: float) -> str:
    return "-" if x != x else f"{x:.1e}"


def too_large_message(n: int, max_params: int) -> str:
    """Why the meter refuses a model of ``n`` parameters, and what to do instead."""
    return (
        f"flat_directions: the model has {n:,} parameters, more than max_params={max_params:,}: the meter forms the "
        f"Jacobian (outputs × parameters) and its {n:,}×{n:,} Gram matrix in float64 (~{8 * n * n / 1e6:,.0f} MB, and "
        "cubic time). Measure a small model of the same architecture (fewer layers, a smaller width and vocabulary: "
        "the symmetries are per layer), count at scale with gaugeopt.gauge_dimension(model, convention='complete') "
        "(gaugeopt count), or raise max_params if you have the memory"
    )


# ---------------------------------------------------------------------- inputs and progress
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
    from gaugeopt.structure.registry import find_attention

    d = find_attention(model)[0].d_model
    n = sum(p.numel() for p in model.parameters())
    return math.ceil(factor * n / (length * d)) + math.ceil(vocab / length)


class _Progress:
    """Stage lines on stderr (or a callable), at most every ``every`` seconds within a stage."""

    def __init__(self, progress: bool | Callable[[str], None] | None, work: int, every: float = 2.0) -> None:
        if progress is None:
            progress = work > 3_000
        self.emit = progress if callable(progress) else ((lambda s: print(s, file=sys.stderr, flush=True)) if progress else None)
        self.t0 = self.last = time.perf_counter()
        self.every = every

    def __call__(self, msg: str, force: bool = False) -> None:
        now = time.perf_counter()
        if self.emit is not None and (force or now - self.last >= self.every):
            self.emit(f"flat_directions: {msg} ({now - self.t0:.0f} s)")
            self.last = now


def _default_outputs(out: Any) -> torch.Tensor:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


# ---------------------------------------------------------------------- the Jacobian and its spectrum
def _jacobian(model: nn.Module, examples: list[tuple], total: int, outputs: Callable, progress: _Progress):
    """``J``, one block of rows per example (``total`` rows in all)."""
    from torch.func import functional_call, jacrev

    named = list(model.named_parameters())
    names, shapes = [n for n, _ in named], [p.shape for _, p in named]
    sizes = [p.numel() for _, p in named]
    theta = torch.cat([p.detach().reshape(-1) for _, p in named])

    def f(th, args):
        params = {n: t.view(s) for n, t, s in zip(names, th.split(sizes), shapes)}
        return outputs(functional_call(model, params, args)).reshape(-1)

    blocks, done = [], 0
    with warnings.catch_warnings():  # "no batching rule for ..._backward": a performance note from vmap
        warnings.simplefilter("ignore", UserWarning)
        for args in examples:
            blocks.append(jacrev(f)(theta, args).detach())
            done += blocks[-1].shape[0]
            progress(f"Jacobian, {done:,} of {total:,} rows")
    return torch.cat(blocks), names, sizes


def _inertia_below(G: torch.Tensor, mu: float) -> int:
    """Eigenvalues of the symmetric ``G`` below ``mu`` (Sylvester: the negative inertia of ``LDLᵀ`` of ``G − μI``)."""
    n = G.shape[0]
    LD, piv = torch.linalg.ldl_factor(G - mu * torch.eye(n, dtype=G.dtype))
    piv, d, off = piv.tolist(), torch.diagonal(LD).tolist(), torch.diagonal(LD, -1).tolist()
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
) -> dict:
    """The spectrum near zero of ``J`` (float64) and its numerical rank (module docstring, steps 2–3).

    Returns a dict: ``sigma_max``, ``tail`` (relative, ascending), ``nullity``, ``tol``,
    ``sigma_kept``, ``sigma_null``, ``gap``, ``second_gap``, ``null`` (an orthonormal basis of the
    null space, ``(n, nullity)``), ``above`` (the next few singular directions), ``inertia_count``.
    """
    m, n = J.shape
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
    count = _inertia_below(G, (count_rtol * smax) ** 2)
    b = min(n, count + extra)
    mu = (shift_rtol * smax) ** 2
    eye = torch.eye(n, dtype=J.dtype)
    while True:
        L, info = torch.linalg.cholesky_ex(G + mu * eye)
        if int(info) == 0:
            break
        mu *= 10
    V = torch.linalg.qr(torch.randn(n, b, dtype=J.dtype, generator=torch.Generator().manual_seed(1)))[0]
    for _ in range(iters):
        V = torch.linalg.qr(torch.cholesky_solve(V, L))[0]
    B = J @ V  # Rayleigh–Ritz with J: singular values unsquared
    _, S, Wh = torch.linalg.svd(B, full_matrices=B.shape[0] < b)
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


# ---------------------------------------------------------------------- the public entry point
def flat_directions(
    model: nn.Module,
    *example_inputs: Any,
    outputs: Callable[[Any], torch.Tensor] | None = None,
    tol: float | None = None,
    attribute: bool = True,
    max_params: int = DEFAULT_MAX_PARAMS,
    progress: bool | Callable[[str], None] | None = None,
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
        attribute: attribute the null space to the known sectors (:mod:`gaugeopt.tools.attribution`).
        max_params: refuse larger models (the method is dense: ``n²`` memory).
        progress: ``True`` prints stage lines on stderr, ``False`` nothing, a callable receives
            them; ``None`` prints when the model has more than 3,000 parameters.
        **kw: ``count_rtol``, ``extra``, ``shift_rtol``, ``iters``, ``sigma_floor``, ``min_gap`` of :func:`measure`;
            ``angle_tol``, ``exact_tol``, ``seed`` of :func:`gaugeopt.tools.attribution.attribute`.

    Returns:
        :class:`FlatReport`; ``str(report.table())`` prints it.

    Raises:
        GaugeError: a parameter that is not float64, too many parameters, or no example inputs.
    """
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float64]
    if bad:
        raise GaugeError(f"flat_directions: parameter {bad[0]} is {dict(model.named_parameters())[bad[0]].dtype}; "
                         "the meter resolves singular values down to 1e-15·σ_max only in float64: call model.double() first")
    n = sum(p.numel() for p in model.parameters())
    if n > max_params:
        raise GaugeError(too_large_message(n, max_params))
    if not example_inputs:
        raise GaugeError("flat_directions: pass example inputs (e.g. covering_tokens(vocab, length, n_sequences))")
    lead = example_inputs[0].shape[0]
    with torch.no_grad():
        per_example = (outputs or _default_outputs)(model(*(a[:1] if isinstance(a, torch.Tensor) else a
                                                              for a in example_inputs))).numel()
    # one reverse-mode call per example: a batch would backpropagate every output through every example
    examples = [tuple(a[i:i + 1] if isinstance(a, torch.Tensor) else a for a in example_inputs) for i in range(lead)]
    meas_kw = {k: kw.pop(k) for k in ("count_rtol", "extra", "shift_rtol", "iters", "sigma_floor", "min_gap") if k in kw}
    prog = _Progress(progress, n)
    t0 = time.perf_counter()
    J, names, sizes = _jacobian(model, examples, lead * per_example, outputs or _default_outputs, prog)
    t1 = time.perf_counter()
    prog(f"Jacobian {tuple(J.shape)} done; spectrum", force=True)
    res = measure(J, tol=tol, **meas_kw)
    t2 = time.perf_counter()
    dead = torch.nonzero((J != 0).sum(0) == 0).flatten().tolist()
    rep = FlatReport(
        n_params=J.shape[1], n_outputs=J.shape[0], n_examples=lead, rank=J.shape[1] - res["nullity"],
        nullity=res["nullity"], tol=res["tol"], sigma_max=res["sigma_max"], sigma_kept=res["sigma_kept"],
        sigma_null=res["sigma_null"], gap=res["gap"], second_gap=res["second_gap"], tail=res["tail"],
        inertia_count=res["inertia_count"], count_rtol=meas_kw.get("count_rtol", 1e-5),
        unused=[_coord_name(names, sizes, model, i) for i in dead], unused_index=dead, names=names, sizes=sizes,
        null_basis=res["null"], jacobian=J, above_basis=res["above"],
        timings={"jacobian": t1 - t0, "spectrum": t2 - t1},
    )
    if attribute:
        from gaugeopt.tools.attribution import attribute as _attribute

        prog(f"nullity {rep.nullity} at tol {rep.tol:.1e}; attributing", force=True)
        run_inputs = tuple(a[: min(lead, 8)] if isinstance(a, torch.Tensor) else a for a in example_inputs)
        _attribute(rep, model, run_inputs, outputs or _default_outputs, progress=prog, **kw)
        rep.timings["attribution"] = time.perf_counter() - t2
    return rep


def _coord_name(names: list[str], sizes: list[int], model: nn.Module, i: int) -> str:
    params = dict(model.named_parameters())
    off = 0
    for nm, sz in zip(names, sizes):
        if i < off + sz:
            idx = torch.unravel_index(torch.tensor(i - off), params[nm].shape)
            return f"{nm}[{', '.join(str(int(j)) for j in idx)}]"
        off += sz
    return str(i)
