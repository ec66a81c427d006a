"""The multiplier sectors of learnable multipliers (LRM): ``lrm_qk``, ``lrm_vo`` and ``lrm_internal``.

With :class:`~gaugeopt.models.lrm.LRMLinear` projections (``W = diag(r)·W̄·diag(c)``, docs/gauge_group.md):

================  ==============================================================  =======================
sector            element                                                         negative control
================  ==============================================================  =======================
``lrm_qk``        ``r_Q[i] ← r_Q[i] ⊙ δ``, ``r_K[j] ← r_K[j] ⊘ δ`` (δ per RoPE plane)  ``r_Q`` scaled alone
``lrm_vo``        ``r_V[j] ← r_V[j] ⊙ e``, ``c_O[i] ← c_O[i] ⊘ e``                    ``r_V`` scaled alone
``lrm_internal``  ``r ← r ⊙ t``, ``W̄ ← W̄ ⊘ (t ⊗ s)``, ``c ← c ⊙ s`` in every LRM layer  ``W̄`` rows scaled alone
================  ==============================================================  =======================

``lrm_qk`` is not a symmetry under a QK-norm (the norm absorbs only a scale uniform over a head) nor of a
weight-free norm (``site.qk_orthogonal``). ``lrm_internal`` acts per LRM layer, not per record: the
random transform and the flat-direction meter take every LRM layer of the model (an MLP's included),
the certificate and the projector those its records read. ``lrm_qk`` and ``lrm_vo`` add no dimension
to the count: their directions lie in ``qk`` (``vo``) plus ``lrm_internal``'s; ``lrm_internal`` is
counted per LRM layer from the model (:attr:`~gaugeopt.models.lrm.LRMLinear.internal_gauge_dim`).

Example:
    >>> import gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.sectors import claimed
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)))
    >>> claimed(gaugeopt.find_attention(model)[0])[-3:]
    ['lrm_qk', 'lrm_vo', 'lrm_internal']
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.models.lrm import LRMLinear
from gaugeopt.sectors.group_actions import (_log_uniform, random_lrm_internal, rescale_lrm_internal,
                                              scale_qk_multipliers, scale_vo_multipliers)
from gaugeopt.records.rope import plane_index
from gaugeopt.sectors.heads import QK_NORM_LACKS
from gaugeopt.sectors.registry import Family, ProjectionRule, Sector, register
from gaugeopt.records.site import AttentionSite

__all__ = ["lrm_layers"]


def lrm_layers(site: AttentionSite) -> list[LRMLinear]:
    """The LRM layers a record reads, each once."""
    seen: dict[int, LRMLinear] = {}
    for _, ref in site.refs():
        if isinstance(ref.owner, LRMLinear):
            seen.setdefault(id(ref.owner), ref.owner)
    return list(seen.values())


# ---------------------------------------------------------------------- lrm_qk
def _qk_lacking(site: AttentionSite) -> str | None:
    if site.qk_orthogonal:
        return f"rescaling r_Q against r_K is not a symmetry ({site.qk_orthogonal})"
    if site.qk_norm is not None:
        return QK_NORM_LACKS.format("rescaling r_Q against r_K")
    return None


def _qk_valid(site: AttentionSite, g, log_scale: float) -> None:
    pid = plane_index(site.rope, site.d_k)
    per_plane = _log_uniform((site.h_kv, int(pid.max()) + 1), log_scale, g, torch.float64)
    scale_qk_multipliers(site, per_plane[:, pid])


def _qk_control(site: AttentionSite, g) -> str:  # r_Q scaled per plane, r_K not compensated
    r = site.q.row_mult.get()
    r.mul_(_log_uniform(r.shape, 0.5, g, torch.float64).to(r))
    return "r_q_alone"


def _qk_families(site: AttentionSite) -> list[Family]:
    pid = plane_index(site.rope, site.d_k)
    n = int(pid.max()) + 1

    def lrm_qk(t, pid=pid, n=n):
        scale_qk_multipliers(site, torch.exp(t.reshape(site.h_kv, n))[:, pid])

    return [Family("lrm_qk", site.name, site.h_kv * n, lrm_qk, True, "r_Q ⊙ δ, r_K ⊘ δ")]


register(Sector(
    name="lrm_qk", family="multiplier", summary="r_Q ⊙ δ against r_K ⊘ δ (δ per KV group and RoPE plane)",
    lacking=_qk_lacking, present=lambda site: site.has_multipliers, valid=_qk_valid, control=_qk_control,
    families=_qk_families,
    projection=ProjectionRule("diagonal", frozenset({"q.row_mult", "k.row_mult"}), redundant_with="qk"),
    proof_order=9, transform_order=0,
))


# ---------------------------------------------------------------------- lrm_vo
def _vo_valid(site: AttentionSite, g, log_scale: float) -> None:
    scale_vo_multipliers(site, _log_uniform((site.h_kv, site.d_v), log_scale, g, torch.float64))


def _vo_control(site: AttentionSite, g) -> str:
    r = site.v.row_mult.get()
    r.mul_(_log_uniform(r.shape, 0.5, g, torch.float64).to(r))
    return "r_v_alone"


def _vo_families(site: AttentionSite) -> list[Family]:
    def lrm_vo(t):
        scale_vo_multipliers(site, torch.exp(t.reshape(site.h_kv, site.d_v)))

    return [Family("lrm_vo", site.name, site.h_kv * site.d_v, lrm_vo, True, "r_V ⊙ e, c_O ⊘ e")]


register(Sector(
    name="lrm_vo", family="multiplier", summary="r_V ⊙ e against c_O ⊘ e (e per KV group and channel)",
    lacking=lambda site: None, present=lambda site: site.v.row_mult is not None and site.o.col_mult is not None,
    valid=_vo_valid, control=_vo_control, through_scores=False, families=_vo_families,
    projection=ProjectionRule("diagonal", frozenset({"v.row_mult", "o.col_mult"}), redundant_with="vo"),
    proof_order=10, transform_order=1,
))


# ---------------------------------------------------------------------- lrm_internal
def _internal_valid(site: AttentionSite, g, log_scale: float) -> None:
    for m in lrm_layers(site):
        random_lrm_internal(m, g, log_scale=log_scale)


def _internal_control(site: AttentionSite, g) -> str:  # W̄ rescaled without the compensating row multipliers
    for m in lrm_layers(site):
        m.weight.mul_(_log_uniform((m.out_features, 1), 0.5, g, torch.float64).to(m.weight))
    return "w_bar_alone"


def _model_valid(model: nn.Module, g, log_scale: float) -> None:
    layers = [m for m in model.modules() if isinstance(m, LRMLinear)]
    if not layers:
        raise GaugeError("random_gauge_transform: kind 'lrm_internal' needs learnable multipliers (gaugeopt.apply_lrm)")
    for m in layers:
        random_lrm_internal(m, g, log_scale=log_scale)


def _layer_family(name: str, m: LRMLinear) -> Family:
    sizes = [m.out_features] + [m.in_features] * len(m.split_sizes)

    def apply(t):
        parts = torch.exp(t).split(sizes)
        rescale_lrm_internal(m, parts[0], list(parts[1:]))

    return Family("lrm_internal", name, sum(sizes), apply, True, "diag(r)·W̄·diag(c) unchanged")


_EVERY_LRM_ROLE = frozenset(f"{p}.{role}" for p in "qkvo" for role in ("weight", "bias", "row_mult", "col_mult")) | {
    "latent.q_rope", "latent.q_rope_bias", "latent.k_rope", "latent.k_rope_bias"}

register(Sector(
    name="lrm_internal", family="multiplier", summary="r ⊙ t, W̄ ⊘ (t ⊗ s), c ⊙ s inside every LRM layer",
    lacking=lambda site: None, present=lambda site: bool(lrm_layers(site)),
    valid=_internal_valid, control=_internal_control, through_scores=False,
    layer_valid=_model_valid,
    layer_families=lambda model: [_layer_family(n, m) for n, m in model.named_modules() if isinstance(m, LRMLinear)],
    projection=ProjectionRule("internal", _EVERY_LRM_ROLE, units="lrm_layers", last=True),
    proof_order=11, transform_order=11,
))
