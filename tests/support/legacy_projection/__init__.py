"""The projection sectors as they were before the batched rewrite, kept as a test oracle.

``dense.py``, ``multipliers.py`` and ``sylvester.py`` are verbatim copies of the straightforward
implementation (per-site gathers, bias columns concatenated, a dense eigendecomposition of
every ``lrm_internal`` Schur complement); only their imports point here. :func:`vertical`
drives them for one sector family the way the projector did, so that the tests can compare
every new path with them in float64 (``tests/projection/test_projection_paths.py``).
"""

from __future__ import annotations

import torch

import gaugeopt
from gaugeopt.adapters.apply_lrm import LRMLinear
from legacy_projection.dense import DenseSector
from legacy_projection.multipliers import DiagonalSector, InternalSector
from legacy_projection.sylvester import default_rtol


class _Ctx:
    def __init__(self, params, dtype, mode, cg_tol=None, cg_maxiter=200):
        self.params, self.dtype, self.mode = params, dtype, mode
        self.rtol = default_rtol(dtype)
        self.cg_tol = default_rtol(dtype) if cg_tol is None else cg_tol
        self.cg_maxiter = cg_maxiter
        self.device = next(iter(params.values())).device
        self.info = {"cg_iterations": 0, "cg_residual": 0.0}

    def weight(self, x):
        if isinstance(x, str):
            return self.params[x].detach().to(self.dtype)
        return x.view(self.params[x.name].detach().to(self.dtype))

    def note_cg(self, sector, iters, res):
        self.info["cg_iterations"] = max(self.info["cg_iterations"], iters)
        self.info["cg_residual"] = max(self.info["cg_residual"], res)


def _acc(store):
    return lambda x: store[x] if isinstance(x, str) else x.view(store[x.name])


def sectors(model):
    sites = gaugeopt.find_attention(model)
    params = dict(model.named_parameters())
    pname = {id(p): n for n, p in params.items()}
    lrm = [(n, m) for n, m in model.named_modules() if isinstance(m, LRMLinear)]
    return {
        "qk": DenseSector("qk", sites), "vo": DenseSector("vo", sites),
        "lrm_qk": DiagonalSector("lrm_qk", sites), "lrm_vo": DiagonalSector("lrm_vo", sites),
        "lrm_internal": InternalSector(lrm, pname),
    }


@torch.no_grad()
def vertical(model, u, sector_names, *, mode="exact", dtype=torch.float64, at=None):
    """``{name: vertical part}`` of ``u`` over the given sectors, projected one after the other
    (exact for sectors touching disjoint entries, i.e. any family without ``lrm_internal``)."""
    params = dict(model.named_parameters()) if at is None else {**dict(model.named_parameters()), **at}
    impl = sectors(model)
    ctx = _Ctx(params, dtype, mode)
    work = {n: (u[n] if u.get(n) is not None else torch.zeros_like(p)).detach().to(dtype).clone()
            for n, p in params.items()}
    out = {n: torch.zeros_like(t) for n, t in work.items()}
    for s in sector_names:
        sec = impl[s]
        sec.apply(ctx, sec.prepare(ctx), _acc(work), _acc(out), None)
    names = set()
    for s in sector_names:
        sec = impl[s]
        names |= ({r.name for r in sec.refs()} if isinstance(sec, DenseSector) else set(sec.param_names()))
    return {n: out[n] for n in names}
