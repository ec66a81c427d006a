"""Gauge-orthogonal projection: remove the vertical (pure-gauge) part of a vector field.

A vector field ``u`` — a gradient, an optimizer update, an Adam moment — is given per
parameter, as ``{name: tensor}`` (names as in ``model.named_parameters()``) or as a list
aligned with ``named_parameters()``. Its *vertical* part is its Frobenius-orthogonal
projection onto the span of the gauge generators at the current weights θ (docs/projection.md,
paper 000 Remark 51, paper 004 §5); the *horizontal* part ``u − u_vert`` is what changes
the function. The gradient of a gauge-invariant loss is already horizontal (paper 000
Prop. 38); Adam's per-coordinate scaling and weight decay are not gauge-equivariant, so an
optimizer *update* has a vertical part.

Sectors (each projectable on its own; names as in :data:`SECTORS`):

================  ==============================================  ==============================
sector            generators (per KV group / channel / block)      solver
================  ==============================================  ==============================
``qk``            ``GL(d_k)`` on ``[W̄_Q|b̄_Q]``, ``[W̄_K|b̄_K]``;      Sylvester (batched eigh);
                  RoPE commutant ``a·I + b·J`` per plane           closed form per plane
``vo``            ``GL(d_v)`` on ``[W̄_V|b̄_V]``, ``W̄_O`` columns      Sylvester (batched eigh)
``lrm_qk``        ``r_Q`` vs ``r_K`` per channel / RoPE plane       closed form
``lrm_vo``        ``r_V`` vs ``c_O`` per channel                    closed form
``lrm_internal``  ``r·W̄·c`` rescalings of every LRM layer           CG on the Schur complement
``qk_gain``       QK-norm gains ``g_q`` vs ``g_k`` per RoPE plane      closed form
                  (or channel), per layer or KV group
``key_bias``      ``b̄_K`` on the non-rotary channels                   closed form (coordinates)
``value_bias``    ``b̄_V`` traded against ``b̄_O`` through ``W_O``       Cholesky, ``h_kv·d_v`` per layer
``qk_rope``       multi-head latent attention: the RoPE commutant    closed form per plane
                  on every head's RoPE query rows against the
                  one key they share (docs/mla.md)
================  ==============================================  ==============================

The bias sectors (:mod:`gaugeopt.structure.bias`, :mod:`gaugeopt.projection.bias`) are present where
the biases are: ``key_bias`` needs a key bias on channels RoPE does not rotate (none under full
RoPE or a QK-norm), ``value_bias`` value and output biases.

**Multi-head latent attention** (``site.latent``, docs/mla.md): ``qk`` and ``vo`` are the part without
RoPE (per head) and ``qk_rope`` the RoPE part; its latent sectors (``latent_rotation``, ``latent_gain``)
are symmetries that the projector does not remove — like the residual stream's norm sectors, they are
counted, measured and certified, not projected.

**QK-norm sites** (``site.qk_norm``) have no ``qk`` and no ``lrm_qk`` sector — neither is a
symmetry once queries and keys are normalised — and a ``qk_gain`` sector instead
(docs/qk_norm.md); their ``vo``, ``lrm_vo`` and ``lrm_internal`` sectors are unchanged. ``"auto"``
picks, for each site, what it has. For a LayerNorm QK-norm (timm) the gain gauge is what is
projected; the further directions a LayerNorm leaves invisible (its key bias, a query-bias shift,
the mean direction of each head's rows, one centred rotation) are not. A site that keeps only the
orthogonal part of its Q/K gauge (``site.qk_orthogonal``: Llama 4's weight-free L2 norm) projects
only the rotation of each RoPE plane in its ``qk`` sector (``d_k/2`` per KV group); with channels RoPE
does not rotate it has no projected Q/K sector (not implemented; no model in use has that layout).

GQA ties one ``X`` per KV group to all its query heads; biases travel with their rows;
under LRM the dense gauges act through ``W̄`` (:mod:`gaugeopt.projection.dense`). With learnable
multipliers and GQA the ``qk``/``vo`` normal equations, and ``lrm_internal`` always, are solved by
preconditioned CG to the relative residual ``cg_tol``; everything else is direct.

**Joint projection.** ``qk``, ``vo``, ``lrm_qk``, ``lrm_vo`` and ``qk_gain`` touch disjoint parameter
entries, so their spans are mutually orthogonal and projecting them one after the other is
exactly the projection onto their sum; so do ``key_bias`` and ``value_bias`` between them. The
families overlap one another: the bias sectors share ``b̄_K`` with ``qk`` and ``b̄_V`` with ``vo``, and
``lrm_internal`` overlaps all but ``qk_gain`` (it moves ``W̄``, ``b̄`` and the multipliers). The
requested sectors are split into groups that share no entry (``{qk, key_bias}``, ``{vo,
value_bias}``, or everything with ``lrm_internal``), each projected on its own; inside a group of
several families the last one is eliminated exactly and the others' parts are solved for together
by conjugate gradients on the normal equations ``P_i(I − P_k)Σ_j a_j = P_i(I − P_k)u`` — for two
families ``P1(I − P2)P1`` (see :meth:`GaugeProjector._joint`) — stopped when the part of the result
still in the other families' spans is ``≤ joint_tol·‖u‖`` (it is exactly orthogonal to the last):
the result differs from ``u`` by a sum of generators and is orthogonal to all of them to that
tolerance, which characterises the exact joint projection (``info["joint_residual"]``).
``{qk, key_bias}`` has a closed form instead (the key bias is a coordinate subspace ``E``, and
``(I − P_E)`` of the ``qk`` sector is the ``qk`` sector at ``b̄_K = 0`` there:
:meth:`GaugeProjector._qk_with_key_bias`), used whenever no coefficients are asked for. The
``{vo, value_bias}`` group takes 10–25 CG iterations of its two sectors in float64 — about nine
times the head gauges on a GPT-2 layer, for about 3% of an AdamW update's norm — so ``"auto"``
(every sector the model has) leaves ``value_bias`` out (:data:`OPT_IN`) and ``"all"`` includes it;
``key_bias`` costs nothing extra and is in ``"auto"``. The diagonal multiplier gauges are redundant there:
``lrm_qk`` generators are ``qk`` generators (diagonal ``X``) plus ``lrm_internal`` row rescalings
of the Q and K blocks (likewise ``lrm_vo``), so with ``qk`` (``vo``) and ``lrm_internal`` requested
they are left out of the joint solve — same span, better conditioned (``lrm_qk`` and
``lrm_internal`` alone are nearly parallel when the multipliers dominate the rows of ``W̄``).

**Modes** (:data:`MODES`, checked by :func:`check_mode`). ``"exact"``: the Sylvester solve.
``"approx"``: a fixed number (``approx_iters``) of conjugate-gradient steps on the same normal
equations, preconditioned by one ADI step (two Cholesky factorisations, no eigendecomposition),
warm-started from the best multiple of the previous call's coefficients. CG minimises the norm of the vertical part it leaves behind
over a space containing its start, so ``"approx"`` never leaves more vertical part than the
field had (:func:`~gaugeopt.projection.cg.batched_pcg`); ``last_info`` reports the
relative residual of the normal equations (``approx_residual``) and an estimate of the vertical
fraction left (``approx_left_estimate``, 0-dim tensors: no host synchronisation until read). A
joint projection in ``"approx"`` mode runs ``approx_iters`` iterations of the joint CG on exact
sector projections (each iteration only removes more). ``"paper000"``: paper 000 Algorithm 2
(two one-sided pseudo-inverse estimates, symmetrised) for the dense ``qk``/``vo`` blocks — exact
when the Gram matrices are identities; on generic weights it can *add* vertical part (measured
on a GPT-2-shaped layer: 0.204 → 0.357 of ``‖u‖``, an output 175 % away from the exact one),
so it is there to reproduce the paper, not to train with. Closed forms (RoPE planes, diagonal
gauges) and ``lrm_internal`` (CG to ``cg_tol``) are exact in every mode.

**Pseudo-inverse rule.** See :mod:`gaugeopt.projection.sylvester`: eigenvalues of a Gram operator below
``rtol ×`` the largest of their block are non-directions (coefficient 0), never divided by.

**Cost** per KV group: ``O(k·n²·m)`` for the Gram and cross terms (``k`` heads of the group,
``n = d_k`` or ``d_v``, ``m`` the model width) plus ``O(n³)`` for the eigendecompositions and the
solve, all batched over every group of every layer in one call.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.projection.projector import GaugeProjector
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, rope="split_half")).double()
    >>> u = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    >>> proj = GaugeProjector(model, "all")
    >>> proj.sectors  # full RoPE: no key-bias sector; the value bias trades with the output bias
    ('qk', 'vo', 'value_bias')
    >>> GaugeProjector(model).sectors  # "auto": every sector but the costly value-bias trade
    ('qk', 'vo')
    >>> hor = proj.project(u)
    >>> float(gaugeopt.vertical_fraction(model, hor)) < 1e-12
    True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.kernels import dispatch
from gaugeopt.structure.lrm import LRMLinear
from gaugeopt.projection.bias import BiasShiftSector
from gaugeopt.projection.multipliers import DiagonalSector, InternalSector
from gaugeopt.projection.dense import DenseSector
from gaugeopt.structure.gate import Gate
from gaugeopt.structure.site import AttentionSite, TensorRef
from gaugeopt.structure.registry import find_attention
from gaugeopt.projection.sylvester import default_cg_tol, default_rtol

__all__ = ["SECTORS", "OPT_IN", "MODES", "check_mode", "GaugeProjector", "Decomposition", "horizontal"]

SECTORS = ("qk", "vo", "lrm_qk", "lrm_vo", "lrm_internal", "qk_gain", "key_bias", "value_bias", "qk_rope")
# Sectors "auto" leaves out and "all" includes: the value-bias trade couples V/O to the output bias,
# and projecting {vo, value_bias} jointly costs ~10 CG iterations of the vo sector (~9x the head gauges
# on a GPT-2 layer) for ~3% of an AdamW update's norm (tests/test_bias_sectors.py measures both).
OPT_IN = ("value_bias",)
MODES = ("exact", "approx", "paper000")


def check_mode(mode: str, owner: str = "GaugeProjector") -> None:
    """Raise :class:`GaugeError` unless ``mode`` is one of :data:`MODES` (the one check the
    projector, :class:`gaugeopt.GaugeProjected` and the Lightning callback share)."""
    if mode not in MODES:
        raise GaugeError(f"{owner}: mode={mode!r} is not one of {MODES}")


# Families of mutually disjoint sectors (their projections add up); the families overlap one another.
# The joint projection eliminates the last family present exactly and solves for the others by CG.
_FAMILIES = (("qk", "vo", "lrm_qk", "lrm_vo", "qk_gain", "qk_rope"), ("key_bias", "value_bias"), ("lrm_internal",))
_OVERLAPPING = ("lrm_internal",)
_REDUNDANT = {"lrm_qk": "qk", "lrm_vo": "vo"}  # with lrm_internal present, the key's span lies in the value's + internal

# Which sectors share parameter entries (the rest touch disjoint entries: their spans are orthogonal).
_SHARES = {frozenset(p) for p in (("qk", "key_bias"), ("vo", "value_bias"))} | {
    frozenset(("lrm_internal", s)) for s in ("qk", "vo", "lrm_qk", "lrm_vo", "key_bias", "value_bias", "qk_rope")}


def _components(secs: Sequence[str]) -> list[list[list[str]]]:
    """The requested sectors as connected components of the sharing relation, each split into the
    :data:`_FAMILIES` it meets (in that order): one family — a direct projection; several — a joint one."""
    comps: list[set[str]] = []
    for s in secs:
        joined = [c for c in comps if any(frozenset((s, t)) in _SHARES for t in c)]
        merged = {s}.union(*joined)
        comps = [c for c in comps if c not in joined] + [merged]
    out = []
    for c in comps:
        fams = [[s for s in fam if s in c] for fam in _FAMILIES]
        out.append([f for f in fams if f])
    return out


Tensors = Union[Mapping[str, torch.Tensor], Sequence[Union[torch.Tensor, None]]]


@dataclass
class Decomposition:
    """Result of :meth:`GaugeProjector.decompose`.

    Attributes:
        vertical: ``{name: tensor}`` over the sectors' parameters (compute dtype).
        horizontal: ``u − vertical`` over the same names.
        coefficients: ``{(sector, unit): tensor}`` Lie-algebra coordinates of ``vertical``
            (``X``/``Y`` per KV group as ``(h_kv, n, n)``, ``t`` per diagonal set, ``(x, y)`` per
            LRM block); summed over the sweeps of a joint projection.
        norms: ``{(sector, unit): (‖u_vert‖², ‖u‖²)}`` over the unit's entries (with
            ``decompose(..., norms=True)``; not filled for joint projections).
        info: solver facts: ``cg_iterations``, ``cg_residual``, ``joint_iterations``, ``joint_residual``;
            in ``"approx"`` mode also ``approx_iterations``, ``approx_residual`` and ``approx_left_estimate``.
    """

    vertical: dict[str, torch.Tensor]
    horizontal: dict[str, torch.Tensor]
    coefficients: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    norms: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


class _Ctx:
    """One projection call: the point θ, precision and solver settings."""

    def __init__(self, proj: "GaugeProjector", at: Mapping[str, torch.Tensor] | None) -> None:
        self.proj, self.at = proj, at
        self.dtype, self.rtol, self.mode = proj._dtype_now, proj._rtol_now, proj.mode
        self.cg_tol, self.cg_maxiter = proj._cg_tol_now, proj.cg_maxiter
        self.device = proj._device
        self.info: dict = {"cg_iterations": 0, "cg_residual": 0.0}
        self._cache: dict[str, torch.Tensor] = {}

    def _param(self, name: str) -> torch.Tensor:
        t = self._cache.get(name)
        if t is None:
            src = self.at[name] if (self.at is not None and name in self.at) else self.proj._params[name]
            t = src.detach().to(self.dtype)
            self._cache[name] = t
        return t

    def weight(self, x: TensorRef | str) -> torch.Tensor:
        """Weights at θ, canonical view for a ref, whole tensor for a name (compute dtype)."""
        if isinstance(x, str):
            return self._param(x)
        return x.view(self._param(x.name))

    def note_approx(self, sector: str, iters: int, res: torch.Tensor, left: torch.Tensor) -> None:
        """Truncated CG of ``mode="approx"``: residual and error estimate stay tensors (no sync)."""
        info = self.info
        info["approx_iterations"] = max(info.get("approx_iterations", 0), iters)
        r = res.max() if res.numel() else res.new_zeros(())
        info["approx_residual"] = torch.maximum(info["approx_residual"], r) if "approx_residual" in info else r
        sq = left.square().sum()
        self._left_sq = self._left_sq + sq if hasattr(self, "_left_sq") else sq

    def note_cg(self, sector: str, iters: int, res: float) -> None:
        self.info["cg_iterations"] = max(self.info["cg_iterations"], iters)
        self.info["cg_residual"] = max(self.info["cg_residual"], res)
        if res > self.cg_tol:
            self.proj._warn_once(
                f"gauge projection ({sector}): conjugate gradients stopped after {iters} iterations at relative "
                f"residual {res:.2e} > cg_tol={self.cg_tol:.1e}; raise cg_maxiter"
            )


def _names_of(sec) -> list[str]:
    """Parameter names a sector object touches."""
    if isinstance(sec, DenseSector):
        return list(dict.fromkeys(r.name for r in sec.refs()))
    return sec.param_names()


def _accessor(store: dict[str, torch.Tensor]):
    def acc(x: TensorRef | str) -> torch.Tensor:
        if isinstance(x, str):
            return store[x]
        return x.view(store[x.name])

    return acc


class GaugeProjector:
    """Projects vector fields given per parameter off the gauge directions of ``model``.

    Built once per model (finds the attention sites and the sectors); every call reads the
    *current* weights (or the point ``at=``), so it stays valid while the model trains.

    Args:
        model: the model whose ``named_parameters()`` names the vector field's entries.
        sectors: ``"auto"`` (every sector the model has but ``value_bias``, :data:`OPT_IN`), ``"all"``
            (every one), or a subset of
            :data:`SECTORS`.
        mode: ``"exact"``, ``"approx"`` or ``"paper000"`` (see the module docstring).
        sites: attention sites (default :func:`gaugeopt.find_attention`); with ``sites`` given,
            ``lrm_internal`` covers only the LRM layers those sites read.
        rtol: pseudo-inverse threshold (default ``1000·ε`` of the compute dtype).
        dtype: compute dtype (default float64 for float64 inputs, float32 otherwise).
        cg_tol, cg_maxiter: relative residual and cap of the CG solves (LRM + GQA, ``lrm_internal``);
            default ``cg_tol`` is :func:`~gaugeopt.projection.sylvester.default_cg_tol`
            (``max(10·ε, 1e-13)``).
        joint_tol, joint_maxiter: stopping rule of the alternating joint projection (only
            when ``lrm_internal`` is combined with another sector); default ``joint_tol`` ``1e3·ε``.
        approx_iters: CG steps of ``mode="approx"`` (per dense batch; joint CG iterations of a
            joint projection).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` for the closed-form sectors (``lrm_qk``,
            ``lrm_vo``, ``qk`` of full-rotary RoPE layers) in :meth:`vertical` and :meth:`project`:
            ``"auto"`` runs the fused Triton kernel on CUDA tensors (:mod:`gaugeopt.kernels.dispatch`,
            ``GAUGEOPT_BACKEND``); dense sectors, joint projections, ``at=``, an explicit ``dtype``
            and :meth:`decompose` always run in torch.
    """

    def __init__(
        self,
        model: nn.Module,
        sectors: str | Sequence[str] = "auto",
        mode: str = "exact",
        *,
        sites: Sequence[AttentionSite] | None = None,
        rtol: float | None = None,
        dtype: torch.dtype | None = None,
        cg_tol: float | None = None,
        cg_maxiter: int = 200,
        joint_tol: float | None = None,
        joint_maxiter: int = 500,
        approx_iters: int = 4,
        backend: str = "auto",
        trainable_only: bool = False,
    ) -> None:
        dispatch.requested_backend(backend)  # validates the argument and GAUGEOPT_BACKEND now
        self.backend = backend
        check_mode(mode)
        if not (isinstance(approx_iters, int) and approx_iters >= 1):
            raise GaugeError(f"GaugeProjector: approx_iters={approx_iters!r} must be a positive integer")
        self.model, self.mode, self.approx_iters = model, mode, approx_iters
        self.rtol, self.dtype, self.cg_tol, self.cg_maxiter = rtol, dtype, cg_tol, cg_maxiter
        self.joint_tol, self.joint_maxiter = joint_tol, joint_maxiter
        if not isinstance(trainable_only, bool):
            raise GaugeError(f"GaugeProjector: trainable_only={trainable_only!r} must be True or False")
        self._params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self._order = list(self._params)
        pname = {id(p): n for n, p in self._params.items()}
        self._gate = Gate(model, "GaugeProjector", sites=sites)
        self.sites = self._gate.sites
        lrm_modules = [(n, m) for n, m in model.named_modules() if isinstance(m, LRMLinear)]
        if sites is not None:
            owners = {id(ref.owner) for s in self.sites for _, ref in s.refs()}
            lrm_modules = [(n, m) for n, m in lrm_modules if id(m) in owners or any(id(p) in owners for p in m.parameters())]
        self.frozen: list[str] = []  # (sector, unit) pairs left out because they would move a frozen tensor
        keep = self._trainable if trainable_only else (lambda kind, units, make: units)
        # a layer whose Q/K gauge is only the rotations of its RoPE planes (an L2 Q/K norm, Llama 4) has no dense
        # qk sector when it also has channels RoPE leaves alone (no model in use does; docs/projection.md)
        dense = [s for s in self.sites if s.qk_norm is None and not (s.qk_orthogonal and s.rope.rotary_dim < s.d_k)]
        impl = {
            "qk": DenseSector("qk", keep("qk", dense, lambda u: DenseSector("qk", u)), approx_iters=approx_iters),
            "vo": DenseSector("vo", keep("vo", self.sites, lambda u: DenseSector("vo", u)), approx_iters=approx_iters),
            "lrm_qk": DiagonalSector("lrm_qk", keep("lrm_qk", self.sites, lambda u: DiagonalSector("lrm_qk", u))),
            "lrm_vo": DiagonalSector("lrm_vo", keep("lrm_vo", self.sites, lambda u: DiagonalSector("lrm_vo", u))),
            "lrm_internal": InternalSector(keep("lrm_internal", lrm_modules, lambda u: InternalSector(u, pname)), pname),
            "qk_gain": DiagonalSector("qk_gain", keep("qk_gain", self.sites, lambda u: DiagonalSector("qk_gain", u))),
            "key_bias": BiasShiftSector("key_bias", keep("key_bias", self.sites, lambda u: BiasShiftSector("key_bias", u))),
            "value_bias": BiasShiftSector("value_bias",
                                          keep("value_bias", self.sites, lambda u: BiasShiftSector("value_bias", u))),
            "qk_rope": DenseSector("qk_rope", keep("qk_rope", [s for s in self.sites if s.latent is not None],
                                                   lambda u: DenseSector("qk_rope", u)), approx_iters=approx_iters),
        }
        available = tuple(k for k in SECTORS if impl[k].units())
        if sectors == "all":
            chosen = available
        elif sectors == "auto":
            chosen = tuple(k for k in available if k not in OPT_IN)
        else:
            chosen = (sectors,) if isinstance(sectors, str) else tuple(sectors)
            bad = [s for s in chosen if s not in SECTORS]
            if bad:
                raise GaugeError(f"GaugeProjector: unknown sectors {bad}; valid sectors are {SECTORS}, 'auto' or 'all'")
            missing = [s for s in chosen if s not in available]
            if missing:
                raise GaugeError(
                    f"GaugeProjector: sectors {missing} are not present in this model (it has {available}); "
                    "the lrm_* sectors need learnable multipliers (gaugeopt.apply_lrm); a QK-norm layer has "
                    "'qk_gain' instead of 'qk' and 'lrm_qk' (docs/qk_norm.md); 'key_bias' needs a key bias on "
                    "channels RoPE does not rotate, 'value_bias' value and output biases (gaugeopt.structure.bias)"
                )
            chosen = tuple(dict.fromkeys(chosen))
        self.sectors: tuple[str, ...] = chosen
        self._impl = {k: impl[k] for k in available}
        for k, sec in self._impl.items():
            for n in self._sector_names(k):
                if n not in self._params:
                    raise GaugeError(
                        f"GaugeProjector: sector {k!r} reads parameter {n!r}, which is not in model.named_parameters(); "
                        "were the sites found on another model?"
                    )
                if type(self._params[n]).__name__ == "DTensor":
                    raise GaugeError(
                        f"GaugeProjector: parameter {n!r} is a sharded DTensor; the projector works on whole tensors "
                        "(project before sharding, or gather the parameters)"
                    )
        self._device = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        self._warned: set[str] = set()
        self.last_info: dict = {}

    # ------------------------------------------------------------------ structure
    def _sector_names(self, sector: str) -> list[str]:
        return _names_of(self._impl[sector])

    def param_names(self, sectors: Sequence[str] | None = None) -> list[str]:
        """Names of the parameters the given sectors (default: the chosen ones) touch, in model order."""
        touched = {n for s in self._resolve(sectors) for n in self._sector_names(s)}
        return [n for n in self._order if n in touched]

    def units(self, sector: str) -> list[str]:
        """Unit names of a sector: attention site names, or LRM layer names for ``lrm_internal``."""
        return self._impl[sector].units()

    def _trainable(self, kind: str, units: list, make) -> list:
        """The units (sites, or LRM layers) of sector ``kind`` none of whose tensors is frozen."""
        kept = []
        for u in units:
            try:
                names = _names_of(make([u]))
            except GaugeError:  # the unit has no such sector: nothing to leave out
                kept.append(u)
                continue
            frozen = [n for n in names if n in self._params and not self._params[n].requires_grad]
            if frozen:
                self.frozen.append(f"{kind} of {u.name if hasattr(u, 'name') else u[0]} ({', '.join(frozen[:3])})")
            else:
                kept.append(u)
        return kept

    @property
    def gate(self):
        """The :class:`~gaugeopt.structure.gate.Gate` the records passed (``gate.ensure()`` re-checks them)."""
        return self._gate

    def _require_certified(self) -> None:
        """Projected directions are only as right as the records: every use re-checks them
        (:meth:`Gate.ensure`); records that changed since the projector was built are an error here —
        :class:`gaugeopt.GaugeProjected` and the callbacks build a new projector instead."""
        if self._gate.ensure():
            raise GaugeError(
                "GaugeProjector: the model's attention changed since this projector was built (a layer replaced or "
                "added, a record that differs); build a new GaugeProjector(model, ...)"
            )

    def _resolve(self, sectors) -> tuple[str, ...]:
        if sectors is None:
            return self.sectors
        s = (sectors,) if isinstance(sectors, str) else tuple(sectors)
        bad = [x for x in s if x not in self._impl]
        if bad:
            raise GaugeError(f"sectors {bad} are not available; this projector has {tuple(self._impl)}")
        return s

    def _warn_once(self, msg: str) -> None:
        if msg.split(":")[0] not in self._warned:
            self._warned.add(msg.split(":")[0])
            warnings.warn(msg, RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ input handling
    def _as_dict(self, tensors: Tensors) -> tuple[dict[str, torch.Tensor | None], str]:
        """``{name: tensor}`` and the input kind (``"dict"``/``"list"``); checks names and shapes."""
        if isinstance(tensors, Mapping):
            unknown = [k for k in tensors if k not in self._params]
            if unknown:
                raise GaugeError(
                    f"tensors has names that are not parameters of the model: {unknown[:5]}; "
                    "use the names of model.named_parameters()"
                )
            given, kind = dict(tensors), "dict"
        elif isinstance(tensors, (list, tuple)):
            if len(tensors) != len(self._order):
                raise GaugeError(
                    f"tensors is a sequence of length {len(tensors)}; a list must align with "
                    f"model.named_parameters() ({len(self._order)} entries), or pass a {{name: tensor}} dict"
                )
            given, kind = dict(zip(self._order, tensors)), "list"
        else:
            raise GaugeError(
                f"tensors must be a {{name: tensor}} mapping or a list aligned with named_parameters(), "
                f"got {type(tensors).__name__}"
            )
        for n, t in given.items():
            if t is not None and tuple(t.shape) != tuple(self._params[n].shape):
                raise GaugeError(f"tensors[{n!r}] has shape {tuple(t.shape)}, the parameter has {tuple(self._params[n].shape)}")
        return given, kind

    def _compute_dtype(self, given: dict) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        dts = {t.dtype for t in given.values() if t is not None} | {self._params[n].dtype for n in self.param_names()}
        return torch.float64 if torch.float64 in dts else torch.float32

    def _work(self, given: dict, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The field in the compute dtype over ``names``: the given tensor itself when it already is
        contiguous and of that dtype (the sectors only read it), a copy otherwise."""
        work = {}
        for n in names:
            p = self._params[n]
            t = given.get(n)
            if t is None:
                work[n] = torch.zeros(p.shape, dtype=dtype, device=p.device)
            elif t.dtype == dtype and t.device == p.device and t.is_contiguous():
                work[n] = t.detach()
            else:
                work[n] = torch.empty(p.shape, dtype=dtype, device=p.device).copy_(t.detach())
        return work

    # ------------------------------------------------------------------ core
    def _setup(self, given: dict) -> None:
        self._dtype_now = self._compute_dtype(given)
        self._rtol_now = default_rtol(self._dtype_now) if self.rtol is None else self.rtol
        self._cg_tol_now = default_cg_tol(self._dtype_now) if self.cg_tol is None else self.cg_tol

    def _vertical_family(self, ctx, family, work, record=None, coeffs=None, out=None):
        """Add the vertical part of ``work`` in ``family`` (``[(sector, prepared)]``) into ``out``
        (zeros over its names by default)."""
        if out is None:
            names = [n for sec, _ in family for n in _names_of(sec)]
            out = {n: torch.zeros_like(work[n]) for n in dict.fromkeys(names)}
        rec = record
        if coeffs is not None:
            def rec(sector, unit, coef, vsq, usq):
                key = (sector, unit)
                coeffs[key] = coeffs[key] + coef if key in coeffs else coef
                if record is not None:
                    record(sector, unit, coef, vsq, usq)
        for sec, prep in family:
            sec.apply(ctx, prep, _accessor(work), _accessor(out), rec)
        return out

    def _run(self, given: dict, secs: tuple[str, ...], at, coeffs=None, unit_norms=None):
        """``(work, vertical, info)``: the field in the compute dtype and its vertical part over the
        sectors' parameters; coefficients and per-unit norms only when asked for (they cost)."""
        self._setup(given)
        names = self.param_names(secs)
        work = self._work(given, names, self._dtype_now)
        ctx = _Ctx(self, at)
        components = _components(secs)
        joint = any(len(c) > 1 for c in components)
        if joint and ctx.mode == "approx":  # exact sector projections inside, the joint CG truncated
            ctx.mode = "exact"
        info = ctx.info
        info.update(joint_iterations=0, joint_residual=0.0)
        # one output for every component: they touch disjoint entries (that is what makes them
        # components), so each adds its part in place — no per-component buffers to zero and sum
        vert: dict[str, torch.Tensor] = {}
        record = None
        if unit_norms is not None:
            def record(sector, unit, coef, vsq, usq):
                unit_norms[(sector, unit)] = (float(vsq), float(usq))
        for families in components:  # mutually orthogonal: their projections add up
            if len(families) == 1:
                family = [(self._impl[s], self._impl[s].prepare(ctx)) for s in families[0]]
                for n in (n for sec, _ in family for n in _names_of(sec)):
                    if n not in vert:
                        vert[n] = torch.zeros_like(work[n])
                self._vertical_family(ctx, family, work, None if joint else record, coeffs, out=vert)
                continue
            if families == [["qk"], ["key_bias"]] and coeffs is None:
                part = self._qk_with_key_bias(ctx, work)
            else:
                part = self._joint_component(ctx, families, work, coeffs, info)
            for n, v in part.items():  # a component's own result is kept, not copied into a zeroed buffer
                if n in vert:
                    vert[n].add_(v)
                else:
                    vert[n] = v
        if hasattr(ctx, "_left_sq"):  # approx: ‖error‖ estimate over ‖u‖ (tensors, read lazily)
            usq = sum(torch.linalg.vector_norm(work[n]).double().square() for n in names)
            info["approx_left_estimate"] = torch.where(usq > 0, (ctx._left_sq.double() / usq).sqrt(), usq)
        self.last_info = dict(info)
        return work, vert, dict(info)

    def _qk_with_key_bias(self, ctx, work) -> dict[str, torch.Tensor]:
        """The projection onto ``span(qk) + E`` in closed form, ``E`` the key-bias coordinates (non-rotary
        channels of ``b̄_K``): ``P = P_E + P_{(I−P_E)V_qk}(I − P_E)``. A ``qk`` generator's component
        in ``E`` is ``−X̃ b̄_K`` on those channels, and ``X̃`` (in the RoPE commutant, twisted by a
        diagonal) never mixes rotary and non-rotary channels, so ``(I − P_E)V_qk`` is the ``qk`` sector
        at θ with ``b̄_K = 0`` there — one ``qk`` projection at that point instead of a joint CG.
        (Used when no coefficients are asked for; :meth:`decompose` takes the joint CG, whose
        coefficients are the ones at θ.)"""
        kb, qk = self._impl["key_bias"], self._impl["qk"]
        at = dict(ctx.at or {})
        u = dict(work)
        for b in kb.secs:
            name, idx = b.bias.name, list(b.channels)
            if name not in u or u[name] is work[name]:
                u[name] = work[name].clone()
                at[name] = ctx.weight(name).clone()
            b.bias.view(at[name])[:, idx] = 0
            b.bias.view(u[name])[:, idx] = 0
        shifted = _Ctx(self, at)
        shifted.mode = ctx.mode
        vert = self._vertical_family(shifted, [(qk, qk.prepare(shifted))], u)
        for key in ("cg_iterations", "cg_residual"):
            ctx.info[key] = max(ctx.info[key], shifted.info[key])
        for n, v in self._vertical_family(ctx, [(kb, kb.prepare(ctx))], work).items():
            vert[n] = vert[n] + v if n in vert else v
        return vert

    def _joint_component(self, ctx, families: list[list[str]], work, coeffs, info) -> dict[str, torch.Tensor]:
        """The vertical part of ``work`` in one component of overlapping families (:func:`_components`)."""
        if "lrm_internal" in families[-1]:  # span(lrm_qk) ⊂ span(qk) + span(lrm_internal) (likewise vo): same
            families = [[s for s in fam if _REDUNDANT.get(s) not in fam] for fam in families]  # span, better conditioned
        prepared = [[(self._impl[s], self._impl[s].prepare(ctx)) for s in fam if s != "lrm_internal"] for fam in families]
        outer = None
        if "lrm_internal" in families[-1]:
            # lrm_internal units outside the other families' support (the MLP's LRM layers) are orthogonal
            # to everything else: projected once, outside the joint CG, whose vectors then span attention only
            others = {n for fam in families[:-1] for s in fam for n in self._sector_names(s)}
            inner, outer = self._impl["lrm_internal"].split(others)
            prepared[-1] = [(inner, inner.prepare(ctx))] if inner.units() else []
        prepared = [fam for fam in prepared if fam]
        names = dict.fromkeys(n for fam in prepared for sec, _ in fam for n in _names_of(sec))
        maxiter = self.approx_iters if self.mode == "approx" else self.joint_maxiter
        if len(prepared) > 1:
            vert, info_j = self._joint(ctx, prepared, {n: work[n] for n in names}, coeffs, maxiter)
            info["joint_iterations"] = max(info["joint_iterations"], info_j["joint_iterations"])
            info["joint_residual"] = max(info["joint_residual"], info_j["joint_residual"])
        else:
            vert = self._vertical_family(ctx, prepared[0], work, coeffs=coeffs)
        if outer is not None and outer.units():
            vert.update(self._vertical_family(ctx, [(outer, outer.prepare(ctx))], work, coeffs=coeffs))
        return vert

    def decompose(
        self,
        tensors: Tensors,
        *,
        sectors: Sequence[str] | None = None,
        at: Mapping[str, torch.Tensor] | None = None,
        norms: bool = False,
    ) -> Decomposition:
        """Vertical and horizontal parts of ``tensors`` over the sectors' parameters.

        Args:
            tensors: the vector field (missing entries count as zero).
            sectors: a subset of :attr:`sectors` (default all of them).
            at: ``{name: tensor}`` weights of the point θ to project at (default: the model's
                current parameters; entries not given are read from the model).
            norms: fill :attr:`Decomposition.norms` (one host synchronisation per unit).
        """
        self._require_certified()
        secs = self._resolve(sectors)
        given, _ = self._as_dict(tensors)
        coeffs: dict = {}
        unit_norms: dict = {}
        work, vert, info = self._run(given, secs, at, coeffs, unit_norms if norms else None)
        hor = {n: work[n] - vert[n] for n in vert}
        return Decomposition(vert, hor, coeffs, unit_norms, info)

    def _joint(self, ctx, families, u, coeffs, maxiter):
        """Projection onto ``V_1 + … + V_k`` for overlapping families with exact projectors ``P_i``.

        Writing the vertical part as ``a_1 + … + a_k`` (``a_i ∈ V_i``), the last family is eliminated
        exactly, ``a_k = P_k(u − s)`` with ``s = a_1 + … + a_{k−1}``, and ``x = (a_1, …, a_{k−1})``
        solves the normal equations of ``min ‖(I − P_k)(u − s)‖²``:
        ``P_i (I − P_k) s = P_i (I − P_k) u`` for ``i < k`` — symmetric positive semi-definite on
        ``V_1 × … × V_{k−1}`` (for ``k = 2``: ``S = P_1(I − P_2)P_1``, eigenvalues ``sin²`` of the
        principal angles; intersections are its consistent null space). Conjugate gradients, restarted
        on the true residual ``r_i = P_i(u − s − a_k)``, which is also the certificate: the result is
        exactly orthogonal to ``V_k`` and to each ``V_i`` up to ``‖r_i‖``.
        """
        tol = default_rtol(self._dtype_now) if self.joint_tol is None else self.joint_tol
        names = list(u)
        *firsts, last = families
        # P(fam, x, out) zeroes only the tensors the family writes: every buffer below holds the images of
        # one family only (r_i, Sp_i, delta_i, a_i, p_i of family i; tmp of the last), so it is zero elsewhere
        support = {id(fam): list(dict.fromkeys(n for sec, _ in fam for n in _names_of(sec))) for fam in families}
        if len({t.device for t in u.values()}) == 1:
            # one flat buffer: the CG vector operations are single in-place kernels, the sectors see views
            sizes, shapes = [u[n].numel() for n in names], [u[n].shape for n in names]

            def views(flat):
                return {n: t.view(shape) for n, t, shape in zip(names, flat.split(sizes), shapes)}

            U = torch.cat([u[n].reshape(-1) for n in names])

            def new():
                return torch.zeros_like(U)

            def P(fam, x, out, c=None):
                """``out ← `` the family's vertical part of ``x`` (``out`` zero outside the family's tensors)."""
                o = views(out)
                for n in support[id(fam)]:
                    o[n].zero_()
                self._vertical_family(ctx, fam, views(x), coeffs=c, out=o)
                return out

            def axpy_(a, x, y):  # y += a·x
                return y.add_(x, alpha=a)

            def xpby_(x, b, y):  # y = x + b·y
                return y.mul_(b).add_(x)

            def copy_(dst, src):
                return dst.copy_(src)

            def zero_(x):
                return x.zero_()

            def dot(x, y):
                return float(torch.dot(x, y))

            u_vec, unflat = U, views
        else:  # parameters on several devices: the same algorithm on dicts of tensors
            def new():
                return {n: torch.zeros_like(u[n]) for n in names}

            def P(fam, x, out, c=None):
                for n in support[id(fam)]:
                    out[n].zero_()
                self._vertical_family(ctx, fam, x, coeffs=c, out=out)
                return out

            def axpy_(a, x, y):
                for n in names:
                    y[n].add_(x[n], alpha=a)
                return y

            def xpby_(x, b, y):
                for n in names:
                    y[n].mul_(b).add_(x[n])
                return y

            def copy_(dst, src):
                for n in names:
                    dst[n].copy_(src[n])
                return dst

            def zero_(x):
                for t in x.values():
                    t.zero_()
                return x

            def dot(x, y):
                return sum(float((x[n] * y[n]).sum()) for n in names)

            u_vec, unflat = {n: u[n] for n in names}, lambda d: d
        u = u_vec
        k = len(firsts)
        w, tmp = new(), new()  # work buffers
        a, r, p, Sp, delta = ([new() for _ in range(k)] for _ in range(5))

        def reduced(xs, out):  # out_i ← P_i (I − P_k) Σ_j x_j   (w, tmp used)
            copy_(w, xs[0])
            for x in xs[1:]:
                axpy_(1.0, x, w)
            axpy_(-1.0, P(last, w, tmp), w)
            for fam, o in zip(firsts, out):
                P(fam, w, o)

        def bdot(xs, ys):
            return sum(dot(x, y) for x, y in zip(xs, ys))

        unorm = math.sqrt(dot(u, u)) or 1.0
        iters = 0
        while True:
            copy_(w, u)  # r_i ← P_i (I − P_k)(u − s): the true residual of the reduced system, per family
            for x in a:
                axpy_(-1.0, x, w)
            axpy_(-1.0, P(last, w, tmp), w)
            for fam, o in zip(firsts, r):
                P(fam, w, o)
            res = math.sqrt(bdot(r, r)) / unorm
            if res <= tol or iters >= maxiter:
                break
            rr = bdot(r, r)
            for p_, r_, d_ in zip(p, r, delta):
                copy_(p_, r_)
                zero_(d_)
            while iters < maxiter:
                reduced(p, Sp)
                pSp = bdot(p, Sp)
                if pSp <= 0:
                    break
                alpha = rr / pSp
                for d_, p_, r_, s_ in zip(delta, p, r, Sp):
                    axpy_(alpha, p_, d_)
                    axpy_(-alpha, s_, r_)
                iters += 1
                rr_new = bdot(r, r)
                if math.sqrt(rr_new) / unorm <= 0.5 * tol:  # the true residual above decides; half is margin for rounding
                    break
                for p_, r_ in zip(p, r):
                    xpby_(r_, rr_new / rr, p_)
                rr = rr_new
            for a_, d_ in zip(a, delta):
                axpy_(1.0, d_, a_)
        if res > tol and self.mode != "approx":
            self._warn_once(
                f"gauge projection (joint): conjugate gradients stopped after {iters} iterations with {res:.2e} of "
                f"‖u‖ still vertical (joint_tol={tol:.1e}); the sector families are nearly parallel here, raise joint_maxiter"
            )
        if coeffs is None:  # the last residual check left a_k = P_k(u − s) in tmp: the result is s + a_k
            vert = copy_(w, tmp)
            for x in a:
                axpy_(1.0, x, vert)
            return unflat(vert), {"joint_iterations": iters, "joint_residual": res}
        vert = new()
        for fam, x, buf in zip(firsts, a, Sp):  # coefficients in Lie-algebra coordinates; x ∈ V_i up to rounding
            axpy_(1.0, P(fam, x, buf, coeffs), vert)
        copy_(w, u)
        axpy_(-1.0, vert, w)
        axpy_(1.0, P(last, w, tmp, coeffs), vert)
        return unflat(vert), {"joint_iterations": iters, "joint_residual": res}

    # ------------------------------------------------------------------ kernel routing
    def _route(self, given: dict, secs: tuple[str, ...], at) -> tuple[list[str], tuple[str, ...]]:
        """Split ``secs`` into the sectors the fused kernel projects and the rest (torch).

        Only when each sector is projected on its own (no ``lrm_internal``, and no ``qk`` beside
        ``key_bias``: the fused sectors then touch entries no other requested sector does), at the
        model's own weights and in the inputs' dtype."""
        from gaugeopt.projection.triton_backend import FUSED_SECTORS, unsupported_reason

        if at is not None or self.dtype is not None or any(s in _OVERLAPPING for s in secs):
            return [], secs
        fused = []
        for s in secs:
            if s not in FUSED_SECTORS or (s == "qk" and "key_bias" in secs):  # qk and key_bias share b_K
                continue
            d = dispatch.choose(f"project_{s}", self._device, backend=self.backend, module="projection_triton",
                                unsupported=lambda s=s: unsupported_reason(self.sites, s, given))
            if d.backend == "triton":
                fused.append(s)
        return fused, tuple(s for s in secs if s not in fused)

    # ------------------------------------------------------------------ public API
    def vertical(self, tensors: Tensors, *, sectors: Sequence[str] | None = None, at=None) -> dict[str, torch.Tensor]:
        """``{name: u_vert}`` over the sectors' parameters, in each input's dtype (float64 if absent)."""
        self._require_certified()
        given, _ = self._as_dict(tensors)
        fused, rest = self._route(given, self._resolve(sectors), at)
        out: dict[str, torch.Tensor] = {}
        if rest:
            _, vert, _ = self._run(given, rest, at)
            out = {n: v.to(self._out_dtype(given, n)) for n, v in vert.items()}
        if fused:
            from gaugeopt.projection.triton_backend import vertical_triton

            for s in fused:
                out.update(vertical_triton(self.sites, s, given, rtol=self.rtol))
        return out

    def _out_dtype(self, given, n) -> torch.dtype:
        t = given.get(n)
        return t.dtype if t is not None else self._params[n].dtype

    def project(self, tensors: Tensors, *, sectors: Sequence[str] | None = None, at=None, inplace: bool = False):
        """The horizontal part ``u − u_vert``, returned like ``tensors`` came in.

        A dict comes back as a dict holding every input key plus the sectors' parameters (a
        missing entry counted as zero may get a nonzero horizontal part); entries outside the
        sectors are the input tensors themselves. A list comes back aligned with
        ``named_parameters()``. With ``inplace=True`` the given tensors are updated in place
        (entries that were missing are created in the returned container only).
        """
        self._require_certified()
        given, kind = self._as_dict(tensors)
        fused, rest = self._route(given, self._resolve(sectors), at)
        result = dict(given)
        if rest:
            work, vert, _ = self._run(given, rest, at)
            for n, v in vert.items():
                t = given.get(n)
                if t is None:
                    result[n] = (-v).to(self._params[n].dtype)
                elif inplace:
                    t.sub_(v.to(t.dtype))
                elif v.dtype == t.dtype:
                    result[n] = torch.sub(work[n], v)
                else:
                    result[n] = (work[n] - v).to(t.dtype)
        if fused:
            from gaugeopt.projection.triton_backend import vertical_triton

            for s in fused:
                result.update(vertical_triton(self.sites, s, given, rtol=self.rtol, subtract=True, inplace=inplace))
        if kind == "list":
            return [result.get(n) for n in self._order]
        return result

    def basis(self, *, sectors: Sequence[str] | None = None, at=None, dtype: torch.dtype = torch.float64):
        """Yield ``(label, {name: tensor})``: the generator images of a basis of each sector's Lie
        algebra at θ (elementary matrices per KV group, ``I``/``J`` per RoPE plane, indicator
        vectors for the diagonal and internal gauges). For small models (diagnostics, tests)."""
        self._require_certified()
        self._dtype_now, self._rtol_now, self._cg_tol_now = dtype, default_rtol(dtype), default_rtol(dtype)
        ctx = _Ctx(self, at)
        for s in self._resolve(sectors):
            sec = self._impl[s]
            names = self._sector_names(s)
            for label, write in sec.basis(ctx, sec.prepare(ctx)):
                store = {n: torch.zeros(self._params[n].shape, dtype=dtype, device=self._device) for n in names}
                write(_accessor(store))
                yield label, {n: t for n, t in store.items() if bool(t.any())}


def horizontal(
    model: nn.Module,
    tensors: Tensors,
    *,
    sectors: str | Sequence[str] = "auto",
    mode: str = "exact",
    **kwargs,
):
    """One-shot :meth:`GaugeProjector.project` (builds the projector each call).

    Example:
        >>> import torch
        >>> from gaugeopt.models import GPT, GPTConfig
        >>> from gaugeopt.projection.projector import horizontal
        >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
        >>> grads = [torch.randn_like(p) for p in model.parameters()]
        >>> len(horizontal(model, grads)) == len(list(model.parameters()))
        True
    """
    return GaugeProjector(model, sectors, mode, **kwargs).project(tensors)
