"""Finite gauge actions on a model's attention, random group elements, and invalid controls.

The symmetries of docs/gauge_group.md, acting on the *effective* weights (``diag(r)·W̄·diag(c)``
under LRM, biases travelling with their rows), per KV group ``j`` shared by its query heads:

========================  =================================================================
action                    effect
========================  =================================================================
:func:`act_qk`            ``W_Q[i] ← Aᵀ W_Q[i]``, ``W_K[j] ← A⁻¹ W_K[j]``; ``A`` in the RoPE commutant
:func:`act_vo`            ``W_V[j] ← Cᵀ W_V[j]``, ``W_O[:, i] ← W_O[:, i] C⁻ᵀ``
:func:`permute_heads`     KV groups (and query heads within them) reordered consistently
:func:`scale_qk_multipliers`   ``r_Q[i] ← r_Q[i] ⊙ δ``, ``r_K[j] ← r_K[j] ⊘ δ`` (δ constant per RoPE plane)
:func:`scale_vo_multipliers`   ``r_V[j] ← r_V[j] ⊙ e``, ``c_O[i] ← c_O[i] ⊘ e``
:func:`rescale_lrm_internal`   ``r ← r ⊙ t``, ``W̄ ← W̄ ⊘ (t ⊗ s)``, ``c ← c ⊙ s`` inside one LRM layer
:func:`scale_qk_gains`    QK-norm: ``g_q ← g_q ⊙ d``, ``g_k ← g_k ⊘ d`` (LayerNorm biases alike; ``d``
                          constant per RoPE plane when the norm acts before RoPE)
:func:`shift_key_bias`    ``b_K[j][c] += δ`` on the non-rotary channels ``c`` (the bias sectors,
:func:`trade_value_bias`  :mod:`gaugeopt.structure.bias`); ``b_V[j] += δ``, ``b_O −= Σ_{i∈j} W_O[:, i] δ``
:func:`~gaugeopt.structure.latent.act_qk_rope`        multi-head latent attention (:mod:`gaugeopt.structure.latent`):
:func:`~gaugeopt.structure.latent.rotate_latent`      the RoPE part ``q_i ← Bᵀq_i`` (every head), ``k_pe ← B⁻¹k_pe``;
:func:`~gaugeopt.structure.latent.scale_latent_gain`  a latent's ``O(L)`` rotation and its gain against the
                          up-projection's columns
========================  =================================================================

On a QK-norm site (``site.qk_norm``, docs/qk_norm.md) :func:`act_qk` and
:func:`scale_qk_multipliers` are *not* symmetries; its Q/K gauge is :func:`scale_qk_gains`, and
:func:`permute_heads` moves per-head gains with their heads. On a multi-head latent attention site
(``site.latent``, docs/mla.md) :func:`act_qk` and :func:`act_vo` act on the part without RoPE, and
:func:`permute_heads` moves each head's RoPE query rows with the rest of the head.

:func:`random_gauge_transform` draws well-conditioned elements of any of these; and
:func:`invalid_gauge_transform` applies the paper's negative controls (asymmetric Q/K, wrong
inverse, V/O mismatch, cross-head mixing, a general ``GL(d_k)`` under RoPE), those of QK-norm
(the plain-attention Q/K gauge under the norm, per-head scalars on ``W_Q``, gain rescales that
break the rule) and those of the bias sectors (a key-bias shift on RoPE-rotated channels, a value
bias moved without its output-bias compensation), which must change the function. :func:`relative_change` measures either.

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

from typing import Iterable, Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.linalg import random_orthogonal, random_well_conditioned
from gaugeopt.structure.bias import BIAS_SECTORS, missing_reason
from gaugeopt.structure.latent import LATENT_SECTORS, act_qk_rope, rotate_latent, scale_latent_gain
from gaugeopt.structure.lrm import LRMLinear
from gaugeopt.structure.rope import (commutant_basis, commutator_size, plane_index, random_commutant,
                                     random_orthogonal_commutant)
from gaugeopt.structure.site import AttentionSite
from gaugeopt.structure.gate import trusted_sites

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

BIAS_KINDS = BIAS_SECTORS
VALID_KINDS = ("qk", "vo", "perm", "lrm_qk", "lrm_vo", "lrm_internal", "qk_gain", "key_bias", "value_bias",
               *LATENT_SECTORS)
INVALID_KINDS = ("asymmetric_qk", "wrong_inverse", "vo_mismatch", "cross_head", "gl_under_rope",
                 "qk_under_norm", "head_scalar", "gain_off_plane", "gain_untied", "gain_without_bias",
                 "key_bias_rope", "value_bias_alone", "sinks_unmoved", "bias_under_sinks")
QK_NORM_INVALID_KINDS = INVALID_KINDS[5:10]  # controls that need a QK-norm site
BIAS_INVALID_KINDS = INVALID_KINDS[10:12]  # controls that need a key bias under RoPE, a value bias
SINK_INVALID_KINDS = INVALID_KINDS[12:]  # controls that need attention sinks
# controls that need multi-head latent attention (docs/mla.md); apart, so that INVALID_KINDS stays what plain attention has
LATENT_INVALID_KINDS = ("rope_per_head", "perm_without_rope", "latent_gl", "latent_gain_alone")
ALL_INVALID_KINDS = INVALID_KINDS + LATENT_INVALID_KINDS
_NOT_UNDER_NORM = ("qk", "lrm_qk")  # valid kinds that a QK-norm site does not have


def relative_change(reference: torch.Tensor, other: torch.Tensor) -> float:
    """``‖other − reference‖ / ‖reference‖`` (Frobenius, computed in float64)."""
    ref = reference.detach().double()
    return float((other.detach().double() - ref).norm() / ref.norm().clamp_min(torch.finfo(torch.float64).tiny))


def _per_query(site: AttentionSite, x: torch.Tensor) -> torch.Tensor:
    """Expand a per-KV-group tensor ``(h_kv, ...)`` to per query head ``(h, ...)``."""
    return site.per_query(x)


def _check_commutes(site: AttentionSite, A: torch.Tensor, what: str = "A") -> None:
    if commutator_size(site.rope, site.d_k, A) > 1e-10:
        raise GaugeError(
            f"{site.name}: {what} does not commute with the RoPE rotations ({site.rope.kind}, rotary_dim="
            f"{site.rope.rotary_dim}); under RoPE the Q/K gauge is a·I + b·J on each plane "
            "(see gaugeopt.structure.rope.random_commutant), anything else changes the attention scores"
        )


@torch.no_grad()
def act_qk(site: AttentionSite, A: torch.Tensor, *, B_inv: torch.Tensor | None = None, check: bool = True) -> None:
    """Apply ``A ∈ GL(d_k)^{h_kv}``: ``W_Q[i] ← Aᵀ W_Q[i]``, ``W_K[j] ← A⁻¹ W_K[j]`` (biases alike).

    Args:
        A: ``(h_kv, d_k, d_k)``, one factor per KV group.
        B_inv: the factor applied to K instead of ``A⁻¹`` (only for invalid controls).
        check: refuse an ``A`` that does not commute with the site's RoPE rotations.
    """
    _expect(A, (site.h_kv, site.d_k, site.d_k), "A")
    if check:
        _check_commutes(site, A)
        if site.qk_orthogonal:
            eye = torch.eye(site.d_k, dtype=A.dtype, device=A.device)
            if float((A.mT @ A - eye).abs().amax()) > 1e-10:
                raise GaugeError(
                    f"{site.name}: A is not orthogonal; only the orthogonal part of the Q/K gauge is a symmetry here "
                    f"({site.qk_orthogonal}): use gaugeopt.structure.rope.random_orthogonal_commutant"
                )
    wq, bq = site.effective("q")
    wk, bk = site.effective("k")
    A = A.to(wq)
    At = _per_query(site, A).mT  # (h, d_k, d_k)
    K = torch.linalg.inv(A) if B_inv is None else B_inv.to(wq)
    site.set_effective("q", At @ wq, None if bq is None else (At @ bq[..., None])[..., 0])
    site.set_effective("k", K @ wk, None if bk is None else (K @ bk[..., None])[..., 0])


@torch.no_grad()
def act_vo(site: AttentionSite, C: torch.Tensor, *, D: torch.Tensor | None = None) -> None:
    """Apply ``C ∈ GL(d_v)^{h_kv}``: ``W_V[j] ← Cᵀ W_V[j]``, ``W_O[:, i] ← W_O[:, i] C⁻ᵀ``.

    ``D`` replaces ``C`` on the output side (only for the V/O-mismatch control).
    """
    _expect(C, (site.h_kv, site.d_v, site.d_v), "C")
    wv, bv = site.effective("v")
    wo, bo = site.effective("o")  # wo: (d, h, d_v)
    C = C.to(wv)
    Ct = C.mT
    site.set_effective("v", Ct @ wv, None if bv is None else (Ct @ bv[..., None])[..., 0])
    out_factor = torch.linalg.inv(C if D is None else D.to(wv)).mT  # C⁻ᵀ, (h_kv, d_v, d_v)
    wo_new = torch.einsum("dhv,hvw->dhw", wo, _per_query(site, out_factor))
    site.set_effective("o", wo_new, bo)


@torch.no_grad()
def permute_heads(site: AttentionSite, kv_perm: torch.Tensor, q_perm: torch.Tensor | None = None) -> None:
    """Reorder heads: new KV head ``j`` is old KV head ``kv_perm[j]``; new query head ``i`` is
    old query head ``q_perm[i]``, which must belong to old group ``kv_perm[i // n_rep]``.

    ``q_perm`` defaults to keeping each group's query heads in order.
    """
    n = site.n_rep
    kv_perm = torch.as_tensor(kv_perm, dtype=torch.long)
    if site.fixed_head_order and not (
        torch.equal(kv_perm, torch.arange(site.h_kv)) and (q_perm is None or torch.equal(torch.as_tensor(q_perm), torch.arange(site.h)))
    ):
        raise GaugeError(
            f"{site.name}: its heads may not be permuted ({site.fixed_head_order}); permuting them changes the "
            "function (canonicalize with sort_heads=False)"
        )
    if sorted(kv_perm.tolist()) != list(range(site.h_kv)):
        raise GaugeError(f"{site.name}: kv_perm={kv_perm.tolist()} is not a permutation of range({site.h_kv})")
    if q_perm is None:
        q_perm = (kv_perm[:, None] * n + torch.arange(n)[None, :]).reshape(-1)
    q_perm = torch.as_tensor(q_perm, dtype=torch.long)
    if sorted(q_perm.tolist()) != list(range(site.h)) or not torch.equal(q_perm // n, kv_perm.repeat_interleave(n)):
        raise GaugeError(
            f"{site.name}: q_perm={q_perm.tolist()} must permute range({site.h}) and keep each query head with "
            f"its KV group (new head i must come from old group kv_perm[i // {n}])"
        )
    q_refs = [ref for role, ref in site.q.refs() if role != "col_mult"]
    if site.latent is not None:  # a head's RoPE query rows move with it; the shared key stays
        q_refs += [r for r in (site.latent.q_rope, site.latent.q_rope_bias) if r is not None]
    for ref in q_refs:
        v = ref.get()
        v.copy_(v[q_perm])
    for proj in (site.k, site.v):
        for role, ref in proj.refs():
            if role != "col_mult":
                v = ref.get()
                v.copy_(v[kv_perm])
    wo = site.o.weight.get()
    wo.copy_(wo[:, q_perm])
    if site.o.col_mult is not None:
        c = site.o.col_mult.get()
        c.copy_(c[q_perm])
    if site.sinks is not None:  # each query head's sink logit moves with it
        v = site.sinks.get()
        v.copy_(v[q_perm])
    if site.qk_norm is not None and site.qk_norm.per_head:  # per-head gains move with their heads
        n_ = site.qk_norm
        for ref, perm in ((n_.q_gain, q_perm), (n_.q_bias, q_perm), (n_.k_gain, kv_perm), (n_.k_bias, kv_perm)):
            if ref is not None:
                v = ref.get()
                v.copy_(v[perm])


def _require_mults(site: AttentionSite, roles: Iterable[tuple[str, str]]) -> None:
    for p, role in roles:
        if getattr(getattr(site, p), role) is None:
            raise GaugeError(
                f"{site.name}: {p}.{role} is missing; this gauge needs learnable multipliers (gaugeopt.apply_lrm)"
            )


@torch.no_grad()
def scale_qk_multipliers(site: AttentionSite, delta: torch.Tensor, *, check: bool = True) -> None:
    """``r_Q[i] ← r_Q[i] ⊙ δ[g(i)]``, ``r_K[j] ← r_K[j] ⊘ δ[j]`` with ``δ: (h_kv, d_k)``.

    Under RoPE both coordinates of a plane must share one factor (``check`` enforces it).
    """
    _require_mults(site, (("q", "row_mult"), ("k", "row_mult")))
    _expect(delta, (site.h_kv, site.d_k), "delta")
    if site.qk_orthogonal:
        raise GaugeError(f"{site.name}: rescaling r_Q against r_K changes its function ({site.qk_orthogonal}: the norm "
                         "undoes the scale of each head, per channel it does not)")
    if site.qk_norm is not None:
        raise GaugeError(
            f"{site.name} normalises queries and keys (QK-norm): rescaling r_Q against r_K changes its function (the "
            "norm absorbs only a rescale uniform over a head, and only up to its epsilon); its Q/K gauge acts on the "
            "norm's gains (scale_qk_gains, kind 'qk_gain')"
        )
    if check:
        _check_plane_constant(site, site.rope, delta, "a per-channel Q/K multiplier scale")
    rq, rk = site.q.row_mult.get(), site.k.row_mult.get()
    rq.mul_(_per_query(site, delta.to(rq)))
    rk.div_(delta.to(rk))


def _check_plane_constant(site: AttentionSite, rope, delta: torch.Tensor, what: str) -> None:
    if not rope.active:
        return
    first, second = (list(c) for c in zip(*rope.planes(site.d_k)))
    if not torch.equal(delta[:, first], delta[:, second]):
        raise GaugeError(
            f"{site.name}: {what} must be equal on both coordinates of each RoPE plane; otherwise the rescaled "
            "pair no longer commutes with the rotation"
        )


@torch.no_grad()
def scale_qk_gains(site: AttentionSite, delta: torch.Tensor, *, check: bool = True, move_bias: bool = True) -> None:
    """The gain gauge of a QK-norm site: ``g_q ← g_q ⊙ d``, ``g_k ← g_k ⊘ d`` (docs/qk_norm.md).

    ``delta: (groups, d_k)`` with ``groups`` of the site's ``"qk_gain"`` pair (1 for a gain vector
    shared by every head; ``h_kv`` for per-head gains, each KV group's factor acting on all its
    query heads). A gain stored with an offset (Gemma's ``1 + w``) becomes ``(1 + w)·d − 1``; a
    LayerNorm bias moves with its gain (``move_bias=False`` leaves it: an invalid control).

    Args:
        check: refuse a ``d`` that is not constant on each RoPE plane when the norm acts before RoPE.
    """
    pair = site.pair("qk_gain")
    _expect(delta, (pair.groups, site.d_k), "delta")
    if check:
        _check_plane_constant(site, pair.rope, delta, "a QK-norm gain factor")
    for side, f in ((pair.a, delta), (pair.b, 1.0 / delta)):
        per_row = side.expand(f)
        for m in side.members("gain"):
            if not (move_bias or m.measured):
                continue
            v = m.ref.get()
            v.copy_((v + m.offset) * per_row.to(v) - m.offset if m.offset else v * per_row.to(v))


@torch.no_grad()
def shift_key_bias(site: AttentionSite, delta: torch.Tensor) -> None:
    """The key-bias shift: ``b_K[j][c] ← b_K[j][c] + δ[j, c]`` on the non-rotary channels ``c``.

    ``delta: (h_kv, len(channels))`` with the channels of ``site.bias_sector("key_bias")`` (all of
    ``d_k`` without RoPE). Every score of query ``i`` moves by the same ``q_i·δ``, which softmax
    ignores (:mod:`gaugeopt.structure.bias`)."""
    sec = site.bias_sector("key_bias")
    _, bk = site.effective("k")
    site.set_effective_bias("k", sec.shifted(bk, delta))


@torch.no_grad()
def trade_value_bias(site: AttentionSite, delta: torch.Tensor) -> None:
    """The value-bias trade: ``b_V[j] ← b_V[j] + δ[j]``, ``b_O ← b_O − Σ_{i∈j} W_O[:, i] δ[j]``.

    ``delta: (h_kv, d_v)``. Attention rows sum to one, so each head's output moves by ``W_O[:, i]δ``,
    which the output bias takes back (:mod:`gaugeopt.structure.bias`)."""
    sec = site.bias_sector("value_bias")
    _, bv = site.effective("v")
    wo, bo = site.effective("o")
    site.set_effective_bias("v", sec.shifted(bv, delta))
    site.set_effective_bias("o", sec.absorbed(bo, wo, delta))


@torch.no_grad()
def scale_vo_multipliers(site: AttentionSite, e: torch.Tensor) -> None:
    """``r_V[j] ← r_V[j] ⊙ e[j]``, ``c_O[i] ← c_O[i] ⊘ e[g(i)]`` with ``e: (h_kv, d_v)``."""
    _require_mults(site, (("v", "row_mult"), ("o", "col_mult")))
    _expect(e, (site.h_kv, site.d_v), "e")
    rv, co = site.v.row_mult.get(), site.o.col_mult.get()
    rv.mul_(e.to(rv))
    co.div_(_per_query(site, e.to(co)))


@torch.no_grad()
def rescale_lrm_internal(module: LRMLinear, t: torch.Tensor, s: Sequence[torch.Tensor]) -> None:
    """Internal LRM gauge of one layer: per block ``k``, ``r_k ← r_k ⊙ t_k``,
    ``W̄_k ← W̄_k ⊘ (t_k ⊗ s_k)``, ``b̄_k ← b̄_k ⊘ t_k``, ``c_k ← c_k ⊙ s_k``.

    Args:
        t: ``(out_features,)`` row factors (split like the blocks).
        s: one ``(in_features,)`` column factor per block.
    """
    if len(s) != len(module.split_sizes):
        raise GaugeError(f"rescale_lrm_internal: {len(s)} column factors for {len(module.split_sizes)} blocks")
    for k, (rows, tk) in enumerate(zip(_block_slices(module), t.split(module.split_sizes))):
        sk = s[k].to(module.weight)
        tk = tk.to(module.weight)
        module.row_mults[k].mul_(tk)
        module.col_mults[k].mul_(sk)
        module.weight[rows].div_(tk[:, None] * sk[None, :])
        if module.bias is not None:
            module.bias[rows].div_(tk)


def _block_slices(module: LRMLinear) -> list[slice]:
    out, start = [], 0
    for n in module.split_sizes:
        out.append(slice(start, start + n))
        start += n
    return out


def _expect(x: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != shape:
        raise GaugeError(f"{what} has shape {tuple(x.shape)}, expected {shape}")


def as_generator(generator: torch.Generator | int | None, what: str) -> torch.Generator | None:
    """A ``torch.Generator`` from a generator, an integer seed or ``None``."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        return torch.Generator().manual_seed(generator)
    raise GaugeError(f"{what}: generator must be a torch.Generator, an integer seed or None, got {type(generator).__name__}")


def _log_uniform(shape, scale, generator, dtype) -> torch.Tensor:
    return torch.exp((torch.rand(shape, generator=generator, dtype=dtype) * 2 - 1) * scale)


def _site_kinds(site: AttentionSite, kinds: tuple[str, ...], explicit: bool, what: str) -> tuple[str, ...]:
    """The kinds ``site`` has; an explicitly requested kind it lacks is refused with the alternative."""
    if site.qk_norm is None:
        lacking = {"qk_gain": "it has no QK-norm; its Q/K gauge is kind 'qk'"}
    else:
        why = ("it normalises queries and keys (QK-norm): {} is not a symmetry there; its Q/K gauge is kind "
               "'qk_gain' (the norm's gains, docs/qk_norm.md)")
        lacking = {"qk": why.format("GL(d_k) on W_Q/W_K"), "lrm_qk": why.format("rescaling r_Q against r_K")}
    if site.qk_orthogonal:
        lacking["lrm_qk"] = f"rescaling r_Q against r_K is not a symmetry ({site.qk_orthogonal})"
    for kind in BIAS_KINDS:
        why = missing_reason(site, kind)
        if why is not None:
            lacking[kind] = why
    if site.latent is None:
        for kind in LATENT_SECTORS:
            lacking[kind] = "it is not multi-head latent attention (no RoPE key shared by all heads, no latent spaces)"
    bad = [k for k in kinds if k in lacking]
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
    first (:mod:`gaugeopt.structure.gate`): checked, and proved on the model as it is now.

    Args:
        model: the model (modified and returned).
        kinds: ``None`` (default): each layer's own Q/K gauge (``"qk"``, or ``"qk_gain"`` under a
            QK-norm), ``"vo"`` and ``"perm"``; or any of ``"qk"`` (``GL(d_k)`` per KV group, restricted to the RoPE commutant),
            ``"vo"`` (``GL(d_v)``), ``"perm"`` (head permutations, in the layers whose heads may be
            permuted: not under ALiBi or T5's relative bias), ``"lrm_qk"``, ``"lrm_vo"``
            (diagonal multiplier gauges), ``"lrm_internal"`` (every LRM layer's internal
            rescaling), ``"qk_gain"`` (a QK-norm site's gain gauge, with random signs), ``"key_bias"``,
            ``"value_bias"`` (the bias sectors, :mod:`gaugeopt.structure.bias`: shifts ``δ ~
            N(0, log_scale²)``), on multi-head latent attention ``"qk_rope"`` (the RoPE part),
            ``"latent_rotation"`` (Haar-random ``O(L)`` per latent) and ``"latent_gain"`` (a gain factor per
            latent channel, random signs; docs/mla.md), or ``"all"`` for every kind each site has. A QK-norm site has
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
        kinds = ("qk", "qk_gain", "vo", "perm", "qk_rope")
    elif kinds == "all":
        kinds = VALID_KINDS if has_lrm else ("qk", "vo", "perm", "qk_gain", *BIAS_KINDS, *LATENT_SECTORS)
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in VALID_KINDS]
    if bad:
        raise GaugeError(f"random_gauge_transform: unknown kinds {bad}; valid kinds are {VALID_KINDS} or 'all'")
    g = generator
    for site in sites:
        here = _site_kinds(site, kinds, explicit, "random_gauge_transform")
        for kind in _SITE_ORDER:
            if kind in here and not (kind == "perm" and site.fixed_head_order):
                apply_valid(site, kind, g, log_scale=log_scale)
    if "lrm_internal" in kinds:
        if not has_lrm:
            raise GaugeError("random_gauge_transform: kind 'lrm_internal' needs learnable multipliers (gaugeopt.apply_lrm)")
        for m in model.modules():
            if isinstance(m, LRMLinear):
                random_lrm_internal(m, g, log_scale=log_scale)
    return model


# the per-site kinds, in the order random_gauge_transform applies them
_SITE_ORDER = ("lrm_qk", "lrm_vo", "key_bias", "value_bias", "latent_gain", "latent_rotation", "qk", "qk_rope",
               "qk_gain", "vo", "perm")


def apply_valid(site: AttentionSite, kind: str, generator: torch.Generator | None = None, *, log_scale: float = 0.5) -> None:
    """Apply one random valid element of the per-site gauge ``kind`` (``"qk"``, ``"qk_gain"``,
    ``"vo"``, ``"perm"``, ``"lrm_qk"``, ``"lrm_vo"``, ``"key_bias"``, ``"value_bias"``, ``"qk_rope"``,
    ``"latent_rotation"``, ``"latent_gain"``) to ``site``, in place (no certificate check: the building
    block of :func:`random_gauge_transform` and :func:`gaugeopt.certify`)."""
    g, dtype = generator, torch.float64
    if kind == "qk_rope":
        lat = site.latent
        if lat is None:
            raise GaugeError(f"apply_valid: {site.name} has no 'qk_rope' part (not multi-head latent attention)")
        act_qk_rope(site, random_commutant(lat.rope, lat.r, 1, log_scale=log_scale, generator=g))
    elif kind == "latent_rotation":
        for lat in _latents(site):
            rotate_latent(site, lat.name, random_orthogonal(1, lat.width, generator=g)[0])
    elif kind == "latent_gain":
        for lat in _latents(site):
            sign = torch.where(torch.rand(lat.width, generator=g) < 0.5, -1.0, 1.0).to(dtype)
            scale_latent_gain(site, lat.name, sign * _log_uniform((lat.width,), log_scale, g, dtype))
    elif kind in BIAS_KINDS:
        sec = site.bias_sector(kind)
        delta = log_scale * torch.randn(sec.groups, len(sec.channels), generator=g, dtype=dtype)
        (shift_key_bias if kind == "key_bias" else trade_value_bias)(site, delta)
    elif kind == "lrm_qk":
        pid = plane_index(site.rope, site.d_k)
        per_plane = _log_uniform((site.h_kv, int(pid.max()) + 1), log_scale, g, dtype)
        scale_qk_multipliers(site, per_plane[:, pid])
    elif kind == "lrm_vo":
        scale_vo_multipliers(site, _log_uniform((site.h_kv, site.d_v), log_scale, g, dtype))
    elif kind == "qk" and site.qk_orthogonal:  # a rotation per RoPE plane, SO of the non-rotary block
        act_qk(site, random_orthogonal_commutant(site.rope, site.d_k, site.h_kv, generator=g))
    elif kind == "qk":
        act_qk(site, random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g))
    elif kind == "qk_gain":
        pair = site.pair("qk_gain")
        pid = plane_index(pair.rope, site.d_k)
        n_slots = int(pid.max()) + 1
        sign = torch.where(torch.rand((pair.groups, n_slots), generator=g) < 0.5, -1.0, 1.0).to(dtype)
        per_slot = sign * _log_uniform((pair.groups, n_slots), log_scale, g, dtype)
        scale_qk_gains(site, per_slot[:, pid])
    elif kind == "vo":
        act_vo(site, random_well_conditioned(site.h_kv, site.d_v, log_scale=log_scale, generator=g))
    elif kind == "perm":
        kv_perm = torch.randperm(site.h_kv, generator=g)
        within = torch.argsort(torch.rand(site.h_kv, site.n_rep, generator=g), dim=1)
        q_perm = (kv_perm[:, None] * site.n_rep + within).reshape(-1)
        permute_heads(site, kv_perm, q_perm)
    else:
        raise GaugeError(f"apply_valid: kind={kind!r} is not one of {_SITE_ORDER}")


def _latents(site: AttentionSite):
    if site.latent is None:
        raise GaugeError(f"{site.name} has no latent spaces (not multi-head latent attention)")
    return site.latent.latents()


def random_lrm_internal(module: LRMLinear, generator: torch.Generator | None = None, *, log_scale: float = 0.5) -> None:
    """A random element of one LRM layer's internal gauge (:func:`rescale_lrm_internal`)."""
    t = _log_uniform((module.out_features,), log_scale, generator, torch.float64)
    s = [_log_uniform((module.in_features,), log_scale, generator, torch.float64) for _ in module.split_sizes]
    rescale_lrm_internal(module, t, s)


def applicable_invalid_kinds(sites: Sequence[AttentionSite]) -> tuple[str, ...]:
    """The :data:`ALL_INVALID_KINDS` that apply to these sites (each needs some feature, see
    :func:`invalid_gauge_transform`)."""
    out = []
    for kind in ALL_INVALID_KINDS:
        try:
            _invalid_sites(sites, kind)
        except GaugeError:
            continue
        out.append(kind)
    return tuple(out)


def _invalid_sites(sites: Sequence[AttentionSite], kind: str) -> list[AttentionSite]:
    """The sites a control acts on; raises when it applies to none of them."""
    mla = (lambda s: s.latent is not None, "multi-head latent attention")
    need = {
        "gl_under_rope": (lambda s: s.rope.active or s.latent is not None, "a model with RoPE"),
        "cross_head": (lambda s: s.h_kv >= 2, "at least two KV heads"),
        "qk_under_norm": (lambda s: s.qk_norm is not None or bool(s.qk_orthogonal), "a QK-norm model"),
        "head_scalar": (lambda s: bool(s.qk_orthogonal) or
                        s.qk_norm is not None and (s.qk_norm.eps > 0 or s.qk_norm.scope == "full"),
                        "a QK-norm model with eps > 0 (with eps = 0 a per-head scalar is a symmetry of a per-head norm)"),
        "gain_off_plane": (lambda s: s.qk_norm is not None and s.qk_norm.before_rope and s.rope.active,
                           "a QK-norm model whose norm acts before RoPE"),
        "gain_untied": (lambda s: s.qk_norm is not None and s.qk_norm.per_head and s.n_rep > 1,
                        "a QK-norm model with per-head gains and GQA"),
        "gain_without_bias": (lambda s: s.qk_norm is not None and s.qk_norm.q_bias is not None,
                              "a QK-norm model with a LayerNorm bias"),
        "key_bias_rope": (lambda s: s.k.bias is not None and s.qk_norm is None and s.rope.active,
                          "a key bias under RoPE"),
        "value_bias_alone": (lambda s: s.v.bias is not None, "a value bias"),
        "sinks_unmoved": (lambda s: s.sinks is not None and s.h > 1 and not s.fixed_head_order,
                          "attention sinks on more than one head"),
        "bias_under_sinks": (lambda s: s.sinks is not None and _sink_bias_shift(s) is not None,
                             "attention sinks with a key bias on non-rotary channels, or value and output biases"),
        "rope_per_head": mla,
        "perm_without_rope": (lambda s: s.latent is not None and s.h > 1 and not s.fixed_head_order,
                              "multi-head latent attention with two or more heads"),
        "latent_gl": mla,
        "latent_gain_alone": mla,
    }
    if kind not in need:
        return list(sites)
    test, what = need[kind]
    chosen = [s for s in sites if test(s)]
    if not chosen:
        raise GaugeError(f"invalid_gauge_transform: {kind!r} needs {what}")
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
                           the non-rotary channels), which the sinks break (:mod:`gaugeopt.structure.bias`)
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
    if kind not in ALL_INVALID_KINDS:
        raise GaugeError(f"invalid_gauge_transform: kind={kind!r} is not one of {ALL_INVALID_KINDS}")
    sites = _invalid_sites(trusted_sites(model, "invalid_gauge_transform", sites=sites), kind)
    g = as_generator(generator, "invalid_gauge_transform")
    for site in sites:
        apply_invalid(site, kind, g, log_scale=log_scale)
    return model


def apply_invalid(site: AttentionSite, kind: str, generator: torch.Generator | None = None, *, log_scale: float = 0.5) -> None:
    """Apply the negative control ``kind`` (:data:`ALL_INVALID_KINDS`) to one site, in place; a control
    that does not apply to the site (``gl_under_rope`` without RoPE, ``cross_head`` with one KV
    head, a QK-norm control on plain attention) leaves it unchanged."""
    g = generator
    rwc = lambda n, d: random_well_conditioned(n, d, log_scale=log_scale, generator=g)  # noqa: E731
    if kind not in ALL_INVALID_KINDS:
        raise GaugeError(f"apply_invalid: kind={kind!r} is not one of {ALL_INVALID_KINDS}")
    try:
        _invalid_sites([site], kind)
    except GaugeError:
        return
    if kind == "asymmetric_qk":
        A = random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g)
        B = random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g)
        act_qk(site, A, B_inv=torch.linalg.inv(B), check=False)  # A, B in the commutant by construction
    elif kind == "wrong_inverse":
        A = random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g)
        act_qk(site, A, B_inv=A.mT, check=False)
    elif kind == "vo_mismatch":
        act_vo(site, rwc(site.h_kv, site.d_v), D=rwc(site.h_kv, site.d_v))
    elif kind == "gl_under_rope":
        if site.rope.active:
            act_qk(site, rwc(site.h_kv, site.d_k), check=False)
        if site.latent is not None:  # the RoPE part of latent attention
            act_qk_rope(site, rwc(1, site.latent.r), check=False)
    elif kind == "rope_per_head":
        lat = site.latent
        B = random_commutant(lat.rope, lat.r, site.h, log_scale=log_scale, generator=g)
        act_qk_rope(site, B[:1], per_head=B)
    elif kind == "perm_without_rope":
        lat = site.latent
        kept = [(ref, ref.get().detach().clone()) for ref in (lat.q_rope, lat.q_rope_bias) if ref is not None]
        kv = torch.arange(site.h_kv).roll(1)
        permute_heads(site, kv, (kv[:, None] * site.n_rep + torch.arange(site.n_rep)).reshape(-1))
        with torch.no_grad():
            for ref, saved in kept:
                ref.get().copy_(saved)
    elif kind == "latent_gl":
        for lat in site.latent.latents():
            rotate_latent(site, lat.name, rwc(1, lat.width)[0], check=False)
    elif kind == "latent_gain_alone":
        for lat in site.latent.latents():
            scale_latent_gain(site, lat.name, _log_uniform((lat.width,), log_scale, g, torch.float64), move_columns=False)
    elif kind == "cross_head":
        _mix_heads(site, rwc(1, site.h_kv * site.d_k)[0])
    elif kind == "qk_under_norm":  # in the commutant by construction; not orthogonal (check=False lets it through)
        act_qk(site, random_commutant(site.rope, site.d_k, site.h_kv, log_scale=log_scale, generator=g), check=False)
    elif kind == "head_scalar":
        c = 10.0 ** (torch.rand(site.h, generator=g, dtype=torch.float64) - 2.0)  # in [0.01, 0.1)
        wq, bq = site.effective("q")
        site.set_effective("q", wq * c[:, None, None].to(wq), None if bq is None else bq * c[:, None].to(bq))
    elif kind in ("gain_off_plane", "gain_without_bias"):
        pair = site.pair("qk_gain")
        delta = _log_uniform((pair.groups, site.d_k), log_scale, g, torch.float64)
        if kind == "gain_without_bias":
            pid = plane_index(pair.rope, site.d_k)
            delta = delta[:, pid]  # a valid factor: only the bias is wrong
        scale_qk_gains(site, delta, check=False, move_bias=kind != "gain_without_bias")
    elif kind == "gain_untied":
        _untied_gains(site, _log_uniform((site.h, site.d_k), log_scale, g, torch.float64))
    elif kind == "key_bias_rope":
        rotated = sorted(c for plane in site.rope.planes(site.d_k) for c in plane)
        wk, bk = site.effective("k")
        bk[:, rotated] += log_scale * torch.randn(site.h_kv, len(rotated), generator=g, dtype=torch.float64).to(bk)
        site.set_effective_bias("k", bk)
    elif kind == "value_bias_alone":
        _, bv = site.effective("v")
        site.set_effective_bias("v", bv + log_scale * torch.randn(bv.shape, generator=g, dtype=torch.float64).to(bv))
    elif kind == "sinks_unmoved":
        saved = site.sinks.get().detach().clone()
        kv_perm = torch.arange(site.h_kv).roll(1) if site.h_kv > 1 else torch.arange(1)
        q_perm = (kv_perm[:, None] * site.n_rep + torch.arange(site.n_rep).roll(1)[None, :]).reshape(-1)
        permute_heads(site, kv_perm, q_perm)
        with torch.no_grad():
            site.sinks.get().copy_(saved)
    elif kind == "bias_under_sinks":
        with torch.no_grad():
            _sink_bias_shift(site)(log_scale, g)


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


@torch.no_grad()
def _untied_gains(site: AttentionSite, per_head: torch.Tensor) -> None:
    """``g_q[i] ← g_q[i] ⊙ d_i`` for every query head, ``g_k[j] ← g_k[j] ⊘ d_{first head of j}``."""
    pid = plane_index(site.pair("qk_gain").rope, site.d_k)
    d = per_head[:, pid]
    n = site.qk_norm
    for ref, f in ((n.q_gain, d), (n.k_gain, 1.0 / d[:: site.n_rep])):
        v = ref.get()
        v.copy_((v + n.gain_offset) * f.to(v) - n.gain_offset)


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
