"""The Triton backend of the closed-form projection sectors: sites → descriptor tables → one launch.

:class:`~gaugeopt.projection.GaugeProjector` routes ``lrm_qk``, ``lrm_vo`` and the ``qk`` sector
of full-rotary RoPE layers (a closed form per plane) here when the dispatch
(:mod:`gaugeopt.kernels.dispatch`) picks Triton; the kernels are
:mod:`gaugeopt.kernels.projection_triton`. Which tensors form each side comes from the sites'
:class:`~gaugeopt.structure.pair.GaugePair`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.distributed import is_dtensor
from gaugeopt.projection.sylvester import default_rtol
from gaugeopt.structure.pair import GaugePair, Member
from gaugeopt.structure.rope import plane_index
from gaugeopt.structure.site import AttentionSite

__all__ = ["FUSED_SECTORS", "unsupported_reason", "vertical_triton", "fused_sites", "fused_refs"]

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
    from gaugeopt.kernels.projection_triton import SUPPORTED_DTYPES

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
    pdt, udt, dev = set(), set(), set()
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
    if len(dev) > 1:
        return f"tensors on several devices {sorted(map(str, dev))}"
    if len(pdt) > 1 or len(udt) > 1:
        return f"the {sector} parameters (or the vector field) mix dtypes"
    return None


def _geometry(view: torch.Tensor) -> tuple[int, int, int, int]:
    """(stride_head, stride_chan, stride_col, n_cols) of a ``(heads, width[, cols])`` view."""
    if view.dim() == 2:
        return view.stride(0), view.stride(1), 0, 1
    return view.stride(0), view.stride(1), view.stride(2), view.shape[2]


def vertical_triton(
    sites: Sequence[AttentionSite],
    sector: str,
    tensors: Mapping[str, torch.Tensor],
    *,
    rtol: float | None = None,
    subtract: bool = False,
    inplace: bool = False,
) -> dict[str, torch.Tensor]:
    """The vertical part of ``tensors`` in ``sector`` (or ``u − v`` with ``subtract=True``).

    Args:
        sites: attention sites (:func:`gaugeopt.find_attention`).
        sector: ``"lrm_qk"``, ``"lrm_vo"`` or ``"qk"`` (full-rotary RoPE planes).
        tensors: ``{name: u}`` as in ``model.named_parameters()``; missing entries count as zero.
        rtol: pseudo-inverse threshold (default ``1000·ε`` of the compute dtype).
        subtract: return the horizontal part ``u − v`` of the sector's tensors instead.
        inplace: with ``subtract``, write ``u − v`` into the given tensors.

    Returns:
        ``{name: tensor}`` over the sector's parameters, each in its input's dtype (the
        parameter's dtype where the entry was missing): what the torch projector returns.
    """
    from gaugeopt.kernels import projection_triton as kt

    why = unsupported_reason(sites, sector, tensors)
    if why is not None:
        raise GaugeError(f"vertical_triton cannot project these sites: {why}; use the torch path (backend='torch')")
    sites = fused_sites(sites, sector)
    params = {r.name: r.param for r in _refs(sites, sector)}
    dts = {p.dtype for p in params.values()} | {t.dtype for n, t in tensors.items() if n in params}
    acc = torch.float64 if torch.float64 in dts else torch.float32
    rtol = default_rtol(acc) if rtol is None else rtol
    device = next(iter(params.values())).device

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
    pdt = next(iter(params.values())).dtype
    udt = next(iter(src.values())).dtype
    rt = torch.tensor([rtol], dtype=acc, device=device)
    if sector in ("lrm_qk", "lrm_vo"):
        site_rows, desc_rows, slots = [], [], []
        block_k, block_c = 1, 1
        for site in sites:
            pair = _pair(site, sector)
            (ma,), (mb,) = _members(site, sector)
            width = pair.width
            slot = plane_index(pair.rope, width)
            site_rows.append([len(desc_rows), pair.groups, pair.a.repeat, pair.b.repeat, width, int(slot.max()) + 1,
                              len(slots), 0])
            slots += slot.tolist()
            for m in (ma, mb):
                v = m.ref.get().detach()
                for t in (v, m.ref.view(src[m.ref.name]), m.ref.view(out[m.ref.name])):
                    desc_rows.append([t.data_ptr(), v.stride(0), v.stride(1), 0])
            block_k = max(block_k, pair.a.repeat, pair.b.repeat)
            block_c = max(block_c, width)
        kt.launch_diagonal(site_rows, desc_rows, slots, rt, param_dtype=pdt, field_dtype=udt, subtract=subtract,
                           block_k=block_k, block_c=block_c)
    else:
        unit_rows, site_rows, desc_rows, twist_rows, planes = [], [], [], [], []
        max_cols, has_twist = 1, False
        for si, site in enumerate(sites):
            pair = _pair(site, sector)
            ma, mb = _members(site, sector)
            pl = pair.rope.planes(pair.width)
            site_rows.append([len(desc_rows), len(ma), len(mb), pair.a.repeat, pair.b.repeat, len(pl), len(planes), 0])
            planes += [list(pq) for pq in pl]
            for m in ma + mb:
                v = m.ref.get().detach()
                sh, sc, sx, ncols = _geometry(v)
                desc_rows.append([v.data_ptr(), m.ref.view(src[m.ref.name]).data_ptr(),
                                  m.ref.view(out[m.ref.name]).data_ptr(), sh, sc, sx, ncols, 0])
                max_cols = max(max_cols, ncols)
            for tw in (pair.a.mult, pair.b.mult):
                if tw is None:
                    twist_rows.append([0, 0, 0])
                else:
                    tv = tw.get().detach()
                    twist_rows.append([tv.data_ptr(), tv.stride(0), tv.stride(1)])
                    has_twist = True
            unit_rows += kt.plane_units(pair.groups, len(pl), si)
        flags = kt.launch_planes(unit_rows, site_rows, desc_rows, twist_rows, planes, rt, param_dtype=pdt,
                                 field_dtype=udt, subtract=subtract, has_twist=has_twist, max_cols=max_cols)
        if has_twist and bool(flags.any()):  # the one host sync, only with multipliers (as the torch path checks)
            raise GaugeError(
                "a Q/K row multiplier has an exact zero; the gauge generators in W̄ coordinates divide by it. "
                "Re-initialise that multiplier."
            )
    if inplace and subtract:
        for n, t in out.items():
            given = tensors.get(n)
            if given is not None and t is not given:
                given.copy_(t)
                out[n] = given
    return out
