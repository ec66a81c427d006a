"""Gauge actions: every valid action preserves the function to rounding (float64), every
invalid control changes it, on every adapter (plain and with learnable multipliers)."""


import pytest
import torch

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.transforms import (
    BIAS_INVALID_KINDS,
    INVALID_KINDS,
    QK_NORM_INVALID_KINDS,
    SINK_INVALID_KINDS,
    applicable_invalid_kinds,
    act_qk,
    permute_heads,
    scale_qk_multipliers,
)
from gaugeopt.linalg import random_well_conditioned

VALID_TOL = 1e-12
INVALID_MIN = 1e-3


def _attention_change(case, moved) -> float:
    """Largest relative change of any attention layer's output: HF Llama-style models round the
    residual stream to float32 in their RMSNorm, so logits alone would hide a 1e-9 error."""
    a = zoo.attention_io(case, case.model)
    b = zoo.attention_io(case, moved)
    return max(gaugeopt.relative_change(x[2], y[2]) for x, y in zip(a, b))


def _kinds_for(lrm: bool, model):
    kinds = ["qk", "vo", "perm"]
    bias = sorted({k for s in gaugeopt.find_attention(model) for k in s.bias_kinds})  # the bias sectors it has
    return kinds + bias + (["lrm_qk", "lrm_vo", "lrm_internal"] if lrm else [])


@pytest.mark.parametrize("name, lrm", zoo.CASES, ids=zoo.CASE_IDS)
def test_each_valid_action_preserves_function(name, lrm):
    case = zoo.build(name, lrm=lrm)
    ref = case.logits()
    for kind in _kinds_for(lrm, case.model):
        moved = gaugeopt.random_gauge_transform(case.copy(), (kind,), generator=torch.Generator().manual_seed(7))
        changed = [n for (n, p), (_, q) in zip(case.model.named_parameters(), moved.named_parameters()) if not torch.equal(p, q)]
        assert changed, f"{kind} changed no parameter"  # the action really acted
        assert gaugeopt.relative_change(ref, case.logits(moved)) <= VALID_TOL, kind
        assert _attention_change(case, moved) <= VALID_TOL, kind


@pytest.mark.parametrize("name, lrm", zoo.CASES, ids=zoo.CASE_IDS)
def test_composed_valid_actions_preserve_function(name, lrm):
    case = zoo.build(name, lrm=lrm)
    moved = gaugeopt.random_gauge_transform(case.copy(), "all", generator=torch.Generator().manual_seed(3))
    assert gaugeopt.relative_change(case.logits(), case.logits(moved)) <= VALID_TOL
    assert _attention_change(case, moved) <= VALID_TOL


@pytest.mark.parametrize("name, lrm", zoo.CASES, ids=zoo.CASE_IDS)
def test_invalid_controls_change_function(name, lrm):
    case = zoo.build(name, lrm=lrm)
    sites = gaugeopt.find_attention(case.model)
    ref = case.logits()
    tried = []
    for kind in INVALID_KINDS:
        if kind == "gl_under_rope" and not sites[0].rope.active:
            continue
        if kind == "cross_head" and sites[0].h_kv < 2:
            continue
        if kind in QK_NORM_INVALID_KINDS + SINK_INVALID_KINDS or (
                kind in BIAS_INVALID_KINDS and kind not in applicable_invalid_kinds(sites)):
            with pytest.raises(GaugeError, match="needs"):  # QK-norm, sinks: test_qk_norm.py, test_recent_families.py
                gaugeopt.invalid_gauge_transform(case.copy(), kind)
            continue
        moved = gaugeopt.invalid_gauge_transform(case.copy(), kind, generator=torch.Generator().manual_seed(5))
        assert gaugeopt.relative_change(ref, case.logits(moved)) >= INVALID_MIN, kind
        tried.append(kind)
    assert {"asymmetric_qk", "wrong_inverse", "vo_mismatch"} <= set(tried)
    if sites[0].rope.active:
        assert "gl_under_rope" in tried
    if sites[0].v.bias is not None:
        assert "value_bias_alone" in tried
    if sites[0].rope.active and sites[0].k.bias is not None:
        assert "key_bias_rope" in tried


def test_rope_commutant_check_refuses_general_matrix():
    case = zoo.build("gpt_rope_interleaved")
    site = gaugeopt.find_attention(case.model)[0]
    with pytest.raises(GaugeError, match="does not commute with the RoPE rotations"):
        act_qk(site, random_well_conditioned(site.h_kv, site.d_k))


def test_partial_rotary_leaves_full_gl_on_the_rest():
    """With rotary_dim=4 < d_k=8 a general GL(4) on coordinates 4..7 is a symmetry."""
    case = zoo.build("gpt_rope_partial_interleaved")
    site = gaugeopt.find_attention(case.model)[0]
    A = torch.eye(site.d_k, dtype=torch.float64).repeat(site.h_kv, 1, 1)
    A[:, 4:, 4:] = random_well_conditioned(site.h_kv, 4, generator=torch.Generator().manual_seed(0))
    moved = case.copy()
    act_qk(gaugeopt.find_attention(moved)[0], A)
    assert gaugeopt.relative_change(case.logits(), case.logits(moved)) <= VALID_TOL
    # ... but not on the rotated ones
    A[:, :4, :4] = random_well_conditioned(site.h_kv, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(GaugeError):
        act_qk(site, A)


def test_per_channel_multiplier_scale_under_rope_is_refused():
    case = zoo.build("gpt_rope_split_half_gqa", lrm=True)
    site = gaugeopt.find_attention(case.model)[0]
    delta = torch.ones(site.h_kv, site.d_k, dtype=torch.float64)
    delta[:, 0] = 2.0  # plane (0, 4) gets different scales on its two coordinates
    with pytest.raises(GaugeError, match="RoPE plane"):
        scale_qk_multipliers(site, delta)
    # the same scale on both coordinates of the plane is a symmetry
    delta[:, 4] = 2.0
    moved = case.copy()
    scale_qk_multipliers(gaugeopt.find_attention(moved)[0], delta)
    assert gaugeopt.relative_change(case.logits(), case.logits(moved)) <= VALID_TOL


def test_permutation_must_keep_query_heads_with_their_group():
    case = zoo.build("gpt_gqa")  # h=4, h_kv=2: groups {0,1}, {2,3}
    site = gaugeopt.find_attention(case.model)[0]
    with pytest.raises(GaugeError, match="keep each query head with its KV group"):
        permute_heads(site, torch.tensor([1, 0]), torch.tensor([0, 1, 2, 3]))
    moved = case.copy()
    permute_heads(gaugeopt.find_attention(moved)[0], torch.tensor([1, 0]), torch.tensor([3, 2, 0, 1]))
    assert gaugeopt.relative_change(case.logits(), case.logits(moved)) <= VALID_TOL
    w_old = site.q.weight.get()
    w_new = gaugeopt.find_attention(moved)[0].q.weight.get()
    assert torch.equal(w_new[0], w_old[3]) and torch.equal(w_new[2], w_old[0])


def test_lrm_kinds_need_multipliers():
    case = zoo.build("gpt")
    with pytest.raises(GaugeError, match="multipliers"):
        gaugeopt.random_gauge_transform(case.copy(), ("lrm_qk",))
    with pytest.raises(GaugeError, match="unknown kinds"):
        gaugeopt.random_gauge_transform(case.copy(), ("rotate",))


def test_float32_valid_actions_stay_at_rounding_level():
    case = zoo.build("gpt_rope_split_half_gqa", lrm=True, dtype=torch.float32)
    moved = gaugeopt.random_gauge_transform(case.copy(), "all", generator=torch.Generator().manual_seed(0))
    assert gaugeopt.relative_change(case.logits(), case.logits(moved)) < 1e-5
