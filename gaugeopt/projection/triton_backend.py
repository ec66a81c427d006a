"""The Triton backend of the closed-form projection sectors: attention sites → the kernel op's tensors.

:class:`~gaugeopt.projection.GaugeProjector` routes ``lrm_qk``, ``lrm_vo`` and the ``qk`` sector
of full-rotary RoPE layers (a closed form per plane) here when its route
(:mod:`gaugeopt.projection.routing`) picks Triton. This module says why the kernel cannot take a
model (:func:`unsupported_reason`), describes the sites as the kernel op's tensors
(:func:`describe`: which tensors form each side comes from the sites'
:class:`~gaugeopt.records.pair.GaugePair`) and runs it (:func:`vertical_triton`); the kernels,
their launchers and their plain-torch references are :mod:`gaugeopt.kernels.projection`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.distributed import is_dtensor
from gaugeopt.projection.sylvester import default_rtol
from gaugeopt.records.pair import GaugePair, Member
from gaugeopt.records.rope import plane_index
from gaugeopt.records.site import AttentionSite

__all__ = ["FUSED_SECTORS", "unsupported_reason", "vertical_triton", "describe", "fused_sites", "fused_refs"]

FUSED_SECTORS = ("lrm_qk", "lrm_vo", "qk")


def _pair(site: AttentionSite, sector: str) -> GaugePair:
    return site.pair("vo" if sector == "lrm_vo" else "qk")


def _members(site: AttentionSite, sector: str) -> tuple[tuple[Member, ...], tuple[Member, ...]]:
    """Side a's and side b's tensors: the multipliers (``lrm_*``) or the rows and biases (``qk``)."""
    pair = _pair(site, sector)
    mode = "plain" if sector == "qk" else "lrm"
    return pair.a.members(mode), pair.b.members(mode)


def fused_sites(sites: Sequence[AttentionSite], sector: str) -> list[AttentionSite]:
    """The sites that carry ``sector`` (a QK-norm site carries neither ``qk`` nor ``lrm_qk``)."""
    if sector in ("qk", "lrm_qk"):
        sites = [s for s in sites if s.qk_norm is None and not s.qk_orthogonal]
    if sector in ("lrm_qk", "lrm_vo"):
        return [s for s in sites if _pair(s, sector).has_multipliers]
    return list(sites)


def _refs(sites, sector):
    for site in sites:
        for members in _members(site, sector):
            for m in members:
                yield m.ref


def fused_refs(sites: Sequence[AttentionSite], sector: str) -> list:
    """The tensors the fused kernel reads for ``sector`` (parameters; the field at the same names)."""
    return list(_refs(fused_sites(sites, sector), sector))


def unsupported_reason(sites: Sequence[AttentionSite], sector: str, tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Why the fused kernel cannot project ``sector`` of these sites (``None`` when it can)."""
    from gaugeopt.kernels.projection.spec import SUPPORTED_DTYPES

    if sector not in FUSED_SECTORS:
        return f"sector {sector!r} has no closed form (fused sectors: {FUSED_SECTORS}); it needs the Sylvester solve"
    if sector == "qk" and any(s.qk_orthogonal for s in sites):
        return "a site keeps only the orthogonal part of its Q/K gauge (a weight-free norm); the torch path projects it"
    sites = fused_sites(sites, sector)
    if not sites:
        return f"no site carries the {sector} gauge"
    if sector == "qk":
        for s in sites:
            if not s.rope.active or s.rope.rotary_dim != s.d_k:
                return (f"{s.name}: the qk sector is a closed form only when every channel is in a RoPE plane "
                        f"(rope={s.rope.kind}, rotary_dim={s.rope.rotary_dim}, d_k={s.d_k}); the dense block needs the "
                        "Sylvester solve")
    pdt, udt, dev, missing = set(), set(), set(), False
    for ref in _refs(sites, sector):
        p = ref.param
        u = tensors.get(ref.name)
        for what, t in (("parameter", p), ("tensor", u)):
            if t is None:
                continue
            if is_dtensor(t):
                return f"the {what} {ref.name} is a DTensor (FSDP2)"
            if t.dtype not in SUPPORTED_DTYPES:
                return f"the {what} {ref.name} has dtype {t.dtype}"
            dev.add(t.device)
        pdt.add(p.dtype)
        if u is not None:
            udt.add(u.dtype)
        missing |= u is None
    if len(dev) > 1:
        return f"tensors on several devices {sorted(map(str, dev))}"
    if len(pdt) > 1 or len(udt) > 1:
        return f"the {sector} parameters (or the vector field) mix dtypes"
    if missing and udt and udt != pdt:  # a missing entry is zeros of the parameter's dtype: one launch takes one
        return f"the vector field ({sorted(map(str, udt))}) misses entries of the {sector} parameters ({sorted(map(str, pdt))})"
    if sector == "qk":
        twists = {m.param.dtype for s in sites for m in (_pair(s, sector).a.mult, _pair(s, sector).b.mult) if m is not None}
        if twists - pdt:
            return f"the row multipliers ({sorted(map(str, twists))}) and the rows ({sorted(map(str, pdt))}) differ in dtype"
    return None


def describe(
    sites: Sequence[AttentionSite],
    sector: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    subtract: bool = False,
    inplace: bool = False,
) -> tuple[list, dict[str, torch.Tensor], torch.dtype]:
    """The kernel op's input for ``sector`` of ``sites``: ``(descriptions, outputs, accumulation dtype)``.

    The descriptions are :class:`~gaugeopt.kernels.projection.spec.DiagonalSite` (``lrm_qk``,
    ``lrm_vo``) or :class:`~gaugeopt.kernels.projection.spec.PlaneSite` (``qk``) of the sites that
    carry the sector, on views of the parameters, of the field (a copy in the parameter's layout
    where its strides differ; zeros where an entry is missing) and of the outputs: zeros, or for
    ``subtract`` a copy of the field (the given tensor itself with ``inplace``).
    """
    from gaugeopt.kernels.projection.spec import DiagonalSite, PlaneMember, PlaneSite

    sites = fused_sites(sites, sector)
    params = {r.name: r.param for r in _refs(sites, sector)}
    dts = {p.dtype for p in params.values()} | {t.dtype for n, t in tensors.items() if n in params}
    acc = torch.float64 if torch.float64 in dts else torch.float32
    src: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for n, p in params.items():
        u = tensors.get(n)
        if u is None:
            u = torch.zeros_like(p)
        elif u.stride() != p.stride():  # the kernels address u and out with the parameter's strides
            u = torch.empty_like(p, dtype=u.dtype).copy_(u)
        src[n] = u
        if subtract:
            out[n] = u if (inplace and u is tensors.get(n)) else u.clone()
        else:
            out[n] = torch.zeros_like(u)
    found = []
    for site in sites:
        pair = _pair(site, sector)
        ma, mb = _members(site, sector)
        if sector in ("lrm_qk", "lrm_vo"):
            (a,), (b,) = ma, mb
            slot = plane_index(pair.rope, pair.width)
            va, vb = a.ref.get().detach(), b.ref.get().detach()
            found.append(DiagonalSite(va, vb, a.ref.view(src[a.ref.name]), b.ref.view(src[b.ref.name]),
                                      a.ref.view(out[a.ref.name]), b.ref.view(out[b.ref.name]), groups=pair.groups,
                                      repeat_a=pair.a.repeat, repeat_b=pair.b.repeat, slot=slot.tolist(),
                                      n_slots=int(slot.max()) + 1))
        else:
            def members(ms):
                return [PlaneMember(m.ref.get().detach(), m.ref.view(src[m.ref.name]), m.ref.view(out[m.ref.name]))
                        for m in ms]

            found.append(PlaneSite(members(ma), members(mb), [tuple(pq) for pq in pair.rope.planes(pair.width)],
                                   pair.groups, pair.a.repeat, pair.b.repeat,
                                   twist_a=None if pair.a.mult is None else pair.a.mult.get().detach(),
                                   twist_b=None if pair.b.mult is None else pair.b.mult.get().detach()))
    return found, out, acc


def vertical_triton(
    sites: Sequence[AttentionSite],
    sector: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    rtol: float | None = None,
    subtract: bool = False,
    inplace: bool = False,
    checked: bool = False,
) -> dict[str, torch.Tensor]:
    """The vertical part of ``tensors`` in ``sector`` (or ``u − v`` with ``subtract=True``).

    Args:
        sites: attention sites (:func:`gaugeopt.find_attention`).
        sector: ``"lrm_qk"``, ``"lrm_vo"`` or ``"qk"`` (full-rotary RoPE planes).
        tensors: ``{name: u}`` as in ``model.named_parameters()``; missing entries count as zero.
        rtol: pseudo-inverse threshold (default ``1000·ε`` of the compute dtype).
        subtract: return the horizontal part ``u − v`` of the sector's tensors instead.
        inplace: with ``subtract``, write ``u − v`` into the given tensors.
        checked: the caller has asked :func:`unsupported_reason` already (the projector's route).

    Returns:
        ``{name: tensor}`` over the sector's parameters, each in its input's dtype (the
        parameter's dtype where the entry was missing): what the torch projector returns.
    """
    from gaugeopt.kernels import projection as kp

    why = None if checked else unsupported_reason(sites, sector, tensors)
    if why is not None:
        raise GaugeError(f"vertical_triton cannot project these sites: {why}; use the torch path (backend='torch')")
    found, out, acc = describe(sites, sector, tensors, subtract=subtract, inplace=inplace)
    rtol = default_rtol(acc) if rtol is None else rtol
    if sector in ("lrm_qk", "lrm_vo"):
        kp.project_diagonal(found, rtol=rtol, subtract=subtract)
    else:
        kp.project_planes(found, rtol=rtol, subtract=subtract)
    if inplace and subtract:
        for n, t in out.items():
            given = tensors.get(n)
            if given is not None and t is not given:
                given.copy_(t)
                out[n] = given
    return out
