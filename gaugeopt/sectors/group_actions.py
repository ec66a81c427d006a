"""The finite gauge actions on one attention record: the group elements of docs/gauge_group.md.

Each function moves one record's tensors in place by one group element, acting on the *effective*
weights (``diag(r)·W̄·diag(c)`` under learnable multipliers, biases travelling with their rows),
per KV group ``j`` shared by its query heads:

==============================  ===========================================================
action                          effect
==============================  ===========================================================
:func:`act_qk`                  ``W_Q[i] ← Aᵀ W_Q[i]``, ``W_K[j] ← A⁻¹ W_K[j]``; ``A`` in the RoPE commutant
:func:`act_vo`                  ``W_V[j] ← Cᵀ W_V[j]``, ``W_O[:, i] ← W_O[:, i] C⁻ᵀ``
:func:`permute_heads`           KV groups (and query heads within them) reordered consistently
:func:`scale_qk_multipliers`    ``r_Q[i] ← r_Q[i] ⊙ δ``, ``r_K[j] ← r_K[j] ⊘ δ`` (δ constant per RoPE plane)
:func:`scale_vo_multipliers`    ``r_V[j] ← r_V[j] ⊙ e``, ``c_O[i] ← c_O[i] ⊘ e``
:func:`rescale_lrm_internal`    ``r ← r ⊙ t``, ``W̄ ← W̄ ⊘ (t ⊗ s)``, ``c ← c ⊙ s`` inside one LRM layer
:func:`scale_qk_gains`          QK-norm: ``g_q ← g_q ⊙ d``, ``g_k ← g_k ⊘ d`` (LayerNorm biases alike; ``d``
                                constant per RoPE plane when the norm acts before RoPE)
:func:`shift_key_bias`          ``b_K[j][c] += δ`` on the non-rotary channels ``c`` (:mod:`gaugeopt.records.bias_sector`)
:func:`trade_value_bias`        ``b_V[j] += δ``, ``b_O −= Σ_{i∈j} W_O[:, i] δ``
==============================  ===========================================================

Multi-head latent attention has its own (:mod:`gaugeopt.records.latent`: the RoPE part, a latent's
rotation and its gain). Which of these a record has, their random elements and the controls that
must change the function are the sector registry's (:mod:`gaugeopt.sectors`); the model-wide
entry points, which pass the gate first, are :mod:`gaugeopt.transforms`. This module checks its
arguments (shapes, the RoPE commutant, multipliers present) but not the records: it is the building
block below the certificate, which uses it to prove them.

Example:
    >>> import copy, torch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.sectors.group_actions import act_vo, relative_change
    >>> from gaugeopt.adapters.find import find_attention
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32)).double()
    >>> x = torch.randint(0, 64, (2, 16))
    >>> moved = copy.deepcopy(model)
    >>> site = find_attention(moved)[0]
    >>> act_vo(site, torch.linalg.matrix_exp(0.3 * torch.randn(site.h_kv, site.d_v, site.d_v, dtype=torch.float64)))
    >>> relative_change(model(x)[0], moved(x)[0]) < 1e-12
    True
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.models.lrm import LRMLinear
from gaugeopt.records.rope import commutator_size
from gaugeopt.records.site import AttentionSite

__all__ = [
    "act_qk", "act_vo", "permute_heads", "scale_qk_multipliers", "scale_vo_multipliers", "rescale_lrm_internal",
    "scale_qk_gains", "shift_key_bias", "trade_value_bias", "random_lrm_internal", "relative_change", "as_generator",
]


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
            "(see gaugeopt.records.rope.random_commutant), anything else changes the attention scores"
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
                    f"({site.qk_orthogonal}): use gaugeopt.records.rope.random_orthogonal_commutant"
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
    ignores (:mod:`gaugeopt.records.bias_sector`)."""
    sec = site.bias_sector("key_bias")
    _, bk = site.effective("k")
    site.set_effective_bias("k", sec.shifted(bk, delta))


@torch.no_grad()
def trade_value_bias(site: AttentionSite, delta: torch.Tensor) -> None:
    """The value-bias trade: ``b_V[j] ← b_V[j] + δ[j]``, ``b_O ← b_O − Σ_{i∈j} W_O[:, i] δ[j]``.

    ``delta: (h_kv, d_v)``. Attention rows sum to one, so each head's output moves by ``W_O[:, i]δ``,
    which the output bias takes back (:mod:`gaugeopt.records.bias_sector`)."""
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


def random_lrm_internal(module: LRMLinear, generator: torch.Generator | None = None, *, log_scale: float = 0.5) -> None:
    """A random element of one LRM layer's internal gauge (:func:`rescale_lrm_internal`)."""
    t = _log_uniform((module.out_features,), log_scale, generator, torch.float64)
    s = [_log_uniform((module.in_features,), log_scale, generator, torch.float64) for _ in module.split_sizes]
    rescale_lrm_internal(module, t, s)
