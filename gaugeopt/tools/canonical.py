"""Canonical forms of the attention gauge: the QR section and the Gram-balanced section.

A canonical form picks one representative of each gauge orbit (docs/model_tools.md). Per attention
layer and KV group ``j`` (shared by its query heads ``i``), in gaugeopt's PyTorch layout
(``W_Q[i]: (d_k, d)``, rows are head channels; the paper writes ``W_Q^{(i)} = W_Q[i]ᵀ``):

=================  ==============================================  ==============================
section            Q/K equations (``P = Σ_i W_Q[i]W_Q[i]ᵀ``,       V/O equation
                   ``R = W_K[j]W_K[j]ᵀ``, both ``d_k×d_k``)
=================  ==============================================  ==============================
``"qr"``           ``P = I``  (paper 000 Alg. 1: thin QR of the    ``W_V[j]W_V[j]ᵀ = I``
                   stacked queries, positive diagonal, ``R``
                   transported into ``W_K``)
``"balanced"``     ``P = R``  (paper 001 Def. 31,                  ``W_V[j]W_V[j]ᵀ = I``
                   ``W_QᵀW_Q = W_KᵀW_K`` in the paper's layout)
=================  ==============================================  ==============================

The paper's ``(W_V^{(i)})ᵀW_V^{(i)} = I`` is ``W_V[j]W_V[j]ᵀ = I`` here. With GQA one factor
serves a whole group, so the query condition is on the group sum ``P`` (for ``h_kv = h`` it
is the paper's per-head condition). Biases travel covariantly (paper 000 Prop. 12):
``b_Q ← Aᵀb_Q``, ``b_K ← A⁻¹b_K``, ``b_V ← Cᵀb_V``; the head gauges leave the output bias alone.

**Bias sectors** (:mod:`gaugeopt.structure.bias`). Prop. 12's laws are unique only up to two more
exact symmetries: the key bias is free on the non-rotary channels (softmax ignores a score shift
common to all keys) and the value bias trades against the output bias (attention rows sum to
one). With ``biases="fold"`` (default) the form fixes them too — ``b_K = 0`` on the non-rotary
channels, and ``b_V = 0`` with ``Σ_i W_O[:, i] b_V[g(i)]`` added to ``b_O`` — so models that differ
by a bias move canonicalise to the same parameters; :attr:`CanonicalReport.bias_zeroed` counts the
entries that became pure zeros (GPT-2 small: ``12·(768 + 768) = 18,432``). A zero block stays zero
under the head gauges (their factors are block diagonal on the rotary/non-rotary split), so the
order of the steps does not matter. ``biases="keep"`` leaves the biases as they are.

**Residual freedom.** Both sections leave ``O(d_k) × O(d_v)`` per group (paper 000 Prop. 45).
``residual="keep"`` stops there — exactly Algorithm 1 for ``"qr"``, the symmetric
positive-definite balancing factor for ``"balanced"``. ``residual="fix"`` (default) removes
it with a deterministic convention, so the form is unique on generic weights:

* ``P + R`` is diagonal with descending diagonal (``"qr"``: ``R = diag(σ²)``, the rows of
  ``W_Q`` are the left singular vectors of the QK circuit ``W_QᵀW_K``; ``"balanced"``:
  ``P = R = diag(σ)``, the symmetric split of its SVD);
* ``Σ_i W_O[:, i]ᵀW_O[:, i]`` is diagonal with descending diagonal (SVD of the OV circuit);
* signs: each row ``a`` of ``W_K`` (and of ``W_V``) has ``Σ_c W[a, c]³ > 0``.

**RoPE.** The Q/K factor must lie in the commutant: ``a·I + b·J`` on each rotation plane
(``GL(1, ℂ)``: a scale ``ρ`` and an angle ``φ``) and full ``GL`` on the non-rotary
coordinates. A plane's 2×2 Grams ``P_m, R_m`` can only be scaled and conjugated by a
rotation, so on a plane the section fixes the *traces* — ``"qr"``: ``tr P_m = 2``,
``"balanced"``: ``tr P_m = tr R_m`` — and, with ``residual="fix"``, the angle (``P_m + R_m``
diagonal, larger entry first) and the sign ``−I`` (cubic rule over both rows of ``W_K``).
Non-rotary coordinates get the full treatment above. The residual freedom on a plane is
``SO(2)``.

**Head order** (``sort_heads=True``). Query heads within a KV group, then the groups, are
sorted by descending QK-circuit energy ``‖W_Q[i]ᵀW_K[j]‖_F²`` (group: summed over its query
heads), ties broken by the OV-circuit energy ``‖W_O[:, i]W_V[j]‖_F²``, then
lexicographically on the canonical parameters. Both keys are gauge invariant; in the QR
section with ``h_kv = h`` the first is paper 000's ``‖W_K^{(i)}‖_F`` rule (paper 001 sorts
by ``‖W_Q‖_F``, which is not invariant across sections). Exact ties change nothing (the
tied heads are then identical); *near* ties make the order fragile, see
:attr:`CanonicalReport.margins`.

**QK-norm** (docs/qk_norm.md). A site that RMS-normalises queries and keys has no ``GL(d_k)`` on
``W_Q``/``W_K`` to section: its Q/K gauge is the gain gauge ``g_q ⊙ d``, ``g_k ⊘ d`` (one ``d`` per
RoPE plane, or channel, per layer — per KV group for per-head gains). The section, per group and
slot, with ``s = RMS`` of the gains over the slot (``1 + w`` for Gemma): ``"qr"``: ``s_q = 1``;
``"balanced"``: ``s_q = s_k``; ``residual="fix"`` also fixes the sign of ``d`` by
``Σ_slot g_k³ > 0``. ``W_Q``, ``W_K`` are left as they are (the group does not move them), the V/O
section and the head order are as above, and per-head gains move with their heads. A LayerNorm
QK-norm (timm) is refused: its further invisible directions (the key bias, a query-bias shift,
each head's mean direction, a centred rotation) have no section here, so a form would not be unique.

**Multi-head latent attention** (docs/mla.md). Each latent is moved first, by criteria the head gauges
cannot change (they act on the other side of the up-projections): its gain to ``γ = 1`` (the
diagonal gain gauge; a zero gain entry is refused), then, with ``residual="fix"``, its rotation so
that ``A Aᵀ`` is diagonal with descending diagonal for the down-projection rows ``A = [W_down | b_down]``,
each row signed by the cubic rule. The part without RoPE then gets the Q/K and V/O sections above
(per head, no RoPE), and the RoPE part the plane section above on the stacked RoPE query rows of all
heads against the one shared key. The head order adds the RoPE circuit energy ``‖W_Q^rope[i]ᵀW_K^rope‖²``
to the QK key, and heads move with their RoPE query rows.

**Learnable multipliers.** The gauge acts on the effective weights ``diag(r)·W̄·diag(c)``.
With ``fold_multipliers=True`` (default) every :class:`~gaugeopt.models.lrm.LRMLinear` is first
folded (``W̄ ← diag(r)W̄diag(c)``, ``b̄ ← r⊙b̄``, ``r = c = 1``), which also removes the
internal ``r·W̄·c`` rescalings, so the stored parameters are canonical. With ``False`` the
multipliers keep their values (head sorting moves them with their heads) and only the
effective attention weights are canonical; ``W̄`` absorbs the change.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.tools.canonical import canonicalize
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)).double()
    >>> report = canonicalize(model, "qr")
    >>> x = torch.randint(0, 64, (2, 16))
    >>> gaugeopt.relative_change(model(x)[0], report.model(x)[0]) < 1e-12
    True
    >>> report.after.summary()["value_orthonormality"][1] < 1e-12
    True
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gaugeopt.structure.actions import act_qk, act_vo, permute_heads, scale_qk_gains, shift_key_bias, trade_value_bias
from gaugeopt.structure.latent import act_qk_rope, rotate_latent, scale_latent_gain
from gaugeopt.errors import GaugeError
from gaugeopt.fix.drift import read_mean_squares, slot_rms
from gaugeopt.models.lrm import LRMLinear
from gaugeopt.structure.pair import query_rows
from gaugeopt.structure.rope import plane_index
from gaugeopt.structure.site import AttentionSite
from gaugeopt.structure.gate import trusted_sites
from gaugeopt.structure.registry import find_attention

__all__ = [
    "SECTIONS", "RESIDUALS", "GaugeMetrics", "CanonicalReport", "canonicalize", "canonical_metrics",
    "section_residual", "fold_lrm_multipliers", "effective_tensors", "head_energies", "fold_bias_tensors",
    "fold_biases", "BIAS_MODES", "refuse_latent",
]

SECTIONS = ("qr", "balanced")
RESIDUALS = ("fix", "keep")
BIAS_MODES = ("fold", "keep")


# ---------------------------------------------------------------------- reading a site
def effective_tensors(site: AttentionSite, *, fold_biases: bool = False) -> dict[str, torch.Tensor | None]:
    """Effective float64 copies: ``wq (h, d_k, d)``, ``bq (h, d_k)``, ``wk (h_kv, d_k, d)``,
    ``bk``, ``wv (h_kv, d_v, d)``, ``bv``, ``wo (h, d_out, d_v)`` (per head: ``W_O[:, i]``), ``bo``.

    ``fold_biases=True`` returns the representative of the bias sectors instead
    (:func:`fold_bias_tensors`): ``b_K = 0`` on the non-rotary channels, ``b_V = 0`` with
    ``Σ_i W_O[:, i] b_V[g(i)]`` added to ``b_O`` — the same function."""
    out: dict[str, torch.Tensor | None] = {}
    for p in "qkvo":
        w, b = site.effective(p)
        out["w" + p] = w.detach().double()  # (under LRM site.effective stays attached to the multipliers)
        out["b" + p] = None if b is None else b.detach().double()
    out["wo"] = out["wo"].permute(1, 0, 2)  # (d_out, h, d_v) -> (h, d_out, d_v)
    return fold_bias_tensors(site, out) if fold_biases else out


def fold_bias_tensors(site: AttentionSite, t: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The bias sectors' representative of :func:`effective_tensors`' ``t`` (a new dict): the
    key-bias shift ``δ = −b_K`` on the non-rotary channels and the value-bias trade ``δ = −b_V``
    (:mod:`gaugeopt.structure.bias`), where the site has them; other entries are shared."""
    out = dict(t)
    kinds = site.bias_kinds
    if "key_bias" in kinds:
        sec = site.bias_sector("key_bias")
        out["bk"] = sec.shifted(t["bk"], -t["bk"][:, list(sec.channels)])
    if "value_bias" in kinds:
        sec = site.bias_sector("value_bias")
        out["bo"] = sec.absorbed(t["bo"], t["wo"].permute(1, 0, 2), -t["bv"])
        out["bv"] = sec.shifted(t["bv"], -t["bv"])
    return out


@torch.no_grad()
def fold_biases(site: AttentionSite) -> int:
    """Move ``site`` to the bias sectors' representative, in place (the function is unchanged):
    ``b_K ← 0`` on the non-rotary channels (:func:`~gaugeopt.structure.actions.shift_key_bias`),
    ``b_O ← b_O + Σ_i W_O[:, i] b_V[g(i)]``, ``b_V ← 0``
    (:func:`~gaugeopt.structure.actions.trade_value_bias`). Returns how many bias entries became pure
    zeros (``h_kv·(d_k − r)`` + ``h_kv·d_v`` where the site has the sectors)."""
    zeroed = 0
    for kind in site.bias_kinds:
        sec = site.bias_sector(kind)
        _, b = site.effective(sec.proj)
        delta = -b[:, list(sec.channels)]
        (shift_key_bias if kind == "key_bias" else trade_value_bias)(site, delta)  # b + (−b) is exactly 0
        zeroed += sec.dim
    return zeroed


def _stack_queries(site: AttentionSite, wq: torch.Tensor) -> torch.Tensor:
    """``(h, d_k, d) -> (h_kv, d_k, n_rep·d)``: the query rows of each KV group side by side,
    so that ``S Sᵀ = Σ_i W_Q[i]W_Q[i]ᵀ`` (:meth:`~gaugeopt.structure.pair.PairSide.stack`)."""
    return query_rows(site).stack(wq)


def _stack_outputs(site: AttentionSite, wo: torch.Tensor) -> torch.Tensor:
    """``(h, d_out, d_v) -> (h_kv, n_rep·d_out, d_v)``: ``Tᵀ T = Σ_i W_O[:, i]ᵀW_O[:, i]``."""
    return site.pair("vo").b.stack(wo.mT).mT


# ---------------------------------------------------------------------- small linear algebra
def _qr_pos(x: torch.Tensor, what: str, rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Thin QR ``x = Q R`` of ``(..., m, n)`` with ``diag(R) > 0`` (paper 000 Remark 48);
    refuses a numerically rank-deficient ``x`` (the section needs full rank, Assumption A4)."""
    q, r = torch.linalg.qr(x)
    s = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    s[s == 0] = 1
    q, r = q * s[..., None, :], r * s[..., :, None]
    sv = torch.linalg.svdvals(r)
    ratio = sv[..., -1] / sv[..., 0].clamp_min(torch.finfo(sv.dtype).tiny)
    if x.shape[-2] < x.shape[-1] or bool((ratio <= rtol).any()):
        worst = float(ratio.min()) if x.shape[-2] >= x.shape[-1] else 0.0
        raise GaugeError(
            f"{what} is numerically rank deficient (σ_min/σ_max = {worst:.2e} <= rank_rtol={rtol:.1e}); "
            "the canonical form needs full-rank projections (paper 000 Assumption A4). Prune or merge the "
            "degenerate head first, or pass a smaller rank_rtol if the model is merely ill conditioned"
        )
    return q, r


def _tri_inv(r: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(r.shape[-1], dtype=r.dtype).expand_as(r)
    return torch.linalg.solve_triangular(r, eye, upper=True)


def _sign_of_cubes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sign(Σ_c x³)`` per row (``+1`` for 0) and the margin ``|Σ x³| / Σ |x|³``."""
    cube = (rows**3).sum(-1)
    s = torch.sign(cube)
    s[s == 0] = 1
    return s, cube.abs() / (rows.abs() ** 3).sum(-1).clamp_min(torch.finfo(rows.dtype).tiny)


def _gaps(sig: torch.Tensor) -> torch.Tensor:
    """Smallest relative gap between consecutive descending values, per batch entry."""
    if sig.shape[-1] < 2:
        return torch.full(sig.shape[:-1], float("inf"), dtype=sig.dtype)
    return ((sig[..., :-1] - sig[..., 1:]) / sig[..., :1].clamp_min(torch.finfo(sig.dtype).tiny)).amin(-1)


# ---------------------------------------------------------------------- the factors
def _free_qk_factor(S, K, section, residual, rtol, what, margins):
    """Factor ``A (g, f, f)`` for unconstrained coordinates: queries ``S (g, f, N)``, keys ``K (g, f, M)``.

    ``Sᵀ = Q_S R_S``, ``Kᵀ = Q_K R_K``, core ``R_S R_Kᵀ = u σ vᵀ``; ``A = R_S⁻¹ u σᵗ`` gives
    ``AᵀS = σᵗuᵀQ_Sᵀ`` and ``A⁻¹K = σ¹⁻ᵗvᵀQ_Kᵀ`` (``t = 0``: QR section, ``t = ½``: balanced).
    """
    _, rs = _qr_pos(S.mT, f"{what} stacked W_Q", rtol)
    rs_inv = _tri_inv(rs)
    if residual == "keep" and section == "qr":
        return rs_inv  # paper 000 Algorithm 1
    qk, rk = _qr_pos(K.mT, f"{what} W_K", rtol)
    u, sig, vh = torch.linalg.svd(rs @ rk.mT)
    t = 0.0 if section == "qr" else 0.5
    A = rs_inv @ (u * sig[..., None, :] ** t)
    if residual == "keep":  # balanced: the symmetric positive-definite balancing factor
        x, y, _ = torch.linalg.svd(A)
        return (x * y[..., None, :]) @ x.mT
    s, margin = _sign_of_cubes(vh @ qk.mT)  # rows of A⁻¹K up to the positive σ¹⁻ᵗ
    margins["spectral_gap"] = min(margins["spectral_gap"], float(_gaps(sig).min()))
    margins["sign_margin"] = min(margins["sign_margin"], float(margin.min()))
    return A * s[..., None, :]


def _plane_qk_factor(S, K, planes, section, residual, what, margins):
    """Per plane ``(p, q)`` the commutant element ``ρ(cos φ·I + sin φ·J)``; returns ``(a, b)``,
    each ``(g, n_planes)``, with ``A[p,p] = A[q,q] = a``, ``A[q,p] = b``, ``A[p,q] = −b``."""
    p, q = (list(c) for c in zip(*planes))
    Sp, Sq, Kp, Kq = S[:, p], S[:, q], K[:, p], K[:, q]
    tr_p = (Sp * Sp).sum(-1) + (Sq * Sq).sum(-1)
    tr_r = (Kp * Kp).sum(-1) + (Kq * Kq).sum(-1)
    tiny = torch.finfo(S.dtype).tiny
    if bool((tr_p <= tiny).any()) or bool((tr_r <= tiny).any()):
        raise GaugeError(f"{what}: a RoPE plane of W_Q or W_K is zero; the canonical form needs every plane to be used")
    rho = (2.0 / tr_p).sqrt() if section == "qr" else (tr_r / tr_p) ** 0.25
    if residual == "keep":
        return rho, torch.zeros_like(rho)
    r2, ir2 = rho**2, rho**-2  # G = ρ²P_m + ρ⁻²R_m, rotated to diagonal (larger entry first)
    g_pp = r2 * (Sp * Sp).sum(-1) + ir2 * (Kp * Kp).sum(-1)
    g_qq = r2 * (Sq * Sq).sum(-1) + ir2 * (Kq * Kq).sum(-1)
    g_pq = r2 * (Sp * Sq).sum(-1) + ir2 * (Kp * Kq).sum(-1)
    phi = 0.5 * torch.atan2(2 * g_pq, g_pp - g_qq)  # angle of the top eigenvector
    c, s = torch.cos(phi), torch.sin(phi)
    kp_new = (c[..., None] * Kp + s[..., None] * Kq) / rho[..., None]  # A⁻¹K = ρ⁻¹Rot(−φ)K on the plane
    kq_new = (-s[..., None] * Kp + c[..., None] * Kq) / rho[..., None]
    sign, margin = _sign_of_cubes(torch.cat([kp_new, kq_new], dim=-1))
    gap = torch.sqrt((g_pp - g_qq) ** 2 + 4 * g_pq**2) / (g_pp + g_qq)
    margins["spectral_gap"] = min(margins["spectral_gap"], float(gap.min()))
    margins["sign_margin"] = min(margins["sign_margin"], float(margin.min()))
    return sign * rho * c, sign * rho * s


def _qk_factor(site, t, section, residual, rtol, margins) -> torch.Tensor:
    S = _stack_queries(site, t["wq"])
    K = t["wk"]
    g, dk = site.h_kv, site.d_k
    r = site.rope.rotary_dim
    A = torch.zeros(g, dk, dk, dtype=torch.float64)
    what = f"{site.name}: Q/K"
    if r < dk:
        A[:, r:, r:] = _free_qk_factor(S[:, r:], K[:, r:], section, residual, rtol, what, margins)
    planes = site.rope.planes(dk)
    if planes:
        a, b = _plane_qk_factor(S, K, planes, section, residual, what, margins)
        p, q = (list(c) for c in zip(*planes))
        A[:, p, p] = a
        A[:, q, q] = a
        A[:, q, p] = b
        A[:, p, q] = -b
    return A


# ---------------------------------------------------------------------- QK-norm: the gain section
def refuse_layer_norm(site: AttentionSite, what: str) -> None:
    """Refuse a site whose Q/K gauge has no section here: a LayerNorm QK-norm (its invisible directions;
    module docstring) or a weight-free norm per head (only rotations of W_Q/W_K, ``site.qk_orthogonal``)."""
    if site.qk_orthogonal:
        raise GaugeError(
            f"{what}: {site.name} keeps only the orthogonal part of the Q/K gauge ({site.qk_orthogonal}); gaugeopt "
            "has no canonical section or invariants for it yet, so no unique form exists here"
        )
    if site.qk_norm is not None and site.qk_norm.kind != "rms":
        raise GaugeError(
            f"{what}: {site.name} normalises queries and keys with a LayerNorm; besides the gain gauge it leaves "
            "directions the function never sees (the key bias, a query-bias shift, each head's mean direction, a "
            "centred rotation) that gaugeopt does not section, so no unique form exists here. RMSNorm QK-norm "
            "(Qwen3, OLMo 2, Gemma 3, GPT(qk_norm=True)) is supported"
        )


def refuse_latent(sites, what: str) -> None:
    """Refuse multi-head latent attention in a tool that does not quotient its RoPE part and latents."""
    for site in sites:
        if site.latent is not None:
            raise GaugeError(
                f"{what}: {site.name} is multi-head latent attention ({site.kind}); this tool compares and aligns the "
                "head circuits of plain attention and would ignore the RoPE key its heads share and the rotations and "
                "gains of its latent spaces, so its verdict would not be sound. canonicalize supports it: compare "
                "canonical forms (docs/mla.md)"
            )


def gain_scales(site: AttentionSite) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s_q, s_k, slot)`` of a QK-norm site: RMS of the gains (``gain + offset``) per group and
    slot (``(groups, n_slots)``, float64) and the slot of each channel."""
    pair = site.pair("qk_gain")
    slot = plane_index(pair.rope, site.d_k)
    n = int(slot.max()) + 1
    s_q = slot_rms(read_mean_squares(pair.a, pair.a.members("gain"), torch.float64), slot, n)
    s_k = slot_rms(read_mean_squares(pair.b, pair.b.members("gain"), torch.float64), slot, n)
    return s_q, s_k, slot


def _gain_cubes(site: AttentionSite, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ g_k³, Σ |g_k|³)`` of the key gains (``+ offset``) per group and slot."""
    pair = site.pair("qk_gain")
    n = int(slot.max()) + 1
    g = pair.b.grouped(site.qk_norm.k_gain.get().detach().double() + site.qk_norm.gain_offset)  # (G, 1, d_k)
    onehot = torch.nn.functional.one_hot(slot, n).to(g.dtype)
    return (g**3).sum(1) @ onehot, (g.abs() ** 3).sum(1) @ onehot


def _gain_section(site: AttentionSite, section: str, residual: str, margins: dict) -> None:
    """Move the site's gains to the section (module docstring)."""
    s_q, s_k, slot = gain_scales(site)
    tiny = torch.finfo(torch.float64).tiny
    if bool((s_q <= tiny).any()) or bool((s_k <= tiny).any()):
        raise GaugeError(f"{site.name}: a slot of the QK-norm gains is zero; the canonical form needs every slot used")
    d = 1.0 / s_q if section == "qr" else (s_k / s_q).sqrt()
    if residual == "fix":
        cube, norm = _gain_cubes(site, slot)
        sign = torch.where(cube / d < 0, -1.0, 1.0).to(d)  # after g_k ← g_k / d: Σ g_k³ > 0
        margins["sign_margin"] = min(margins["sign_margin"], float((cube.abs() / norm.clamp_min(tiny)).min()))
        d = d * sign
    scale_qk_gains(site, d[:, slot])


# ---------------------------------------------------------------------- latent attention: latents and the RoPE part
def _latent_rows(lat) -> torch.Tensor:
    """``A = [W_down | b_down]`` of a latent, ``(L, d [+1])``, float64."""
    w = lat.down.get().detach().double()
    return w if lat.down_bias is None else torch.cat([w, lat.down_bias.get().detach().double()[:, None]], 1)


def _latent_section(site: AttentionSite, residual: str, margins: dict) -> None:
    """Move each latent of ``site`` to ``γ = 1`` and (``residual="fix"``) ``A Aᵀ`` diagonal, descending, signed."""
    for lat in site.latent.latents():
        g = lat.effective_gain().double()
        if bool((g == 0).any()):
            raise GaugeError(f"{site.name}: the {lat.name} latent's RMSNorm gain has an exact zero; that channel is dead "
                             "and the gain section (γ = 1) cannot reach it")
        scale_latent_gain(site, lat.name, 1.0 / g)
        if residual != "fix":
            continue
        A = _latent_rows(lat)
        ev, U = torch.linalg.eigh(A @ A.mT)
        ev, U = ev.flip(-1), U.flip(-1)
        sign, margin = _sign_of_cubes(U.mT @ A)
        margins["spectral_gap"] = min(margins["spectral_gap"], float(_gaps(ev.clamp_min(0)[None]).min()))
        margins["sign_margin"] = min(margins["sign_margin"], float(margin.min()))
        rotate_latent(site, lat.name, U.mT * sign[:, None])


def _rope_factor(site: AttentionSite, section: str, residual: str, margins: dict) -> torch.Tensor:
    """``B (1, r, r)``: the plane section of the RoPE part (all heads' RoPE rows against the shared key)."""
    pair = site.pair("qk_rope")
    qr, kr = _rope_rows(site)
    S, K = pair.a.stack(qr), kr
    planes = pair.rope.planes(pair.width)
    a, b = _plane_qk_factor(S, K, planes, section, residual, f"{site.name}: RoPE part", margins)
    p, q = (list(c) for c in zip(*planes))
    B = torch.zeros(1, pair.width, pair.width, dtype=torch.float64)
    B[:, p, p] = a
    B[:, q, q] = a
    B[:, q, p] = b
    B[:, p, q] = -b
    return B


def _vo_factor(site, t, residual, rtol, margins) -> torch.Tensor:
    """``C (h_kv, d_v, d_v)`` with ``CᵀW_V`` row-orthonormal; ``"fix"`` also diagonalises the
    stacked ``W_O`` Gram (``W_Vᵀ = Q_V R_V``, ``T = Q_T R_T``, ``R_T R_Vᵀ = uσvᵀ``, ``C = R_V⁻¹v``)."""
    what = f"{site.name}: V/O"
    qv, rv = _qr_pos(t["wv"].mT, f"{what} W_V", rtol)
    rv_inv = _tri_inv(rv)
    if residual == "keep":
        return rv_inv  # paper 000 Algorithm 1
    _, rt = _qr_pos(_stack_outputs(site, t["wo"]), f"{what} stacked W_O", rtol)
    _, sig, vh = torch.linalg.svd(rt @ rv.mT)
    s, margin = _sign_of_cubes(vh @ qv.mT)  # rows of CᵀW_V
    margins["spectral_gap"] = min(margins["spectral_gap"], float(_gaps(sig).min()))
    margins["sign_margin"] = min(margins["sign_margin"], float(margin.min()))
    return (rv_inv @ vh.mT) * s[..., None, :]


# ---------------------------------------------------------------------- head order
def _cmp_factory(keys: list[tuple[float, float]], blocks: torch.Tensor):
    def cmp(a: int, b: int) -> int:
        for x, y in zip(keys[a], keys[b]):
            if x != y:
                return -1 if x > y else 1  # descending
        diff = (blocks[a] != blocks[b]).nonzero()
        if len(diff) == 0:
            return 0
        c = int(diff[0])
        return -1 if blocks[a, c] > blocks[b, c] else 1

    return functools.cmp_to_key(cmp)


def _with(x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(like.shape[0], 0) if x is None else x.reshape(like.shape[0], -1)


def head_energies(site: AttentionSite, t: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauge-invariant per-query-head keys ``(‖W_Q[i]ᵀW_K[j]‖_F², ‖W_O[:, i]W_V[j]‖_F²)``, each ``(h,)``,
    from ``d_k×d_k`` Grams (``‖XᵀY‖² = ⟨XXᵀ, YYᵀ⟩``)."""
    t = effective_tensors(site) if t is None else t
    expand = site.per_query  # a KV head's value for each of its query heads
    gq = t["wq"] @ t["wq"].mT
    gk = expand(t["wk"] @ t["wk"].mT)
    go = t["wo"].mT @ t["wo"]
    gv = expand(t["wv"] @ t["wv"].mT)
    e_qk = (gq * gk).sum((-1, -2))
    if site.latent is not None:  # the RoPE circuit of each head against the shared key
        qr, kr = _rope_rows(site)
        e_qk = e_qk + ((qr @ qr.mT) * (kr @ kr.mT)).sum((-1, -2))
    return e_qk, (go * gv).sum((-1, -2))


def _rope_rows(site: AttentionSite) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent attention site's RoPE query rows ``(h, r, m_q)`` and shared key rows ``(1, r, d)``, float64 copies."""
    lat = site.latent
    return lat.q_rope.get().detach().double(), lat.k_rope.get().detach().double()


def _head_order(site: AttentionSite, margins: dict) -> tuple[torch.Tensor, torch.Tensor]:
    t = effective_tensors(site)
    n, g = site.n_rep, site.h_kv
    e_qk, e_ov = head_energies(site, t)
    q_blocks = torch.cat([_with(t["wq"], t["wq"]), _with(t["bq"], t["wq"]), _with(t["wo"], t["wo"])], 1)
    if site.latent is not None:
        q_blocks = torch.cat([q_blocks, _with(_rope_rows(site)[0], t["wq"])], 1)
    within = []
    for j in range(g):
        idx = list(range(j * n, (j + 1) * n))
        keys = [(float(e_qk[i]), float(e_ov[i])) for i in idx]
        order = sorted(range(n), key=_cmp_factory(keys, q_blocks[idx]))
        within.append([idx[o] for o in order])
    g_keys = [(float(e_qk[w].sum()), float(e_ov[w].sum())) for w in within]
    g_blocks = torch.cat(
        [_with(t["wk"], t["wk"]), _with(t["bk"], t["wk"]), _with(t["wv"], t["wv"]), _with(t["bv"], t["wv"]),
         torch.stack([q_blocks[w].reshape(-1) for w in within])], 1,
    )
    kv_order = sorted(range(g), key=_cmp_factory(g_keys, g_blocks))
    q_perm = torch.tensor([i for j in kv_order for i in within[j]])
    chains = [[g_keys[j][0] for j in kv_order]] + [[float(e_qk[i]) for i in w] for w in within]
    for chain in chains:  # only neighbours the sort actually compared
        for a, b in zip(chain, chain[1:]):
            if a > 0:
                margins["sort_gap"] = min(margins["sort_gap"], abs(a - b) / a)
    return torch.tensor(kv_order), q_perm


# ---------------------------------------------------------------------- metrics
@dataclass
class GaugeMetrics:
    """Paper 000 Table 8 per (layer, KV group), from the effective weights.

    ``value_orthonormality = ‖W_V W_Vᵀ − I‖_F``; ``qk_imbalance = ‖P − R‖_F / ‖P‖_F`` and
    ``cond_q = κ(P)``, ``cond_k = κ(R)`` with the weight Grams ``P = Σ_i W_Q[i]W_Q[i]ᵀ``,
    ``R = W_K W_Kᵀ`` (the paper uses activation covariances; for white inputs they coincide).
    Under RoPE the balanced section equalises only the per-plane traces of ``P`` and ``R``, so
    ``qk_imbalance`` does not vanish there. On a QK-norm site (whose Q/K gauge moves the gains,
    not ``W_Q``/``W_K``) ``qk_imbalance = ‖s_q − s_k‖ / ‖s_q‖`` over the slots of the gain scales
    (0 in the balanced section), one value per group of the gain pair.
    """

    value_orthonormality: torch.Tensor
    qk_imbalance: torch.Tensor
    cond_q: torch.Tensor
    cond_k: torch.Tensor

    def summary(self) -> dict[str, tuple[float, float]]:
        """``{metric: (mean, max)}`` over layers and KV groups."""
        return {name: (float(v.mean()), float(v.max())) for name, v in vars(self).items()}


def canonical_metrics(model: nn.Module) -> GaugeMetrics:
    """Compute :class:`GaugeMetrics` for every attention layer of ``model``."""
    vals: dict[str, list[torch.Tensor]] = {k: [] for k in ("value_orthonormality", "qk_imbalance", "cond_q", "cond_k")}
    for site in find_attention(model):
        t = effective_tensors(site)
        S = _stack_queries(site, t["wq"])
        P, R = S @ S.mT, t["wk"] @ t["wk"].mT
        gv = t["wv"] @ t["wv"].mT
        vals["value_orthonormality"].append(torch.linalg.matrix_norm(gv - torch.eye(site.d_v, dtype=gv.dtype)))
        if site.qk_norm is None:
            vals["qk_imbalance"].append(torch.linalg.matrix_norm(P - R) / torch.linalg.matrix_norm(P))
        else:
            s_q, s_k, _ = gain_scales(site)
            vals["qk_imbalance"].append((s_q - s_k).norm(dim=-1) / s_q.norm(dim=-1))
        for name, G in (("cond_q", P), ("cond_k", R)):
            ev = torch.linalg.eigvalsh(G)
            vals[name].append(ev[..., -1] / ev[..., 0].clamp_min(torch.finfo(ev.dtype).tiny))
    return GaugeMetrics(**{k: torch.cat(v) for k, v in vals.items()})


# ---------------------------------------------------------------------- the section's equations
def section_residual(model: nn.Module, section: str = "qr", residual: str = "fix", biases: str = "fold") -> float:
    """Largest violation of the section's equations in ``model`` (0 for an exact canonical form).

    Relative residuals of: the Q/K condition (``P = I`` / ``P = R`` on non-rotary coordinates,
    ``tr P_m = 2`` / ``tr P_m = tr R_m`` per plane; on a QK-norm site ``s_q = 1`` / ``s_q = s_k``
    per slot of the gains; on latent attention also the RoPE part's planes and the latents'
    ``γ = 1`` and diagonal ``A Aᵀ``), ``W_V W_Vᵀ = I``, with ``residual="fix"`` the
    diagonal/descending/sign conventions (a wrong sign counts as 1), and with ``biases="fold"``
    the bias sectors' ``b_K = 0`` (non-rotary channels) and ``b_V = 0``, relative to the bias's
    scale (its rows' norm, or 1).
    """
    _check_args(section, residual, biases)
    worst = 0.0
    for site in find_attention(model):
        refuse_layer_norm(site, "section_residual")
        t = effective_tensors(site)
        if biases == "fold":
            worst = max(worst, _bias_residual(site, t))
        if site.qk_norm is not None:
            worst = max(worst, _gain_residual(site, section, residual))
            worst = max(worst, _vo_residual(site, t, residual))
            continue
        S, K = _stack_queries(site, t["wq"]), t["wk"]
        r, dk = site.rope.rotary_dim, site.d_k
        eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
        if r < dk:
            P, R = S[:, r:] @ S[:, r:].mT, K[:, r:] @ K[:, r:].mT
            ref = torch.linalg.matrix_norm(P + R)
            target = eye(dk - r) if section == "qr" else R
            worst = max(worst, float((torch.linalg.matrix_norm(P - target) / ref).max()))
            if residual == "fix":
                worst = max(worst, _diag_violation(P + R, ref), _sign_violation(K[:, r:]))
        planes = site.rope.planes(dk)
        if planes:
            worst = max(worst, _plane_residual(S, K, planes, section, residual))
        if site.latent is not None:
            worst = max(worst, _latent_residual(site, section, residual))
        worst = max(worst, _vo_residual(site, t, residual))
    return worst


def _plane_residual(S: torch.Tensor, K: torch.Tensor, planes, section: str, residual: str) -> float:
    """The plane conditions: ``tr P_m = 2`` (qr) or ``tr P_m = tr R_m`` (balanced); with ``"fix"`` the plane's
    ``P_m + R_m`` diagonal (larger first) and the cubic sign over both key rows."""
    p, q = (list(c) for c in zip(*planes))
    tp = (S[:, p] ** 2).sum(-1) + (S[:, q] ** 2).sum(-1)
    tr = (K[:, p] ** 2).sum(-1) + (K[:, q] ** 2).sum(-1)
    gap = (tp - 2).abs() / 2 if section == "qr" else (tp - tr).abs() / (tp + tr)
    worst = float(gap.max())
    if residual == "fix":
        G = torch.stack([S[:, p], S[:, q]], 2) @ torch.stack([S[:, p], S[:, q]], 2).mT
        G = G + torch.stack([K[:, p], K[:, q]], 2) @ torch.stack([K[:, p], K[:, q]], 2).mT
        worst = max(worst, _diag_violation(G, torch.linalg.matrix_norm(G)))
        worst = max(worst, _sign_violation(torch.cat([K[:, p], K[:, q]], -1)))
    return worst


def _latent_residual(site: AttentionSite, section: str, residual: str) -> float:
    """A latent attention site's latents (``γ = 1``; ``"fix"``: ``A Aᵀ`` diagonal, descending, signed) and the
    RoPE part's plane conditions."""
    worst = 0.0
    for lat in site.latent.latents():
        worst = max(worst, float((lat.effective_gain().double() - 1).abs().max()))
        if residual == "fix":
            A = _latent_rows(lat)
            G = A @ A.mT
            worst = max(worst, _diag_violation(G[None], torch.linalg.matrix_norm(G)), _sign_violation(A))
    pair = site.pair("qk_rope")
    qr, kr = _rope_rows(site)
    return max(worst, _plane_residual(pair.a.stack(qr), kr, pair.rope.planes(pair.width), section, residual))


def _bias_residual(site: AttentionSite, t: dict) -> float:
    worst = 0.0
    for kind in site.bias_kinds:
        sec = site.bias_sector(kind)
        b = t["b" + sec.proj][:, list(sec.channels)]
        w = t["w" + sec.proj][:, list(sec.channels)]
        worst = max(worst, float(b.norm() / max(float(w.norm()), 1.0)))
    return worst


def _vo_residual(site: AttentionSite, t: dict, residual: str) -> float:
    gv = t["wv"] @ t["wv"].mT
    worst = float(torch.linalg.matrix_norm(gv - torch.eye(site.d_v, dtype=torch.float64)).max())
    if residual == "fix":
        T = _stack_outputs(site, t["wo"])
        G = T.mT @ T
        worst = max(worst, _diag_violation(G, torch.linalg.matrix_norm(G)), _sign_violation(t["wv"]))
    return worst


def _gain_residual(site: AttentionSite, section: str, residual: str) -> float:
    s_q, s_k, slot = gain_scales(site)
    gap = (s_q - 1).abs() if section == "qr" else (s_q - s_k).abs() / (s_q + s_k)
    worst = float(gap.max())
    if residual == "fix":
        worst = max(worst, float((_gain_cubes(site, slot)[0] < 0).any()))
    return worst


def _diag_violation(G: torch.Tensor, ref: torch.Tensor) -> float:
    """Off-diagonal mass and ascending steps of the diagonal, relative to ``ref``."""
    d = torch.diagonal(G, dim1=-2, dim2=-1)
    off = torch.linalg.matrix_norm(G - torch.diag_embed(d))
    steps = (d[..., 1:] - d[..., :-1]).clamp_min(0).amax(-1) if d.shape[-1] > 1 else torch.zeros_like(off)
    return float(((off + steps) / ref).max())


def _sign_violation(rows: torch.Tensor) -> float:
    return float(((rows**3).sum(-1) < 0).any())


# ---------------------------------------------------------------------- the public entry point
@dataclass
class CanonicalReport:
    """What :func:`canonicalize` did.

    Attributes:
        model: the canonical model (the input itself when ``inplace=True``).
        section, residual: as requested.
        before, after: :class:`GaugeMetrics` (paper 000 Table 8).
        kv_perms, q_perms: per layer, new KV head ``j`` is old ``kv_perms[l][j]`` and new query
            head ``i`` is old ``q_perms[l][i]`` (identity without sorting).
        margins: how far the deterministic choices are from being ambiguous, all relative:
            ``spectral_gap`` (smallest gap between the singular values or plane eigenvalues the
            residual fix diagonalised), ``sign_margin`` (smallest ``|Σx³|/Σ|x|³`` of the sign
            rule), ``sort_gap`` (smallest relative gap between consecutive sort keys). A value
            near rounding level means a tiny perturbation can pick another representative of the
            same orbit (the function never changes); ``inf`` when the choice was not made.
        biases: ``"fold"`` or ``"keep"``, as requested.
        bias_zeroed: bias entries the bias sectors made pure zeros (``b_K`` on non-rotary channels,
            ``b_V``): parameters a checkpoint in this form no longer needs.
    """

    model: nn.Module
    section: str
    residual: str
    before: GaugeMetrics
    after: GaugeMetrics
    kv_perms: list[torch.Tensor] = field(default_factory=list)
    q_perms: list[torch.Tensor] = field(default_factory=list)
    margins: dict[str, float] = field(default_factory=dict)
    biases: str = "fold"
    bias_zeroed: int = 0


def _check_args(section: str, residual: str, biases: str = "fold") -> None:
    if section not in SECTIONS:
        raise GaugeError(f"canonicalize: section={section!r} must be one of {SECTIONS}")
    if residual not in RESIDUALS:
        raise GaugeError(f"canonicalize: residual={residual!r} must be one of {RESIDUALS}")
    if biases not in BIAS_MODES:
        raise GaugeError(f"canonicalize: biases={biases!r} must be one of {BIAS_MODES}")


@torch.no_grad()
def fold_lrm_multipliers(model: nn.Module) -> nn.Module:
    """Fold every :class:`LRMLinear`'s multipliers into its base weight, in place (function unchanged):
    per block ``W̄ ← diag(r)·W̄·diag(c)``, ``b̄ ← r ⊙ b̄``, ``r ← 1``, ``c ← 1``."""
    for m in model.modules():
        if isinstance(m, LRMLinear):
            start = 0
            for k, size in enumerate(m.split_sizes):
                rows = slice(start, start + size)
                start += size
                r, c = m.row_mults[k], m.col_mults[k]
                m.weight[rows] = m.weight[rows] * r[:, None] * c[None, :]
                if m.bias is not None:
                    m.bias[rows] = m.bias[rows] * r
                r.fill_(1.0)
                c.fill_(1.0)
    return model


@torch.no_grad()
def canonicalize(
    model: nn.Module,
    section: str = "qr",
    *,
    residual: str = "fix",
    sort_heads: bool = True,
    fold_multipliers: bool = True,
    biases: str = "fold",
    inplace: bool = False,
    rank_rtol: float | None = None,
) -> CanonicalReport:
    """Move ``model`` to the canonical representative of its gauge orbit (the function is unchanged).

    Args:
        model: any model :func:`gaugeopt.find_attention` understands. Work is done in float64
            and written back in the model's dtype.
        section: ``"qr"`` (paper 000 Algorithm 1) or ``"balanced"`` (paper 001 Definition 31).
        residual: ``"fix"`` removes the residual ``O(d_k) × O(d_v)`` (unique form on generic
            weights); ``"keep"`` leaves it, as the papers do.
        sort_heads: order heads by the documented rule (module docstring).
        fold_multipliers: fold LRM multipliers into the weights first (see module docstring).
        biases: ``"fold"`` moves the bias sectors to their representative — ``b_K = 0`` on the
            non-rotary channels, ``b_V = 0`` absorbed into ``b_O`` (:func:`fold_biases`) — so the form
            is unique under them too; ``"keep"`` leaves the biases where they are (the papers' forms).
        inplace: modify ``model`` instead of a deep copy.
        rank_rtol: refuse projections with ``σ_min/σ_max`` at or below this (default
            ``min(1e3·eps, 1e-4)`` for the model's dtype).

    Returns:
        A :class:`CanonicalReport` (``.model`` is the canonical model).

    Raises:
        GaugeError: unknown section/residual/biases, a rank-deficient projection, or a LayerNorm QK-norm.
    """
    _check_args(section, residual, biases)
    for site in trusted_sites(model, "canonicalize"):  # proved on the model: copies carry the proof
        refuse_layer_norm(site, "canonicalize")
    target = model if inplace else copy.deepcopy(model)
    if fold_multipliers:
        fold_lrm_multipliers(target)
    sites = trusted_sites(target, "canonicalize")
    if rank_rtol is None:
        dtype = sites[0].q.weight.param.dtype
        rank_rtol = min(1e3 * torch.finfo(dtype if dtype.is_floating_point else torch.float32).eps, 1e-4)
    before = canonical_metrics(target)
    margins = {"spectral_gap": float("inf"), "sign_margin": float("inf"), "sort_gap": float("inf")}
    kv_perms, q_perms = [], []
    zeroed = 0
    for site in sites:
        if biases == "fold":
            zeroed += fold_biases(site)
        if site.latent is not None:  # the latents first: their criteria ignore the head gauges (module docstring)
            _latent_section(site, residual, margins)
            act_qk_rope(site, _rope_factor(site, section, residual, margins))
        if site.qk_norm is None:
            A = _qk_factor(site, effective_tensors(site), section, residual, rank_rtol, margins)
            act_qk(site, A)
        else:
            _gain_section(site, section, residual, margins)
        C = _vo_factor(site, effective_tensors(site), residual, rank_rtol, margins)
        act_vo(site, C)
        if sort_heads:
            kv_perm, q_perm = _head_order(site, margins)
            permute_heads(site, kv_perm, q_perm)
        else:
            kv_perm, q_perm = torch.arange(site.h_kv), torch.arange(site.h)
        kv_perms.append(kv_perm)
        q_perms.append(q_perm)
    return CanonicalReport(target, section, residual, before, canonical_metrics(target), kv_perms, q_perms, margins,
                           biases, zeroed)
