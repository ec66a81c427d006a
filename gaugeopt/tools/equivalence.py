"""Are two checkpoints the same point of the quotient by the attention gauge group?

The group ``G`` here is the head gauges (docs/gauge_group.md) together with the bias sectors
(:mod:`gaugeopt.records.bias_sector`): the key-bias shift on non-rotary channels and the value-bias
trade against the output bias. Both are quotiented by moving the biases to their representative
first (:func:`gaugeopt.tools.canonical.fold_bias_tensors`: ``b_K = 0`` on the non-rotary channels,
``b_V = 0`` folded into ``b_O``), which the head gauges keep; everything below reads those folded
tensors.

**Complete invariants.** For one query head ``i`` of KV group ``j``, with augmented weights
``X_Q = [W_Q[i] | b_Q[i]]``, ``X_K = [W_K[j] | b_K[j]]``, ``X_V = [W_V[j] | b_V[j]]``, the
gauge group ``G`` (docs/gauge_group.md) leaves invariant

* the QK circuits ``X_Qᵀ E X_K`` for ``E`` in the algebra the RoPE rotations generate:
  ``E = I`` without RoPE; per rotation plane ``m`` the plane projector ``I_m`` and its
  generator ``J_m``, plus the projector ``I_free`` on the non-rotary coordinates;
* the OV circuit ``W_O[:, i] X_V``;
* with attention sinks (gpt-oss), the head's sink logit ``s_i`` (it moves with its head and with
  nothing else).

On a QK-norm site (RMSNorm; docs/qk_norm.md) the group leaves ``W_Q``, ``W_K`` and their biases where
they are and moves only the gains, ``g_q ⊙ d``, ``g_k ⊘ d`` with ``d`` per slot (RoPE plane or
channel): the invariants are ``X_Q``, ``X_K`` themselves and, per slot ``π``, the outer product
``g̃_q[π] g̃_k[π]ᵀ`` of the head's query and key gains (``g̃ = g + offset``), which determines the
gains up to exactly that ``d`` when they are nonzero; the OV circuit as above. A LayerNorm QK-norm is
refused (:func:`gaugeopt.tools.canonical.refuse_layer_norm`). Discrete symmetries of a QK-norm
layer outside this group (a channel's rows negated with its gain, a quarter turn of a plane with
its gains swapped) are not quotiented: models differing by one compare as not equivalent.

Conversely, equal circuits imply a gauge transformation between the heads when every block of
``W_Q[i]``, ``W_K[j]``, ``W_V[j]``, ``W_O[:, i]`` has full rank (unique minimal-rank
factorisation, paper 000 Thm. 22; ``E = J_m`` forces the factor to commute with ``J`` on each
plane, i.e. to lie in the RoPE commutant). So :func:`compare` decides ``G``-equivalence by

1. the same architecture (attention shapes and RoPE layout, parameter names and shapes);
2. the same computation besides the parameters (:mod:`gaugeopt.tools.computation`): every module's
   class, buffers (``inv_freq``) and settings (RoPE base and scaling, sliding window, norm ``eps``,
   attention scale, the Hugging Face config the modules read) — a difference is named in the
   report's ``reason``;
3. equal *gauge-inert* tensors: every parameter outside the attention projections, the
   effective output bias, and the effective weights ``diag(r)·W̄·diag(c)`` of every other
   :class:`~gaugeopt.models.lrm.LRMLinear` (so LRM multipliers and their internal rescalings are
   quotiented too) — the output bias with the value bias folded in;
4. per layer, a head matching that respects KV groups (optimal assignment on circuit
   distances, two levels under GQA) under which every head's circuits agree.

Circuit distances never form a ``d×d`` matrix: for the matching,
``‖XᵀY − X'ᵀY'‖² = ⟨XXᵀ, YYᵀ⟩ + ⟨X'X'ᵀ, Y'Y'ᵀ⟩ − 2⟨XX'ᵀ, YY'ᵀ⟩`` (``d_k×d_k`` Grams,
accurate to ``~√eps``); for the verdict on the matched pairs, without cancellation,
``‖XᵀY − X'ᵀY'‖ = ‖R·[Y; −Y']‖`` with ``[X; X']ᵀ = QR`` (accurate to ``~κ·eps``).

**What a verdict means.** ``True`` is sound without any genericity assumption: equal
circuits and equal inert tensors compute the same function (to an error proportional to
``tol``). ``False`` means "not in one ``G``-orbit at this tolerance"; it implies a different
function only where ``G`` is the whole symmetry group, i.e. on the generic stratum of paper 000
Thm. 2. It can be a false negative for functionally identical models that differ by a
symmetry outside ``G``: MLP hidden-unit permutations and rescalings, norm gains traded against
the layers that read them, residual-stream rotations folded into norms (the families
:func:`gaugeopt.flat_directions` measures). Paper 001 claims complete discrimination from a bispectrum
of canonicalised head features; that holds only if canonicalisation removes *all* continuous
freedom, which its Definition 31 does not (it leaves ``O(d_k) × O(d_v)`` per head, paper 000
Prop. 45). The circuits here are invariant under the whole ``G``, so no residual fix, sign
rule or head sort is involved and near-ties there cannot flip a verdict. What remains
fragile: two heads of one model closer than ``tol`` to each other may be matched either way
(harmless: both pass or both fail), and heads near rank deficiency (``rank_margin``) make the
converse direction ill conditioned.

:func:`spectral_fingerprint` is the compact, permutation-invariant summary: per head the singular
values of the QK and OV circuits — in the balanced canonical form
(:mod:`gaugeopt.tools.canonical`) exactly the diagonals of ``P = R`` and of the ``W_O`` Gram — plus
the norms of the inert tensors. Equal fingerprints are necessary, not sufficient.

Example:
    >>> import copy, torch, gaugeopt
    >>> from gaugeopt.tools.equivalence import equivalent
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> a = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, rope="split_half")).double()
    >>> b = gaugeopt.random_gauge_transform(copy.deepcopy(a), generator=torch.Generator().manual_seed(1))
    >>> equivalent(a, b, tol=1e-10)
    True
    >>> with torch.no_grad():
    ...     b.transformer.h[0].mlp.c_fc.weight[0, 0] += 1e-6
    >>> equivalent(a, b, tol=1e-10)
    False
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gaugeopt.tools.canonical import effective_tensors, refuse_latent, refuse_layer_norm
from gaugeopt.tools.computation import computation_difference, computation_state
from gaugeopt.errors import GaugeError
from gaugeopt.models.lrm import LRMLinear
from gaugeopt.records.rope import plane_index
from gaugeopt.records.site import AttentionSite
from gaugeopt.trust.gate import trusted_sites
from gaugeopt.adapters.find import find_attention

__all__ = [
    "SpectralFingerprint",
    "EquivalenceReport",
    "LayerMatch",
    "compare",
    "equivalent",
    "spectral_fingerprint",
    "match_heads",
    "linear_assignment",
]


# ---------------------------------------------------------------------- optional dependency
def linear_assignment(cost: torch.Tensor) -> torch.Tensor:
    """Optimal assignment of a square cost matrix: ``col[i]`` for each row ``i`` (Hungarian
    algorithm, ``scipy.optimize.linear_sum_assignment``)."""
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError as err:  # pragma: no cover - scipy is in the test environment
        raise GaugeError(
            "head matching needs SciPy's linear_sum_assignment; install it with "
            "`pip install scipy` (or `pip install gaugeopt[tools]`)"
        ) from err
    rows, cols = linear_sum_assignment(cost.detach().double().cpu().numpy())
    out = torch.empty(cost.shape[0], dtype=torch.long)
    out[torch.as_tensor(rows)] = torch.as_tensor(cols, dtype=torch.long)
    return out


# ---------------------------------------------------------------------- invariant factor pairs
def _aug(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``[W | b]`` along the input axis (a zero column without bias, so layouts always agree)."""
    col = torch.zeros(*w.shape[:-1], 1, dtype=w.dtype) if b is None else b[..., None]
    return torch.cat([w, col], -1)


def circuit_factors(site: AttentionSite, t: dict | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Factor pairs ``(X (h, B, s, D₁), Y (h, B, s, D₂))`` whose products ``X_bᵀY_b`` are the
    complete per-query-head invariants (module docstring); the last pair is the OV circuit."""
    if site.qk_orthogonal:
        refuse_layer_norm(site, "equivalence")
    t = effective_tensors(site, fold_biases=True) if t is None else t
    r, dk = site.rope.rotary_dim, site.d_k
    expand = site.per_query  # a KV head's rows for each of its query heads
    xq = _aug(t["wq"], t["bq"])  # (h, d_k, d+1)
    xk = expand(_aug(t["wk"], t["bk"]))  # (h, d_k, d_in+1)
    pairs = []
    if site.qk_norm is not None:
        pairs += _qk_norm_factors(site, xq, xk)
    elif r < dk:
        pairs.append((xq[:, None, r:], xk[:, None, r:]))
    planes = site.rope.planes(dk)
    if planes:
        p, q = (list(c) for c in zip(*planes))
        qp = torch.stack([xq[:, p], xq[:, q]], 2)  # (h, m, 2, D)
        kp = torch.stack([xk[:, p], xk[:, q]], 2)
        kj = torch.stack([-xk[:, q], xk[:, p]], 2)  # J = [[0, −1], [1, 0]] on (p, q)
        pairs += [(qp, kp), (qp, kj)]
    if site.sinks is not None:  # a per-head scalar invariant: s_i = [s_i]ᵀ[1]
        s = site.sinks.get().detach().double().reshape(site.h, 1, 1, 1)
        pairs.append((s, torch.ones_like(s)))
    xv = expand(_aug(t["wv"], t["bv"]))  # (h, d_v, D)
    pairs.append((t["wo"].mT[:, None], xv[:, None]))  # W_O[:, i] X_V = (W_O[:, i]ᵀ)ᵀ X_V
    return pairs


def _qk_norm_factors(site: AttentionSite, xq: torch.Tensor, xk: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The Q/K invariants of a QK-norm head (module docstring) as factor pairs: ``(I, X_Q)``, ``(I, X_K)``
    and per slot ``(g̃_q[π], g̃_k[π])`` (rows of width 2, a single channel padded with 0)."""
    refuse_layer_norm(site, "equivalence")
    h, dk = site.h, site.d_k
    eye = torch.eye(dk, dtype=torch.float64).expand(h, 1, dk, dk)
    n = site.qk_norm
    pair = site.pair("qk_gain")
    gq = n.q_gain.get().detach().double() + n.gain_offset  # (1 or h, d_k)
    gk = n.k_gain.get().detach().double() + n.gain_offset  # (1 or h_kv, d_k)
    gq = gq.expand(h, dk) if gq.shape[0] == 1 else gq
    gk = gk.expand(site.h_kv, dk) if gk.shape[0] == 1 else gk
    gk = site.per_query(gk)
    slot = plane_index(pair.rope, dk)
    n_slots = int(slot.max()) + 1
    fq = torch.zeros(h, n_slots, 1, 2, dtype=torch.float64)
    fk = torch.zeros_like(fq)
    for m in range(n_slots):
        chans = (slot == m).nonzero().flatten()
        fq[:, m, 0, : len(chans)] = gq[:, chans]
        fk[:, m, 0, : len(chans)] = gk[:, chans]
    return [(eye, xq[:, None]), (eye, xk[:, None]), (fq, fk)]


def _gram_sqdist(pa, pb) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """All-pairs squared circuit distances ``(h_a, h_b)`` for QK and OV by the Gram identity,
    and the QK/OV scales (RMS head circuit norm over both models)."""
    out, scales = [], []
    for (Xa, Ya), (Xb, Yb) in zip(pa, pb):
        na = ((Xa @ Xa.mT) * (Ya @ Ya.mT)).sum((-1, -2, -3))
        nb = ((Xb @ Xb.mT) * (Yb @ Yb.mT)).sum((-1, -2, -3))
        cross = (torch.einsum("ibsd,jbtd->ijbst", Xa, Xb) * torch.einsum("ibsd,jbtd->ijbst", Ya, Yb)).sum((-1, -2, -3))
        out.append((na[:, None] + nb[None, :] - 2 * cross).clamp_min(0))
        scales.append((na.mean() + nb.mean()) / 2)
    tiny = torch.finfo(torch.float64).tiny
    sqk, sov = max(float(sum(scales[:-1])), tiny) ** 0.5, max(float(scales[-1]), tiny) ** 0.5
    return sum(out[:-1]), out[-1], sqk, sov


def _precise_sqdist(pa, pb, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``‖XᵀY − X'ᵀY'‖²`` for head ``i`` of A against head ``perm[i]`` of B, cancellation-free."""
    out = []
    for (Xa, Ya), (Xb, Yb) in zip(pa, pb):
        _, R = torch.linalg.qr(torch.cat([Xa, Xb[perm]], -2).mT)
        out.append((R @ torch.cat([Ya, -Yb[perm]], -2)).square().sum((-1, -2, -3)))
    return sum(out[:-1]), out[-1]


def match_heads(
    site_a: AttentionSite, site_b: AttentionSite, cost: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-respecting optimal head matching of B to A.

    Returns ``(kv_perm, q_perm)`` in :func:`gaugeopt.transforms.permute_heads` form: B's KV group
    ``kv_perm[j]`` matches A's group ``j`` and B's query head ``q_perm[i]`` matches A's head
    ``i``. The cost defaults to the relative squared circuit distances (QK + OV). Under GQA
    the groups are matched on the optimal within-group assignment costs (exact optimum of
    the group-respecting problem).
    """
    if cost is None:
        cost = circuit_cost(site_a, site_b)
    n, g = site_a.n_rep, site_a.h_kv
    if n == 1:
        kv = linear_assignment(cost)
        return kv, kv.clone()
    group_cost = torch.empty(g, g, dtype=torch.float64)
    within = {}
    for j in range(g):
        for jb in range(g):
            sub = cost[j * n:(j + 1) * n, jb * n:(jb + 1) * n]
            within[j, jb] = linear_assignment(sub)
            group_cost[j, jb] = sub[torch.arange(n), within[j, jb]].sum()
    kv = linear_assignment(group_cost)
    q = torch.cat([int(kv[j]) * n + within[j, int(kv[j])] for j in range(g)])
    return kv, q


def circuit_cost(site_a: AttentionSite, site_b: AttentionSite) -> torch.Tensor:
    """``(h, h)`` relative squared circuit distances (QK and OV, each over its RMS head norm)."""
    dqk, dov, sqk, sov = _gram_sqdist(circuit_factors(site_a), circuit_factors(site_b))
    return dqk / sqk**2 + dov / sov**2


# ---------------------------------------------------------------------- gauge-inert tensors
def inert_tensors(model: nn.Module, sites: list[AttentionSite] | None = None) -> dict[str, torch.Tensor]:
    """Float64 copies of everything the attention gauge does not touch, by name (see module docstring)."""
    sites = find_attention(model) if sites is None else sites
    owned = {n for s in sites for n in s.parameter_names()}
    out: dict[str, torch.Tensor] = {}
    for s in sites:
        bo = effective_tensors(s, fold_biases=True)["bo"]
        if bo is not None:
            out[s.o.bias.name] = bo
    lrm_params: set[str] = set()
    for name, m in model.named_modules():
        if isinstance(m, LRMLinear):
            names = [f"{name}.{n}" if name else n for n, _ in m.named_parameters()]
            lrm_params.update(names)
            if owned.isdisjoint(names):
                prefix = f"{name}." if name else ""
                out[prefix + "weight"] = m.effective_weight().detach().double()
                if m.bias is not None:
                    out[prefix + "bias"] = (m.bias * m.row_multiplier()).detach().double()
    for name, p in model.named_parameters():
        if name not in owned and name not in lrm_params:
            out[name] = p.detach().double()
    return out


def _norm_layout(site: AttentionSite) -> tuple:
    n = site.qk_norm
    return () if n is None else (n.kind, n.scope, n.per_head, n.before_rope, n.eps, n.gain_offset)


def _signature(sites: list[AttentionSite], inert: dict[str, torch.Tensor]) -> tuple:
    return (
        tuple((s.h, s.h_kv, s.d_k, s.d_v, s.d_model, s.rope.kind, s.rope.rotary_dim, _norm_layout(s)) for s in sites),
        tuple(sorted((k, tuple(v.shape)) for k, v in inert.items())),
    )


def _rank_margin(pairs_src: dict) -> float:
    """Smallest ``σ_min/σ_max`` over every head's ``W_Q[i]``, ``W_K[j]``, ``W_V[j]``, ``W_O[:, i]``."""
    worst = float("inf")
    for w in (pairs_src["wq"], pairs_src["wk"], pairs_src["wv"], pairs_src["wo"].mT):
        sv = torch.linalg.svdvals(w)
        worst = min(worst, float((sv[..., -1] / sv[..., 0].clamp_min(torch.finfo(sv.dtype).tiny)).min()))
    return worst


# ---------------------------------------------------------------------- comparison
@dataclass
class LayerMatch:
    """One attention layer of :func:`compare`: B's heads ``q_perm`` (groups ``kv_perm``) match
    A's heads in order; ``qk``/``ov`` are the largest relative circuit distances over heads."""

    name: str
    kv_perm: torch.Tensor
    q_perm: torch.Tensor
    qk: float
    ov: float


@dataclass
class EquivalenceReport:
    """The verdict of :func:`compare` and the numbers behind it.

    Attributes:
        equivalent: every distance at or below ``tol``.
        reason: one line saying why not (empty when equivalent).
        layers: per attention layer, the matching and its circuit distances.
        inert: largest relative difference of a gauge-inert tensor, and its name.
        rank_margin: smallest ``σ_min/σ_max`` of a head projection in either model (how far
            from the rank-deficient set, where equal circuits stop implying one orbit).
    """

    equivalent: bool
    tol: float
    reason: str = ""
    layers: list[LayerMatch] = field(default_factory=list)
    inert: tuple[float, str] = (0.0, "")
    rank_margin: float = float("inf")

    def max_distance(self) -> float:
        return max([self.inert[0]] + [max(m.qk, m.ov) for m in self.layers])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = max(float(a.norm()), float(b.norm()), torch.finfo(torch.float64).tiny)
    return float((a - b).norm()) / den


@torch.no_grad()
def compare(model_a: nn.Module, model_b: nn.Module, tol: float = 1e-8) -> EquivalenceReport:
    """Decide whether ``model_b`` is ``model_a`` up to the attention gauge group, and say why.

    Args:
        model_a, model_b: models :func:`gaugeopt.find_attention` understands (any dtypes;
            compared in float64). Neither is modified.
        tol: largest allowed relative distance: per head circuit, relative to the layer's RMS
            head circuit norm; per inert tensor, relative to its norm.

    Returns:
        An :class:`EquivalenceReport` (see the module docstring for what a verdict means).
    """
    if not tol >= 0:
        raise GaugeError(f"compare: tol={tol!r} must be a non-negative number")
    sites_a, sites_b = trusted_sites(model_a, "equivalent"), trusted_sites(model_b, "equivalent")
    refuse_latent(sites_a + sites_b, "compare")
    inert_a, inert_b = inert_tensors(model_a, sites_a), inert_tensors(model_b, sites_b)
    sig_a, sig_b = _signature(sites_a, inert_a), _signature(sites_b, inert_b)
    if sig_a != sig_b:
        what = "attention layers (heads, widths or RoPE)" if sig_a[0] != sig_b[0] else "parameter names or shapes"
        return EquivalenceReport(False, tol, f"different architectures: the {what} differ")
    computation = computation_difference(computation_state(model_a), computation_state(model_b), tol)
    if computation:
        return EquivalenceReport(False, tol, f"different computations besides the parameters: {computation}")
    worst_inert = max(((_rel(inert_a[k], inert_b[k]), k) for k in inert_a), default=(0.0, ""))
    layers, margin = [], float("inf")
    for sa, sb in zip(sites_a, sites_b):
        ta, tb = effective_tensors(sa, fold_biases=True), effective_tensors(sb, fold_biases=True)
        pa, pb = circuit_factors(sa, ta), circuit_factors(sb, tb)
        dqk, dov, sqk, sov = _gram_sqdist(pa, pb)
        kv, q = match_heads(sa, sb, dqk / sqk**2 + dov / sov**2)
        eqk, eov = _precise_sqdist(pa, pb, q)
        layers.append(LayerMatch(sa.name, kv, q, float(eqk.max()) ** 0.5 / sqk, float(eov.max()) ** 0.5 / sov))
        margin = min(margin, _rank_margin(ta), _rank_margin(tb))
    report = EquivalenceReport(True, tol, "", layers, worst_inert, margin)
    if worst_inert[0] > tol:
        report.equivalent = False
        report.reason = f"gauge-inert tensor {worst_inert[1]} differs (relative {worst_inert[0]:.2e} > tol {tol:.1e})"
    else:
        bad = max(layers, key=lambda m: max(m.qk, m.ov))
        if max(bad.qk, bad.ov) > tol:
            which = "QK" if bad.qk >= bad.ov else "OV"
            report.equivalent = False
            report.reason = (
                f"{bad.name}: no head matching makes the {which} circuits agree "
                f"(relative {max(bad.qk, bad.ov):.2e} > tol {tol:.1e})"
            )
    return report


def equivalent(model_a: nn.Module, model_b: nn.Module, tol: float = 1e-8) -> bool:
    """``True`` when ``model_b`` equals ``model_a`` up to the attention gauge group (see :func:`compare`)."""
    return compare(model_a, model_b, tol).equivalent


# ---------------------------------------------------------------------- fingerprint
@dataclass(frozen=True)
class SpectralFingerprint:
    """Gauge- and permutation-invariant summary of a model (see :func:`spectral_fingerprint`): equal
    fingerprints are necessary for gauge equivalence, never sufficient.

    Attributes:
        signature: attention shapes/RoPE layouts, the inert tensors' names and shapes, and the
            computation besides the parameters (:meth:`gaugeopt.tools.computation.ComputationState.key`:
            every module's class and settings, its buffers' names and shapes).
        spectra: per layer ``(h, d_k + d_v)``: each head's QK-circuit singular values then its
            OV-circuit singular values (descending), rows in decreasing QK-circuit energy.
        inert_norms: Frobenius norms of the inert tensors, then of the buffers, in ``signature`` order.
    """

    signature: tuple
    spectra: tuple[torch.Tensor, ...]
    inert_norms: torch.Tensor

    def distance(self, other: SpectralFingerprint) -> float:
        """Largest relative difference (rows matched optimally per layer); ``inf`` across architectures."""
        if self.signature != other.signature:
            return float("inf")
        worst = float(((self.inert_norms - other.inert_norms).abs() / self.inert_norms.clamp_min(1e-300)).max()) \
            if self.inert_norms.numel() else 0.0
        for a, b in zip(self.spectra, other.spectra):
            scale = float(a.norm(dim=1).square().mean().sqrt()) or 1.0
            cost = torch.cdist(a, b)
            perm = linear_assignment(cost)
            worst = max(worst, float(cost[torch.arange(len(perm)), perm].max()) / scale)
        return worst

    def digest(self, digits: int = 6) -> str:
        """A short hash of the values rounded to ``digits`` significant digits.

        A *necessary* condition only: gauge-equivalent models give equal digests (unless a value sits
        on a rounding boundary), but so do models whose circuits differ by an orthogonal map on one
        side (equal singular values, a different function). Use :func:`compare` for a verdict."""
        h = hashlib.sha256(repr(self.signature).encode())
        fmt = f"{{:.{digits - 1}e}}"
        for a in self.spectra:
            rows = sorted(",".join(fmt.format(float(v)) for v in row) for row in a)
            h.update(";".join(rows).encode())
        h.update(",".join(fmt.format(float(v)) for v in self.inert_norms).encode())
        return h.hexdigest()[:16]


@torch.no_grad()
def spectral_fingerprint(model: nn.Module) -> SpectralFingerprint:
    """The :class:`SpectralFingerprint` of ``model`` (float64; the model is not modified)."""
    sites = trusted_sites(model, "spectral_fingerprint")
    refuse_latent(sites, "spectral_fingerprint")
    inert = inert_tensors(model, sites)
    spectra = []
    for site in sites:
        t = effective_tensors(site, fold_biases=True)
        expand = site.per_query
        _, rq = torch.linalg.qr(_aug(t["wq"], t["bq"]).mT)
        _, rk = torch.linalg.qr(expand(_aug(t["wk"], t["bk"])).mT)
        _, ro = torch.linalg.qr(t["wo"])
        _, rv = torch.linalg.qr(expand(_aug(t["wv"], t["bv"])).mT)
        sq, so = torch.linalg.svdvals(rq @ rk.mT), torch.linalg.svdvals(ro @ rv.mT)
        order = torch.argsort(sq.square().sum(-1), descending=True)
        spectra.append(torch.cat([sq, so], -1)[order])
    state = computation_state(model)
    sig = (*_signature(sites, inert), state.key())
    norms = [float(inert[k].norm()) for k, _ in sig[1]]
    norms += [float(state.tensors[k].detach().cpu().abs().double().norm()) for k, _ in sig[2][1]]
    return SpectralFingerprint(sig, tuple(spectra), torch.tensor(norms, dtype=torch.float64))
