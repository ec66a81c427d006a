"""Multi-head latent attention (docs/mla.md): Hugging Face DeepSeek-V2/V3, litgpt and torchtitan.

Every valid action of every sector keeps the logits and every attention output to ≤ 1e-12 (float64,
generic random weights, the implementations' float32 steps computed in float64: mla_helpers.float64_steps);
every negative control changes both by ≥ 1e-3; the certificate passes on the models as built and fails on
a wrong record; gauge_fix, projection and canonical forms keep the function; the counts equal the
measured nullity of tiny models.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gaugeopt
import mla_helpers as H
from gaugeopt import GaugeError
from gaugeopt.projection.projector import GaugeProjector
from gaugeopt.transforms import LATENT_INVALID_KINDS, applicable_invalid_kinds
from gaugeopt.trust.proof import CallRecorder, certify_calls, certify_with
from gaugeopt.records.rope import RopeSpec

VALID_TOL = 1e-12
INVALID_MIN = 1e-3
MLA_KINDS = ("qk", "qk_rope", "vo", "perm", "latent_rotation", "latent_gain")


@pytest.fixture(scope="module")
def cases():
    built: dict = {}

    def get(name):
        if name not in built:
            built[name] = H.build(name)
        return built[name]

    return get


# ---------------------------------------------------------------------- the record
@pytest.mark.parametrize("name", H.NAMES)
def test_record_of_each_implementation(name, cases):
    """The no-RoPE part as the site (d_k = qk_nope_head_dim, no RoPE, one key per head), the RoPE part as a
    multi-query pair (one group, every head against the shared key), the latents; all views of the parameters."""
    case = cases(name)
    _, kind, rope_kind, q_latent = H.FAMILY[name]
    sites = gaugeopt.find_attention(case.model)
    assert len(sites) == 2 and all(s.verified and s.kind == kind for s in sites)
    s = sites[0]
    lat = s.latent
    assert (s.h, s.h_kv, s.d_k, s.d_v, s.rope.active) == (4, 4, 8, 6, False)
    assert (lat.rope.kind, lat.rope.rotary_dim, lat.r) == (rope_kind, 4, 4)
    assert (lat.q_latent is not None) == q_latent and lat.kv_latent.width == 12
    assert s.qk_kinds == ("qk", "qk_rope")
    rope = s.pair("qk_rope")
    assert (rope.groups, rope.a.repeat, rope.a.heads, rope.b.heads, rope.width) == (1, 4, 4, 1, 4)
    assert lat.q_rope.shape == (4, 4, 16 if q_latent else 32) and lat.k_rope.shape == (1, 4, 32)
    for _, ref in s.refs():  # every canonical view aliases its parameter
        view = ref.get()
        assert view.untyped_storage().data_ptr() == ref.param.untyped_storage().data_ptr()
    w = lat.kv_latent.down.param
    assert lat.k_rope.get()[0, 0].data_ptr() == w[12].data_ptr()  # the shared key: the rows after the latent's 12
    with pytest.raises(GaugeError, match="no 'qk_rope' pair"):
        gaugeopt.find_attention(__import__("zoo").build("gpt").model)[0].pair("qk_rope")


# ---------------------------------------------------------------------- valid actions and controls
@pytest.mark.parametrize("name", H.NAMES)
def test_every_valid_action_is_exact(name, cases):
    case = cases(name)
    sites = gaugeopt.find_attention(case.model)
    kinds = MLA_KINDS + sites[0].bias_kinds
    if name.startswith("litgpt_mla") and name != "litgpt_mla_split_half":
        assert set(sites[0].bias_kinds) == {"key_bias", "value_bias"}  # biases on kv_b_proj and proj
    with H.float64_steps():
        y0, a0 = H.attention_outputs(case, case.model)
        for k in kinds + ("all",):
            moved = gaugeopt.random_gauge_transform(case.copy(), k if k == "all" else (k,), generator=7)
            assert any(not torch.equal(p, q) for p, q in zip(case.model.parameters(), moved.parameters())), k
            out, att = H.changes(case, y0, a0, moved)
            print(f"{name} {k}: logits {out:.1e}, attention {att:.1e}")
            assert out <= VALID_TOL and att <= VALID_TOL, (k, out, att)


@pytest.mark.parametrize("name", H.NAMES)
def test_every_control_changes_the_function(name, cases):
    case = cases(name)
    sites = gaugeopt.find_attention(case.model)
    kinds = applicable_invalid_kinds(sites)
    plain = {"asymmetric_qk", "wrong_inverse", "vo_mismatch", "cross_head", "gl_under_rope"}
    assert set(LATENT_INVALID_KINDS) | plain <= set(kinds)
    with H.float64_steps():
        y0, a0 = H.attention_outputs(case, case.model)
        for k in kinds:
            moved = gaugeopt.invalid_gauge_transform(case.copy(), k, generator=5)
            out, att = H.changes(case, y0, a0, moved)
            print(f"{name} {k}: logits {out:.2e}, attention {att:.2e}")
            assert out >= INVALID_MIN and att >= INVALID_MIN, (k, out, att)


@pytest.mark.parametrize("name", ["hf_deepseek_v3", "hf_deepseek_v2", "litgpt_mla", "torchtitan_mla"])
def test_float32_steps_are_named_and_bound_the_error(name, cases):
    """As shipped, each implementation rounds part of the layer through float32; the record names the step,
    and the sectors behind it are exact only to that rounding (here ≤ 1e-6, > 1e-12)."""
    case = cases(name)
    site = gaugeopt.find_attention(case.model)[0]
    expected = {"hf": "latent RMSNorms in float32", "litgpt": "latent RMSNorms in float32", "torchtitan": "RoPE in float32"}
    assert expected[name.split("_")[0]] in site.float32_steps
    if name == "hf_deepseek_v2":
        assert "RoPE in float32" in site.float32_steps
    kind = "qk_rope" if name.startswith(("torchtitan", "hf_deepseek_v2")) else "latent_rotation"
    y0, a0 = H.attention_outputs(case, case.model)
    out, att = H.changes(case, y0, a0, gaugeopt.random_gauge_transform(case.copy(), (kind,), generator=7))
    print(f"{name} {kind} as shipped: logits {out:.1e}, attention {att:.1e}")
    assert 1e-12 < att <= 1e-6 and out <= 1e-6


def test_kinds_a_plain_site_lacks_are_refused():
    case = __import__("zoo").build("gpt_rope_interleaved")
    for kind in ("qk_rope", "latent_rotation", "latent_gain"):
        with pytest.raises(GaugeError, match="not multi-head latent attention"):
            gaugeopt.random_gauge_transform(case.copy(), (kind,))
    with pytest.raises(GaugeError, match="needs multi-head latent attention"):
        gaugeopt.invalid_gauge_transform(case.copy(), "latent_gl")


def test_actions_refuse_what_is_not_a_symmetry(cases):
    from gaugeopt.linalg import random_well_conditioned
    from gaugeopt.records.latent import act_qk_rope, rotate_latent

    site = gaugeopt.find_attention(cases("hf_deepseek_v3").copy())[0]
    with pytest.raises(GaugeError, match="does not commute with the RoPE rotations of the shared key"):
        act_qk_rope(site, random_well_conditioned(1, 4))
    with pytest.raises(GaugeError, match="not orthogonal .* commutes with rotations only"):
        rotate_latent(site, "kv", random_well_conditioned(1, 12)[0])


# ---------------------------------------------------------------------- the certificate
@pytest.mark.parametrize("name", H.NAMES)
def test_certificate_passes_as_built(name):
    """On the model as a user builds it (float32, the library's init): every claimed sector with power."""
    model, x, forward = H.raw(name)
    report = certify_with(model.eval(), lambda m: forward(m, x))
    sites = gaugeopt.find_attention(model)
    for layer, site in zip(report.layers, sites):
        assert set(MLA_KINDS) | set(site.bias_kinds) == set(layer.sectors)
        assert layer.rerun_change is not None and layer.rerun_change < 1e-4
        assert layer.sectors["perm"].control_kind == "perm_without_rope"
        assert layer.sectors["latent_rotation"].control_kind == "latent_gl"
    print(f"{name}: worst valid {report.worst_valid:.1e}, weakest control {report.weakest_control:.1e}")
    assert report.worst_valid <= 1e-6 and report.weakest_control >= INVALID_MIN


def _calls(case):
    sites = gaugeopt.find_attention(case.model)
    with CallRecorder(sites) as rec, torch.no_grad():
        case.forward(case.model)
    return sites, rec.calls


@pytest.mark.parametrize("name", ["hf_deepseek_v3", "litgpt_mla_split_half"])
def test_certificate_fails_on_a_wrong_record(name, cases):
    """The certificate (float64 reruns) of the true record is at rounding level; records with the RoPE planes
    of the other layout, the shared key read from the wrong rows, or no RoPE part fail, naming the sector."""
    case = cases(name)
    with H.float64_steps():
        sites, calls = _calls(case)
        assert certify_calls(sites, calls).worst_valid <= 1e-12
    sites, calls = _calls(case)
    s = sites[0]
    lat = s.latent
    other = "split_half" if lat.rope.kind == "interleaved" else "interleaved"
    flipped = dataclasses.replace(s, latent=dataclasses.replace(lat, rope=RopeSpec(other, lat.r)))
    wrong_rows = dataclasses.replace(lat.k_rope, index=slice(0, lat.r))  # the latent's first rows, not the key's
    shifted = dataclasses.replace(s, latent=dataclasses.replace(lat, k_rope=wrong_rows))
    for wrong, sector in ((flipped, "qk_rope"), (shifted, "qk_rope")):
        with pytest.raises(GaugeError, match=f"sector {sector}"):
            certify_calls([wrong], calls)


# ---------------------------------------------------------------------- GaugeFix
def _imbalance(model, seed=0):
    from gaugeopt.transforms import apply_valid

    g = torch.Generator().manual_seed(seed)
    for site in gaugeopt.find_attention(model):
        for kind in ("qk", "qk_rope", "vo"):
            apply_valid(site, kind, g, log_scale=1.5)


@pytest.mark.parametrize("name", ["hf_deepseek_v3", "hf_deepseek_v2_lite", "litgpt_mla", "torchtitan_mla"])
def test_gauge_fix_balances_both_parts_and_keeps_the_function(name, cases):
    """Both Q/K pairs (per head without RoPE, per plane across heads with it) and V/O are balanced; the
    function does not move; the AdamW state of every rescaled tensor is transported."""
    case = cases(name)
    model = case.copy()
    _imbalance(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with H.float64_steps():
        loss = case.forward(model).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        y0, a0 = H.attention_outputs(case, model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
        report = gaugeopt.gauge_fix(model, opt, vo=True)
        out, att = H.changes(case, y0, a0, model)
    kinds = {(p.kind, p.granularity) for p in report.pairs}
    assert kinds == {("qk", "head"), ("qk_rope", "plane"), ("vo", "head")}
    print(f"{name}: drift {report.max_drift_before:.2f} -> {report.max_drift_after:.1e}; logits {out:.1e}, attention {att:.1e}")
    assert report.max_drift_before > 0.5 and report.max_drift_after <= 1e-9
    assert out <= VALID_TOL and att <= VALID_TOL
    assert gaugeopt.qk_drift(model) <= 1e-9
    for n, p in model.named_parameters():  # the state follows its parameter: exp_avg / s where p ← s·p
        changed = ~torch.isclose(p.detach(), before[n], rtol=0, atol=0)
        if bool(changed.any()):
            s = p.detach()[changed] / before[n][changed]
            torch.testing.assert_close(opt.state[p]["exp_avg"][changed], state[n][changed] / s, rtol=1e-12, atol=1e-300)


# ---------------------------------------------------------------------- projection
@pytest.mark.parametrize("name", ["hf_deepseek_v3_split_half_bias", "litgpt_mla", "torchtitan_mla_cossin_no_q_latent"])
def test_projection_equals_least_squares_over_independent_generators(name, cases):
    """Each sector's vertical part equals least squares over generators built independently (complex-step
    derivatives of the finite actions, projection_helpers); the loss gradient is horizontal."""
    import projection_helpers as P

    model = cases(name).model
    proj = GaugeProjector(model, "all")
    expect = ("qk", "vo", "qk_rope") + (("key_bias", "value_bias") if name == "litgpt_mla" else ())
    assert set(proj.sectors) == set(expect)
    names, shapes = [n for n, _ in model.named_parameters()], {n: p.shape for n, p in model.named_parameters()}
    u = P.random_field(model, seed=1)
    uf = P.flatten(model, u, names, shapes)
    first = gaugeopt.find_attention(model)[0].name
    for sector in ("qk", "vo", "qk_rope"):  # layer 0; its first and last head (heads touch disjoint entries)
        imgs = P.generator_images(model, sector, prefix=first, groups="ends")
        A = np.stack([P.flatten(model, img, names, shapes) for _, img in imgs], 1)
        rows = np.nonzero(np.abs(A).max(1) > 0)[0]
        ref, rank = P.ls_vertical(A[rows], uf[rows])
        ours = P.flatten(model, proj.vertical(u, sectors=(sector,)), names, shapes)[rows]
        print(f"{name} {sector}: rank {rank}, |ours - ref| / |ref| {np.linalg.norm(ours - ref) / np.linalg.norm(ref):.1e}")
        assert rank == A.shape[1] == {"qk": 2 * 64, "vo": 2 * 36, "qk_rope": 4}[sector]
        assert np.linalg.norm(ours - ref) <= 1e-12 * np.linalg.norm(ref)
    case = cases(name)
    model.zero_grad()
    with H.float64_steps():
        logits = case.forward(model)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), case.inputs.roll(-1, 1).reshape(-1)).backward()
    grad = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert gaugeopt.vertical_fraction(model, grad, projector=proj) <= 1e-12
    assert gaugeopt.vertical_fraction(model, u, projector=proj) > 1e-3
    assert gaugeopt.vertical_fraction(model, proj.project(u), projector=proj) <= 1e-12


@pytest.mark.parametrize("name", ["hf_deepseek_v3", "litgpt_mla"])
def test_gauge_projected_step_is_horizontal_and_removes_only_directions_that_keep_the_function(name, cases):
    """GaugeOptimizer(AdamW): every applied update is horizontal; what it removed from AdamW's update is
    vertical — moving along it changes the logits only at second order (first-order change ≤ 1e-12)."""
    case = cases(name)
    model = case.copy().train()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = gaugeopt.GaugeOptimizer(inner, model, sectors="all")
    plain_model = case.copy().train()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1)
    with H.float64_steps():
        for step in range(2):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            for m, o in ((model, opt), (plain_model, plain)):
                logits = case.forward(m)
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), case.inputs.roll(-1, 1).reshape(-1)).backward()
                o.step()
                o.zero_grad()
            update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
            assert gaugeopt.vertical_fraction(model, update, at=before) <= 1e-12
        assert opt.last_vertical_fraction > 1e-3  # AdamW's update had a vertical part
        # the difference between the plain and the projected update at the same point is a sum of generators
        at = {n: p.detach().clone() for n, p in model.named_parameters()}
        removed = {n: p.detach() - at[n] for n, p in plain_model.named_parameters()}
        hor = GaugeProjector(model, "all").project(removed, at=at)
        vert = tuple(removed[n] - hor[n] for n in at)
        point = tuple(at.values())
        model.eval()
        _, along_vert = torch.autograd.functional.jvp(lambda *f: _logits_with(case, model, f), point, vert)
        _, along_all = torch.autograd.functional.jvp(lambda *f: _logits_with(case, model, f), point,
                                                     tuple(removed.values()))
    ratio = float(along_vert.norm() / along_all.norm())
    print(f"{name}: first-order logit change along the removed part / along AdamW's update: {ratio:.1e}")
    assert ratio <= 1e-12


def _logits_with(case, model, flat):
    """The case's logits with the parameters replaced by ``flat`` (in ``named_parameters`` order)."""
    params = dict(zip((n for n, _ in model.named_parameters()), flat))
    if case.name.startswith("hf_"):
        return torch.func.functional_call(model, params, (), {"input_ids": case.inputs, "use_cache": False}).logits
    return torch.func.functional_call(model, params, (case.inputs,))


# ---------------------------------------------------------------------- counting and the flat-direction meter
def test_counts_from_models_and_configs(cases):
    """Per layer ``h·n² + r + h·d_v²`` (wang) plus the latents' ``L(L−1)/2 + L`` (complete), from a model and
    from its config alike; DeepSeek-V3-671B's config (wang): 61·(128·128² + 64 + 128·128²) = 255,856,448."""
    model = cases("hf_deepseek_v3").model
    per = gaugeopt.gauge_dimension(model, per_symmetry=True)
    assert per == {"qk": 2 * 4 * 8**2, "qk_rope": 2 * 4, "vo": 2 * 4 * 6**2}
    assert gaugeopt.gauge_dimension(model.config, per_symmetry=True) == per
    lite = cases("hf_deepseek_v2_lite").model
    assert gaugeopt.gauge_dimension(lite.config) == gaugeopt.gauge_dimension(lite) == sum(per.values())
    v3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
          "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
          "v_head_dim": 128, "vocab_size": 129280, "intermediate_size": 18432, "first_k_dense_replace": 3}
    assert gaugeopt.gauge_dimension(v3) == 61 * (128 * 128**2 + 64 + 128 * 128**2) == 255_856_448
    assert gaugeopt.gauge_dimension(v3, "van_nierop", per_symmetry=True)["qk"] == 61 * 128 * (128 + 64) ** 2
    with pytest.raises(GaugeError, match="routes layers 3..60 to experts"):
        gaugeopt.gauge_dimension(v3, "complete")
    dense = {**v3, "first_k_dense_replace": 61}
    c = gaugeopt.gauge_dimension(dense, "complete", per_symmetry=True)
    d = 7168
    assert c["latent_rotation"] == 61 * (1536 * 1535 // 2 + 512 * 511 // 2) and c["latent_gain"] == 61 * (1536 + 512)
    assert c["norm_gain"] == 61 * 2 * d + d and c["residual_rotation"] == d * (d - 1) // 2 and c["mlp_scale"] == 61 * 18432
    with pytest.raises(GaugeError, match="DeepseekV3MoE"):  # the tiny model's second layer is routed
        gaugeopt.gauge_dimension(model, "complete")


@pytest.mark.parametrize("name", ["hf_deepseek_v3_bias", "hf_deepseek_v2_lite"])
def test_nullity_equals_complete_count(name):
    """The logits' Jacobian of a tiny dense DeepSeek has exactly as many null directions as the complete count,
    all of them inside the span of the exact sectors (remainder 0), with a clear gap."""
    from gaugeopt.flat.meter import flat_directions

    model, x = H.flat_model(name)
    with H.float64_steps():
        rep = flat_directions(model, x, progress=False)
    counts = gaugeopt.gauge_dimension(model, "complete", per_symmetry=True)
    print(f"\n{name}: nullity {rep.nullity}, complete {sum(counts.values())} {counts}, gap x{rep.gap:.1e}")
    print(rep.table())
    assert rep.nullity == sum(counts.values())
    assert not rep.unused and rep.remainder == 0 and rep.sectors[-1].cum_dim == rep.nullity
    assert rep.gap > 1e3 and rep.sigma_null < 1e-11
    assert {"qk_rope", "latent_rotation", "latent_gain"} <= {r.name for r in rep.sectors}
    assert all(r.in_null == r.dim and r.finite <= 1e-12 for r in rep.sectors)
    assert not [r.name for r in rep.near_flat if r.expected]


# ---------------------------------------------------------------------- canonical forms
@pytest.mark.parametrize("name", ["hf_deepseek_v3", "litgpt_mla", "torchtitan_mla_cossin_no_q_latent"])
@pytest.mark.parametrize("section", ["qr", "balanced"])
def test_canonical_form_is_a_gauge_invariant(name, section, cases):
    """The canonical model computes the same function, satisfies its section's equations, and gauge copies
    of the model (every sector, head permutations included) canonicalise to the same parameters."""
    from gaugeopt.tools.canonical import canonicalize, section_residual

    case = cases(name)
    with H.float64_steps():
        y0, a0 = H.attention_outputs(case, case.model)
        rep = canonicalize(case.model, section)
        out, att = H.changes(case, y0, a0, rep.model)
        assert out <= 1e-12 and att <= 1e-12
        assert section_residual(rep.model, section) <= 1e-12
        moved = gaugeopt.random_gauge_transform(case.copy(), "all", generator=11)
        again = canonicalize(moved, section).model
    diff = max(float((p - q).detach().abs().max() / p.detach().abs().max().clamp_min(1e-300))
               for p, q in zip(rep.model.parameters(), again.parameters()))
    print(f"{name} {section}: function {out:.1e}/{att:.1e}, gauge copy differs by {diff:.1e}; margins {rep.margins}")
    assert diff <= 1e-9


# ---------------------------------------------------------------------- refusals
def test_what_is_refused_says_why():
    transformers = pytest.importorskip("transformers")
    model, _, _ = H._hf(3, num_key_value_heads=2)
    with pytest.raises(GaugeError, match=r"num_key_value_heads=2 ≠ num_attention_heads=4"):
        gaugeopt.find_attention(model)
    model, _, _ = H._hf(3, impl="flex_attention")
    with pytest.raises(GaugeError, match="_attn_implementation='flex_attention'"):
        gaugeopt.find_attention(model)
    model, _, _ = H._hf(3)
    with pytest.raises(GaugeError, match="multi-head latent attention .*does not support learnable multipliers"):
        gaugeopt.apply_lrm(model)
    converted = gaugeopt.apply_lrm(model, include=lambda n, m: "self_attn" not in n)
    assert all(s.latent is not None for s in gaugeopt.find_attention(converted))
    with pytest.raises(GaugeError, match="compare: .* multi-head latent attention"):
        gaugeopt.equivalent(model, model)
    with pytest.raises(GaugeError, match="align: .* multi-head latent attention"):
        gaugeopt.merge(model, model)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3

    norm = model.model.layers[0].self_attn.kv_a_layernorm
    norm.forward = lambda x: x  # an instance-level patch
    with pytest.raises(GaugeError, match="kv_a_layernorm with a patched forward"):
        gaugeopt.find_attention(model)
    assert m3.DeepseekV3RMSNorm.forward.__module__ == m3.__name__
