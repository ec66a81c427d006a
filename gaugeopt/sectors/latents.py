"""The sectors of multi-head latent attention: ``qk_rope``, ``latent_rotation`` and ``latent_gain``.

On a record with ``site.latent`` (DeepSeek-V2/V3, docs/mla.md; the actions are
:mod:`gaugeopt.records.latent`'s):

===================  ===========================================================  ===========================
sector               element                                                      negative control
===================  ===========================================================  ===========================
``qk_rope``          ``B`` in the RoPE commutant: ``q_i ← Bᵀq_i`` on every head's RoPE  a general ``GL(r)`` with its
                     query rows, ``k_pe ← B⁻¹k_pe`` on the one key they share            inverse (``gl_under_rope``)
``latent_rotation``  ``M ∈ O(L)`` per latent: ``W_down ← M W_down``,                 a general ``GL(L)``
                     ``W_up ← W_up D Mᵀ D⁻¹`` (the RMSNorm commutes with rotations)     (``latent_gl``)
``latent_gain``      ``γ ← γ ⊙ e``, ``W_up ← W_up diag(e)⁻¹`` per latent                 the gain moved alone
                                                                                  (``latent_gain_alone``)
===================  ===========================================================  ===========================

Every one passes through the scores (the implementations compute the latent norms and rotations in
float32: certified to ``1e-6`` on a module that says so). The projector removes ``qk_rope``; the latent
sectors are counted, measured and certified, not projected. The controls of
:func:`gaugeopt.invalid_gauge_transform` registered here (group ``"latent"``): ``rope_per_head``,
``perm_without_rope``, ``latent_gl`` and ``latent_gain_alone``.

Example:
    >>> from gaugeopt.sectors import sectors
    >>> [(s.name, s.projection is not None) for s in sectors() if s.family == "latent"]
    [('qk_rope', True), ('latent_rotation', False), ('latent_gain', False)]
"""

from __future__ import annotations

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.linalg import random_orthogonal, random_well_conditioned
from gaugeopt.sectors.group_actions import _log_uniform, permute_heads
from gaugeopt.records.latent import act_qk_rope, rotate_latent, scale_latent_gain
from gaugeopt.records.rope import commutant_basis, random_commutant
from gaugeopt.sectors.registry import Control, Family, ProjectionRule, Sector, register, register_control, run
from gaugeopt.records.site import AttentionSite

__all__: list[str] = []

_NOT_LATENT = "it is not multi-head latent attention (no RoPE key shared by all heads, no latent spaces)"


def _lacking(site: AttentionSite) -> str | None:
    return _NOT_LATENT if site.latent is None else None


def _latents(site: AttentionSite):
    if site.latent is None:
        raise GaugeError(f"{site.name} has no latent spaces (not multi-head latent attention)")
    return site.latent.latents()


def _count(key: str):
    return lambda s: {} if s.latent is None else {key: s.latent.dims()[key]}


# ---------------------------------------------------------------------- qk_rope
def _rope_valid(site: AttentionSite, g, log_scale: float) -> None:
    lat = site.latent
    if lat is None:
        raise GaugeError(f"apply_valid: {site.name} has no 'qk_rope' part (not multi-head latent attention)")
    act_qk_rope(site, random_commutant(lat.rope, lat.r, 1, log_scale=log_scale, generator=g))


def _rope_families(site: AttentionSite) -> list[Family]:
    basis = commutant_basis(site.latent.rope, site.latent.r)

    def qk_rope(t, basis=basis):
        act_qk_rope(site, torch.linalg.matrix_exp(torch.einsum("k,kab->ab", t, basis.to(t.dtype)))[None])

    return [Family("qk_rope", site.name, basis.shape[0], qk_rope, True,
                   "q_i^rope·k_pe unchanged by Bᵀ on every head, B⁻¹ on the shared key (B in its RoPE commutant)")]


register(Sector(
    name="qk_rope", family="latent", summary="the RoPE commutant on every head's RoPE query rows against the shared key",
    lacking=_lacking, valid=_rope_valid, control=lambda site, g: run("gl_under_rope", site, g), families=_rope_families,
    projection=ProjectionRule("dense", frozenset({"latent.q_rope", "latent.q_rope_bias", "latent.k_rope", "latent.k_rope_bias"}),
                          sites=lambda site: site.latent is not None),
    count=_count("qk_rope"), default=True, proof_order=3, transform_order=7,
))


# ---------------------------------------------------------------------- latent_rotation
def _rotation_valid(site: AttentionSite, g, log_scale: float) -> None:
    for lat in _latents(site):
        rotate_latent(site, lat.name, random_orthogonal(1, lat.width, generator=g)[0])


def _rotation_families(site: AttentionSite) -> list[Family]:
    out = []
    for x in site.latent.latents():
        L = x.width
        iu = torch.triu_indices(L, L, 1)

        def rotation(t, name=x.name, L=L, iu=iu):
            S = torch.zeros(L, L, dtype=t.dtype)
            S[iu[0], iu[1]] = t
            rotate_latent(site, name, torch.linalg.matrix_exp(S - S.mT))

        out.append(Family("latent_rotation", f"{site.name}:{x.name}", L * (L - 1) // 2, rotation, True,
                          "an RMSNorm commutes with rotations of its latent: W_down ← M W_down, W_up ← W_up D Mᵀ D⁻¹"))
    return out


register(Sector(
    name="latent_rotation", family="latent", summary="O(L) on each latent, against its up-projection's columns",
    lacking=_lacking, valid=_rotation_valid, control=lambda site, g: run("latent_gl", site, g),
    families=_rotation_families, count=_count("latent_rotation"), proof_order=4, transform_order=5,
))


# ---------------------------------------------------------------------- latent_gain
def _gain_valid(site: AttentionSite, g, log_scale: float) -> None:
    for lat in _latents(site):
        sign = torch.where(torch.rand(lat.width, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
        scale_latent_gain(site, lat.name, sign * _log_uniform((lat.width,), log_scale, g, torch.float64))


def _gain_families(site: AttentionSite) -> list[Family]:
    out = []
    for x in site.latent.latents():
        def gain(t, name=x.name):
            scale_latent_gain(site, name, torch.exp(t))

        out.append(Family("latent_gain", f"{site.name}:{x.name}", x.width, gain, True, "the up-projection sees W_up diag(γ)"))
    return out


register(Sector(
    name="latent_gain", family="latent", summary="each latent's norm gain against its up-projection's columns",
    lacking=_lacking, valid=_gain_valid, control=lambda site, g: run("latent_gain_alone", site, g),
    families=_gain_families, count=_count("latent_gain"), proof_order=5, transform_order=4,
))


# ---------------------------------------------------------------------- the latent controls
def _is_latent(site: AttentionSite) -> bool:
    return site.latent is not None


def _rope_per_head(site: AttentionSite, g, log_scale: float) -> None:
    lat = site.latent
    B = random_commutant(lat.rope, lat.r, site.h, log_scale=log_scale, generator=g)
    act_qk_rope(site, B[:1], per_head=B)


def _perm_without_rope(site: AttentionSite, g, log_scale: float) -> None:
    lat = site.latent
    kept = [(ref, ref.get().detach().clone()) for ref in (lat.q_rope, lat.q_rope_bias) if ref is not None]
    kv = torch.arange(site.h_kv).roll(1)
    permute_heads(site, kv, (kv[:, None] * site.n_rep + torch.arange(site.n_rep)).reshape(-1))
    with torch.no_grad():
        for ref, saved in kept:
            ref.get().copy_(saved)


def _latent_gl(site: AttentionSite, g, log_scale: float) -> None:
    for lat in site.latent.latents():
        rotate_latent(site, lat.name, random_well_conditioned(1, lat.width, log_scale=log_scale, generator=g)[0],
                      check=False)


def _latent_gain_alone(site: AttentionSite, g, log_scale: float) -> None:
    for lat in site.latent.latents():
        scale_latent_gain(site, lat.name, _log_uniform((lat.width,), log_scale, g, torch.float64), move_columns=False)


_MLA = "multi-head latent attention"
register_control(Control("rope_per_head", "latent", _is_latent, _MLA, _rope_per_head))
register_control(Control("perm_without_rope", "latent",
                         lambda s: s.latent is not None and s.h > 1 and not s.fixed_head_order,
                         "multi-head latent attention with two or more heads", _perm_without_rope))
register_control(Control("latent_gl", "latent", _is_latent, _MLA, _latent_gl))
register_control(Control("latent_gain_alone", "latent", _is_latent, _MLA, _latent_gain_alone))
