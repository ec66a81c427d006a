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

**Bias sectors** (:mod:`gaugeopt.records.bias_sector`). Prop. 12's laws are unique only up to two more
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

This module assembles the form and checks it (:func:`section_residual`, :func:`canonical_metrics`); the
pieces it is built from — effective tensors, the factors of each section, the head order — are in
:mod:`gaugeopt.tools.canonical_parts`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gaugeopt.transforms import act_qk, act_vo, permute_heads
from gaugeopt.records.latent import act_qk_rope
from gaugeopt.errors import GaugeError
from gaugeopt.models.lrm import LRMLinear
from gaugeopt.records.site import AttentionSite
from gaugeopt.trust.gate import trusted_sites
from gaugeopt.adapters.find import find_attention
from gaugeopt.tools.canonical_parts import (  # noqa: F401  (the public ones re-exported)
    gain_cubes,
    gain_section,
    head_order,
    latent_rows,
    latent_section,
    qk_factor,
    rope_factor,
    rope_rows,
    stack_outputs,
    stack_queries,
    vo_factor,
    effective_tensors,
    fold_bias_tensors,
    fold_biases,
    gain_scales,
    head_energies,
    refuse_latent,
    refuse_layer_norm,
)

__all__ = [
    "SECTIONS", "RESIDUALS", "GaugeMetrics", "CanonicalReport", "canonicalize", "canonical_metrics",
    "section_residual", "fold_lrm_multipliers", "effective_tensors", "head_energies", "fold_bias_tensors",
    "fold_biases", "BIAS_MODES", "refuse_latent",
]

SECTIONS = ("qr", "balanced")
RESIDUALS = ("fix", "keep")
BIAS_MODES = ("fold", "keep")


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
        S = stack_queries(site, t["wq"])
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
        S, K = stack_queries(site, t["wq"]), t["wk"]
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
            A = latent_rows(lat)
            G = A @ A.mT
            worst = max(worst, _diag_violation(G[None], torch.linalg.matrix_norm(G)), _sign_violation(A))
    pair = site.pair("qk_rope")
    qr, kr = rope_rows(site)
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
        T = stack_outputs(site, t["wo"])
        G = T.mT @ T
        worst = max(worst, _diag_violation(G, torch.linalg.matrix_norm(G)), _sign_violation(t["wv"]))
    return worst


def _gain_residual(site: AttentionSite, section: str, residual: str) -> float:
    s_q, s_k, slot = gain_scales(site)
    gap = (s_q - 1).abs() if section == "qr" else (s_q - s_k).abs() / (s_q + s_k)
    worst = float(gap.max())
    if residual == "fix":
        worst = max(worst, float((gain_cubes(site, slot)[0] < 0).any()))
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
            latent_section(site, residual, margins)
            act_qk_rope(site, rope_factor(site, section, residual, margins))
        if site.qk_norm is None:
            A = qk_factor(site, effective_tensors(site), section, residual, rank_rtol, margins)
            act_qk(site, A)
        else:
            gain_section(site, section, residual, margins)
        C = vo_factor(site, effective_tensors(site), residual, rank_rtol, margins)
        act_vo(site, C)
        if sort_heads:
            kv_perm, q_perm = head_order(site, margins)
            permute_heads(site, kv_perm, q_perm)
        else:
            kv_perm, q_perm = torch.arange(site.h_kv), torch.arange(site.h)
        kv_perms.append(kv_perm)
        q_perms.append(q_perm)
    return CanonicalReport(target, section, residual, before, canonical_metrics(target), kv_perms, q_perms, margins,
                           biases, zeroed)
