"""The pieces a canonical form is built from (:mod:`gaugeopt.tools.canonical` assembles them).

Per attention record: its effective tensors (multipliers and, optionally, folded biases), the stacked
queries and outputs of each KV group; the factors of each section — the Q/K factor of the free channels
(positive-diagonal QR, or the Gram-balanced square root) and of each RoPE plane (a rotation and a scale),
the V/O factor, the QK-norm gain section, the latents and RoPE part of latent attention; and the head
order (KV groups sorted by their energy, ties broken by the next key, refused when two are closer than the
margin). Every factor records its margin — the gap that decides it — in ``margins``: a form whose margin is
at rounding level is not unique, and :func:`~gaugeopt.tools.canonical.canonicalize` says so.

Example:
    >>> import torch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.adapters.find import find_attention
    >>> from gaugeopt.tools.canonical_parts import effective_tensors
    >>> site = find_attention(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)))[0]
    >>> {k: tuple(v.shape) for k, v in effective_tensors(site).items() if v is not None and k in ("wq", "wk")}
    {'wq': (2, 4, 8), 'wk': (2, 4, 8)}
"""

from __future__ import annotations

import functools

import torch

from gaugeopt.transforms import scale_qk_gains, shift_key_bias, trade_value_bias
from gaugeopt.records.latent import rotate_latent, scale_latent_gain
from gaugeopt.errors import GaugeError
from gaugeopt.fix.drift import read_mean_squares, slot_rms
from gaugeopt.records.pair import query_rows
from gaugeopt.records.rope import plane_index
from gaugeopt.records.site import AttentionSite

__all__ = [
    "effective_tensors", "fold_bias_tensors", "fold_biases", "stack_queries", "stack_outputs", "qk_factor", "refuse_layer_norm", "refuse_latent", "gain_scales", "gain_cubes", "gain_section", "latent_rows", "latent_section", "rope_factor", "vo_factor", "head_energies", "rope_rows", "head_order",
]


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
    (:mod:`gaugeopt.records.bias_sector`), where the site has them; other entries are shared."""
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
    ``b_K ← 0`` on the non-rotary channels (:func:`~gaugeopt.transforms.shift_key_bias`),
    ``b_O ← b_O + Σ_i W_O[:, i] b_V[g(i)]``, ``b_V ← 0``
    (:func:`~gaugeopt.transforms.trade_value_bias`). Returns how many bias entries became pure
    zeros (``h_kv·(d_k − r)`` + ``h_kv·d_v`` where the site has the sectors)."""
    zeroed = 0
    for kind in site.bias_kinds:
        sec = site.bias_sector(kind)
        _, b = site.effective(sec.proj)
        delta = -b[:, list(sec.channels)]
        (shift_key_bias if kind == "key_bias" else trade_value_bias)(site, delta)  # b + (−b) is exactly 0
        zeroed += sec.dim
    return zeroed


def stack_queries(site: AttentionSite, wq: torch.Tensor) -> torch.Tensor:
    """``(h, d_k, d) -> (h_kv, d_k, n_rep·d)``: the query rows of each KV group side by side,
    so that ``S Sᵀ = Σ_i W_Q[i]W_Q[i]ᵀ`` (:meth:`~gaugeopt.records.pair.PairSide.stack`)."""
    return query_rows(site).stack(wq)


def stack_outputs(site: AttentionSite, wo: torch.Tensor) -> torch.Tensor:
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


def qk_factor(site, t, section, residual, rtol, margins) -> torch.Tensor:
    S = stack_queries(site, t["wq"])
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


def gain_cubes(site: AttentionSite, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ g_k³, Σ |g_k|³)`` of the key gains (``+ offset``) per group and slot."""
    pair = site.pair("qk_gain")
    n = int(slot.max()) + 1
    g = pair.b.grouped(site.qk_norm.k_gain.get().detach().double() + site.qk_norm.gain_offset)  # (G, 1, d_k)
    onehot = torch.nn.functional.one_hot(slot, n).to(g.dtype)
    return (g**3).sum(1) @ onehot, (g.abs() ** 3).sum(1) @ onehot


def gain_section(site: AttentionSite, section: str, residual: str, margins: dict) -> None:
    """Move the site's gains to the section (module docstring)."""
    s_q, s_k, slot = gain_scales(site)
    tiny = torch.finfo(torch.float64).tiny
    if bool((s_q <= tiny).any()) or bool((s_k <= tiny).any()):
        raise GaugeError(f"{site.name}: a slot of the QK-norm gains is zero; the canonical form needs every slot used")
    d = 1.0 / s_q if section == "qr" else (s_k / s_q).sqrt()
    if residual == "fix":
        cube, norm = gain_cubes(site, slot)
        sign = torch.where(cube / d < 0, -1.0, 1.0).to(d)  # after g_k ← g_k / d: Σ g_k³ > 0
        margins["sign_margin"] = min(margins["sign_margin"], float((cube.abs() / norm.clamp_min(tiny)).min()))
        d = d * sign
    scale_qk_gains(site, d[:, slot])


# ---------------------------------------------------------------------- latent attention: latents and the RoPE part
def latent_rows(lat) -> torch.Tensor:
    """``A = [W_down | b_down]`` of a latent, ``(L, d [+1])``, float64."""
    w = lat.down.get().detach().double()
    return w if lat.down_bias is None else torch.cat([w, lat.down_bias.get().detach().double()[:, None]], 1)


def latent_section(site: AttentionSite, residual: str, margins: dict) -> None:
    """Move each latent of ``site`` to ``γ = 1`` and (``residual="fix"``) ``A Aᵀ`` diagonal, descending, signed."""
    for lat in site.latent.latents():
        g = lat.effective_gain().double()
        if bool((g == 0).any()):
            raise GaugeError(f"{site.name}: the {lat.name} latent's RMSNorm gain has an exact zero; that channel is dead "
                             "and the gain section (γ = 1) cannot reach it")
        scale_latent_gain(site, lat.name, 1.0 / g)
        if residual != "fix":
            continue
        A = latent_rows(lat)
        ev, U = torch.linalg.eigh(A @ A.mT)
        ev, U = ev.flip(-1), U.flip(-1)
        sign, margin = _sign_of_cubes(U.mT @ A)
        margins["spectral_gap"] = min(margins["spectral_gap"], float(_gaps(ev.clamp_min(0)[None]).min()))
        margins["sign_margin"] = min(margins["sign_margin"], float(margin.min()))
        rotate_latent(site, lat.name, U.mT * sign[:, None])


def rope_factor(site: AttentionSite, section: str, residual: str, margins: dict) -> torch.Tensor:
    """``B (1, r, r)``: the plane section of the RoPE part (all heads' RoPE rows against the shared key)."""
    pair = site.pair("qk_rope")
    qr, kr = rope_rows(site)
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


def vo_factor(site, t, residual, rtol, margins) -> torch.Tensor:
    """``C (h_kv, d_v, d_v)`` with ``CᵀW_V`` row-orthonormal; ``"fix"`` also diagonalises the
    stacked ``W_O`` Gram (``W_Vᵀ = Q_V R_V``, ``T = Q_T R_T``, ``R_T R_Vᵀ = uσvᵀ``, ``C = R_V⁻¹v``)."""
    what = f"{site.name}: V/O"
    qv, rv = _qr_pos(t["wv"].mT, f"{what} W_V", rtol)
    rv_inv = _tri_inv(rv)
    if residual == "keep":
        return rv_inv  # paper 000 Algorithm 1
    _, rt = _qr_pos(stack_outputs(site, t["wo"]), f"{what} stacked W_O", rtol)
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
        qr, kr = rope_rows(site)
        e_qk = e_qk + ((qr @ qr.mT) * (kr @ kr.mT)).sum((-1, -2))
    return e_qk, (go * gv).sum((-1, -2))


def rope_rows(site: AttentionSite) -> tuple[torch.Tensor, torch.Tensor]:
    """A latent attention site's RoPE query rows ``(h, r, m_q)`` and shared key rows ``(1, r, d)``, float64 copies."""
    lat = site.latent
    return lat.q_rope.get().detach().double(), lat.k_rope.get().detach().double()


def head_order(site: AttentionSite, margins: dict) -> tuple[torch.Tensor, torch.Tensor]:
    t = effective_tensors(site)
    n, g = site.n_rep, site.h_kv
    e_qk, e_ov = head_energies(site, t)
    q_blocks = torch.cat([_with(t["wq"], t["wq"]), _with(t["bq"], t["wq"]), _with(t["wo"], t["wo"])], 1)
    if site.latent is not None:
        q_blocks = torch.cat([q_blocks, _with(rope_rows(site)[0], t["wq"])], 1)
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
