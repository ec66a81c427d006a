"""The head sectors: ``qk``, ``vo`` and ``perm``, with the plain-attention negative controls.

Per KV group ``j`` shared by its query heads (docs/gauge_group.md):

========  ==========================================================  ==============================
sector    element                                                     negative control
========  ==========================================================  ==============================
``qk``    ``A ∈ GL(d_k)`` in the RoPE commutant: ``W_Q[i] ← AᵀW_Q[i]``,   ``gl_under_rope`` under RoPE, else
          ``W_K[j] ← A⁻¹W_K[j]`` (only its orthogonal part where the     ``asymmetric_qk``; ``qk_under_norm``
          norm is weight-free, ``site.qk_orthogonal``)                    with a weight-free norm
``vo``    ``C ∈ GL(d_v)``: ``W_V[j] ← CᵀW_V[j]``, ``W_O[:, i] ← W_O[:, i]C⁻ᵀ``  ``vo_mismatch``
``perm``  KV groups, and query heads within them, reordered together       query heads moved alone;
          (sinks and latent RoPE rows move with their heads)                ``sinks_unmoved``,
                                                                           ``perm_without_rope``
========  ==========================================================  ==============================

A QK-norm record has no ``qk`` (its Q/K gauge is ``qk_gain``, :mod:`.norm_gains`); a record whose head
order is fixed (ALiBi, T5's relative bias) has no ``perm``: its one valid permutation is the identity.
The controls of :func:`gaugeopt.invalid_gauge_transform` registered here: ``asymmetric_qk``,
``wrong_inverse``, ``vo_mismatch``, ``cross_head``, ``gl_under_rope`` and ``sinks_unmoved``.

Example:
    >>> from gaugeopt.sectors import sector
    >>> sector("vo").summary
    'GL(d_v) per KV group on W_V rows and W_O columns'
"""

from __future__ import annotations

import torch

from gaugeopt.linalg import random_well_conditioned
from gaugeopt.sectors.group_actions import act_qk, act_vo, permute_heads
from gaugeopt.records.latent import act_qk_rope
from gaugeopt.records.rope import (commutant_basis, orthogonal_commutant_basis, random_commutant,
                                     random_orthogonal_commutant)
from gaugeopt.sectors.registry import Control, Family, ProjectionRule, Sector, register, register_control, run
from gaugeopt.records.site import AttentionSite

__all__ = ["QK_NORM_LACKS"]

# Why a QK-norm record lacks a plain-attention Q/K gauge ({} names it).
QK_NORM_LACKS = ("it normalises queries and keys (QK-norm): {} is not a symmetry there; its Q/K gauge is kind "
                 "'qk_gain' (the norm's gains, docs/qk_norm.md)")


# ---------------------------------------------------------------------- qk
def _qk_lacking(site: AttentionSite) -> str | None:
    return None if site.qk_norm is None else QK_NORM_LACKS.format("GL(d_k) on W_Q/W_K")


def _qk_valid(site: AttentionSite, g, log_scale: float) -> None:
    if site.qk_orthogonal:  # a rotation per RoPE plane, SO of the non-rotary block
        act_qk(site, random_orthogonal_commutant(site.rope, site.d_k, site.h_kv, generator=g))
    else:
        act_qk(site, random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g))


def _qk_control(site: AttentionSite, g) -> str:
    if site.qk_orthogonal:  # the whole commutant, which the weight-free norm breaks
        return run("qk_under_norm", site, g)
    return run("gl_under_rope" if site.rope.active else "asymmetric_qk", site, g)


def _qk_families(site: AttentionSite) -> list[Family]:
    g = site.h_kv
    basis = orthogonal_commutant_basis(site.rope, site.d_k) if site.qk_orthogonal else commutant_basis(site.rope, site.d_k)
    n = basis.shape[0]

    def qk(t, basis=basis, n=n):
        A = torch.linalg.matrix_exp(torch.einsum("gk,kab->gab", t.reshape(g, n), basis.to(t.dtype)))
        act_qk(site, A)

    return [Family("qk", site.name, g * n, qk, True, "scores q·k unchanged by Aᵀ, A⁻¹ (A in the RoPE commutant)")]


def _dense_qk(site: AttentionSite) -> bool:
    # a layer whose Q/K gauge is only the rotations of its RoPE planes (an L2 Q/K norm, Llama 4) has no dense qk
    # sector when it also has channels RoPE leaves alone (no model in use does; docs/projection.md)
    return site.qk_norm is None and not (site.qk_orthogonal and site.rope.rotary_dim < site.d_k)


register(Sector(
    name="qk", family="head", summary="GL(d_k) per KV group in the RoPE commutant, A^T on W_Q and A^-1 on W_K",
    lacking=_qk_lacking, valid=_qk_valid, control=_qk_control, families=_qk_families,
    projection=ProjectionRule("dense", frozenset({"q.weight", "q.bias", "k.weight", "k.bias"}), sites=_dense_qk),
    count=lambda s: {} if s.qk_norm is not None else {"qk": s.h_kv * s.qk_dim()},
    default=True, proof_order=0, transform_order=6,
))


# ---------------------------------------------------------------------- vo
def _vo_valid(site: AttentionSite, g, log_scale: float) -> None:
    act_vo(site, random_well_conditioned(site.h_kv, site.d_v, log_scale=log_scale, generator=g))


def _vo_families(site: AttentionSite) -> list[Family]:
    g, dv = site.h_kv, site.d_v

    def vo(t):
        act_vo(site, torch.linalg.matrix_exp(t.reshape(g, dv, dv)))

    return [Family("vo", site.name, g * dv * dv, vo, True, "W_O v unchanged by Cᵀ, C⁻ᵀ")]


register(Sector(
    name="vo", family="head", summary="GL(d_v) per KV group on W_V rows and W_O columns",
    lacking=lambda site: None, valid=_vo_valid, control=lambda site, g: run("vo_mismatch", site, g),
    through_scores=False, families=_vo_families,
    projection=ProjectionRule("dense", frozenset({"v.weight", "v.bias", "o.weight"})),
    count=lambda s: {"vo": s.h_kv * s.d_v**2},
    default=True, proof_order=2, transform_order=9,
))


# ---------------------------------------------------------------------- perm
def _perm_valid(site: AttentionSite, g, log_scale: float) -> None:
    if site.fixed_head_order:  # the only valid permutation of these heads is the identity
        return
    kv_perm = torch.randperm(site.h_kv, generator=g)
    within = torch.argsort(torch.rand(site.h_kv, site.n_rep, generator=g), dim=1)
    permute_heads(site, kv_perm, (kv_perm[:, None] * site.n_rep + within).reshape(-1))


def _perm_proof(site: AttentionSite, g) -> None:
    """A permutation that is never the identity (the certificate claims ``perm`` with two heads or more)."""
    kv = torch.randperm(site.h_kv, generator=g)
    if site.h_kv > 1 and torch.equal(kv, torch.arange(site.h_kv)):
        kv = kv.roll(1)
    within = torch.argsort(torch.rand(site.h_kv, site.n_rep, generator=g), dim=1)
    if site.h_kv == 1:
        within = within.roll(1, dims=1) if torch.equal(within[0], torch.arange(site.n_rep)) else within
    permute_heads(site, kv, (kv[:, None] * site.n_rep + within).reshape(-1))


def _perm_control(site: AttentionSite, g) -> str:
    if site.sinks is not None:  # every head moved but its sink logit
        return run("sinks_unmoved", site, g)
    if site.latent is not None:  # every head moved but its RoPE query rows
        return run("perm_without_rope", site, g)
    perm = torch.arange(site.h).roll(1)  # query heads moved, their keys, values and output columns not
    for role, ref in site.q.refs():
        if role != "col_mult":
            v = ref.get()
            v.copy_(v[perm])
    return "q_heads_alone"


register(Sector(
    name="perm", family="head", summary="KV groups and their query heads reordered together",
    lacking=lambda site: None, present=lambda site: site.h > 1 and not site.fixed_head_order,
    valid=_perm_valid, proof_element=_perm_proof, control=_perm_control,
    default=True, proof_order=6, transform_order=10,
))


# ---------------------------------------------------------------------- the plain-attention controls
def _rwc(site, g, log_scale, n, d):
    return random_well_conditioned(n, d, log_scale=log_scale, generator=g)


def _asymmetric_qk(site: AttentionSite, g, log_scale: float) -> None:
    A = random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g)
    B = random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g)
    act_qk(site, A, B_inv=torch.linalg.inv(B), check=False)  # A, B in the commutant by construction


def _wrong_inverse(site: AttentionSite, g, log_scale: float) -> None:
    A = random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g)
    act_qk(site, A, B_inv=A.mT, check=False)


def _vo_mismatch(site: AttentionSite, g, log_scale: float) -> None:
    act_vo(site, _rwc(site, g, log_scale, site.h_kv, site.d_v), D=_rwc(site, g, log_scale, site.h_kv, site.d_v))


def _gl_under_rope(site: AttentionSite, g, log_scale: float) -> None:
    if site.rope.active:
        act_qk(site, _rwc(site, g, log_scale, site.h_kv, site.d_k), check=False)
    if site.latent is not None:  # the RoPE part of latent attention
        act_qk_rope(site, _rwc(site, g, log_scale, 1, site.latent.r), check=False)


def _cross_head(site: AttentionSite, g, log_scale: float) -> None:
    _mix_heads(site, _rwc(site, g, log_scale, 1, site.h_kv * site.d_k)[0])


@torch.no_grad()
def _mix_heads(site: AttentionSite, M: torch.Tensor) -> None:
    """``q_all ← Mᵀ q_all`` and ``k_all ← M⁻¹ k_all`` over the stacked KV groups (per query
    replica), which keeps ``Σ_heads q·k`` but not the per-head scores the softmax sees."""
    if site.h_kv < 2:
        return
    wq, bq = site.effective("q")  # (h, d_k, d)
    wk, bk = site.effective("k")  # (h_kv, d_k, d)
    hk, n, dk = site.h_kv, site.n_rep, site.d_k
    M = M.to(wq)
    Mi = torch.linalg.inv(M)

    def mix(w, mat, grouped):  # w: (h_kv*n or h_kv, d_k, ...) -> same
        tail = w.shape[2:]
        if grouped:
            x = w.reshape(hk, n, dk, *tail).transpose(0, 1).reshape(n, hk * dk, *tail)
            x = torch.einsum("ab,nb...->na...", mat, x)
            return x.reshape(n, hk, dk, *tail).transpose(0, 1).reshape(hk * n, dk, *tail)
        return torch.einsum("ab,b...->a...", mat, w.reshape(hk * dk, *tail)).reshape(hk, dk, *tail)

    site.set_effective("q", mix(wq, M.mT, True), None if bq is None else mix(bq, M.mT, True))
    site.set_effective("k", mix(wk, Mi, False), None if bk is None else mix(bk, Mi, False))


def _sinks_unmoved(site: AttentionSite, g, log_scale: float) -> None:
    saved = site.sinks.get().detach().clone()
    kv_perm = torch.arange(site.h_kv).roll(1) if site.h_kv > 1 else torch.arange(1)
    q_perm = (kv_perm[:, None] * site.n_rep + torch.arange(site.n_rep).roll(1)[None, :]).reshape(-1)
    permute_heads(site, kv_perm, q_perm)
    with torch.no_grad():
        site.sinks.get().copy_(saved)


def _always(site: AttentionSite) -> bool:
    return True


register_control(Control("asymmetric_qk", "plain", _always, "", _asymmetric_qk))
register_control(Control("wrong_inverse", "plain", _always, "", _wrong_inverse))
register_control(Control("vo_mismatch", "plain", _always, "", _vo_mismatch))
register_control(Control("cross_head", "plain", lambda s: s.h_kv >= 2, "at least two KV heads", _cross_head))
register_control(Control("gl_under_rope", "plain", lambda s: s.rope.active or s.latent is not None, "a model with RoPE",
                         _gl_under_rope))
register_control(Control("sinks_unmoved", "sinks", lambda s: s.sinks is not None and s.h > 1 and not s.fixed_head_order,
                         "attention sinks on more than one head", _sinks_unmoved))
