"""Gauge transformations of a whole model: random valid elements and negative controls, through the gate.

:func:`random_gauge_transform` applies a random element of every sector it is asked for (the kinds,
docs/gauge_group.md) to every attention layer that has it; :func:`invalid_gauge_transform` applies one of
the named negative controls — the paper's (asymmetric Q/K, wrong inverse, V/O mismatch, cross-head
mixing, a general ``GL(d_k)`` under RoPE), those of QK-norm (the plain Q/K gauge under the norm,
per-head scalars on ``W_Q``, gain rescales that break the rule), of the bias sectors (a key-bias shift
on RoPE-rotated channels, a value bias moved without the output bias), of attention sinks and of
latent attention —, each of which must change the function. :func:`relative_change` measures either.
Both pass the gate first (:mod:`gaugeopt.trust.gate`): the records are checked and proved on
the model as it is now.

What a kind does, which layers have it, its random element and its controls are the sector registry's
(:mod:`gaugeopt.sectors`); :data:`VALID_KINDS`, :data:`INVALID_KINDS` and the other tuples here
are read from it. :func:`apply_valid` and :func:`apply_invalid` act on one record without the gate (the
building blocks). The finite actions themselves (:func:`act_qk`, :func:`act_vo`, :func:`permute_heads`,
the multiplier, gain and bias moves) are :mod:`gaugeopt.sectors.group_actions`', importable from here.

Example:
    >>> import copy, torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, rope="interleaved")).double()
    >>> x = torch.randint(0, 64, (2, 16))
    >>> moved = gaugeopt.random_gauge_transform(copy.deepcopy(model), generator=torch.Generator().manual_seed(1))
    >>> gaugeopt.relative_change(model(x)[0], moved(x)[0]) < 1e-12
    True
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.models.lrm import LRMLinear
from gaugeopt import sectors
from gaugeopt.trust.gate import trusted_sites
from gaugeopt.sectors.group_actions import (  # noqa: F401  (the actions, importable from here as they always were)
    _log_uniform,
    act_qk,
    act_vo,
    as_generator,
    permute_heads,
    random_lrm_internal,
    relative_change,
    rescale_lrm_internal,
    scale_qk_gains,
    scale_qk_multipliers,
    scale_vo_multipliers,
    shift_key_bias,
    trade_value_bias,
)
from gaugeopt.records.site import AttentionSite

__all__ = [
    "act_qk",
    "act_vo",
    "permute_heads",
    "scale_qk_multipliers",
    "scale_vo_multipliers",
    "rescale_lrm_internal",
    "scale_qk_gains",
    "shift_key_bias",
    "trade_value_bias",
    "random_gauge_transform",
    "invalid_gauge_transform",
    "apply_valid",
    "apply_invalid",
    "random_lrm_internal",
    "relative_change",
    "VALID_KINDS",
    "INVALID_KINDS",
    "QK_NORM_INVALID_KINDS",
    "BIAS_INVALID_KINDS",
    "SINK_INVALID_KINDS",
    "LATENT_INVALID_KINDS",
    "ALL_INVALID_KINDS",
    "applicable_invalid_kinds",
]


# ---------------------------------------------------------------------- the kinds, read from the registry
def _valid_kinds() -> tuple[str, ...]:
    return tuple(s.name for s in sectors.sectors())


def _controls(*groups: str) -> tuple[str, ...]:
    return tuple(c.name for c in sectors.controls() if c.group in groups)


def _all_invalid_kinds() -> tuple[str, ...]:
    return _controls("plain", "qk_norm", "bias", "sinks") + _controls("latent")


# The public tuples (VALID_KINDS, INVALID_KINDS, ...) are computed from the registry when read, so that a
# sector registered later is in them: the valid kinds are the sectors; INVALID_KINDS the named controls of
# plain attention, QK-norm, biases and sinks, in that order; LATENT_INVALID_KINDS those of latent attention.
_DERIVED = {
    "VALID_KINDS": _valid_kinds,
    "BIAS_KINDS": lambda: tuple(s.name for s in sectors.sectors() if s.family == "bias"),
    "INVALID_KINDS": lambda: _controls("plain", "qk_norm", "bias", "sinks"),
    "QK_NORM_INVALID_KINDS": lambda: _controls("qk_norm"),
    "BIAS_INVALID_KINDS": lambda: _controls("bias"),
    "SINK_INVALID_KINDS": lambda: _controls("sinks"),
    "LATENT_INVALID_KINDS": lambda: _controls("latent"),
    "ALL_INVALID_KINDS": _all_invalid_kinds,
}


def __getattr__(name: str):
    derive = _DERIVED.get(name)
    if derive is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return derive()


# ---------------------------------------------------------------------- valid elements
def _site_kinds(site: AttentionSite, kinds: tuple[str, ...], explicit: bool, what: str) -> tuple[str, ...]:
    """The kinds ``site`` has; an explicitly requested kind it lacks is refused with the alternative."""
    lacking = {k: sectors.sector(k).lacking(site) for k in kinds}
    bad = [k for k in kinds if lacking[k] is not None]
    if bad and explicit:
        raise GaugeError(f"{what}: kind {bad[0]!r} does not apply to {site.name}: {lacking[bad[0]]}; or pass kinds='all'")
    return tuple(k for k in kinds if k not in bad)


def random_gauge_transform(
    model: nn.Module,
    kinds: Sequence[str] | str | None = None,
    generator: torch.Generator | int | None = None,
    *,
    sites: Sequence[AttentionSite] | None = None,
    log_scale: float = 0.5,
) -> nn.Module:
    """Apply a random valid gauge transformation to every attention layer, in place.

    Elements are well conditioned (singular values in ``[e^{-s}, e^{s}]``, ``s = log_scale``)
    so the transformed model computes the same function to a few ulps. The records pass the gate
    first (:mod:`gaugeopt.trust.gate`): checked, and proved on the model as it is now.

    Args:
        model: the model (modified and returned).
        kinds: ``None`` (default): each layer's own Q/K gauge (``"qk"``, or ``"qk_gain"`` under a
            QK-norm), ``"vo"`` and ``"perm"``; or any of ``"qk"`` (``GL(d_k)`` per KV group, restricted to the RoPE commutant),
            ``"vo"`` (``GL(d_v)``), ``"perm"`` (head permutations, in the layers whose heads may be
            permuted: not under ALiBi or T5's relative bias), ``"lrm_qk"``, ``"lrm_vo"``
            (diagonal multiplier gauges), ``"lrm_internal"`` (every LRM layer's internal
            rescaling), ``"qk_gain"`` (a QK-norm site's gain gauge, with random signs), ``"key_bias"``,
            ``"value_bias"`` (the bias sectors, :mod:`gaugeopt.records.bias_sector`: shifts ``δ ~
            N(0, log_scale²)``), on multi-head latent attention ``"qk_rope"`` (the RoPE part),
            ``"latent_rotation"`` (Haar-random ``O(L)`` per latent) and ``"latent_gain"`` (a gain factor per
            latent channel, random signs; docs/mla.md), any other registered sector
            (:mod:`gaugeopt.sectors`), or ``"all"`` for every kind each site has. A QK-norm site has
            ``"qk_gain"`` and neither ``"qk"``, ``"lrm_qk"`` nor ``"key_bias"``; a key bias under full
            RoPE has no ``"key_bias"`` sector; asking a site for a kind it lacks raises :class:`GaugeError`.
        generator: a ``torch.Generator`` or an integer seed, for reproducibility.
        sites: attention sites (default ``find_attention(model)``).

    Returns:
        ``model``.
    """
    if not isinstance(model, nn.Module):
        raise GaugeError(f"random_gauge_transform: model must be an nn.Module (it is modified and returned), got "
                         f"{type(model).__name__}")
    generator = as_generator(generator, "random_gauge_transform")
    sites = trusted_sites(model, "random_gauge_transform", sites=sites)
    has_lrm = any(isinstance(m, LRMLinear) for m in model.modules())
    explicit = kinds not in ("all", None)
    if kinds is None:
        kinds = tuple(s.name for s in sectors.sectors() if s.default)
    elif kinds == "all":
        kinds = tuple(s.name for s in sectors.sectors() if has_lrm or s.family != "multiplier")
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    valid = _valid_kinds()
    bad = [k for k in kinds if k not in valid]
    if bad:
        raise GaugeError(f"random_gauge_transform: unknown kinds {bad}; valid kinds are {valid} or 'all'")
    g = generator
    order = sectors.in_transform_order()
    for site in sites:
        here = _site_kinds(site, kinds, explicit, "random_gauge_transform")
        for sec in order:
            if sec.name in here and sec.layer_valid is None:
                sec.valid(site, g, log_scale)
    for sec in order:  # sectors that act on layers, not records (lrm_internal: every LRM layer)
        if sec.name in kinds and sec.layer_valid is not None:
            sec.layer_valid(model, g, log_scale)
    return model


def apply_valid(site: AttentionSite, kind: str, generator: torch.Generator | None = None, *, log_scale: float = 0.5) -> None:
    """Apply one random valid element of the sector ``kind`` (``"qk"``, ``"qk_gain"``, ``"vo"``, ``"perm"``,
    ``"lrm_qk"``, ``"lrm_vo"``, ``"lrm_internal"`` — the record's LRM layers —, ``"key_bias"``,
    ``"value_bias"``, ``"qk_rope"``, ``"latent_rotation"``, ``"latent_gain"`` or another registered sector)
    to ``site``, in place (no certificate check: the building block of :func:`random_gauge_transform`)."""
    if kind not in _valid_kinds():
        raise GaugeError(f"apply_valid: kind={kind!r} is not one of {_valid_kinds()}")
    sectors.sector(kind).valid(site, generator, log_scale)


# ---------------------------------------------------------------------- negative controls
def applicable_invalid_kinds(sites: Sequence[AttentionSite]) -> tuple[str, ...]:
    """The :data:`ALL_INVALID_KINDS` that apply to these sites (each needs some feature, see
    :func:`invalid_gauge_transform`)."""
    return tuple(k for k in _all_invalid_kinds() if any(sectors.control(k).needs(s) for s in sites))


def _invalid_sites(sites: Sequence[AttentionSite], kind: str) -> list[AttentionSite]:
    """The sites a control acts on; raises when it applies to none of them."""
    c = sectors.control(kind)
    chosen = [s for s in sites if c.needs(s)]
    if not chosen:
        raise GaugeError(f"invalid_gauge_transform: {kind!r} needs {c.needs_what}")
    return chosen


def invalid_gauge_transform(
    model: nn.Module,
    kind: str,
    generator: torch.Generator | int | None = None,
    *,
    sites: Sequence[AttentionSite] | None = None,
    log_scale: float = 0.5,
) -> nn.Module:
    """Apply one of the negative controls to every attention layer it applies to, in place
    (paper 000, Table 7; docs/qk_norm.md for the QK-norm ones).

    =====================  ===============================================================
    ``kind``               transformation (each must change the function)
    =====================  ===============================================================
    ``asymmetric_qk``      ``W_Q ← Aᵀ W_Q``, ``W_K ← B⁻¹ W_K`` with an independent ``B``
    ``wrong_inverse``      ``W_Q ← Aᵀ W_Q``, ``W_K ← Aᵀ W_K`` (transpose instead of inverse)
    ``vo_mismatch``        ``W_V ← Cᵀ W_V``, ``W_O ← W_O D⁻ᵀ`` with an independent ``D``
    ``cross_head``         one ``M ∈ GL(h_kv·d_k)`` mixing the KV groups, ``Mᵀ`` on Q and ``M⁻¹`` on K
    ``gl_under_rope``      a general ``A ∈ GL(d_k)`` (outside the RoPE commutant) with its true inverse
    ``qk_under_norm``      QK-norm sites (and weight-free norms, ``qk_orthogonal``): the plain-attention
                           Q/K gauge, ``A`` in the RoPE commutant (all of ``GL(d_k)`` without RoPE) with its
                           true inverse, on ``W_Q``/``W_K``
    ``head_scalar``        QK-norm sites with ``eps > 0``: ``W_Q[i], b_Q[i] ← c_i·(W_Q[i], b_Q[i])`` with
                           ``c_i = 10^U(−2, −1)`` per query head (a symmetry only at ``eps = 0``,
                           and there only for a per-head norm)
    ``gain_off_plane``     QK-norm before RoPE: the gain rescale with a factor per *channel*,
                           not constant on the RoPE planes
    ``gain_untied``        per-head gains with GQA: a factor per *query head*, the key gain
                           divided by the factor of its group's first query head
    ``gain_without_bias``  LayerNorm QK-norm: the gain rescale with the biases left in place
    ``key_bias_rope``      a key bias under RoPE: ``b_K[j][c] += δ`` on the *rotated* channels
                           (the key-bias shift is a symmetry only on the others)
    ``value_bias_alone``   ``b_V[j] += δ`` without the output bias taking ``W_O δ`` back
    ``sinks_unmoved``      attention sinks: a head permutation of everything but the sinks
    ``bias_under_sinks``   attention sinks: the value-bias trade (or, without it, the key-bias shift on
                           the non-rotary channels), which the sinks break (:mod:`gaugeopt.records.bias_sector`)
    =====================  ===============================================================

    Multi-head latent attention (:data:`LATENT_INVALID_KINDS`, docs/mla.md): ``gl_under_rope`` is a
    general ``B ∈ GL(r)`` on its RoPE part with its true inverse on the shared key, and

    =====================  ===============================================================
    ``rope_per_head``      the RoPE part with a commutant element per query head (``B_i``), the
                           shared key divided by the first head's: the key is not per head
    ``perm_without_rope``  the heads' rows and columns permuted, each head's RoPE query rows left
    ``latent_gl``          a general ``M ∈ GL(L)`` on each latent with its exact inverse on the
                           up-projection (``W_up D M⁻¹ D⁻¹``): the RMSNorm keeps only rotations
    ``latent_gain_alone``  a latent's gain rescaled without the up-projection's columns
    =====================  ===============================================================

    Raises:
        GaugeError: the control applies to no site of the model (e.g. ``gain_off_plane`` without RoPE).
    """
    if kind not in _all_invalid_kinds():
        raise GaugeError(f"invalid_gauge_transform: kind={kind!r} is not one of {_all_invalid_kinds()}")
    sites = _invalid_sites(trusted_sites(model, "invalid_gauge_transform", sites=sites), kind)
    g = as_generator(generator, "invalid_gauge_transform")
    for site in sites:
        apply_invalid(site, kind, g, log_scale=log_scale)
    return model


def apply_invalid(site: AttentionSite, kind: str, generator: torch.Generator | None = None, *, log_scale: float = 0.5) -> None:
    """Apply the negative control ``kind`` (:data:`ALL_INVALID_KINDS`) to one site, in place; a control
    that does not apply to the site (``gl_under_rope`` without RoPE, ``cross_head`` with one KV
    head, a QK-norm control on plain attention) leaves it unchanged."""
    if kind not in _all_invalid_kinds():
        raise GaugeError(f"apply_invalid: kind={kind!r} is not one of {_all_invalid_kinds()}")
    sectors.run(kind, site, generator, log_scale)
