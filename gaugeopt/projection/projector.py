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

The bias sectors (:mod:`gaugeopt.records.bias_sector`, :mod:`gaugeopt.projection.bias`) are present where
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

**Joint projection.** Sectors that share parameter entries (``{qk, key_bias}``, ``{vo, value_bias}``,
and everything with ``lrm_internal``) are projected onto the sum of their spans together
(:mod:`gaugeopt.projection.joint`: the last family eliminated exactly, conjugate gradients on the
others restarted on the true residual, stopped at ``joint_tol·‖u‖``, ``info["joint_residual"]``);
``{qk, key_bias}`` has a closed form. The ``{vo, value_bias}`` group takes 10–25 CG iterations of
its two sectors in float64 — about nine times the head gauges on a GPT-2 layer, for about 3% of
an AdamW update's norm — so ``"auto"`` (every sector the model has) leaves ``value_bias`` out
(:data:`OPT_IN`) and ``"all"`` includes it; ``key_bias`` costs nothing extra and is in ``"auto"``.

**Kernels.** The closed-form sectors (``lrm_qk``, ``lrm_vo``, ``qk`` of full-rotary layers) run in
one fused Triton launch on CUDA tensors when projected on their own
(:mod:`gaugeopt.projection.routing`, decided once per kind of input).

**Modes** (:data:`PROJECTION_MODES`, checked by :func:`check_mode`). ``"exact"``: the Sylvester solve.
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

import warnings
from collections.abc import Mapping
from typing import Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.kernels import dispatch
from gaugeopt.models.lrm import LRMLinear
from gaugeopt.projection import joint
from gaugeopt.projection.bias import BiasShiftSector
from gaugeopt.projection.context import Context, Decomposition, Tensors, accessor, names_of, vertical_family
from gaugeopt.projection.multipliers import DiagonalSector, InternalSector
from gaugeopt.projection.dense import DenseSector
from gaugeopt.projection.routing import KernelRoute
from gaugeopt import sectors as sector_registry
from gaugeopt.trust.gate import Gate
from gaugeopt.records.site import AttentionSite
from gaugeopt.projection.sylvester import default_cg_tol, default_rtol

__all__ = ["SECTORS", "OPT_IN", "PROJECTION_MODES", "check_mode", "projectable", "opt_in", "GaugeProjector", "Decomposition",
           "horizontal"]

# The projectable sectors and the ones "auto" leaves out are the sector registry's
# (gaugeopt.sectors: a Sector with a Projection; opt_in=True): read as SECTORS and OPT_IN.
# value_bias is opt-in: the value-bias trade couples V/O to the output bias, and projecting {vo, value_bias}
# jointly costs ~10 CG iterations of the vo sector (~9x the head gauges on a GPT-2 layer) for ~3% of an
# AdamW update's norm (tests/sectors/test_bias_sectors.py measures both).


def projectable() -> tuple[str, ...]:
    """The names of the registered sectors the projector can remove, in registration order."""
    return tuple(s.name for s in sector_registry.sectors() if s.projection is not None)


def opt_in() -> tuple[str, ...]:
    """The projectable sectors ``"auto"`` leaves out and ``"all"`` includes."""
    return tuple(s.name for s in sector_registry.sectors() if s.projection is not None and s.projection.opt_in)


def __getattr__(name: str):
    """``SECTORS`` and ``OPT_IN``: :func:`projectable` and :func:`opt_in` when read."""
    if name == "SECTORS":
        return projectable()
    if name == "OPT_IN":
        return opt_in()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PROJECTION_MODES = ("exact", "approx", "paper000")


def check_mode(mode: str, owner: str = "GaugeProjector") -> None:
    """Raise :class:`GaugeError` unless ``mode`` is one of :data:`PROJECTION_MODES` (the one check the
    projector, :class:`gaugeopt.GaugeOptimizer` and the Lightning callback share)."""
    if mode not in PROJECTION_MODES:
        raise GaugeError(f"{owner}: mode={mode!r} is not one of {PROJECTION_MODES}")


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
        impl = {sec.name: self._build(sec, keep, lrm_modules, pname) for sec in sector_registry.sectors()
                if sec.projection is not None}
        known, optional = projectable(), opt_in()
        available = tuple(k for k in known if impl[k].units())
        if sectors == "all":
            chosen = available
        elif sectors == "auto":
            chosen = tuple(k for k in available if k not in optional)
        else:
            chosen = (sectors,) if isinstance(sectors, str) else tuple(sectors)
            bad = [s for s in chosen if s not in known]
            if bad:
                raise GaugeError(f"GaugeProjector: unknown sectors {bad}; valid sectors are {known}, 'auto' or 'all'")
            missing = [s for s in chosen if s not in available]
            if missing:
                raise GaugeError(
                    f"GaugeProjector: sectors {missing} are not present in this model (it has {available}); "
                    "the lrm_* sectors need learnable multipliers (gaugeopt.apply_lrm); a QK-norm layer has "
                    "'qk_gain' instead of 'qk' and 'lrm_qk' (docs/qk_norm.md); 'key_bias' needs a key bias on "
                    "channels RoPE does not rotate, 'value_bias' value and output biases (gaugeopt.records.bias_sector)"
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
        self.route = KernelRoute(self.sites, self._params, self._device, backend)

    # ------------------------------------------------------------------ structure
    def _build(self, sec, keep, lrm_modules: list, pname: dict[int, str]):
        """The solver object of one registered sector (its :class:`~gaugeopt.sectors.ProjectionRule`):
        over the records it applies to, or over the LRM layers, less the frozen units when asked."""
        p, name = sec.projection, sec.name
        if p.units == "lrm_layers":
            units = lrm_modules
        else:
            units = [s for s in self.sites if p.sites is None or p.sites(s)]
        if callable(p.solver):  # a sector that brings its own solver
            options = dict(approx_iters=self.approx_iters, param_names=pname)
            return p.solver(name, keep(name, units, lambda u: p.solver(name, u, options)), options)
        if p.solver == "dense":
            return DenseSector(name, keep(name, units, lambda u: DenseSector(name, u)), approx_iters=self.approx_iters)
        if p.solver == "diagonal":
            return DiagonalSector(name, keep(name, units, lambda u: DiagonalSector(name, u)))
        if p.solver == "internal":
            return InternalSector(keep(name, units, lambda u: InternalSector(u, pname)), pname)
        return BiasShiftSector(name, keep(name, units, lambda u: BiasShiftSector(name, u)))  # "bias_shift"

    def _sector_names(self, sector: str) -> list[str]:
        return names_of(self._impl[sector])

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
                names = names_of(make([u]))
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
        """The :class:`~gaugeopt.trust.gate.Gate` the records passed (``gate.ensure()`` re-checks them)."""
        return self._gate

    def _require_certified(self) -> None:
        """Projected directions are only as right as the records: every use re-checks them
        (:meth:`Gate.ensure`); records that changed since the projector was built are an error here —
        :class:`gaugeopt.GaugeOptimizer` and the callbacks build a new projector instead."""
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

    def _context(self, at: Mapping[str, torch.Tensor] | None) -> Context:
        return Context(self._params, at, dtype=self._dtype_now, rtol=self._rtol_now, mode=self.mode,
                       cg_tol=self._cg_tol_now, cg_maxiter=self.cg_maxiter, device=self._device, warn=self._warn_once)

    def _run(self, given: dict, secs: tuple[str, ...], at, coeffs=None, unit_norms=None):
        """``(work, vertical, info)``: the field in the compute dtype and its vertical part over the
        sectors' parameters; coefficients and per-unit norms only when asked for (they cost)."""
        self._setup(given)
        names = self.param_names(secs)
        work = self._work(given, names, self._dtype_now)
        ctx = self._context(at)
        components = joint.components(secs)
        is_joint = any(len(c) > 1 for c in components)
        if is_joint and ctx.mode == "approx":  # exact sector projections inside, the joint CG truncated
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
                for n in (n for sec, _ in family for n in names_of(sec)):
                    if n not in vert:
                        vert[n] = torch.zeros_like(work[n])
                vertical_family(ctx, family, work, None if is_joint else record, coeffs, out=vert)
                continue
            if families == [["qk"], ["key_bias"]] and coeffs is None:
                part = joint.qk_with_key_bias(ctx, self._impl, work)
            else:
                part = joint.joint_component(
                    ctx, self._impl, families, work, coeffs, info,
                    tol=default_rtol(self._dtype_now) if self.joint_tol is None else self.joint_tol,
                    maxiter=self.approx_iters if self.mode == "approx" else self.joint_maxiter,
                    strict=self.mode != "approx")
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

    def _fused(self, given: dict, sector: str, **kw) -> dict[str, torch.Tensor]:
        """One sector through the fused kernel (the route has checked that it can take these tensors)."""
        from gaugeopt.projection.triton_backend import vertical_triton

        return vertical_triton(self.sites, sector, given, rtol=self.rtol, checked=True, **kw)

    # ------------------------------------------------------------------ public API
    def vertical(self, tensors: Tensors, *, sectors: Sequence[str] | None = None, at=None) -> dict[str, torch.Tensor]:
        """``{name: u_vert}`` over the sectors' parameters, in each input's dtype (float64 if absent)."""
        self._require_certified()
        given, _ = self._as_dict(tensors)
        fused, rest = self.route.split(given, self._resolve(sectors), at=at, dtype=self.dtype)
        out: dict[str, torch.Tensor] = {}
        if rest:
            _, vert, _ = self._run(given, rest, at)
            out = {n: v.to(self._out_dtype(given, n)) for n, v in vert.items()}
        for s in fused:
            out.update(self._fused(given, s))
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
        fused, rest = self.route.split(given, self._resolve(sectors), at=at, dtype=self.dtype)
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
        for s in fused:
            result.update(self._fused(given, s, subtract=True, inplace=inplace))
        if kind == "list":
            return [result.get(n) for n in self._order]
        return result

    def basis(self, *, sectors: Sequence[str] | None = None, at=None, dtype: torch.dtype = torch.float64):
        """Yield ``(label, {name: tensor})``: the generator images of a basis of each sector's Lie
        algebra at θ (elementary matrices per KV group, ``I``/``J`` per RoPE plane, indicator
        vectors for the diagonal and internal gauges). For small models (diagnostics, tests)."""
        self._require_certified()
        self._dtype_now, self._rtol_now, self._cg_tol_now = dtype, default_rtol(dtype), default_rtol(dtype)
        ctx = self._context(at)
        for s in self._resolve(sectors):
            sec = self._impl[s]
            names = self._sector_names(s)
            for label, write in sec.basis(ctx, sec.prepare(ctx)):
                store = {n: torch.zeros(self._params[n].shape, dtype=dtype, device=self._device) for n in names}
                write(accessor(store))
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
