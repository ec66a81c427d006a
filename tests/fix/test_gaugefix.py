"""gauge_fix / qk_drift: balanced scales (checked against an independent reference), the
function unchanged, the right tensors touched, RoPE refusals, V/O, magnitude control, reports."""

import copy
import re

import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo
from gaugefix_helpers import add_drift, reference_drift, reference_scales, touched_names
from gaugeopt import GaugeError
from gaugeopt.fix import gauge_fix, qk_drift, vo_drift
from gaugeopt.fix.balance import balance_factors
from gaugeopt.fix.drift import drift_table, read_mean_squares
from gaugeopt.fix.plan import plan_pairs
from gaugeopt.fix.torch_backend import TorchFix

# Acceptance models: own GPT with and without RoPE, with GQA/MQA, HF GPT-2, HF Llama; LRM and plain.
MODELS = ["gpt", "gpt_gqa", "gpt_mqa", "gpt_rope_interleaved", "gpt_rope_split_half_gqa",
          "gpt_rope_partial_split_half", "hf_gpt2", "hf_llama"]
CASES = [(n, lrm) for n in MODELS for lrm in (False, True)] + [("torch_mha", False), ("torch_mha_kdim", False)]
IDS = [n + ("+lrm" if lrm else "") for n, lrm in CASES]


# float64: the fix itself is exact to ~1e-16 per entry; the residual drift is eq. 4's own bias
# ε·(1/s_K − 1/s_Q) ≲ 1e-11 for scales ≳ 0.1. float32: rounding of the two products (~1e-7).
TOL = {torch.float64: dict(logits=1e-12, drift=1e-10), torch.float32: dict(logits=1e-5, drift=1e-6)}


def _granularities(model):
    rope = gaugeopt.find_attention(model)[0].rope.active
    return ["head", "plane", "auto"] + ([] if rope else ["channel"])


def _resolved(gran, site):
    return ("plane" if site.rope.active else "head") if gran == "auto" else gran


@pytest.mark.parametrize("name, lrm", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_fix_balances_every_slot_and_preserves_logits(name, lrm, dtype):
    tol = TOL[dtype]
    base = zoo.build(name, lrm=lrm, dtype=dtype)
    add_drift(base.model, lrm)
    for gran in _granularities(base.model):
        model = copy.deepcopy(base.model)
        site0 = gaugeopt.find_attention(model)[0]
        fine = _resolved(gran, site0)
        before = base.logits(model)
        assert reference_drift(model, granularity=fine) > 0.3  # the test has something to fix
        products = [reference_scales(s, "qk", fine, "lrm" if lrm else "plain") for s in gaugeopt.find_attention(model)]

        report = gauge_fix(model, granularity=gran)

        after = base.logits(model)
        assert gaugeopt.relative_change(before, after) <= tol["logits"], gran
        # balanced at the fix's own granularity (every channel / plane), hence per head too
        assert reference_drift(model, granularity=fine) <= tol["drift"], gran
        assert reference_drift(model, granularity="head") <= tol["drift"], gran
        assert qk_drift(model) <= tol["drift"] and qk_drift(model, granularity=fine) <= tol["drift"]
        # the gauge-invariant product is untouched, and the report agrees with the reference
        for site, (sa, sb) in zip(gaugeopt.find_attention(model), products):
            na, nb = reference_scales(site, "qk", fine, "lrm" if lrm else "plain")
            torch.testing.assert_close(na * nb, sa * sb, rtol=10 * tol["drift"], atol=0)
            rec = report.pairs[site.layer_index]
            assert rec.granularity == fine and rec.mode == ("lrm" if lrm else "plain")
            torch.testing.assert_close(rec.drift_before, (sa / sb).log().abs().to(rec.drift_before),
                                       rtol=1e-5, atol=1e-6)
        assert report.max_drift_after <= tol["drift"]
        assert report.heads_fixed == sum(s.h for s in gaugeopt.find_attention(model))


@pytest.mark.parametrize("name, lrm", [("gpt_rope_split_half_gqa", True), ("hf_gpt2", False), ("gpt_gqa", False)])
def test_fix_touches_only_the_qk_tensors(name, lrm):
    """Everything but r_Q, r_K (or the Q/K rows and biases) is bit-identical afterwards; in a
    fused c_attn the V rows are untouched."""
    case = zoo.build(name, lrm=lrm)
    add_drift(case.model, lrm)
    old = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    gauge_fix(case.model)
    touched = touched_names(case.model)
    changed = {n for n, p in case.model.named_parameters() if not torch.equal(p, old[n])}
    assert changed and changed <= touched
    site = gaugeopt.find_attention(case.model)[0]
    if not lrm:
        v = site.v.weight
        assert torch.equal(v.get(), v.view(old[v.name]))


def test_fixed_point_and_idempotence():
    case = zoo.build("gpt_rope_split_half_gqa", lrm=True)
    add_drift(case.model, True)
    gauge_fix(case.model)
    snapshot = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    again = gauge_fix(case.model)
    assert again.max_drift_before <= 1e-10
    for n, p in case.model.named_parameters():
        torch.testing.assert_close(p, snapshot[n], rtol=1e-11, atol=0)


def test_gqa_scale_is_shared_by_the_group():
    """Under GQA one factor per KV group multiplies all its query heads: after the fix the RMS
    over the group's query heads equals the key head's, while single query heads stay unbalanced."""
    case = zoo.build("gpt_gqa", lrm=True)
    add_drift(case.model, True)
    gauge_fix(case.model, granularity="head")
    site = gaugeopt.find_attention(case.model)[0]
    rq = site.q.row_mult.get().detach()  # (h, d_k)
    rk = site.k.row_mult.get().detach()  # (h_kv, d_k)
    rms = lambda x: x.pow(2).mean().sqrt()  # noqa: E731
    for j in range(site.h_kv):
        group = rq[j * site.n_rep:(j + 1) * site.n_rep]
        torch.testing.assert_close(rms(group), rms(rk[j]), rtol=1e-10, atol=0)
    per_query = [abs(float((rms(rq[i]) / rms(rk[i // site.n_rep])).log())) for i in range(site.h)]
    assert max(per_query) > 1e-3  # a per-query-head balance would have been a different (invalid) gauge


@pytest.mark.parametrize("name", ["gpt_rope_interleaved", "gpt_rope_partial_split_half", "hf_llama"])
def test_channel_granularity_under_rope_is_refused(name):
    case = zoo.build(name, lrm=True)
    with pytest.raises(GaugeError) as err:
        gauge_fix(case.model, granularity="channel")
    msg = str(err.value)
    assert "RoPE" in msg and "rotation" in msg and "'plane'" in msg and "'head'" in msg


@pytest.mark.parametrize("wrong", ["other_convention", "per_channel"])
def test_negative_control_wrong_planes_change_the_function(wrong):
    """If the plan paired the wrong coordinates (the other RoPE convention) or ignored the
    planes, the same fix would change the logits by O(1): the check above has teeth."""
    case = zoo.build("gpt_rope_split_half_gqa", lrm=True)
    add_drift(case.model, True)
    model = case.copy()
    sites = gaugeopt.find_attention(model)
    for s in sites:
        s.rope = (gaugeopt.RopeSpec("interleaved", s.rope.rotary_dim) if wrong == "other_convention"
                  else gaugeopt.RopeSpec())
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(gaugeopt.GaugeError, match=r"sector qk: a valid gauge transformation changed"):
        gauge_fix(model, granularity="plane", sites=sites)  # the gate's proof catches the wrong planes
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    gaugeopt.assume_certified(model, sites=sites)  # past the gate on purpose: what it prevents
    with pytest.warns(RuntimeWarning, match="assumed, not proved"):
        gauge_fix(model, granularity="plane", sites=sites)
    assert gaugeopt.relative_change(case.logits(), case.logits(model)) > 1e-3


@pytest.mark.parametrize("name, lrm", [("gpt_gqa", True), ("gpt_rope_split_half_gqa", False), ("hf_gpt2", True),
                                       ("hf_llama", False), ("torch_mha", False)])
@pytest.mark.parametrize("vo_granularity", ["head", "channel"])
def test_vo_balancing(name, lrm, vo_granularity):
    case = zoo.build(name, lrm=lrm)
    add_drift(case.model, lrm, vo=True)
    before = case.logits()
    assert reference_drift(case.model, "vo", vo_granularity) > 0.3
    report = gauge_fix(case.model, vo=True, vo_granularity=vo_granularity)
    assert gaugeopt.relative_change(before, case.logits()) <= 1e-12
    assert reference_drift(case.model, "vo", vo_granularity) <= 1e-10
    assert reference_drift(case.model, "qk", "head") <= 1e-10
    assert vo_drift(case.model, granularity=vo_granularity) <= 1e-10
    assert [p.kind for p in report.pairs].count("vo") == len(gaugeopt.find_attention(case.model))


def test_vo_negative_control_mismatched_groups():
    """Applying the V factor of group j to the wrong query heads' O columns changes the function."""
    case = zoo.build("gpt_gqa", lrm=True)
    add_drift(case.model, True, vo=True)
    model = case.copy()
    plans = plan_pairs(gaugeopt.find_attention(model), kinds=("vo",), vo_granularity="channel")
    factors = []
    for p in plans:
        b = balance_factors(read_mean_squares(p.a, p.members_a)[None], read_mean_squares(p.b, p.members_b)[None],
                            p.slot, p.n_slots)
        factors.append((b.gauge_a[0], b.gauge_b[0].flip(0), b.magnitude[0]))  # groups swapped on the O side
    TorchFix(plans, {})._apply(factors)
    assert gaugeopt.relative_change(case.logits(), case.logits(model)) > 1e-3


def _scaled_pair(model, factor):
    """Independent construction of the magnitude-controlled model: both r_Q and r_K times ``factor``."""
    with torch.no_grad():
        for s in gaugeopt.find_attention(model):
            s.q.row_mult.get().mul_(factor)
            s.k.row_mult.get().mul_(factor)
    return model


def test_product_decay_is_symmetric_shrink_then_balance():
    case = zoo.build("gpt_rope_split_half_gqa", lrm=True)
    add_drift(case.model, True)
    lam = 0.19
    decayed = case.copy()
    report = gauge_fix(decayed, product_decay=lam)
    expected = _scaled_pair(case.copy(), (1 - lam) ** 0.5)  # scale both by 0.9, then balance
    gauge_fix(expected)
    assert gaugeopt.relative_change(case.logits(expected), case.logits(decayed)) <= 1e-12
    assert gaugeopt.relative_change(case.logits(), case.logits(decayed)) > 1e-3  # it changes the function, on purpose
    assert qk_drift(decayed, granularity="plane") <= 1e-10
    for rec in report.pairs:
        torch.testing.assert_close(rec.product_after, (1 - lam) * rec.product_before, rtol=1e-12, atol=0)
    for site in gaugeopt.find_attention(decayed):  # independent check of the product, per plane
        sa, sb = reference_scales(site, "qk", "plane", "lrm")
        torch.testing.assert_close(sa * sb, (1 - lam) * report.pairs[site.layer_index].product_before)


def test_product_max_caps_only_large_products():
    case = zoo.build("gpt_gqa", lrm=True)
    add_drift(case.model, True)
    prods = torch.cat([t.product.flatten() for t in drift_table(case.model)])
    cap = float(prods.median())
    report = gauge_fix(case.model, granularity="head", product_max=cap)
    assert sum(int((r.product_before > cap).sum()) for r in report.pairs) == len(prods) // 2
    for rec in report.pairs:
        big = rec.product_before > cap
        torch.testing.assert_close(rec.product_after[big], torch.full_like(rec.product_after[big], cap))
        torch.testing.assert_close(rec.product_after[~big], rec.product_before[~big], rtol=1e-13, atol=0)
    after = torch.cat([t.product.flatten() for t in drift_table(case.model)])
    assert float(after.max()) <= cap * (1 + 1e-12) and qk_drift(case.model) <= 1e-10


def test_product_decay_leaves_optimizer_state_like_weight_decay():
    """Only the function-preserving factor is transported; the decay acts like decoupled weight
    decay, which never touches the moments."""
    case = zoo.build("gpt", lrm=True)
    add_drift(case.model, True)
    states = []
    for lam in (None, 0.3):
        model = case.copy()
        opt = torch.optim.Adam(model.parameters())
        case.forward(model).sum().backward()
        opt.step()
        gauge_fix(model, opt, product_decay=lam)
        states.append([opt.state[p]["exp_avg"].clone() for p in model.parameters()])
    for a, b in zip(*states):
        assert torch.equal(a, b)


def test_plain_mode_on_an_lrm_model_rescales_rows():
    case = zoo.build("gpt_gqa", lrm=True)
    add_drift(case.model, False)  # a general Q/K gauge: the rows drift, the multipliers do not
    before = case.logits()
    report = gauge_fix(case.model, mode="plain")
    assert {p.mode for p in report.pairs} == {"plain"}
    assert gaugeopt.relative_change(before, case.logits()) <= 1e-12
    assert reference_drift(case.model, mode="plain") <= 1e-10


def test_input_validation():
    case = zoo.build("gpt", lrm=False)
    m = case.model
    cases = [
        (dict(granularity="rows"), "granularity='rows'"),
        (dict(eps=0.0), "eps=0.0"),
        (dict(eps=-1e-12), "eps=-1e-12"),
        (dict(mode="lrm"), "apply_lrm"),
        (dict(mode="multipliers"), "mode='multipliers'"),
        (dict(unknown_state="ignore"), "unknown_state='ignore'"),
        (dict(product_decay=1.0), "product_decay=1.0"),
        (dict(product_max=0.0), "product_max=0.0"),
        (dict(vo=True, vo_granularity="plane"), "vo_granularity='plane'"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(GaugeError, match=re.escape(fragment)):
            gauge_fix(m, **kwargs)
    with pytest.raises(GaugeError, match="no attention layer found"):
        gauge_fix(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(GaugeError, match="no attention layer found"):
        qk_drift(nn.Linear(4, 4))
    with pytest.raises(GaugeError, match="pass a model or sites"):
        gauge_fix(None)


def test_report_as_dict_for_loggers():
    case = zoo.build("gpt_rope_split_half_gqa", lrm=True)
    add_drift(case.model, True, vo=True)
    opt = torch.optim.AdamW(case.model.parameters())
    case.forward(case.model).sum().backward()
    opt.step()
    report = gauge_fix(case.model, opt, vo=True)
    d = report.as_dict(per_layer=True)
    assert all(isinstance(v, float) for v in d.values())
    assert d["gaugefix/qk_drift_before"] == report.max_drift_before > 0.3
    assert d["gaugefix/qk_drift_after"] <= 1e-10 and d["gaugefix/vo_drift_after"] <= 1e-10
    assert d["gaugefix/heads_fixed"] == 8.0
    assert d["gaugefix/params_transported"] == 8.0  # r_Q, r_K, r_V, c_O in 2 layers
    assert "gaugefix/layer1/qk_drift_before" in d and "gaugefix/layer1/vo_scale_product" in d
    assert len(report.per_layer("qk", "drift_before")) == 2


def test_balance_factors_seam_batched_over_layers():
    """The pure seam: stacked layers give the same factors as one layer at a time, the balanced
    scales are equal, and the product is kept."""
    g = torch.Generator().manual_seed(0)
    L, G, n, C = 3, 2, 2, 8
    ms_q = torch.rand(L, G, n, C, generator=g, dtype=torch.float64) * 4
    ms_k = torch.rand(L, G, 1, C, generator=g, dtype=torch.float64) / 4
    slot = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])  # split-half planes of d_k = 8
    whole = balance_factors(ms_q, ms_k, slot, 4)
    for layer in range(L):
        one = balance_factors(ms_q[layer:layer + 1], ms_k[layer:layer + 1], slot, 4)
        torch.testing.assert_close(one.gauge_b[0], whole.gauge_b[layer], rtol=0, atol=0)
    new_q = ms_q * whole.gauge_a[:, :, None, :] ** 2
    new_k = ms_k * whole.gauge_b[:, :, None, :] ** 2
    for m in range(4):
        chans = (slot == m).nonzero().flatten()
        sq = new_q[..., chans].mean(dim=(-1, -2)).sqrt()
        sk = new_k[..., chans].mean(dim=(-1, -2)).sqrt()
        torch.testing.assert_close(sq, sk, rtol=1e-10, atol=0)
    assert float(whole.drift_after.max()) <= 1e-10
    torch.testing.assert_close(whole.product_after, whole.product_before, rtol=1e-14, atol=0)
    torch.testing.assert_close(whole.gauge_a * whole.gauge_b, torch.ones_like(whole.gauge_a))


def test_compiled_model_is_not_recompiled():
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    case = zoo.build("gpt_rope_split_half_gqa", lrm=True, dtype=torch.float32)
    add_drift(case.model, True)
    eager = case.copy()
    cnt = CompileCounter()
    compiled = torch.compile(case.model, backend=cnt)
    with torch.no_grad():
        y0 = compiled(case.inputs)[0]
    assert cnt.frame_count == 1
    opt = torch.optim.AdamW(compiled.parameters())
    report = gauge_fix(compiled, opt)
    assert report.max_drift_before > 0.3 and qk_drift(compiled) <= 1e-6
    gauge_fix(eager)
    with torch.no_grad():
        y1 = compiled(case.inputs)[0]
    assert cnt.frame_count == 1  # no recompilation
    torch.testing.assert_close(y1, eager(case.inputs)[0], rtol=1e-5, atol=1e-5)  # the new values are used
    assert gaugeopt.relative_change(y0, y1) <= 1e-5
    torch._dynamo.reset()


def test_public_names():
    assert gaugeopt.qk_drift is qk_drift and gaugeopt.gauge_fix is gauge_fix
