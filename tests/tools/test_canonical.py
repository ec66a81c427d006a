"""Canonical forms (gaugeopt.tools.canonical): function preserved, section equations, uniqueness up to
exactly the stated residual freedom, head order, metrics, LRM folding, errors."""

from __future__ import annotations


import pytest
import torch

import gaugeopt
import zoo
from gaugeopt.tools.canonical import canonicalize, section_residual
from gaugeopt.records.rope import commutant_basis
from model_tools_helpers import (
    CANON_CASES,
    CANON_IDS,
    attention_change,
    effective,
    gauge_kinds,
    section_violation,
    state_diff,
)

SECTIONS = ("qr", "balanced")


@pytest.fixture(scope="module")
def cases():
    return {n + ("+lrm" if lrm else ""): zoo.build(n, 3, lrm=lrm) for n, lrm in CANON_CASES}


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("cid", CANON_IDS)
def test_function_and_section_equations(cases, cid, section):
    case = cases[cid]
    for residual in ("fix", "keep"):
        canon = canonicalize(case.model, section, residual=residual).model
        assert gaugeopt.relative_change(case.logits(), case.logits(canon)) <= 1e-10
        assert attention_change(case, canon) <= 1e-10
        assert section_violation(canon, section, residual) <= 1e-10
        assert section_residual(canon, section, residual) <= 1e-10
    # negative control: a random model is far from the section
    assert section_violation(case.model, section, "keep") > 1e-2
    assert section_residual(case.model, section, "keep") > 1e-2


@pytest.mark.parametrize("name", ["gpt", "gpt_rope_interleaved", "gpt_rope_split_half_gqa", "gpt_mqa"])
def test_greedy_decoding_identical_on_gpt(name):
    case = zoo.build(name, 4)
    canon = canonicalize(case.model, "balanced").model
    idx = torch.randint(0, zoo.VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    out_a = case.model.generate(idx, 16, temperature=0)
    out_b = canon.generate(idx, 16, temperature=0)
    assert torch.equal(out_a, out_b)
    # negative control: greedy decoding does notice a non-gauge change of the same size
    wrong = gaugeopt.invalid_gauge_transform(case.copy(), "vo_mismatch", generator=torch.Generator().manual_seed(0))
    assert not torch.equal(out_a, wrong.generate(idx, 16, temperature=0))


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize("cid", CANON_IDS)
def test_fixed_residual_gives_one_representative_per_orbit(cases, cid, section):
    """residual='fix' breaks O(d_k)×O(d_v) (and the head order): transformed copies give the
    *same* canonical parameters."""
    case = cases[cid]
    lrm = cid.endswith("+lrm")
    ref = canonicalize(case.model, section).model
    for seed in range(3):
        moved = gaugeopt.random_gauge_transform(case.copy(), gauge_kinds(lrm), torch.Generator().manual_seed(seed))
        assert state_diff(case.model, moved) > 1e-2  # the transform really moved the parameters
        assert state_diff(ref, canonicalize(moved, section).model) <= 1e-10


@pytest.mark.parametrize("cid", ["gpt", "gpt_rope_partial_split_half", "hf_gpt2", "hf_llama", "gpt+lrm"])
def test_bias_sectors_folded(cases, cid):
    """biases='fold': b_K = 0 on the non-rotary channels, b_V = 0 with W_O·b_V moved into b_O (read
    from the stored tensors here), the count of zeroed entries, the same function; 'keep' leaves
    the biases; copies moved by the bias sectors canonicalise to the same parameters only when folded."""
    case = cases[cid]
    report = canonicalize(case.model, "qr")
    canon = report.model
    assert gaugeopt.relative_change(case.logits(), case.logits(canon)) <= 1e-12
    expect = 0
    for site in gaugeopt.find_attention(canon):
        _, bk = effective(site, "k")
        _, bv = effective(site, "v")
        r = site.rope.rotary_dim
        if bk is not None and r < site.d_k:
            assert bool((bk[:, r:] == 0).all()) and bool((bk[:, :r] != 0).all())  # rotary channels keep theirs
            expect += site.h_kv * (site.d_k - r)
        if bv is not None and site.o.bias is not None:
            assert bool((bv == 0).all())
            expect += site.h_kv * site.d_v
    assert expect > 0 and report.bias_zeroed == expect and report.biases == "fold"
    assert section_residual(canon, "qr") <= 1e-10
    kept = canonicalize(case.model, "qr", biases="keep")
    assert kept.bias_zeroed == 0 and section_residual(kept.model, "qr", biases="keep") <= 1e-10
    assert section_residual(kept.model, "qr") > 1e-2  # the fold's equations do not hold there
    moved = gaugeopt.random_gauge_transform(case.copy(), ("key_bias", "value_bias") if "llama" not in cid else ("value_bias",),
                                            torch.Generator().manual_seed(4))
    assert state_diff(canon, canonicalize(moved, "qr").model) <= 1e-10
    assert state_diff(kept.model, canonicalize(moved, "qr", biases="keep").model) > 1e-2


def _group_rows(site, j):
    """``[W_Q[i] | b_Q[i] for i in group j, W_K[j] | b_K[j]]`` and ``[W_V[j] | b_V[j], W_O[:, i]ᵀ …]``."""
    aug = lambda w, b: w if b is None else torch.cat([w, b[:, None]], 1)  # noqa: E731
    wq, bq = effective(site, "q")
    wk, bk = effective(site, "k")
    wv, bv = effective(site, "v")
    wo, _ = effective(site, "o")
    heads = [i for i in range(site.h) if i // site.n_rep == j]
    queries = [aug(wq[i], None if bq is None else bq[i]) for i in heads]
    qk = torch.cat(queries + [aug(wk[j], None if bk is None else bk[j])], 1)
    vo = torch.cat([aug(wv[j], None if bv is None else bv[j])] + [wo[:, i].T for i in heads], 1)
    return qk, vo


@pytest.mark.parametrize("section", SECTIONS)
@pytest.mark.parametrize(
    "cid", ["gpt", "gpt_rope_split_half_gqa", "gpt_rope_partial_split_half", "hf_llama", "hf_gpt2"]
)
def test_kept_residual_is_exactly_orthogonal(cases, cid, section):
    """residual='keep' (paper 000 Alg. 1 / SPD balancing): transformed copies differ, but only by
    an orthogonal factor per KV group (in the RoPE commutant for Q/K) — exactly Prop. 45's
    residual O(d_k) × O(d_v)."""
    case = cases[cid]
    a = canonicalize(case.model, section, residual="keep").model
    moved = gaugeopt.random_gauge_transform(case.copy(), ("qk", "vo", "perm"), torch.Generator().manual_seed(5))
    b = canonicalize(moved, section, residual="keep").model
    assert state_diff(a, b) > 1e-3  # the residual freedom is really there
    for sa, sb in zip(gaugeopt.find_attention(a), gaugeopt.find_attention(b)):
        rope_gens = commutant_basis(sa.rope, sa.d_k)[1:sa.rope.rotary_dim:2] if sa.rope.active else None
        for j in range(sa.h_kv):
            for xa, xb, rope in zip(_group_rows(sa, j), _group_rows(sb, j), (rope_gens, None)):
                omega = torch.linalg.lstsq(xa.T, xb.T).solution.T  # xb ≈ Ω xa
                eye = torch.eye(omega.shape[0], dtype=omega.dtype)
                assert float((omega @ omega.T - eye).abs().max()) <= 1e-10
                assert float((omega @ xa - xb).abs().max() / xb.abs().max()) <= 1e-10
                if rope is not None:
                    assert float((omega @ rope - rope @ omega).abs().max()) <= 1e-10


@pytest.mark.parametrize("cid", ["gpt", "gpt_rope_split_half_gqa", "hf_gpt2", "gpt_mqa"])
def test_head_order(cases, cid):
    """Groups, then heads within a group, by descending ‖W_Q[i]ᵀW_K[j]‖_F (formed densely here);
    for MHA in the QR section this is the paper's descending ‖W_K‖_F."""
    case = cases[cid]
    canon = canonicalize(case.model, "qr").model
    for site in gaugeopt.find_attention(canon):
        wq, _ = effective(site, "q")
        wk, _ = effective(site, "k")
        energy = [float((wq[i].T @ wk[i // site.n_rep]).norm() ** 2) for i in range(site.h)]
        groups = [sum(energy[j * site.n_rep:(j + 1) * site.n_rep]) for j in range(site.h_kv)]
        assert groups == sorted(groups, reverse=True)
        for j in range(site.h_kv):
            within = energy[j * site.n_rep:(j + 1) * site.n_rep]
            assert within == sorted(within, reverse=True)
        if site.n_rep == 1:
            knorm = [float(wk[j].norm()) for j in range(site.h_kv)]
            assert knorm == sorted(knorm, reverse=True)


def test_permutations_reported_and_respect_groups(cases):
    case = cases["gpt_rope_split_half_gqa"]
    moved = gaugeopt.random_gauge_transform(case.copy(), ("perm",), torch.Generator().manual_seed(1))
    report = canonicalize(moved, "qr")
    for site, kv, q in zip(gaugeopt.find_attention(moved), report.kv_perms, report.q_perms):
        assert sorted(q.tolist()) == list(range(site.h))
        assert torch.equal(q // site.n_rep, kv.repeat_interleave(site.n_rep))
    unsorted = canonicalize(moved, "qr", sort_heads=False)
    assert all(torch.equal(q, torch.arange(len(q))) for q in unsorted.q_perms)
    assert state_diff(unsorted.model, report.model) > 1e-2


def test_metrics_before_after_match_definitions():
    case = zoo.build("gpt_gqa", 3)
    report = canonicalize(case.model, "balanced")
    for model, metrics in ((case.model, report.before), (report.model, report.after)):
        expect = {"value_orthonormality": [], "qk_imbalance": [], "cond_q": [], "cond_k": []}
        for site in gaugeopt.find_attention(model):
            wq, _ = effective(site, "q")
            wk, _ = effective(site, "k")
            wv, _ = effective(site, "v")
            for j in range(site.h_kv):
                P = sum(wq[i] @ wq[i].T for i in range(site.h) if i // site.n_rep == j)
                R = wk[j] @ wk[j].T
                eye = torch.eye(site.d_v, dtype=P.dtype)
                expect["value_orthonormality"].append(float((wv[j] @ wv[j].T - eye).norm()))
                expect["qk_imbalance"].append(float((P - R).norm() / P.norm()))
                expect["cond_q"].append(float(torch.linalg.cond(P)))
                expect["cond_k"].append(float(torch.linalg.cond(R)))
        for k, v in expect.items():
            assert torch.allclose(getattr(metrics, k), torch.tensor(v, dtype=torch.float64), rtol=1e-8, atol=1e-12), k
    after, before = report.after.summary(), report.before.summary()
    assert before["value_orthonormality"][0] > 0.1 and after["value_orthonormality"][1] <= 1e-12
    assert before["qk_imbalance"][0] > 0.1 and after["qk_imbalance"][1] <= 1e-12  # no RoPE: P = R exactly
    assert torch.allclose(report.after.cond_q, report.after.cond_k)
    qr = canonicalize(case.model, "qr").after
    assert torch.allclose(qr.cond_q, torch.ones_like(qr.cond_q))


def test_lrm_fold_and_keep_multipliers(cases):
    case = cases["gpt+lrm"]
    moved = gaugeopt.random_gauge_transform(case.copy(), "all", torch.Generator().manual_seed(2))
    folded = canonicalize(moved, "qr").model
    mults = [p for n, p in folded.named_parameters() if "_mults" in n]
    assert mults and all(torch.equal(p, torch.ones_like(p)) for p in mults)
    kept = canonicalize(moved, "qr", fold_multipliers=False, sort_heads=False).model
    before = {n: p for n, p in moved.named_parameters() if "_mults" in n}
    after = dict(kept.named_parameters())
    assert all(torch.equal(p, after[n]) for n, p in before.items())  # multipliers untouched
    assert gaugeopt.relative_change(case.logits(), case.logits(kept)) <= 1e-10
    # the effective attention weights are canonical either way
    kept = canonicalize(moved, "qr", fold_multipliers=False).model
    assert any(not torch.equal(p, torch.ones_like(p)) for n, p in kept.named_parameters() if "_mults" in n)
    for sa, sb in zip(gaugeopt.find_attention(folded), gaugeopt.find_attention(kept)):
        for p in "qkvo":
            wa, ba = effective(sa, p)
            wb, bb = effective(sb, p)
            assert float((wa - wb).norm() / wa.norm()) <= 1e-10
    assert section_violation(kept, "qr") <= 1e-10


def test_inplace_and_copy(cases):
    case = cases["gpt"]
    snapshot = case.copy()
    report = canonicalize(case.model, "qr")
    assert report.model is not case.model and state_diff(case.model, snapshot) == 0.0
    target = case.copy()
    report = canonicalize(target, "qr", inplace=True)
    assert report.model is target and state_diff(target, snapshot) > 1e-2


def test_float32_model_keeps_dtype():
    case = zoo.build("gpt_rope_split_half_gqa", 1, dtype=torch.float32)
    canon = canonicalize(case.model, "qr").model
    assert all(p.dtype == torch.float32 for p in canon.parameters())
    assert gaugeopt.relative_change(case.logits(), case.logits(canon)) <= 1e-5
    assert section_residual(canon, "qr") <= 1e-5


def test_errors_name_the_problem(cases):
    case = cases["gpt"]
    with pytest.raises(gaugeopt.GaugeError, match="section='svd'"):
        canonicalize(case.model, "svd")
    with pytest.raises(gaugeopt.GaugeError, match="residual='drop'"):
        canonicalize(case.model, "qr", residual="drop")
    broken = case.copy()
    with torch.no_grad():
        site = gaugeopt.find_attention(broken)[1]
        w = site.q.weight.get()
        w[2, 0] = w[2, 1]  # head 2 of layer 1: two equal query rows, rank d_k - 1
    match = r"transformer\.h\.1\.attn: Q/K stacked W_Q is numerically rank deficient"
    with pytest.raises(gaugeopt.GaugeError, match=match):
        canonicalize(broken, "qr")


def test_margins_reported(cases):
    report = canonicalize(cases["gpt_rope_split_half_gqa"].model, "qr")
    assert set(report.margins) == {"spectral_gap", "sign_margin", "sort_gap"}
    assert all(0 < v < 1 for v in report.margins.values())
    kept = canonicalize(cases["gpt"].model, "qr", residual="keep")
    assert kept.margins["spectral_gap"] == float("inf") and kept.margins["sign_margin"] == float("inf")
