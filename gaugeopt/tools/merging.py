"""Gauge-aligned model merging (paper 000 Algorithm 3, Proposition 47).

Two trainings of one architecture land on different points of (nearly) the same gauge orbit,
so averaging their raw parameters averages unrelated coordinates. :func:`merge` averages
``θ_avg = (1 − α)·θ̃_A + α·g*(θ̃_B)`` after aligning B to A:

1. **Canonicalise** both (:func:`gaugeopt.tools.canonical.canonicalize`, any section; LRM
   multipliers are folded so both live in effective-weight coordinates).
2. **Match heads** per layer with the Hungarian algorithm
   (``scipy.optimize.linear_sum_assignment``) on gauge-invariant circuit distances
   (:func:`gaugeopt.tools.equivalence.match_heads`: QK and OV circuits, KV groups matched first
   under GQA) — Prop. 47's "any fixed gauge-invariant metric on canonical blocks", robust to
   near-ties in the canonical head order and the residual fix.
3. **Procrustes per KV group** for the residual orthogonal freedom of the section:
   ``Ω = argmin_{Ω ∈ O} ‖X_A − Ω X_B‖_F`` with ``X = [W_Q[i] | b_Q[i] …, W_K[j] | b_K[j]]``
   (rows = head channels, all query heads of the group side by side) and ``Ω = UVᵀ`` from
   ``X_A X_Bᵀ = UΣVᵀ``; applied as the gauge ``A = Ωᵀ`` (orthogonal, so ``A⁻¹ = Aᵀ`` keeps the
   section's equations). Under RoPE ``Ω`` is restricted to the commutant: one rotation
   ``ψ = atan2(N₀₁ − N₁₀, N₀₀ + N₁₁)`` per plane (``N = X_B X_Aᵀ`` on the plane's rows) and a
   full orthogonal Procrustes on the non-rotary rows. V/O likewise with
   ``X = [W_V[j] | b_V[j], W_O[:, i]ᵀ …]`` and ``C = Ωᵀ``.
4. **Average** every floating-point tensor of the state dict.

Two models whose modules read different non-parameter state — a RoPE base or scaling, a sliding
window, a norm ``eps``, a buffer like ``inv_freq``, a config value (:mod:`gaugeopt.tools.computation`)
— are refused before step 1, the difference named: the average would silently run under A's settings.

Step 3 is Algorithm 3's "query–key Procrustes", extended to V/O. With ``residual="fix"``
(default) the canonical forms of gauge-equivalent models already coincide and steps 2–3 only
undo what differs between *different* models; with ``residual="keep"`` they do the work.

Example:
    >>> import copy, torch, gaugeopt
    >>> from gaugeopt.tools.merging import merge
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> a = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)).double()
    >>> b = gaugeopt.random_gauge_transform(copy.deepcopy(a), generator=torch.Generator().manual_seed(1))
    >>> x = torch.randint(0, 64, (2, 16))
    >>> result = merge(a, b)
    >>> gaugeopt.relative_change(a(x)[0], result.merged(x)[0]) < 1e-12
    True
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gaugeopt.transforms import act_qk, act_vo, permute_heads
from gaugeopt.tools.canonical import stack_outputs, stack_queries, canonicalize, effective_tensors, refuse_latent
from gaugeopt.tools.computation import computation_difference, computation_state
from gaugeopt.tools.equivalence import _aug, match_heads
from gaugeopt.errors import GaugeError
from gaugeopt.records.site import AttentionSite
from gaugeopt.adapters.find import find_attention

__all__ = ["LayerAlignment", "MergeResult", "align", "average", "merge", "attention_distance"]


@dataclass
class LayerAlignment:
    """One layer of an alignment: B's groups ``kv_perm`` / heads ``q_perm`` matched A's in
    order; relative attention-parameter distances ``‖θ_A − θ_B‖/‖θ_A‖`` after canonicalisation,
    after head matching and after Procrustes."""

    name: str
    kv_perm: torch.Tensor
    q_perm: torch.Tensor
    canonical: float
    matched: float
    procrustes: float


@dataclass
class MergeResult:
    """Output of :func:`align` / :func:`merge`.

    Attributes:
        reference: model A in canonical form (same function as A).
        aligned: model B moved into A's gauge (same function as B).
        merged: ``(1 − alpha)·reference + alpha·aligned`` (``None`` from :func:`align`).
        alpha: the interpolation weight.
        layers: per attention layer, the matching and distances.
    """

    reference: nn.Module
    aligned: nn.Module
    merged: nn.Module | None = None
    alpha: float = 0.5
    layers: list[LayerAlignment] = field(default_factory=list)


def attention_distance(site_a: AttentionSite, site_b: AttentionSite) -> float:
    """``‖θ_A − θ_B‖_F / ‖θ_A‖_F`` over one layer's effective Q, K, V, O weights and biases."""
    ta, tb = effective_tensors(site_a), effective_tensors(site_b)
    num = den = 0.0
    for k, a in ta.items():
        if a is not None and k != "bo":
            num += float((a - tb[k]).square().sum())
            den += float(a.square().sum())
    return (num / max(den, torch.finfo(torch.float64).tiny)) ** 0.5


def _procrustes(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """``argmin_{Ω orthogonal} ‖X − ΩY‖_F`` for ``X, Y (..., r, c)``: ``Ω = UVᵀ``, ``XYᵀ = UΣVᵀ``."""
    u, _, vh = torch.linalg.svd(X @ Y.mT)
    return u @ vh


@torch.no_grad()
def _align_qk(site_a: AttentionSite, site_b: AttentionSite) -> None:
    def rows(site):
        t = effective_tensors(site)
        q = stack_queries(site, _aug(t["wq"], t["bq"]))  # (g, d_k, n·(d+1))
        return torch.cat([q, _aug(t["wk"], t["bk"])], -1)

    Xa, Xb = rows(site_a), rows(site_b)
    g, dk, r = site_a.h_kv, site_a.d_k, site_a.rope.rotary_dim
    omega = torch.zeros(g, dk, dk, dtype=torch.float64)
    if r < dk:
        omega[:, r:, r:] = _procrustes(Xa[:, r:], Xb[:, r:])
    planes = site_a.rope.planes(dk)
    if planes:
        p, q = (list(c) for c in zip(*planes))
        n00 = (Xb[:, p] * Xa[:, p]).sum(-1)
        n11 = (Xb[:, q] * Xa[:, q]).sum(-1)
        n01 = (Xb[:, p] * Xa[:, q]).sum(-1)
        n10 = (Xb[:, q] * Xa[:, p]).sum(-1)
        psi = torch.atan2(n01 - n10, n00 + n11)
        c, s = torch.cos(psi), torch.sin(psi)
        omega[:, p, p] = c
        omega[:, q, q] = c
        omega[:, q, p] = s
        omega[:, p, q] = -s
    act_qk(site_b, omega.mT)  # A = Ωᵀ: W_Q ← ΩW_Q, W_K ← A⁻¹W_K = ΩW_K


@torch.no_grad()
def _align_vo(site_a: AttentionSite, site_b: AttentionSite) -> None:
    def rows(site):
        t = effective_tensors(site)
        return torch.cat([_aug(t["wv"], t["bv"]), stack_outputs(site, t["wo"]).mT], -1)  # (g, d_v, ·)

    omega = _procrustes(rows(site_a), rows(site_b))
    act_vo(site_b, omega.mT)  # C = Ωᵀ: W_V ← ΩW_V, W_O[:, i] ← W_O[:, i]C⁻ᵀ = W_O[:, i]Ωᵀ


def _refuse_different_computations(model_a: nn.Module, model_b: nn.Module) -> None:
    """Models whose modules read different buffers or settings (RoPE base, window, eps, config) have no
    meaningful average: refuse, naming the difference. Buffers may differ by rounding (16 ulp of the
    coarser parameter dtype)."""
    eps = max((torch.finfo(p.dtype).eps for m in (model_a, model_b) for p in m.parameters() if p.is_floating_point()),
              default=torch.finfo(torch.float64).eps)
    diff = computation_difference(computation_state(model_a), computation_state(model_b), 16 * eps)
    if diff:
        raise GaugeError(
            f"merge: the two models compute different functions besides their parameters — {diff}. An average "
            "of their parameters would run under model_a's settings; merge only models built from one configuration"
        )


def _check_same(sites_a, sites_b) -> None:
    shape = lambda s: (s.h, s.h_kv, s.d_k, s.d_v, s.d_model, s.rope)  # noqa: E731
    if [shape(s) for s in sites_a] != [shape(s) for s in sites_b]:
        raise GaugeError(
            "merge: the two models have different attention layouts (h, h_kv, d_k, d_v, d_model per layer: "
            f"{[shape(s)[:5] for s in sites_a]} vs {[shape(s)[:5] for s in sites_b]}); "
            "only models of one architecture can be merged"
        )


@torch.no_grad()
def align(
    model_a: nn.Module,
    model_b: nn.Module,
    *,
    section: str = "qr",
    residual: str = "fix",
    sort_heads: bool = True,
    procrustes: bool = True,
) -> MergeResult:
    """Canonicalise both models and move B into A's gauge (steps 1–3); neither input is modified.

    Args:
        section, residual, sort_heads: passed to :func:`gaugeopt.tools.canonical.canonicalize`.
        procrustes: run the per-group orthogonal alignment (step 3).

    Returns:
        A :class:`MergeResult` with ``reference``, ``aligned`` and ``layers`` (``merged=None``).

    Raises:
        GaugeError: the models differ besides their parameters (a module's class, buffer or setting —
            RoPE base or scaling, sliding window, norm ``eps``, config: :mod:`gaugeopt.tools.computation`),
            different attention layouts, or a latent-attention model.
    """
    sites_a, sites_b = find_attention(model_a), find_attention(model_b)
    refuse_latent(sites_a + sites_b, "align")
    _check_same(sites_a, sites_b)
    _refuse_different_computations(model_a, model_b)
    ref = canonicalize(model_a, section, residual=residual, sort_heads=sort_heads).model
    aligned = canonicalize(model_b, section, residual=residual, sort_heads=sort_heads).model
    sites_a, sites_b = find_attention(ref), find_attention(aligned)
    layers = []
    for sa, sb in zip(sites_a, sites_b):
        d0 = attention_distance(sa, sb)
        kv_perm, q_perm = match_heads(sa, sb)
        permute_heads(sb, kv_perm, q_perm)
        d1 = attention_distance(sa, sb)
        if procrustes:
            if sa.qk_norm is None:  # under QK-norm W_Q/W_K carry no continuous gauge: nothing to align
                _align_qk(sa, sb)
            _align_vo(sa, sb)
        layers.append(LayerAlignment(sa.name, kv_perm, q_perm, d0, d1, attention_distance(sa, sb)))
    return MergeResult(ref, aligned, None, 0.5, layers)


@torch.no_grad()
def average(model_a: nn.Module, model_b: nn.Module, alpha: float = 0.5) -> nn.Module:
    """``(1 − alpha)·A + alpha·B`` over every floating-point state-dict entry (a new model).

    Without :func:`align` first this is the naive average that gauge symmetry defeats."""
    out = copy.deepcopy(model_a)
    sb = model_b.state_dict()
    for name, t in out.state_dict().items():
        if name not in sb or sb[name].shape != t.shape:
            raise GaugeError(
                f"average: model_b has no tensor {name!r} of shape {tuple(t.shape)}; the architectures differ"
            )
        if t.is_floating_point():
            t.copy_((1 - alpha) * t + alpha * sb[name].to(t))
    return out


@torch.no_grad()
def merge(
    model_a: nn.Module,
    model_b: nn.Module,
    alpha: float = 0.5,
    *,
    section: str = "qr",
    residual: str = "fix",
    sort_heads: bool = True,
    procrustes: bool = True,
) -> MergeResult:
    """Gauge-aligned average of two models of one architecture (paper 000 Algorithm 3).

    Args:
        model_a, model_b: the models (not modified); the result lives in A's canonical gauge.
        alpha: weight of B (``0`` returns A's function, ``1`` B's).
        section, residual, sort_heads, procrustes: see :func:`align`.

    Returns:
        A :class:`MergeResult`; ``merged`` is the averaged model.

    Raises:
        GaugeError: different architectures or computations besides the parameters (named in the
            message: :func:`align`), a rank-deficient head, or SciPy missing.
    """
    if not 0.0 <= alpha <= 1.0:
        raise GaugeError(f"merge: alpha={alpha!r} must lie in [0, 1]")
    result = align(model_a, model_b, section=section, residual=residual, sort_heads=sort_heads, procrustes=procrustes)
    result.alpha = alpha
    result.merged = average(result.reference, result.aligned, alpha)
    return result
