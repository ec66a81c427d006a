"""Reference constructions for the projection tests, independent of gaugeopt's projector.

Generators are the derivatives of the *finite* gauge actions of :mod:`gaugeopt.transforms`
(``act_qk``, ``act_vo``, ``act_qk_rope``, ``scale_qk_multipliers``, ``scale_vo_multipliers``,
``rescale_lrm_internal``, ``scale_qk_gains``, ``shift_key_bias``, ``trade_value_bias``) at the identity, taken by the complex-step method: on a complex
copy of the model, apply the action with group element ``I + iε·E`` and read
``Im(θ)/ε`` — exact to rounding (no subtractive cancellation, truncation ``O(ε²)`` with
``ε = 1e-30``). Nothing here uses gaugeopt's generator formulas or solvers.

The least-squares reference is paper 004 Algorithm 3 with the Euclidean metric: stack the
generators of a unit (restricted to their support rows), QR with column pivoting, keep the
columns with ``|R_ii| > 1e-10·|R_00|``, and project with the orthonormal factor.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch
import torch.nn as nn

import gaugeopt
from gaugeopt.transforms import (
    act_qk, act_vo, rescale_lrm_internal, scale_qk_gains, scale_qk_multipliers, scale_vo_multipliers, shift_key_bias,
    trade_value_bias,
)
from gaugeopt.records.latent import act_qk_rope
from gaugeopt.adapters.apply_lrm import LRMLinear
from gaugeopt.records.rope import commutant_basis, orthogonal_commutant_basis, plane_index

EPS = 1e-30
CDT = torch.complex128


@dataclass
class UnitGenerators:
    """The generators of one unit (a site or an LRM layer) of one sector, flattened."""

    sector: str
    unit: str
    names: list[str]  # parameters in the support, model order
    rows: np.ndarray  # flat indices (into the concatenation of `names`) of the support rows
    A: np.ndarray  # (len(rows), m) generator matrix


def _complex_copy(model: nn.Module) -> nn.Module:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return copy.deepcopy(model).to(CDT)


_SAVED: dict[int, dict[str, torch.Tensor]] = {}


def _images(mc: nn.Module, apply, cand: list[str]) -> dict[str, torch.Tensor]:
    """``{name: Im(θ)/ε}`` after ``apply()`` on the complex model, which is then restored.

    ``cand``: the parameters the action may touch (others are not read)."""
    params = _SAVED.setdefault(id(mc), {"__params__": dict(mc.named_parameters())})["__params__"]
    saved = _SAVED[id(mc)]
    with torch.no_grad():
        for n in cand:
            saved.setdefault(n, params[n].detach().clone())
        apply()
        out = {}
        for n in cand:
            im = params[n].detach().imag
            if bool(im.any()):
                out[n] = im / EPS
                params[n].copy_(saved[n])
    return out


def _one(n: int, d: int, j: int, E: torch.Tensor) -> torch.Tensor:
    A = torch.eye(d, dtype=CDT).repeat(n, 1, 1)
    A[j] = A[j] + 1j * EPS * E.to(CDT)
    return A


def generator_images(
    model: nn.Module, sector: str, prefix: str = "", groups: str = "all"
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """``[(unit, {name: image})]`` for a basis of ``sector``'s Lie algebra, by complex step.

    Only units (attention sites, LRM layers) whose name starts with ``prefix``; with
    ``groups="ends"`` only the first and the last KV group of each site (KV groups touch
    disjoint entries, so least squares decouples over them)."""

    def kv_groups(s):
        return range(s.h_kv) if groups == "all" else sorted({0, s.h_kv - 1})

    mc = _complex_copy(model)
    sites = [s for s in gaugeopt.find_attention(mc) if s.name.startswith(prefix)]
    out = []
    if sector == "qk":
        for s in sites:
            cand = s.parameter_names()
            for j in kv_groups(s):
                basis = orthogonal_commutant_basis(s.rope, s.d_k) if s.qk_orthogonal else commutant_basis(s.rope, s.d_k)
                for E in basis:
                    out.append((s.name, _images(mc, lambda s=s, j=j, E=E: act_qk(s, _one(s.h_kv, s.d_k, j, E)), cand)))
    elif sector == "qk_rope":  # multi-head latent attention: one factor for every head against the shared key
        for s in sites:
            if s.latent is None:
                continue
            cand = s.parameter_names()
            r = s.latent.r
            for E in commutant_basis(s.latent.rope, r):
                out.append((s.name, _images(mc, lambda s=s, E=E: act_qk_rope(s, _one(1, r, 0, E)), cand)))
    elif sector == "vo":
        for s in sites:
            cand = s.parameter_names()
            for j in kv_groups(s):
                for a in range(s.d_v):
                    for b in range(s.d_v):
                        E = torch.zeros(s.d_v, s.d_v, dtype=torch.float64)
                        E[a, b] = 1.0
                        out.append((s.name, _images(mc, lambda s=s, j=j, E=E: act_vo(s, _one(s.h_kv, s.d_v, j, E)), cand)))
    elif sector == "lrm_qk":
        for s in sites:
            cand = s.parameter_names()
            if s.q.row_mult is None:
                continue
            pid = plane_index(s.rope, s.d_k)
            for j in kv_groups(s):
                for m in range(int(pid.max()) + 1):
                    delta = torch.ones(s.h_kv, s.d_k, dtype=CDT)
                    delta[j, pid == m] = 1 + 1j * EPS
                    out.append((s.name, _images(mc, lambda s=s, d=delta: scale_qk_multipliers(s, d), cand)))
    elif sector == "lrm_vo":
        for s in sites:
            cand = s.parameter_names()
            if s.v.row_mult is None:
                continue
            for j in kv_groups(s):
                for c in range(s.d_v):
                    e = torch.ones(s.h_kv, s.d_v, dtype=CDT)
                    e[j, c] = 1 + 1j * EPS
                    out.append((s.name, _images(mc, lambda s=s, e=e: scale_vo_multipliers(s, e), cand)))
    elif sector == "qk_gain":
        for s in sites:
            if s.qk_norm is None:
                continue
            cand = s.parameter_names()
            pair = s.pair("qk_gain")
            pid = plane_index(pair.rope, s.d_k)
            for j in range(pair.groups):
                for m in range(int(pid.max()) + 1):
                    delta = torch.ones(pair.groups, s.d_k, dtype=CDT)
                    delta[j, pid == m] = 1 + 1j * EPS
                    out.append((s.name, _images(mc, lambda s=s, d=delta: scale_qk_gains(s, d), cand)))
    elif sector in ("key_bias", "value_bias"):
        action = shift_key_bias if sector == "key_bias" else trade_value_bias
        for s in sites:
            if sector not in s.bias_kinds:
                continue
            cand = s.parameter_names()
            width = len(s.bias_sector(sector).channels)
            for j in kv_groups(s):
                for c in range(width):
                    delta = torch.zeros(s.h_kv, width, dtype=CDT)
                    delta[j, c] = 1j * EPS
                    out.append((s.name, _images(mc, lambda s=s, d=delta, a=action: a(s, d), cand)))
    elif sector == "lrm_internal":
        for name, m in mc.named_modules():
            if not isinstance(m, LRMLinear) or not name.startswith(prefix):
                continue
            cand = [f"{name}.{n}" for n, _ in m.named_parameters()]
            nb = len(m.split_sizes)
            for rho in range(m.out_features):
                t = torch.ones(m.out_features, dtype=CDT)
                t[rho] = 1 + 1j * EPS
                s = [torch.ones(m.in_features, dtype=CDT) for _ in range(nb)]
                out.append((name, _images(mc, lambda m=m, t=t, s=s: rescale_lrm_internal(m, t, s), cand)))
            for k in range(nb):
                for kap in range(m.in_features):
                    t = torch.ones(m.out_features, dtype=CDT)
                    s = [torch.ones(m.in_features, dtype=CDT) for _ in range(nb)]
                    s[k][kap] = 1 + 1j * EPS
                    out.append((f"{name}[{k}]", _images(mc, lambda m=m, t=t, s=s: rescale_lrm_internal(m, t, s), cand)))
    else:
        raise KeyError(sector)
    _SAVED.pop(id(mc), None)
    return out


def flatten(model: nn.Module, tensors: dict[str, torch.Tensor], names: list[str] | None = None, shapes=None) -> np.ndarray:
    """Concatenate ``tensors[name]`` (zeros where missing) over ``names`` into one float64 vector."""
    shapes = shapes or {n: p.shape for n, p in model.named_parameters()}
    names = names or list(shapes)
    parts = []
    for n in names:
        t = tensors.get(n)
        parts.append(np.zeros(int(np.prod(shapes[n]))) if t is None else t.detach().double().reshape(-1).numpy())
    return np.concatenate(parts)


def unit_generators(imgs: list, model: nn.Module, sector: str, merge_units: bool = False) -> list[UnitGenerators]:
    """Generator matrices per unit (or one for the whole sector with ``merge_units``) from
    :func:`generator_images`' output."""
    order = [n for n, _ in model.named_parameters()]
    by_unit: dict[str, list] = {}
    for unit, img in imgs:
        unit = unit.split("[")[0] if not merge_units else "all"
        by_unit.setdefault(unit, []).append(img)
    result = []
    for unit, lst in by_unit.items():
        names = [n for n in order if any(n in img for img in lst)]
        shapes = {n: p.shape for n, p in model.named_parameters()}
        cols = np.stack([flatten(model, img, names, shapes) for img in lst], axis=1)
        rows = np.nonzero(np.abs(cols).max(axis=1) > 0)[0]
        result.append(UnitGenerators(sector, unit, names, rows, cols[rows]))
    return result


def ls_vertical(A: np.ndarray, u: np.ndarray, tol: float = 1e-10) -> tuple[np.ndarray, int]:
    """Euclidean projection of ``u`` onto the column span of ``A`` (QR with pivoting) and the rank."""
    if A.shape[1] == 0:
        return np.zeros_like(u), 0
    Q, R, _ = scipy.linalg.qr(A, mode="economic", pivoting=True)
    d = np.abs(np.diag(R))
    rank = int((d > tol * d[0]).sum()) if d.size and d[0] > 0 else 0
    Qr = Q[:, :rank]
    return Qr @ (Qr.T @ u), rank


def random_field(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters()}


def norm(t: dict[str, torch.Tensor]) -> float:
    return float(sum(float(x.double().square().sum()) for x in t.values() if x is not None)) ** 0.5
