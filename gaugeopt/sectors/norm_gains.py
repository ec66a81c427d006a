"""The gain sector of a QK-norm: ``qk_gain``, with the QK-norm negative controls and counts.

A record that normalises queries and keys (``site.qk_norm``, docs/qk_norm.md) keeps none of
``GL(d_k)`` on ``W_Q``/``W_K``; its Q/K gauge acts on the norm's gains, ``g_q ← g_q ⊙ d``,
``g_k ← g_k ⊘ d`` (a LayerNorm's biases alike), with ``d`` constant on each RoPE plane when the norm
acts before RoPE, one ``d`` per layer for a gain shared by every head and per KV group for per-head
gains. A random element has random signs (a negative gain is as good as a positive one).

The controls of :func:`gaugeopt.invalid_gauge_transform` registered here (group ``"qk_norm"``):
``qk_under_norm`` (the plain Q/K gauge under the norm; also the control of a weight-free norm's
``qk``), ``head_scalar`` (per-head scalars on ``W_Q``: a symmetry only at ``eps = 0``),
``gain_off_plane`` (a factor per channel under RoPE), ``gain_untied`` (a factor per query head with
GQA) and ``gain_without_bias`` (a LayerNorm's biases left in place). :func:`qk_norm_counts` is the
count of :func:`gaugeopt.gauge_dimension` for one QK-norm layer, in every convention.

Example:
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.adapters.find import find_attention
    >>> from gaugeopt.sectors import claimed, sector
    >>> site = find_attention(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, qk_norm=True)))[0]
    >>> claimed(site)
    ['qk_gain', 'vo', 'perm', 'value_bias']
    >>> sector("qk").lacking(site)[:58]
    'it normalises queries and keys (QK-norm): GL(d_k) on W_Q/W'
"""

from __future__ import annotations

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.sectors.group_actions import _log_uniform, act_qk, scale_qk_gains
from gaugeopt.records.rope import NO_ROPE, plane_index, random_commutant
from gaugeopt.sectors.registry import Control, Family, ProjectionRule, Sector, register, register_control, run
from gaugeopt.records.site import AttentionSite

__all__ = ["qk_norm_counts"]


def _valid(site: AttentionSite, g, log_scale: float) -> None:
    dtype = torch.float64
    pair = site.pair("qk_gain")
    pid = plane_index(pair.rope, site.d_k)
    n_slots = int(pid.max()) + 1
    sign = torch.where(torch.rand((pair.groups, n_slots), generator=g) < 0.5, -1.0, 1.0).to(dtype)
    per_slot = sign * _log_uniform((pair.groups, n_slots), log_scale, g, dtype)
    scale_qk_gains(site, per_slot[:, pid])


def _families(site: AttentionSite) -> list[Family]:
    pair = site.pair("qk_gain")
    pid = plane_index(pair.rope, site.d_k)
    n = int(pid.max()) + 1

    def qk_gain(t, pid=pid, n=n, groups=pair.groups):
        scale_qk_gains(site, torch.exp(t.reshape(groups, n))[:, pid])

    out = [Family("qk_gain", site.name, pair.groups * n, qk_gain, True, "QK-norm gains g_q ⊙ d, g_k ⊘ d")]
    if site.qk_norm.eps == 0 and site.qk_norm.scope == "head":
        g = site.h_kv

        def head_scale(t):  # with eps = 0 a per-head norm forgets the scale of its rows
            for p, part in (("q", t[: site.h]), ("k", t[site.h:])):
                w, b = site.effective(p)
                c = torch.exp(part).to(w)
                site.set_effective(p, w * c[:, None, None], None if b is None else b * c[:, None])

        out.append(Family("qk_head_scale", site.name, site.h + g, head_scale, True, "a norm with eps = 0 ignores a head's scale"))
    return out


def qk_norm_counts(shape, ignore_rope: bool = False) -> dict[str, int]:
    """The Q/K gauge of one QK-norm layer (a :class:`~gaugeopt.flat.counting.LayerShape`): ``qk_gain``,
    a LayerNorm's invisible directions ``qk_layernorm`` and, with ``eps = 0``, ``qk_head_scale``
    (:mod:`gaugeopt.flat.counting`; ``ignore_rope``: as paper 003 counts)."""
    n = shape.qk_norm
    rope = NO_ROPE if (ignore_rope or not n.before_rope) else shape.rope
    if n.kind == "layer" and shape.rope.active and not n.before_rope:
        raise GaugeError(
            "gauge_dimension: a LayerNorm QK-norm after RoPE has no derived count (docs/qk_norm.md covers LayerNorm "
            "without RoPE and before it)"
        )
    counts = {"qk_gain": (shape.h_kv if n.per_head else 1) * rope.n_slots(shape.d_k)}
    if n.kind == "layer":
        extra = (shape.h + shape.h_kv) * (shape.d_model + int(shape.qk_bias))  # the mean direction of every head's rows
        if not (shape.rope.active and not ignore_rope):
            extra += 1 + (shape.d_k + 1 if n.bias else 0)  # centred rotation; key bias, query-bias shift
        elif n.bias:  # partial RoPE (Phi): the key bias on the channels RoPE leaves alone is still invisible
            extra += shape.d_k - shape.rope.rotary_dim
        counts["qk_layernorm"] = extra
    if n.eps == 0:
        counts["qk_head_scale"] = (shape.h + shape.h_kv) if n.scope == "head" else 2
    return counts


register(Sector(
    name="qk_gain", family="norm_gain", summary="QK-norm gains g_q ⊙ d against g_k ⊘ d (d per RoPE plane or channel)",
    lacking=lambda site: "it has no QK-norm; its Q/K gauge is kind 'qk'" if site.qk_norm is None else None,
    valid=_valid, control=lambda site, g: run("qk_under_norm", site, g), families=_families,
    projection=ProjectionRule("diagonal", frozenset({"qk_norm.q_gain", "qk_norm.k_gain", "qk_norm.q_bias", "qk_norm.k_bias"})),
    count=lambda s: {} if s.qk_norm is None else qk_norm_counts(s),
    default=True, proof_order=1, transform_order=8,
))


# ---------------------------------------------------------------------- the QK-norm controls
def _qk_under_norm(site: AttentionSite, g, log_scale: float) -> None:
    # in the commutant by construction; not orthogonal (check=False lets it through)
    act_qk(site, random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g), check=False)


def _head_scalar(site: AttentionSite, g, log_scale: float) -> None:
    c = 10.0 ** (torch.rand(site.h, generator=g, dtype=torch.float64) - 2.0)  # in [0.01, 0.1)
    wq, bq = site.effective("q")
    site.set_effective("q", wq * c[:, None, None].to(wq), None if bq is None else bq * c[:, None].to(bq))


def _gain_rescale(without_bias: bool):
    def apply(site: AttentionSite, g, log_scale: float) -> None:
        pair = site.pair("qk_gain")
        delta = _log_uniform((pair.groups, site.d_k), log_scale, g, torch.float64)
        if without_bias:
            delta = delta[:, plane_index(pair.rope, site.d_k)]  # a valid factor: only the bias is wrong
        scale_qk_gains(site, delta, check=False, move_bias=not without_bias)
    return apply


def _gain_untied(site: AttentionSite, g, log_scale: float) -> None:
    _untied_gains(site, _log_uniform((site.h, site.d_k), log_scale, g, torch.float64))


@torch.no_grad()
def _untied_gains(site: AttentionSite, per_head: torch.Tensor) -> None:
    """``g_q[i] ← g_q[i] ⊙ d_i`` for every query head, ``g_k[j] ← g_k[j] ⊘ d_{first head of j}``."""
    pid = plane_index(site.pair("qk_gain").rope, site.d_k)
    d = per_head[:, pid]
    n = site.qk_norm
    for ref, f in ((n.q_gain, d), (n.k_gain, 1.0 / d[:: site.n_rep])):
        v = ref.get()
        v.copy_((v + n.gain_offset) * f.to(v) - n.gain_offset)


register_control(Control("qk_under_norm", "qk_norm", lambda s: s.qk_norm is not None or bool(s.qk_orthogonal),
                         "a QK-norm model", _qk_under_norm))
register_control(Control(
    "head_scalar", "qk_norm",
    lambda s: bool(s.qk_orthogonal) or s.qk_norm is not None and (s.qk_norm.eps > 0 or s.qk_norm.scope == "full"),
    "a QK-norm model with eps > 0 (with eps = 0 a per-head scalar is a symmetry of a per-head norm)", _head_scalar))
register_control(Control("gain_off_plane", "qk_norm",
                         lambda s: s.qk_norm is not None and s.qk_norm.before_rope and s.rope.active,
                         "a QK-norm model whose norm acts before RoPE", _gain_rescale(without_bias=False)))
register_control(Control("gain_untied", "qk_norm", lambda s: s.qk_norm is not None and s.qk_norm.per_head and s.n_rep > 1,
                         "a QK-norm model with per-head gains and GQA", _gain_untied))
register_control(Control("gain_without_bias", "qk_norm", lambda s: s.qk_norm is not None and s.qk_norm.q_bias is not None,
                         "a QK-norm model with a LayerNorm bias", _gain_rescale(without_bias=True)))
