"""The bias sectors: ``key_bias`` and ``value_bias``, with their negative controls and near-symmetries.

Which bias moves where, and when a record has each sector, is :mod:`gaugeopt.records.bias_sector`:

==============  ==================================================================  ==========================
sector          element                                                             negative control
==============  ==================================================================  ==========================
``key_bias``    ``b_K[j][c] += δ`` on the channels RoPE leaves alone (every score     under RoPE the shift on the
                of query ``i`` moves by ``q_i·δ``, which the softmax ignores)         rotated channels; else a key
                                                                                    shift that varies per key
``value_bias``  ``b_V[j] += δ``, ``b_O −= Σ_{i∈j} W_O[:, i]δ`` (attention rows sum     ``b_V`` moved alone
                to one)
==============  ==================================================================  ==========================

Attention sinks remove both (the sink takes a query-dependent share of every row). The flat-direction
meter also lists the transformations mistaken for them (``exact=False``): ``key_bias_rope`` (the shift on
rotated channels) and ``value_bias_sink`` (the trade under sinks). ``value_bias`` is opt-in for the
projector (the joint ``{vo, value_bias}`` solve costs ~9× the head gauges for ~3% of an update). The
controls of :func:`gaugeopt.invalid_gauge_transform` registered here: ``key_bias_rope``,
``value_bias_alone`` and ``bias_under_sinks``.

Example:
    >>> from gaugeopt.sectors import sector
    >>> sector("value_bias").projection.moves == {"v.bias", "o.bias"}
    True
"""

from __future__ import annotations

import torch

from gaugeopt.records.bias_sector import missing_reason
from gaugeopt.sectors.group_actions import shift_key_bias, trade_value_bias
from gaugeopt.sectors.registry import Control, Family, ProjectionRule, Sector, register, register_control, run
from gaugeopt.records.site import AttentionSite

__all__: list[str] = []

_ACTIONS = {"key_bias": shift_key_bias, "value_bias": trade_value_bias}
_WHY = {"key_bias": "q_i·δ is the same for every key", "value_bias": "attention rows sum to one"}


def _valid(kind: str):
    def valid(site: AttentionSite, g, log_scale: float) -> None:
        sec = site.bias_sector(kind)
        delta = log_scale * torch.randn(sec.groups, len(sec.channels), generator=g, dtype=torch.float64)
        _ACTIONS[kind](site, delta)
    return valid


def _families(kind: str):
    def families(site: AttentionSite) -> list[Family]:
        sec = site.bias_sector(kind)

        def bias(t, width=len(sec.channels)):
            _ACTIONS[kind](site, t.reshape(site.h_kv, width))

        return [Family(kind, site.name, sec.dim, bias, True, _WHY[kind])]
    return families


def _rotated(site: AttentionSite) -> list[int]:
    return sorted(c for plane in site.rope.planes(site.d_k) for c in plane)


# ---------------------------------------------------------------------- key_bias
def _key_control(site: AttentionSite, g) -> str:
    if site.rope.active:  # the shift on the rotated channels
        return run("key_bias_rope", site, g)
    wk, _ = site.effective("k")  # k_j ← k_j + δ (u·x_j): a key shift that varies per key
    delta = torch.randn(site.h_kv, site.d_k, 1, generator=g, dtype=torch.float64)
    u = torch.randn(1, 1, wk.shape[-1], generator=g, dtype=torch.float64)
    site.set_effective("k", wk + (delta * u).to(wk) * wk.norm() / (delta * u).norm().to(wk))
    return "key_shift_varying"


def _key_near(site: AttentionSite) -> list[Family]:
    rotated = _rotated(site)
    if site.k.bias is None or site.qk_norm is not None or not rotated:
        return []

    def key_bias_rope(t):
        _, bk = site.effective("k")
        bk[:, rotated] = bk[:, rotated] + t.reshape(site.h_kv, len(rotated)).to(bk)
        site.set_effective_bias("k", bk)

    return [Family("key_bias_rope", site.name, site.h_kv * len(rotated), key_bias_rope, False,
                   "RoPE rotates δ by the key's position: q_iᵀR δ varies over keys")]


register(Sector(
    name="key_bias", family="bias", summary="b_K += δ on the channels RoPE leaves alone",
    lacking=lambda site: missing_reason(site, "key_bias"), valid=_valid("key_bias"), control=_key_control,
    families=_families("key_bias"), near_families=_key_near,
    projection=ProjectionRule("bias_shift", frozenset({"k.bias"})),
    count=lambda s: {k: n for k, n in s.bias_sectors().items() if k == "key_bias"},
    proof_order=7, transform_order=2,
))


# ---------------------------------------------------------------------- value_bias
def _value_near(site: AttentionSite) -> list[Family]:
    if site.sinks is None or site.v.bias is None or site.o.bias is None:
        return []

    def value_bias_sink(t):  # the trade that is exact without sinks
        _, bv = site.effective("v")
        wo, bo = site.effective("o")
        delta = t.reshape(site.h_kv, site.d_v).to(bv)
        site.set_effective_bias("v", bv + delta)
        site.set_effective_bias("o", bo - torch.einsum("dhv,hv->d", wo, site.per_query(delta).to(wo)).to(bo))

    return [Family("value_bias_sink", site.name, site.h_kv * site.d_v, value_bias_sink, False,
                   "attention sinks: a row's weights sum to 1 − p_sink, so b_O cannot take W_O δ back")]


register(Sector(
    name="value_bias", family="bias", summary="b_V += δ traded against b_O −= W_O δ",
    lacking=lambda site: missing_reason(site, "value_bias"), valid=_valid("value_bias"),
    control=lambda site, g: run("value_bias_alone", site, g),
    families=_families("value_bias"), near_families=_value_near,
    projection=ProjectionRule("bias_shift", frozenset({"v.bias", "o.bias"}), opt_in=True),
    count=lambda s: {k: n for k, n in s.bias_sectors().items() if k == "value_bias"},
    proof_order=8, transform_order=3,
))


# ---------------------------------------------------------------------- the bias controls
def _key_bias_rope(site: AttentionSite, g, log_scale: float) -> None:
    rotated = _rotated(site)
    wk, bk = site.effective("k")
    bk[:, rotated] += log_scale * torch.randn(site.h_kv, len(rotated), generator=g, dtype=torch.float64).to(bk)
    site.set_effective_bias("k", bk)


def _value_bias_alone(site: AttentionSite, g, log_scale: float) -> None:
    _, bv = site.effective("v")
    site.set_effective_bias("v", bv + log_scale * torch.randn(bv.shape, generator=g, dtype=torch.float64).to(bv))


def _sink_bias_shift(site: AttentionSite):
    """The bias move that would be a symmetry without the sinks: the value-bias trade where the site has
    value and output biases, else the key-bias shift on its non-rotary channels (``None``: neither)."""
    if site.v.bias is not None and site.o.bias is not None:
        def trade(scale, g):
            wo, bo = site.effective("o")
            _, bv = site.effective("v")
            delta = scale * torch.randn(site.h_kv, site.d_v, generator=g, dtype=torch.float64)
            site.set_effective_bias("v", bv + delta.to(bv))
            site.set_effective_bias("o", bo - torch.einsum("dhv,hv->d", wo, site.per_query(delta).to(wo)).to(bo))
        return trade
    free = [c for c in range(site.d_k) if c not in {x for plane in site.rope.planes(site.d_k) for x in plane}]
    if site.k.bias is not None and free and site.qk_norm is None:
        def shift(scale, g):
            _, bk = site.effective("k")
            bk[:, free] += scale * torch.randn(site.h_kv, len(free), generator=g, dtype=torch.float64).to(bk)
            site.set_effective_bias("k", bk)
        return shift
    return None


def _bias_under_sinks(site: AttentionSite, g, log_scale: float) -> None:
    with torch.no_grad():
        _sink_bias_shift(site)(log_scale, g)


register_control(Control("key_bias_rope", "bias", lambda s: s.k.bias is not None and s.qk_norm is None and s.rope.active,
                         "a key bias under RoPE", _key_bias_rope))
register_control(Control("value_bias_alone", "bias", lambda s: s.v.bias is not None, "a value bias", _value_bias_alone))
register_control(Control("bias_under_sinks", "sinks", lambda s: s.sinks is not None and _sink_bias_shift(s) is not None,
                         "attention sinks with a key bias on non-rotary channels, or value and output biases",
                         _bias_under_sinks))
