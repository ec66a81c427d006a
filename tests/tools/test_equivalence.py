"""Equivalence up to the attention gauge group (gaugeopt.tools.equivalence): true for gauge copies,
false for small non-gauge perturbations, distances checked against dense circuits."""

from __future__ import annotations


import pytest
import torch

import gaugeopt
import zoo
from gaugeopt.transforms import INVALID_KINDS, QK_NORM_INVALID_KINDS, SINK_INVALID_KINDS, permute_heads
from gaugeopt.tools.equivalence import compare, equivalent, spectral_fingerprint, match_heads
from model_tools_helpers import (
    CORE_CASES,
    CORE_IDS,
    attention_change,
    explicit_ov_form,
    explicit_qk_forms,
    gauge_kinds,
    perturb,
    state_diff,
)

TOL = 1e-10


@pytest.fixture(scope="module")
def cases():
    chosen = CORE_CASES + [("gpt_rope_partial_interleaved", False)]
    return {n + ("+lrm" if lrm else ""): zoo.build(n, 11, lrm=lrm) for n, lrm in chosen}


@pytest.mark.parametrize("cid", CORE_IDS + ["gpt_rope_partial_interleaved"])
def test_true_for_20_gauge_copies(cases, cid):
    case = cases[cid]
    g = torch.Generator().manual_seed(0)
    fp = spectral_fingerprint(case.model)
    for _ in range(20):
        moved = gaugeopt.random_gauge_transform(case.copy(), gauge_kinds(cid.endswith("+lrm")), g)
        assert state_diff(case.model, moved) > 1e-2
        report = compare(case.model, moved, TOL)
        assert report.equivalent, report.reason
        assert report.max_distance() <= 1e-12
        assert fp.distance(spectral_fingerprint(moved)) <= 1e-12


@pytest.mark.parametrize("cid", CORE_IDS + ["gpt_rope_partial_interleaved"])
def test_false_for_20_small_non_gauge_perturbations(cases, cid):
    """Each copy gets a generic direction of relative size 1e-6 on one tensor — an MLP weight
    (gauge-inert) or the query/value/output rows of one head (moving W_Q alone can never be a
    gauge move: that would also move W_K) — and then a random gauge transform on top."""
    case = cases[cid]
    g = torch.Generator().manual_seed(1)
    for k in range(20):
        moved = case.copy()
        perturb(moved, ("mlp", "q", "v", "o")[k % 4], g, rel=1e-6)
        assert 0 < state_diff(case.model, moved) <= 1.01e-6  # small relative to the weights
        change = max(gaugeopt.relative_change(case.logits(), case.logits(moved)), attention_change(case, moved))
        moved = gaugeopt.random_gauge_transform(moved, gauge_kinds(cid.endswith("+lrm")), g)
        report = compare(case.model, moved, TOL)
        assert not report.equivalent
        assert report.max_distance() > 100 * TOL  # far above tolerance, not a borderline call
        assert change > 1e-12  # the function moved too: not a hidden gauge direction


@pytest.mark.parametrize("kind", [k for k in INVALID_KINDS if k not in QK_NORM_INVALID_KINDS + SINK_INVALID_KINDS])  # QK-norm: test_qk_norm_tools.py
def test_invalid_gauge_controls_are_not_equivalent(kind):
    case = zoo.build("gpt_rope_partial_split_half", 2)
    moved = gaugeopt.invalid_gauge_transform(case.copy(), kind, torch.Generator().manual_seed(0))
    report = compare(case.model, moved, 1e-6)
    # V/O controls move W_O·b_V, which the output bias with the value bias folded in sees first
    caught_by = "attn.c_proj.bias differs" if kind in ("vo_mismatch", "value_bias_alone") else "circuits agree"
    assert not report.equivalent and caught_by in report.reason


def test_distances_equal_dense_circuit_distances(cases):
    """The Gram/QR distances equal ‖F_A − F_B‖ of densely formed (d+1)×(d+1) circuits, including
    the per-plane RoPE forms and the J-forms that a general GL(d_k) would break."""
    for cid in ("gpt_rope_split_half_gqa", "hf_gpt2", "gpt_rope_partial_interleaved"):
        a = cases[cid].model
        b = cases[cid].copy()
        perturb(b, "q", torch.Generator().manual_seed(3), rel=1e-3)
        perturb(b, "v", torch.Generator().manual_seed(4), rel=1e-3)
        report = compare(a, b, TOL)
        for sa, sb, m in zip(gaugeopt.find_attention(a), gaugeopt.find_attention(b), report.layers):
            assert torch.equal(m.q_perm, torch.arange(sa.h))  # small perturbations keep the identity matching
            heads = range(sa.h)
            pairs = [zip(explicit_qk_forms(sa, i), explicit_qk_forms(sb, i)) for i in heads]
            qk = [sum(float((fa - fb).square().sum()) for fa, fb in pair) for pair in pairs]
            ov = [float((explicit_ov_form(sa, i) - explicit_ov_form(sb, i)).square().sum()) for i in heads]
            sqk = (sum(float(f.square().sum()) for s in (sa, sb) for i in heads for f in explicit_qk_forms(s, i))
                   / (2 * sa.h)) ** 0.5
            sov = (sum(float(explicit_ov_form(s, i).square().sum()) for s in (sa, sb) for i in heads)
                   / (2 * sa.h)) ** 0.5
            assert m.qk == pytest.approx(max(qk) ** 0.5 / sqk, rel=1e-6)
            assert m.ov == pytest.approx(max(ov) ** 0.5 / sov, rel=1e-6)


def test_matching_recovers_a_known_permutation():
    case = zoo.build("gpt_gqa", 5)
    moved = case.copy()
    kv, q = torch.tensor([1, 0]), torch.tensor([3, 2, 0, 1])  # new head i = old head q[i]
    permute_heads(gaugeopt.find_attention(moved)[0], kv, q)
    sa, sb = gaugeopt.find_attention(case.model)[0], gaugeopt.find_attention(moved)[0]
    kv_found, q_found = match_heads(sa, sb)
    assert torch.equal(q_found, torch.argsort(q)) and torch.equal(kv_found, torch.argsort(kv))
    assert compare(case.model, moved, TOL).layers[0].q_perm.tolist() == torch.argsort(q).tolist()


def test_architecture_and_inert_differences():
    a, b = zoo.build("gpt", 0), zoo.build("gpt_gqa", 0)
    report = compare(a.model, b.model)
    assert not report.equivalent and "different architectures" in report.reason
    c = a.copy()
    with torch.no_grad():
        c.transformer.ln_f.weight[0] += 1e-7
    report = compare(a.model, c, TOL)
    assert not report.equivalent and "transformer.ln_f.weight" in report.reason
    assert equivalent(a.model, c, tol=1e-6)  # within a looser tolerance


def test_lrm_and_plain_model_compare_by_effective_weights():
    case = zoo.build("gpt", 6)
    lrm = gaugeopt.apply_lrm(case.copy())
    gaugeopt.random_gauge_transform(lrm, "all", torch.Generator().manual_seed(0))
    assert equivalent(case.model, lrm, TOL)


def test_bias_sectors_are_quotiented():
    """A key-bias shift (non-rotary channels) and a value-bias trade leave the function and the
    verdict alone; the same shift on RoPE-rotated channels, or a value bias moved without its
    output-bias compensation, changes both."""
    for name in ("gpt", "gpt_rope_partial_split_half", "hf_gpt2"):
        case = zoo.build(name, 7)
        for kinds in (("key_bias",), ("value_bias",), ("key_bias", "value_bias", "qk", "vo", "perm")):
            moved = gaugeopt.random_gauge_transform(case.copy(), kinds, torch.Generator().manual_seed(1))
            assert gaugeopt.relative_change(case.logits(), case.logits(moved)) <= 1e-12
            report = compare(case.model, moved, TOL)
            assert report.equivalent, (name, kinds, report.reason)
            assert spectral_fingerprint(moved).digest() == spectral_fingerprint(case.model).digest()
    case = zoo.build("gpt_rope_partial_split_half", 7)
    for kind in ("key_bias_rope", "value_bias_alone"):
        moved = gaugeopt.invalid_gauge_transform(case.copy(), kind, torch.Generator().manual_seed(1))
        assert gaugeopt.relative_change(case.logits(), case.logits(moved)) > 1e-3
        assert not equivalent(case.model, moved, 1e-6), kind


def test_fingerprint_is_invariant_and_informative(cases):
    case = cases["gpt_rope_split_half_gqa"]
    fp = spectral_fingerprint(case.model)
    moved = gaugeopt.random_gauge_transform(case.copy(), ("qk", "vo", "perm"), torch.Generator().manual_seed(2))
    assert spectral_fingerprint(moved).digest() == fp.digest()
    assert len(fp.spectra) == 2 and fp.spectra[0].shape == (4, 16)
    other = case.copy()
    perturb(other, "o", torch.Generator().manual_seed(0), rel=1e-3)
    assert fp.distance(spectral_fingerprint(other)) > 1e-6 and spectral_fingerprint(other).digest() != fp.digest()
    assert fp.distance(spectral_fingerprint(cases["gpt"].model)) == float("inf")


def test_tolerance_is_validated():
    case = zoo.build("gpt", 0)
    with pytest.raises(gaugeopt.GaugeError, match="tol=-1"):
        compare(case.model, case.model, -1)
