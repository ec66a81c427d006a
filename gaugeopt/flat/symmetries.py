"""Every continuous symmetry gaugeopt knows, as families of finite actions on one model.

A :class:`Family` is a sector's finite action ``t ↦ g(t)`` (``t = 0`` the identity) bound to one
model instance. :func:`symmetry_families` lists them all:

* the attention sectors of the registry (:mod:`gaugeopt.sectors`), per site, in the
  certificate's order (docs/gauge_group.md): ``qk`` (``A = exp(Σ t_k E_k)`` over the
  RoPE commutant basis, :func:`~gaugeopt.sectors.group_actions.act_qk`), ``vo`` (``C = exp(t)``),
  ``qk_gain`` (QK-norm gains, ``d = exp(t)`` per slot; with a per-head norm and ``eps = 0`` also
  ``qk_head_scale``, each head's rows scaled), ``key_bias`` and ``value_bias``
  (:mod:`gaugeopt.records.bias_sector`), with multipliers ``lrm_qk``, ``lrm_vo`` (``exp(t)`` per slot or
  channel) and, per :class:`~gaugeopt.models.lrm.LRMLinear`, ``lrm_internal``; on multi-head latent
  attention (:mod:`gaugeopt.records.latent`) ``qk_rope`` (``B = exp(Σ t_k E_k)`` over the shared key's
  RoPE commutant), ``latent_rotation`` (``M = exp(S)``, ``S`` antisymmetric, per latent) and
  ``latent_gain`` (``e = exp(t)`` per latent channel);
* the stream sectors (:mod:`gaugeopt.flat.stream_sectors`) when :func:`gaugeopt.flat.stream.find_stream`
  knows the model;
* for the record, families that are *not* symmetries but look like one: ``key_bias_rope`` (the
  key-bias shift on RoPE-rotated channels), ``value_bias_sink`` (the value-bias trade under
  attention sinks) and the stream's inexact ones (residual rotations under
  a tied head, ...), with ``exact=False``.

Head permutations are discrete and have no family. The actions are the library's own
(:mod:`gaugeopt.sectors.group_actions`), so a family's generators (complex step of ``apply``) are the
directions those actions move along; :func:`gaugeopt.flat_directions` measures them against the
model's null space.

Example:
    >>> import torch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.flat.symmetries import symmetry_families
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, rope="split_half", rotary_dim=2))
    >>> families, note = symmetry_families(model)
    >>> [(f.name, f.dim) for f in families if f.unit == "transformer.h.0.attn"]
    [('qk', 12), ('vo', 32), ('key_bias', 4), ('value_bias', 8), ('key_bias_rope', 4)]
    >>> note
    ''
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt import sectors
from gaugeopt.adapters.find import find_attention
from gaugeopt.sectors.registry import Family
from gaugeopt.records.site import AttentionSite
from gaugeopt.flat.stream import find_stream
from gaugeopt.flat.stream_sectors import stream_families

__all__ = ["ATTENTION_SECTORS", "Family", "attention_families", "symmetry_families"]


def __getattr__(name: str):
    if name == "ATTENTION_SECTORS":  # the registered sectors that have continuous families (perm has none)
        return tuple(s.name for s in sectors.sectors() if s.families is not None or s.layer_families is not None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def attention_families(site: AttentionSite) -> list[Family]:
    """The attention sectors of one site (module docstring), in the certificate's order: the exact
    families of the sectors it has, then the near-symmetries (``key_bias_rope``, ``value_bias_sink``)."""
    exact: list[Family] = []
    near: list[Family] = []
    for sec in sectors.in_proof_order():
        if sec.families is not None and sec.claimed_by(site):
            exact += sec.families(site)
        if sec.near_families is not None:
            near += sec.near_families(site)
    return exact + near


def symmetry_families(model: nn.Module, *, sites=None) -> tuple[list[Family], str]:
    """Every family of ``model`` (module docstring) and a note: ``""``, or why the stream sectors are
    missing (:func:`~gaugeopt.flat.stream.find_stream` refused the model) and what the model
    computes in float32 (its symmetries are then exact only to float32 rounding)."""
    sites = find_attention(model) if sites is None else list(sites)
    fams = [f for s in sites for f in attention_families(s)]
    for sec in sectors.in_proof_order():  # sectors that act on layers, not records (lrm_internal)
        if sec.layer_families is not None:
            fams += sec.layer_families(model)
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
