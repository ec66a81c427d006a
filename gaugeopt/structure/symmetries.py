"""Every continuous symmetry gaugeopt knows, as families of finite actions on one model.

A :class:`Family` is a sector's finite action ``t ↦ g(t)`` (``t = 0`` the identity) bound to one
model instance. :func:`symmetry_families` lists them all:

* the attention sectors, per site (docs/gauge_group.md): ``qk`` (``A = exp(Σ t_k E_k)`` over the
  RoPE commutant basis, :func:`~gaugeopt.structure.actions.act_qk`), ``vo`` (``C = exp(t)``),
  ``qk_gain`` (QK-norm gains, ``d = exp(t)`` per slot; with a per-head norm and ``eps = 0`` also
  ``qk_head_scale``, each head's rows scaled), ``key_bias`` and ``value_bias``
  (:mod:`gaugeopt.structure.bias`), with multipliers ``lrm_qk``, ``lrm_vo`` (``exp(t)`` per slot or
  channel) and, per :class:`~gaugeopt.structure.lrm.LRMLinear`, ``lrm_internal``; on multi-head latent
  attention (:mod:`gaugeopt.structure.latent`) ``qk_rope`` (``B = exp(Σ t_k E_k)`` over the shared key's
  RoPE commutant), ``latent_rotation`` (``M = exp(S)``, ``S`` antisymmetric, per latent) and
  ``latent_gain`` (``e = exp(t)`` per latent channel);
* the stream sectors (:mod:`gaugeopt.structure.stream_sectors`) when :func:`gaugeopt.structure.stream.find_stream`
  knows the model;
* for the record, families that are *not* symmetries but look like one: ``key_bias_rope`` (the
  key-bias shift on RoPE-rotated channels), ``value_bias_sink`` (the value-bias trade under
  attention sinks) and the stream's inexact ones (residual rotations under
  a tied head, ...), with ``exact=False``.

Head permutations are discrete and have no family. The actions are the library's own
(:mod:`gaugeopt.structure.actions`), so a family's generators (complex step of ``apply``) are the
directions those actions move along; :func:`gaugeopt.flat_directions` measures them against the
model's null space.

Example:
    >>> import torch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.structure.symmetries import symmetry_families
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, rope="split_half", rotary_dim=2))
    >>> families, note = symmetry_families(model)
    >>> [(f.name, f.dim) for f in families if f.unit == "transformer.h.0.attn"]
    [('qk', 12), ('vo', 32), ('key_bias', 4), ('value_bias', 8), ('key_bias_rope', 4)]
    >>> note
    ''
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.structure.actions import (
    act_qk,
    act_vo,
    rescale_lrm_internal,
    scale_qk_gains,
    scale_qk_multipliers,
    scale_vo_multipliers,
    shift_key_bias,
    trade_value_bias,
)
from gaugeopt.structure.latent import LATENT_SECTORS, act_qk_rope, rotate_latent, scale_latent_gain
from gaugeopt.structure.lrm import LRMLinear
from gaugeopt.structure.registry import find_attention
from gaugeopt.structure.rope import commutant_basis, orthogonal_commutant_basis, plane_index
from gaugeopt.structure.site import AttentionSite

__all__ = ["ATTENTION_SECTORS", "Family", "attention_families", "symmetry_families"]

ATTENTION_SECTORS = ("qk", "vo", "lrm_qk", "lrm_vo", "lrm_internal", "qk_gain", "key_bias", "value_bias",
                     *LATENT_SECTORS)


@dataclass(frozen=True)
class Family:
    """A continuous family of transformations of one model's parameters.

    Attributes:
        name: the sector (:data:`ATTENTION_SECTORS`, :data:`~gaugeopt.structure.stream_sectors.STREAM_SECTORS`,
            or a near-symmetry such as ``key_bias_rope``).
        unit: where it acts (an attention site, a norm, a layer, ``"model"``).
        dim: the length of ``t``.
        apply: ``apply(t)`` moves the model the family was built on, in place, by ``g(t)``; ``t`` is
            real or complex (complex steps give exact generators); ``t = 0`` is the identity.
        exact: whether ``g(t)`` is a symmetry of the model as built (``False``: a family listed to
            show that it is *not* one, e.g. residual rotations under a tied head).
        why: one line on why it is (or is not) a symmetry.
    """

    name: str
    unit: str
    dim: int
    apply: Callable[[torch.Tensor], None]
    exact: bool = True
    why: str = ""


def _slots(rope, d_k: int) -> tuple[torch.Tensor, int]:
    pid = plane_index(rope, d_k)
    return pid, int(pid.max()) + 1


def attention_families(site: AttentionSite) -> list[Family]:
    """The attention sectors of one site (module docstring), exact ones first, then ``key_bias_rope``."""
    out: list[Family] = []
    g, dk, dv, u = site.h_kv, site.d_k, site.d_v, site.name
    if site.qk_norm is None:
        basis = orthogonal_commutant_basis(site.rope, dk) if site.qk_orthogonal else commutant_basis(site.rope, dk)
        n = basis.shape[0]

        def qk(t, basis=basis, n=n):
            A = torch.linalg.matrix_exp(torch.einsum("gk,kab->gab", t.reshape(g, n), basis.to(t.dtype)))
            act_qk(site, A)

        out.append(Family("qk", u, g * n, qk, True, "scores q·k unchanged by Aᵀ, A⁻¹ (A in the RoPE commutant)"))
    else:
        pair = site.pair("qk_gain")
        pid, n = _slots(pair.rope, dk)

        def qk_gain(t, pid=pid, n=n, groups=pair.groups):
            scale_qk_gains(site, torch.exp(t.reshape(groups, n))[:, pid])

        out.append(Family("qk_gain", u, pair.groups * n, qk_gain, True, "QK-norm gains g_q ⊙ d, g_k ⊘ d"))
        if site.qk_norm.eps == 0 and site.qk_norm.scope == "head":
            def head_scale(t):  # with eps = 0 a per-head norm forgets the scale of its rows
                for p, heads, part in (("q", site.h, t[: site.h]), ("k", g, t[site.h:])):
                    w, b = site.effective(p)
                    c = torch.exp(part).to(w)
                    site.set_effective(p, w * c[:, None, None], None if b is None else b * c[:, None])

            out.append(Family("qk_head_scale", u, site.h + g, head_scale, True, "a norm with eps = 0 ignores a head's scale"))

    def vo(t):
        act_vo(site, torch.linalg.matrix_exp(t.reshape(g, dv, dv)))

    out.append(Family("vo", u, g * dv * dv, vo, True, "W_O v unchanged by Cᵀ, C⁻ᵀ"))
    if site.latent is not None:
        out += _latent_families(site)
    if site.qk_norm is None and not site.qk_orthogonal and site.has_multipliers:
        pid, n = _slots(site.rope, dk)

        def lrm_qk(t, pid=pid, n=n):
            scale_qk_multipliers(site, torch.exp(t.reshape(g, n))[:, pid])

        out.append(Family("lrm_qk", u, g * n, lrm_qk, True, "r_Q ⊙ δ, r_K ⊘ δ"))
    if site.v.row_mult is not None and site.o.col_mult is not None:
        def lrm_vo(t):
            scale_vo_multipliers(site, torch.exp(t.reshape(g, dv)))

        out.append(Family("lrm_vo", u, g * dv, lrm_vo, True, "r_V ⊙ e, c_O ⊘ e"))
    for kind in site.bias_kinds:
        sec = site.bias_sector(kind)
        action = shift_key_bias if kind == "key_bias" else trade_value_bias

        def bias(t, action=action, width=len(sec.channels)):
            action(site, t.reshape(g, width))

        why = "q_i·δ is the same for every key" if kind == "key_bias" else "attention rows sum to one"
        out.append(Family(kind, u, sec.dim, bias, True, why))
    if site.sinks is not None and site.v.bias is not None and site.o.bias is not None:
        def value_bias_sink(t):  # the trade that is exact without sinks
            _, bv = site.effective("v")
            wo, bo = site.effective("o")
            delta = t.reshape(g, dv).to(bv)
            site.set_effective_bias("v", bv + delta)
            site.set_effective_bias("o", bo - torch.einsum("dhv,hv->d", wo, site.per_query(delta).to(wo)).to(bo))

        out.append(Family("value_bias_sink", u, g * dv, value_bias_sink, False,
                          "attention sinks: a row's weights sum to 1 − p_sink, so b_O cannot take W_O δ back"))
    rotated = sorted(c for plane in site.rope.planes(dk) for c in plane)
    if site.k.bias is not None and site.qk_norm is None and rotated:
        def key_bias_rope(t):
            _, bk = site.effective("k")
            bk[:, rotated] = bk[:, rotated] + t.reshape(g, len(rotated)).to(bk)
            site.set_effective_bias("k", bk)

        out.append(Family("key_bias_rope", u, g * len(rotated), key_bias_rope, False,
                          "RoPE rotates δ by the key's position: q_iᵀR δ varies over keys"))
    return out


def _latent_families(site: AttentionSite) -> list[Family]:
    """``qk_rope``, ``latent_rotation`` and ``latent_gain`` of a multi-head latent attention site."""
    lat, u = site.latent, site.name
    basis = commutant_basis(lat.rope, lat.r)

    def qk_rope(t, basis=basis):
        act_qk_rope(site, torch.linalg.matrix_exp(torch.einsum("k,kab->ab", t, basis.to(t.dtype)))[None])

    out = [Family("qk_rope", u, basis.shape[0], qk_rope, True,
                  "q_i^rope·k_pe unchanged by Bᵀ on every head, B⁻¹ on the shared key (B in its RoPE commutant)")]
    for x in lat.latents():
        L = x.width
        iu = torch.triu_indices(L, L, 1)

        def rotation(t, name=x.name, L=L, iu=iu):
            S = torch.zeros(L, L, dtype=t.dtype)
            S[iu[0], iu[1]] = t
            rotate_latent(site, name, torch.linalg.matrix_exp(S - S.mT))

        def gain(t, name=x.name):
            scale_latent_gain(site, name, torch.exp(t))

        out.append(Family("latent_rotation", f"{u}:{x.name}", L * (L - 1) // 2, rotation, True,
                          "an RMSNorm commutes with rotations of its latent: W_down ← M W_down, W_up ← W_up D Mᵀ D⁻¹"))
        out.append(Family("latent_gain", f"{u}:{x.name}", L, gain, True, "the up-projection sees W_up diag(γ)"))
    return out


def _lrm_family(name: str, m: LRMLinear) -> Family:
    sizes = [m.out_features] + [m.in_features] * len(m.split_sizes)

    def apply(t):
        parts = torch.exp(t).split(sizes)
        rescale_lrm_internal(m, parts[0], list(parts[1:]))

    return Family("lrm_internal", name, sum(sizes), apply, True, "diag(r)·W̄·diag(c) unchanged")


def symmetry_families(model: nn.Module, *, sites=None) -> tuple[list[Family], str]:
    """Every family of ``model`` (module docstring) and a note: ``""``, or why the stream sectors are
    missing (:func:`~gaugeopt.structure.stream.find_stream` refused the model) and what the model
    computes in float32 (its symmetries are then exact only to float32 rounding)."""
    from gaugeopt.structure.stream import find_stream
    from gaugeopt.structure.stream_sectors import stream_families

    sites = find_attention(model) if sites is None else list(sites)
    fams = [f for s in sites for f in attention_families(s)]
    fams += [_lrm_family(n, m) for n, m in model.named_modules() if isinstance(m, LRMLinear)]
    float32 = [f"{s.name} computes {s.float32_steps}" for s in sites if s.float32_steps]
    missing = []
    try:
        stream = find_stream(model)
        fams += stream_families(stream)
        if stream.float32_steps:
            float32.append(f"the model computes {stream.float32_steps}")
    except GaugeError as err:
        missing.append(str(err))
    if float32:
        float32.append("a float32 step rounds every symmetry to ~1e-7: measure with it computed in float64")
    return sorted(fams, key=lambda f: not f.exact), "; ".join(missing + float32)
