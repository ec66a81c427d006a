"""What the flat-direction meter reports (:func:`gaugeopt.flat.meter.flat_directions`), and the one
numerical kernel it shares with the attribution of the null space to sectors
(:mod:`gaugeopt.flat.attribution`): :func:`r_factor`, the triangular factor of ``J @ V`` accumulated over row
chunks of ``J``.

Kept apart from :mod:`gaugeopt.flat.meter`, which runs the attribution, so that the attribution can read the
report's types without importing the meter back.

Example:
    >>> import torch
    >>> from gaugeopt.flat.report import r_factor
    >>> J, V = torch.randn(50, 6, dtype=torch.float64), torch.linalg.qr(torch.randn(6, 3, dtype=torch.float64)).Q
    >>> R = r_factor(J, V)
    >>> bool(torch.allclose(R.T @ R, (J @ V).T @ (J @ V)))
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gaugeopt.flat.cost import chunk_rows

__all__ = ["FlatReport", "SectorRow", "r_factor"]


@dataclass
class SectorRow:
    """One line of the attribution (:mod:`gaugeopt.flat.attribution`).

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
        float32: for a family expected exact whose finite change is float32 rounding (≤ 1e-5) in a model
            that computes a step in float32: that step (``""`` otherwise). Such a family is exact in
            float64 arithmetic; the float32 step hides it from the measured null space.
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
    float32: str = ""


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
                why = (f"EXACT UP TO FLOAT32 ROUNDING ({r.float32}): {r.note}" if r.float32 else
                       f"EXPECTED EXACT BUT IS NOT: {r.note}" if r.expected else f"not a symmetry: {r.note}")
                out.append(f"{r.name:<20}{r.generators:>6}{r.dim:>6}{r.in_null:>8}{_e(r.max_sin):>10}{_e(r.leak):>10}"
                           f"{_e(r.finite):>10}{'':>22}  {why}; flattest direction sigma/sigma_max {_e(r.sigma_perp)}")
        limited = [r for r in self.near_flat if r.float32]
        if limited:
            out.append(f"float32-limited: {sum(r.dim for r in limited):,} directions of exact symmetries "
                       f"({', '.join(r.name for r in limited)}) are moved only by float32 rounding, so the measured null "
                       "space does not contain them and the nullity is a lower bound; measure with the float32 step "
                       "computed in float64 (flat_directions(..., forward_context=...)) to see them")
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


# ---------------------------------------------------------------------- inputs and progress


def r_factor(J: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``R`` with ``RᵀR = (JV)ᵀ(JV)`` — the triangular factor of ``J @ V`` (its singular values and right
    singular vectors are ``J @ V``'s), accumulated over row chunks of ``J`` so that ``J @ V`` is never
    formed whole: ``R ← qr([R; J_c V])``, backward stable like a QR of the whole product."""
    R = V.new_zeros(0, V.shape[1])
    step = max(chunk_rows(V.shape[1]), V.shape[1])
    for s in range(0, J.shape[0], step):
        R = torch.linalg.qr(torch.cat([R, J[s:s + step] @ V]), mode="r").R
    return R
