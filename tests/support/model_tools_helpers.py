"""Independent constructions for the model-tool tests (canonical forms, equivalence, merging).

Everything here is written with plain per-head loops from the definitions, not by calling the
code under test, so that a layout or formula bug in the implementation cannot hide behind the
same bug in its check.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import gaugeopt
import zoo

# Models the model-tool tests cover: own GPT (MHA, MQA, RoPE both layouts, partial rotary, GQA),
# Hugging Face GPT-2 and Llama (biases, GQA, RoPE), torch MHA, and learnable multipliers.
CANON_CASES = [
    ("gpt", False),
    ("gpt_mqa", False),
    ("gpt_rope_interleaved", False),
    ("gpt_rope_split_half_gqa", False),
    ("gpt_rope_partial_split_half", False),
    ("hf_gpt2", False),
    ("hf_llama", False),
    ("torch_mha_kdim", False),
    ("gpt", True),
    ("hf_llama", True),
]
CANON_IDS = [n + ("+lrm" if lrm else "") for n, lrm in CANON_CASES]
# A smaller set for the 20-copy equivalence and the merge tests.
CORE_CASES = [
    ("gpt", False), ("gpt_rope_split_half_gqa", False), ("hf_gpt2", False), ("hf_llama", False), ("gpt", True),
]
CORE_IDS = [n + ("+lrm" if lrm else "") for n, lrm in CORE_CASES]


def gauge_kinds(lrm: bool):
    """Every gauge kind the model has: the head gauges, the bias sectors where the biases exist, and
    every multiplier gauge on LRM models (``lrm`` is implied by the model; kept for the call sites)."""
    return "all"


def state_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest relative Frobenius difference over the floating state-dict entries."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    worst = 0.0
    for k, x in sa.items():
        if x.is_floating_point():
            den = max(float(x.double().norm()), 1e-300)
            worst = max(worst, float((x.double() - sb[k].double()).norm()) / den)
    return worst


def attention_change(case: zoo.Case, model: nn.Module) -> float:
    """Relative change of every attention layer's output (float64 exact even where a model
    rounds its norms through float32, as Hugging Face Llama does)."""
    ref = torch.cat([o.reshape(-1) for _, _, o in zoo.attention_io(case, case.model)])
    new = torch.cat([o.reshape(-1) for _, _, o in zoo.attention_io(case, model)])
    return gaugeopt.relative_change(ref, new)


def effective(site, p):
    w, b = site.effective(p)
    return w.detach().double(), None if b is None else b.detach().double()


def section_violation(model: nn.Module, section: str, residual: str = "fix") -> float:
    """Largest violation of the section's equations, from per-group loops over the definitions."""
    worst = 0.0
    for site in gaugeopt.find_attention(model):
        wq, _ = effective(site, "q")
        wk, _ = effective(site, "k")
        wv, _ = effective(site, "v")
        wo, _ = effective(site, "o")  # (d, h, d_v)
        r, dk = site.rope.rotary_dim, site.d_k
        for j in range(site.h_kv):
            heads = [i for i in range(site.h) if i // site.n_rep == j]
            P = sum(wq[i] @ wq[i].T for i in heads)
            R = wk[j] @ wk[j].T
            if r < dk:
                Pf, Rf = P[r:, r:], R[r:, r:]
                if section == "qr":
                    worst = max(worst, float((Pf - torch.eye(dk - r, dtype=Pf.dtype)).abs().max()))
                else:
                    worst = max(worst, float((Pf - Rf).abs().max() / Pf.abs().max()))
                if residual == "fix":
                    G = Pf + Rf
                    off = G - torch.diag(torch.diag(G))
                    worst = max(worst, float(off.abs().max() / G.abs().max()))
                    d = torch.diag(G)
                    if len(d) > 1:
                        worst = max(worst, float((d[1:] - d[:-1]).clamp_min(0).max()))
                    for a in range(r, dk):
                        worst = max(worst, float(float((wk[j][a] ** 3).sum()) < 0))
            for p, q in site.rope.planes(dk):
                tp, tr = P[p, p] + P[q, q], R[p, p] + R[q, q]
                worst = max(worst, float(abs(tp - 2) if section == "qr" else abs(tp - tr) / tp))
                if residual == "fix":
                    G = P + R
                    worst = max(worst, float(abs(G[p, q]) / (G[p, p] + G[q, q])), float(G[q, q] > G[p, p]))
                    worst = max(worst, float(float((wk[j][p] ** 3).sum() + (wk[j][q] ** 3).sum()) < 0))
            worst = max(worst, float((wv[j] @ wv[j].T - torch.eye(site.d_v, dtype=wv.dtype)).abs().max()))
            if residual == "fix":
                G = sum(wo[:, i].T @ wo[:, i] for i in heads)
                off = G - torch.diag(torch.diag(G))
                worst = max(worst, float(off.abs().max() / G.abs().max()))
                d = torch.diag(G)
                worst = max(worst, float((d[1:] - d[:-1]).clamp_min(0).max()))
                for a in range(site.d_v):
                    worst = max(worst, float(float((wv[j][a] ** 3).sum()) < 0))
    return worst


def explicit_qk_forms(site, i: int) -> list[torch.Tensor]:
    """The ``(d+1)×(d+1)`` QK invariants ``[W_Q|b_Q]ᵀ E [W_K|b_K]`` of query head ``i``, formed
    densely: ``E = I`` without RoPE; per plane the projector and the rotation generator, plus
    the projector on the non-rotary coordinates. The key-bias shift is quotiented by zeroing
    ``b_K`` on the non-rotary coordinates ``r..d_k−1`` (a plain site: no QK-norm)."""
    wq, bq = effective(site, "q")
    wk, bk = effective(site, "k")
    if bk is not None:
        bk = bk.clone()
        bk[:, site.rope.rotary_dim:] = 0

    def aug(w, b):
        return torch.cat([w, (torch.zeros(w.shape[0], 1, dtype=w.dtype) if b is None else b[:, None])], 1)

    j = i // site.n_rep
    xq = aug(wq[i], None if bq is None else bq[i])
    xk = aug(wk[j], None if bk is None else bk[j])
    dk, r = site.d_k, site.rope.rotary_dim
    Es = []
    if r < dk:
        E = torch.zeros(dk, dk, dtype=torch.float64)
        E[r:, r:] = torch.eye(dk - r, dtype=torch.float64)
        Es.append(E)
    for p, q in site.rope.planes(dk):
        I2 = torch.zeros(dk, dk, dtype=torch.float64)
        I2[p, p] = I2[q, q] = 1
        J2 = torch.zeros(dk, dk, dtype=torch.float64)
        J2[q, p], J2[p, q] = 1, -1
        Es += [I2, J2]
    return [xq.T @ E @ xk for E in Es]


def explicit_ov_form(site, i: int) -> torch.Tensor:
    """``W_O[:, i][W_V[j] | b_V[j]]``; with an output bias the value-bias trade is quotiented by
    dropping ``b_V`` (its image ``W_O b_V`` is compared with the output bias)."""
    wv, bv = effective(site, "v")
    wo, bo = effective(site, "o")
    if bo is not None:
        bv = None
    j = i // site.n_rep
    xv = torch.cat([wv[j], (torch.zeros(site.d_v, 1, dtype=wv.dtype) if bv is None else bv[j][:, None])], 1)
    return wo[:, i] @ xv


@torch.no_grad()
def perturb(model: nn.Module, which: str, gen: torch.Generator, rel: float = 1e-6) -> str:
    """Add a generic random direction of relative size ``rel`` to one tensor; returns its name.

    ``which``: ``"mlp"`` (first MLP input weight), ``"q"`` (the query rows of one head: never
    a gauge direction, since a gauge move of W_Q alone must also move W_K), ``"v"``, ``"o"``.
    """
    sites = gaugeopt.find_attention(model)
    site = sites[int(torch.randint(len(sites), (1,), generator=gen))]
    if which == "mlp":
        owned = set(site.parameter_names())
        name, p = next((n, p) for n, p in model.named_parameters()
                       if p.dim() == 2 and ("mlp" in n or "fc" in n or n.startswith("head")) and n not in owned)
        t = p
    else:
        ref = getattr(site, which).weight
        name = ref.name
        view = ref.get()
        head = int(torch.randint(view.shape[1] if which == "o" else view.shape[0], (1,), generator=gen))
        t = view[:, head] if which == "o" else view[head]
    d = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t)
    t.add_(rel * d / d.norm() * t.norm())
    return name


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
