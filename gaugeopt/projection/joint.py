"""Joint projection onto the sum of overlapping sector families.

``qk``, ``vo``, ``lrm_qk``, ``lrm_vo``, ``qk_gain`` and ``qk_rope`` touch disjoint parameter
entries, so their spans are mutually orthogonal and projecting them one after the other is
exactly the projection onto their sum; so do ``key_bias`` and ``value_bias`` between them. The
families (:data:`FAMILIES`) overlap one another: the bias sectors share ``b̄_K`` with ``qk`` and
``b̄_V`` with ``vo``, and ``lrm_internal`` overlaps all but ``qk_gain`` (it moves ``W̄``, ``b̄`` and
the multipliers). :func:`components` splits the requested sectors into groups that share no
entry (``{qk, key_bias}``, ``{vo, value_bias}``, or everything with ``lrm_internal``), each
projected on its own.

**Inside a group of several families** (:func:`joint_solve`) the last family is eliminated
exactly and the others' parts are solved for together: writing the vertical part as
``a_1 + … + a_k`` (``a_i ∈ V_i``), ``a_k = P_k(u − s)`` with ``s = a_1 + … + a_{k−1}``, and
``x = (a_1, …, a_{k−1})`` solves the normal equations of ``min ‖(I − P_k)(u − s)‖²``::

    P_i (I − P_k) s = P_i (I − P_k) u        (i < k)

— symmetric positive semi-definite on ``V_1 × … × V_{k−1}`` (for two families
``S = P_1(I − P_2)P_1``, eigenvalues ``sin²`` of the principal angles; intersections are its
consistent null space). They are solved by the one conjugate-gradient loop of the package
(:func:`gaugeopt.projection.cg.pcg`), restarted on the **true residual** ``r_i = P_i(u − s − a_k)``,
which decides: the solve stops when ``‖r‖ ≤ joint_tol·‖u‖`` (CG's own recursive residual stops an
inner run at half that, a margin for rounding). The true residual is also the certificate: the
result differs from ``u`` by a sum of generators, is exactly orthogonal to ``V_k`` and to each
``V_i`` up to ``‖r_i‖``, which characterises the exact joint projection (``info["joint_residual"]``).
In ``"approx"`` mode the joint CG runs ``approx_iters`` iterations on exact sector projections
(each iteration only removes more).

**Redundant families.** The diagonal multiplier gauges are redundant beside ``lrm_internal``:
``lrm_qk`` generators are ``qk`` generators (diagonal ``X``) plus ``lrm_internal`` row rescalings
of the Q and K blocks (likewise ``lrm_vo``), so with ``qk`` (``vo``) and ``lrm_internal`` both
requested they are left out (:data:`REDUNDANT`) — same span, better conditioned (``lrm_qk`` and
``lrm_internal`` alone are nearly parallel when the multipliers dominate the rows of ``W̄``).
``lrm_internal`` units outside the other families' support (an MLP's LRM layers) are orthogonal to
everything else and are projected once, outside the joint CG.

**``{qk, key_bias}`` in closed form** (:func:`qk_with_key_bias`): the key bias is a coordinate
subspace ``E``, and ``(I − P_E)`` of the ``qk`` sector is the ``qk`` sector at ``b̄_K = 0`` there, so
``P = P_E + P_{(I−P_E)V_qk}(I − P_E)`` is one ``qk`` projection at a shifted point; it is used
whenever no coefficients are asked for.

Example:
    >>> from gaugeopt.projection.joint import components
    >>> components(("qk", "vo", "key_bias"))  # qk and key_bias share b̄_K: one joint group
    [[['vo']], [['qk'], ['key_bias']]]
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from gaugeopt.projection.cg import HostScalars, pcg
from gaugeopt.projection.context import Context, names_of, vertical_family
from gaugeopt import sectors

__all__ = ["FAMILIES", "OVERLAPPING", "REDUNDANT", "components", "qk_with_key_bias", "joint_component", "joint_solve"]

# What the joint projection needs to know about the sectors is derived from the registry
# (gaugeopt.sectors): two sectors share parameter entries when the roles their ProjectionRule
# moves intersect; FAMILIES are first-fit groups of mutually disjoint sectors in registration order,
# with the sectors marked ``last`` (they overlap every other family) in a family of their own at the end;
# REDUNDANT maps a sector to the one beside which (and the ``last`` family) its span is redundant.
_DERIVED: dict = {"generation": None}


def _projectable() -> list:
    return [s for s in sectors.sectors() if s.projection is not None]


def _derived() -> dict:
    if _DERIVED["generation"] != sectors.generation():
        secs = _projectable()
        moves = {s.name: s.projection.moves for s in secs}
        shares = {frozenset((a, b)) for a in moves for b in moves if a != b and moves[a] & moves[b]}
        families: list[list[str]] = []
        for s in secs:
            if s.projection.last:
                continue
            fam = next((f for f in families if all(frozenset((s.name, t)) not in shares for t in f)), None)
            if fam is None:
                families.append(fam := [])
            fam.append(s.name)
        last = [s.name for s in secs if s.projection.last]
        _DERIVED.update(generation=sectors.generation(), shares=shares,
                        families=tuple(tuple(f) for f in families) + ((tuple(last),) if last else ()),
                        overlapping=tuple(last),
                        redundant={s.name: s.projection.redundant_with for s in secs if s.projection.redundant_with})
    return _DERIVED


def __getattr__(name: str):
    """``FAMILIES``, ``OVERLAPPING`` and ``REDUNDANT``, derived from the sector registry when read."""
    key = {"FAMILIES": "families", "OVERLAPPING": "overlapping", "REDUNDANT": "redundant"}.get(name)
    if key is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _derived()[key]


def components(secs: Sequence[str]) -> list[list[list[str]]]:
    """The requested sectors as connected components of the sharing relation, each split into the
    :data:`FAMILIES` it meets (in that order): one family — a direct projection; several — a joint one."""
    d = _derived()
    comps: list[set[str]] = []
    for s in secs:
        joined = [c for c in comps if any(frozenset((s, t)) in d["shares"] for t in c)]
        merged = {s}.union(*joined)
        comps = [c for c in comps if c not in joined] + [merged]
    out = []
    for c in comps:
        fams = [[s for s in fam if s in c] for fam in d["families"]]
        out.append([f for f in fams if f])
    return out


def qk_with_key_bias(ctx: Context, impl: dict, work: dict) -> dict[str, torch.Tensor]:
    """The projection onto ``span(qk) + E`` in closed form, ``E`` the key-bias coordinates (non-rotary
    channels of ``b̄_K``): ``P = P_E + P_{(I−P_E)V_qk}(I − P_E)``. A ``qk`` generator's component
    in ``E`` is ``−X̃ b̄_K`` on those channels, and ``X̃`` (in the RoPE commutant, twisted by a
    diagonal) never mixes rotary and non-rotary channels, so ``(I − P_E)V_qk`` is the ``qk`` sector
    at θ with ``b̄_K = 0`` there — one ``qk`` projection at that point instead of a joint CG.
    (Used when no coefficients are asked for; ``decompose`` takes the joint CG, whose
    coefficients are the ones at θ.)"""
    kb, qk = impl["key_bias"], impl["qk"]
    at = dict(ctx.at or {})
    u = dict(work)
    for b in kb.secs:
        name, idx = b.bias.name, list(b.channels)
        if name not in u or u[name] is work[name]:
            u[name] = work[name].clone()
            at[name] = ctx.weight(name).clone()
        b.bias.view(at[name])[:, idx] = 0
        b.bias.view(u[name])[:, idx] = 0
    shifted = ctx.moved(at)
    vert = vertical_family(shifted, [(qk, qk.prepare(shifted))], u)
    for key in ("cg_iterations", "cg_residual"):
        ctx.info[key] = max(ctx.info[key], shifted.info[key])
    for n, v in vertical_family(ctx, [(kb, kb.prepare(ctx))], work).items():
        vert[n] = vert[n] + v if n in vert else v
    return vert


def joint_component(ctx: Context, impl: dict, families: list[list[str]], work: dict, coeffs, info: dict, *,
                    tol: float, maxiter: int, strict: bool) -> dict[str, torch.Tensor]:
    """The vertical part of ``work`` in one component of overlapping families (:func:`components`).

    Args:
        impl: ``{sector: sector object}``.
        tol, maxiter: the joint CG's stopping rule (``joint_tol``; ``joint_maxiter``, or
            ``approx_iters`` in ``"approx"`` mode).
        strict: warn when the solve stops above ``tol`` (not in ``"approx"`` mode, where stopping
            early is the point).
    """
    d = _derived()
    last = [s for s in families[-1] if s in d["overlapping"]]
    if last:  # span(lrm_qk) ⊂ span(qk) + span(lrm_internal) (likewise vo): same span, better conditioned
        families = [[s for s in fam if d["redundant"].get(s) not in fam] for fam in families]
    prepared = [[(impl[s], impl[s].prepare(ctx)) for s in fam if s not in last] for fam in families]
    outer = None
    if last:
        assert len(last) == 1, f"one sector marked last per projection, not {last}"
        # lrm_internal units outside the other families' support (the MLP's LRM layers) are orthogonal
        # to everything else: projected once, outside the joint CG, whose vectors then span attention only
        others = {n for fam in families[:-1] for s in fam for n in names_of(impl[s])}
        inner, outer = impl[last[0]].split(others)
        prepared[-1] = [(inner, inner.prepare(ctx))] if inner.units() else []
    prepared = [fam for fam in prepared if fam]
    names = dict.fromkeys(n for fam in prepared for sec, _ in fam for n in names_of(sec))
    if len(prepared) > 1:
        vert, info_j = joint_solve(ctx, prepared, {n: work[n] for n in names}, coeffs, tol=tol, maxiter=maxiter,
                                   warn=ctx.warn if strict else None)
        info["joint_iterations"] = max(info["joint_iterations"], info_j["joint_iterations"])
        info["joint_residual"] = max(info["joint_residual"], info_j["joint_residual"])
    else:
        vert = vertical_family(ctx, prepared[0], work, coeffs=coeffs)
    if outer is not None and outer.units():
        vert.update(vertical_family(ctx, [(outer, outer.prepare(ctx))], work, coeffs=coeffs))
    return vert


# ---------------------------------------------------------------------- the vectors of the joint CG
class _Flat:
    """The field's entries as one flat buffer (parameters on one device): the CG vector operations are
    single in-place kernels, the sectors see views."""

    def __init__(self, u: dict[str, torch.Tensor]) -> None:
        self.names = list(u)
        self.sizes, self.shapes = [u[n].numel() for n in self.names], [u[n].shape for n in self.names]
        self.u = torch.cat([u[n].reshape(-1) for n in self.names])

    def new(self) -> torch.Tensor:
        return torch.zeros_like(self.u)

    def entries(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(shape) for n, t, shape in zip(self.names, flat.split(self.sizes), self.shapes)}

    def axpy_(self, a: float, x, y):  # y += a·x
        return y.add_(x, alpha=a)

    def xpby_(self, x, b: float, y):  # y = x + b·y
        return y.mul_(b).add_(x)

    def copy_(self, dst, src):
        return dst.copy_(src)

    def zero_(self, x):
        return x.zero_()

    def clone(self, x):
        return x.clone()

    def dot(self, x, y) -> float:
        return float(torch.dot(x, y))


class _Dicts:
    """The same operations on ``{name: tensor}`` (parameters on several devices)."""

    def __init__(self, u: dict[str, torch.Tensor]) -> None:
        self.names = list(u)
        self.u = {n: u[n] for n in self.names}

    def new(self):
        return {n: torch.zeros_like(self.u[n]) for n in self.names}

    def entries(self, x):
        return x

    def axpy_(self, a: float, x, y):
        for n in self.names:
            y[n].add_(x[n], alpha=a)
        return y

    def xpby_(self, x, b: float, y):
        for n in self.names:
            y[n].mul_(b).add_(x[n])
        return y

    def copy_(self, dst, src):
        for n in self.names:
            dst[n].copy_(src[n])
        return dst

    def zero_(self, x):
        for t in x.values():
            t.zero_()
        return x

    def clone(self, x):
        return {n: t.clone() for n, t in x.items()}

    def dot(self, x, y) -> float:
        return sum(float((x[n] * y[n]).sum()) for n in self.names)


class _Blocks:
    """The joint CG's space (:class:`gaugeopt.projection.cg.Space`): one vector per family; inner
    products summed over the families on the host in float64, one system (:class:`~gaugeopt.projection.cg.HostScalars`)."""

    scalars = HostScalars

    def __init__(self, vec) -> None:
        self.vec = vec

    def dot(self, xs, ys) -> float:
        return sum(self.vec.dot(x, y) for x, y in zip(xs, ys))

    def norm(self, xs) -> float:
        return math.sqrt(self.dot(xs, xs))

    def axpy_(self, a: float, xs, ys, value: float = 1.0) -> None:
        for x, y in zip(xs, ys):
            self.vec.axpy_(value * a, x, y)

    def xpby_(self, xs, b: float, ys) -> None:
        for x, y in zip(xs, ys):
            self.vec.xpby_(x, b, y)

    def clone(self, xs):
        return [self.vec.clone(x) for x in xs]


def joint_solve(ctx: Context, families, u: dict[str, torch.Tensor], coeffs, *, tol: float, maxiter: int,
                warn: Callable[[str], None] | None) -> tuple[dict[str, torch.Tensor], dict]:
    """Projection onto ``V_1 + … + V_k`` for overlapping families (``[[(sector, prepared)]]``) with
    exact projectors ``P_i`` (the module docstring: the last family eliminated, conjugate gradients
    on the others restarted on the true residual, which decides).

    Returns:
        ``({name: vertical part}, {"joint_iterations", "joint_residual"})``; with ``coeffs``, each
        unit's Lie-algebra coordinates summed into it.
    """
    *firsts, last = families
    # P(fam, x, out) zeroes only the tensors the family writes: every buffer below holds the images of
    # one family only (r_i, Sp_i, delta_i, a_i of family i; tmp of the last), so it is zero elsewhere
    support = {id(fam): list(dict.fromkeys(n for sec, _ in fam for n in names_of(sec))) for fam in families}
    vec = _Flat(u) if len({t.device for t in u.values()}) == 1 else _Dicts(u)

    def P(fam, x, out, c=None):
        """``out ← `` the family's vertical part of ``x`` (``out`` zero outside the family's tensors)."""
        o = vec.entries(out)
        for n in support[id(fam)]:
            o[n].zero_()
        vertical_family(ctx, fam, vec.entries(x), coeffs=c, out=o)
        return out

    u = vec.u
    k = len(firsts)
    w, tmp = vec.new(), vec.new()  # work buffers
    a, r, Sp, delta = ([vec.new() for _ in range(k)] for _ in range(4))

    def reduced(xs):  # Sp_i ← P_i (I − P_k) Σ_j x_j   (w, tmp used)
        vec.copy_(w, xs[0])
        for x in xs[1:]:
            vec.axpy_(1.0, x, w)
        vec.axpy_(-1.0, P(last, w, tmp), w)
        for fam, o in zip(firsts, Sp):
            P(fam, w, o)
        return Sp

    space = _Blocks(vec)
    unorm = math.sqrt(vec.dot(u, u)) or 1.0
    iters = 0
    while True:
        vec.copy_(w, u)  # r_i ← P_i (I − P_k)(u − s): the true residual of the reduced system, per family
        for x in a:
            vec.axpy_(-1.0, x, w)
        vec.axpy_(-1.0, P(last, w, tmp), w)
        for fam, o in zip(firsts, r):
            P(fam, w, o)
        res = math.sqrt(space.dot(r, r)) / unorm
        if res <= tol or iters >= maxiter:
            break
        for d_ in delta:
            vec.zero_(d_)
        # the true residual above decides; CG's recursive one stops at half the tolerance (a margin for rounding)
        done, _, _ = pcg(space, reduced, delta, r, tol=0.5 * tol, scale=unorm, maxiter=maxiter - iters)
        iters += done
        for a_, d_ in zip(a, delta):
            vec.axpy_(1.0, d_, a_)
    if res > tol and warn is not None:
        warn(
            f"gauge projection (joint): conjugate gradients stopped after {iters} iterations with {res:.2e} of "
            f"‖u‖ still vertical (joint_tol={tol:.1e}); the sector families are nearly parallel here, raise joint_maxiter"
        )
    if coeffs is None:  # the last residual check left a_k = P_k(u − s) in tmp: the result is s + a_k
        vert = vec.copy_(w, tmp)
        for x in a:
            vec.axpy_(1.0, x, vert)
        return vec.entries(vert), {"joint_iterations": iters, "joint_residual": res}
    vert = vec.new()
    for fam, x, buf in zip(firsts, a, Sp):  # coefficients in Lie-algebra coordinates; x ∈ V_i up to rounding
        vec.axpy_(1.0, P(fam, x, buf, coeffs), vert)
    vec.copy_(w, u)
    vec.axpy_(-1.0, vert, w)
    vec.axpy_(1.0, P(last, w, tmp, coeffs), vert)
    return vec.entries(vert), {"joint_iterations": iters, "joint_residual": res}
