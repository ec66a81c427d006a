"""Gauge-aligned merging (gaugeopt.tools.merging): merging a model with its gauge copy returns the model's
function while naive averaging does not; Hungarian matching and Procrustes checked on their own."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import gaugeopt
import zoo
from gaugeopt.transforms import act_qk, act_vo, permute_heads
from gaugeopt.tools.merging import align, attention_distance, average, merge
from gaugeopt.records.rope import commutant_basis
from model_tools_helpers import CORE_CASES, CORE_IDS, attention_change, gauge_kinds, perturb


@pytest.fixture(scope="module")
def cases():
    return {n + ("+lrm" if lrm else ""): zoo.build(n, 21, lrm=lrm) for n, lrm in CORE_CASES}


@pytest.mark.parametrize("cid", CORE_IDS)
def test_merge_with_gauge_copy_returns_the_function_naive_average_does_not(cases, cid):
    case = cases[cid]
    kinds = gauge_kinds(cid.endswith("+lrm"))
    copy_b = gaugeopt.random_gauge_transform(case.copy(), kinds, torch.Generator().manual_seed(0))
    for residual, sort in (("fix", True), ("keep", False)):  # keep/no sort: Hungarian and Procrustes do the work
        result = merge(case.model, copy_b, residual=residual, sort_heads=sort)
        assert gaugeopt.relative_change(case.logits(), case.logits(result.merged)) <= 1e-10
        assert attention_change(case, result.merged) <= 1e-10
        assert gaugeopt.relative_change(case.logits(), case.logits(result.aligned)) <= 1e-10
        assert max(m.procrustes for m in result.layers) <= 1e-12
    assert min(m.canonical for m in result.layers) > 0.1  # without alignment the canonical forms differ
    naive = average(case.model, copy_b)
    assert gaugeopt.relative_change(case.logits(), case.logits(naive)) > 1e-2
    assert attention_change(case, naive) > 1e-2


def test_hungarian_recovers_a_known_permutation(cases):
    case = cases["gpt_rope_split_half_gqa"]
    b = case.copy()
    perms = [(torch.tensor([1, 0]), torch.tensor([2, 3, 1, 0])), (torch.tensor([0, 1]), torch.tensor([1, 0, 2, 3]))]
    for site, (kv, q) in zip(gaugeopt.find_attention(b), perms):
        permute_heads(site, kv, q)
    result = align(case.model, b, residual="keep", sort_heads=False)
    for layer, (kv, q) in zip(result.layers, perms):
        assert torch.equal(layer.q_perm, torch.argsort(q)) and torch.equal(layer.kv_perm, torch.argsort(kv))
        assert layer.matched <= 1e-12 < layer.canonical


def _random_commutant_rotation(site, scale, gen):
    """exp of a small skew element of the commutant ∩ so(d_k), one per KV group."""
    basis = commutant_basis(site.rope, site.d_k)
    skew = basis[(basis + basis.mT).flatten(1).norm(dim=1) < 1e-12]  # the antisymmetric elements
    coef = torch.randn(site.h_kv, len(skew), generator=gen, dtype=torch.float64) * scale
    return torch.linalg.matrix_exp(torch.einsum("gk,kab->gab", coef, skew))


@pytest.mark.parametrize("cid", ["gpt", "gpt_rope_split_half_gqa"])
def test_procrustes_is_optimal_for_noisy_copies(cases, cid):
    """B = gauge copy of (A + noise): after alignment B sits at distance O(noise) from A, and no
    small orthogonal commutant move of B's Q/K (or V/O) gets closer (first-order optimality)."""
    case = cases[cid]
    noisy = case.copy()
    g = torch.Generator().manual_seed(3)
    for which in ("q", "v", "o"):
        perturb(noisy, which, g, rel=1e-3)
    noisy = gaugeopt.random_gauge_transform(noisy, ("qk", "vo", "perm"), g)
    result = align(case.model, noisy, residual="keep")
    sites_a = gaugeopt.find_attention(result.reference)
    for index, (layer, sa) in enumerate(zip(result.layers, sites_a)):
        assert layer.procrustes < 1e-2 < layer.canonical
        best = attention_distance(sa, gaugeopt.find_attention(result.aligned)[index])
        assert best == pytest.approx(layer.procrustes)
        for _ in range(6):
            moved_qk = copy.deepcopy(result.aligned)
            site = gaugeopt.find_attention(moved_qk)[index]
            act_qk(site, _random_commutant_rotation(site, 1e-3, g))
            assert attention_distance(sa, site) >= best
            moved_vo = copy.deepcopy(result.aligned)
            site = gaugeopt.find_attention(moved_vo)[index]
            skew = torch.randn(site.h_kv, site.d_v, site.d_v, generator=g, dtype=torch.float64) * 1e-3
            act_vo(site, torch.linalg.matrix_exp(skew - skew.mT))
            assert attention_distance(sa, site) >= best


def test_alpha_endpoints_and_errors(cases):
    a, other = cases["gpt"], zoo.build("gpt", 99)
    result = merge(a.model, other.model, alpha=1.0)
    assert gaugeopt.relative_change(a.logits(other.model), a.logits(result.merged)) <= 1e-10
    result = merge(a.model, other.model, alpha=0.0)
    assert gaugeopt.relative_change(a.logits(), a.logits(result.merged)) <= 1e-10
    with pytest.raises(gaugeopt.GaugeError, match="alpha=1.5"):
        merge(a.model, other.model, alpha=1.5)
    with pytest.raises(gaugeopt.GaugeError, match="different attention layouts"):
        merge(a.model, zoo.build("gpt_gqa", 0).model)


def test_missing_scipy_gives_an_install_hint(cases, monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)
    with pytest.raises(gaugeopt.GaugeError, match="pip install scipy"):
        merge(cases["gpt"].model, cases["gpt"].model)
