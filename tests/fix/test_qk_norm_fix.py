"""GaugeFix on QK-norm models (docs/qk_norm.md): the gains are balanced per RoPE plane, the
function does not move, and the optimizer state is transported exactly — checked against the
optimizer run from scratch in the rescaled coordinates — including Gemma's ``1 + w`` gains."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.fix.plan import plan_pairs
from gaugeopt.fix.triton_backend import unsupported_reason
from gaugeopt.transforms import scale_qk_gains
from gaugeopt.records.rope import plane_index
from gaugefix_helpers import load_params, snapshot_params
from qk_norm_helpers import changes, exact

STEPS = 3


def _imbalance(model, sites, seed=0, spread=1.5):
    """Drift the gains apart along the gauge: per plane (and KV group) a factor e^U(−spread, spread)."""
    g = torch.Generator().manual_seed(seed)
    for site in sites:
        pair = site.pair("qk_gain")
        pid = plane_index(pair.rope, site.d_k)
        d = torch.exp((torch.rand(pair.groups, int(pid.max()) + 1, generator=g, dtype=torch.float64) * 2 - 1) * spread)
        scale_qk_gains(site, d[:, pid])


def _gain_drift(site) -> float:
    """``max |log(RMS g_q / RMS g_k)|`` over the planes (and KV groups), from the gains directly."""
    n = site.qk_norm
    pair = site.pair("qk_gain")
    gq = n.q_gain.get().detach().double() + n.gain_offset
    gk = n.k_gain.get().detach().double() + n.gain_offset
    worst = 0.0
    for j in range(pair.groups):
        rows_q = gq[j * pair.a.repeat:(j + 1) * pair.a.repeat]
        for chans in [list(p) for p in pair.rope.planes(site.d_k)] + [[c] for c in range(pair.rope.rotary_dim, site.d_k)]:
            s_q = rows_q[:, chans].square().mean().sqrt()
            s_k = gk[j, chans].square().mean().sqrt()
            worst = max(worst, abs(math.log(s_q / s_k)))
    return worst


@pytest.mark.parametrize("name", ["hf_qwen3", "hf_olmo2", "offset_norm", "gpt_qknorm_partial_interleaved",
                                  "timm_vit_qknorm", "hf_gemma3"])
def test_fix_balances_gains_and_keeps_function(name):
    """Qwen3 (the acceptance case): gain drift 2.8 → ≤ 1e-6 (measured 3.5e-12: eq. 4's ε = 1e-12 over
    gains of order 1), logits and attention outputs unchanged to ≤ 1e-12 (measured 4.0e-16, 3.0e-16). The same for
    the other layouts; HF Gemma 3's forward multiplies its gain in float32, so there the function is
    compared with that rounding removed (qk_norm_helpers.float64_norms)."""
    case = zoo.build(name)
    sites = gaugeopt.find_attention(case.model)
    _imbalance(case.model, sites)
    before = copy.deepcopy(case.model)
    drift0 = max(_gain_drift(s) for s in sites)
    assert drift0 > 0.5
    report = gaugeopt.gauge_fix(case.model, sites=sites)
    assert {p.kind for p in report.pairs} == {"qk_gain"} and {p.mode for p in report.pairs} == {"gain"}
    assert abs(report.max_drift_before - drift0) < 1e-9
    assert max(_gain_drift(s) for s in sites) <= 1e-6
    assert report.max_drift_after <= 1e-6 and gaugeopt.qk_drift(case.model, granularity="plane") <= 1e-6
    d_logits, d_attn = changes(zoo.Case(name, before, case.inputs, case.forward), case.model,
                               gaugeopt.find_attention(before), sites)
    assert d_logits <= 1e-12 and max(d_attn) <= 1e-12


def test_gain_drift_metric():
    """``qk_drift`` on a QK-norm site is the gain drift: per layer with ``granularity="head"``
    (one gain vector shared by all heads), the worst plane with ``"plane"``."""
    case = zoo.build("gpt_qknorm")
    gaugeopt.gauge_fix(case.model)
    site = gaugeopt.find_attention(case.model)[0]
    scale_qk_gains(site, torch.full((1, site.d_k), 2.0, dtype=torch.float64))  # uniform: log 2 in every slot
    assert gaugeopt.qk_drift(case.model) == pytest.approx(math.log(4), abs=1e-9)  # ratio 2 / (1/2)
    assert gaugeopt.qk_drift(case.model, granularity="plane") == pytest.approx(math.log(4), abs=1e-9)
    table = gaugeopt.fix.drift.drift_table(case.model)
    assert [t.kind for t in table] == ["qk_gain", "qk_gain"] and tuple(table[0].drift.shape) == (1, 1)


def test_modes_and_granularities():
    case = zoo.build("gpt_qknorm", lrm=True)
    sites = gaugeopt.find_attention(case.model)
    for mode in ("lrm", "plain"):
        with pytest.raises(GaugeError, match="mode='auto'"):
            gaugeopt.gauge_fix(case.model, mode=mode)
    with pytest.raises(GaugeError, match="granularity='plane'"):
        gaugeopt.gauge_fix(case.model, granularity="channel")
    plans = plan_pairs(sites, kinds=("qk", "vo"))
    assert [(p.kind, p.mode, p.granularity, p.n_slots) for p in plans[:2]] == [("qk_gain", "gain", "plane", 4), ("vo", "lrm", "head", 1)]
    assert [m.role for m in plans[0].members_a] == ["q.gain"]
    r_q = sites[0].q.row_mult.get().clone()
    _imbalance(case.model, sites)
    gaugeopt.gauge_fix(case.model, vo=True)
    assert torch.equal(sites[0].q.row_mult.get(), r_q)  # r_Q vs r_K is not a gauge here: untouched
    after = zoo.build("offset_norm_after_rope").model  # the norm after RoPE: a factor per channel is exact
    after_plan = plan_pairs(gaugeopt.find_attention(after))[0]
    assert (after_plan.granularity, after_plan.n_slots) == ("channel", 8)
    assert gaugeopt.gauge_dimension(after, per_symmetry=True)["qk_gain"] == 2 * 8
    timm_plans = plan_pairs(gaugeopt.find_attention(zoo.build("timm_vit_qknorm").model))
    assert (timm_plans[0].granularity, timm_plans[0].n_slots) == ("channel", 8)
    assert [(m.role, m.measured) for m in timm_plans[0].members_a] == [("q.gain", True), ("q.norm_bias", False)]


def test_fused_kernel_declines_what_it_cannot_do():
    """The Triton backend scales stored tensors it measures: a ``1 + w`` gain and a LayerNorm bias
    (rescaled, not measured) go to the torch backend; RMSNorm gains are taken."""
    for name, why in (("offset_norm", "offset 1.0"), ("timm_vit_qknorm", "travels with its gain"), ("gpt_qknorm", None)):
        plans = plan_pairs(gaugeopt.find_attention(zoo.build(name, dtype=torch.float32).model))
        reason = unsupported_reason(plans, {})
        assert (reason is None) if why is None else (why in reason), (name, reason)


# ---------------------------------------------------------------------- optimizer-state transport
def _batches(case, n, seed=5):
    g = torch.Generator().manual_seed(seed)
    if case.name.startswith("timm"):
        return [(torch.randn(case.inputs.shape, generator=g, dtype=torch.float64),
                 torch.randint(0, zoo.VOCAB, (case.inputs.shape[0],), generator=g)) for _ in range(n)]
    return [(torch.randint(0, zoo.VOCAB, (zoo.B, zoo.T), generator=g),
             torch.randint(0, zoo.VOCAB, (zoo.B, zoo.T), generator=g)) for _ in range(n)]


def _step(case, model, opt, batch):
    opt.zero_grad(set_to_none=True)
    logits = zoo.forward_fn(case.name)(model, batch[0])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1)).backward()
    opt.step()


def _offsets(sites) -> dict[str, float]:
    return {ref.name: s.qk_norm.gain_offset for s in sites for role, ref in s.qk_norm.refs() if role.endswith("gain")}


def _run(name, make_opt, transport=True):
    """Imbalance, train STEPS steps, fix (Q/K gains and V/O), one more step; and the oracle: the same
    optimizer from scratch on copies held at the rescaled image of every past iterate (for a gain
    stored with an offset the image is ``(p + o)·s − o``: affine, derivative ``s``), then the same step."""
    case = zoo.build(name)
    model = case.model
    sites = gaugeopt.find_attention(model)
    _imbalance(model, sites)
    initial = copy.deepcopy(model)
    batches = _batches(case, STEPS + 1)
    offsets = _offsets(sites)
    with exact(name):
        opt = make_opt(model.parameters())
        snaps = []
        for t in range(STEPS):
            snaps.append(snapshot_params(model))
            _step(case, model, opt, batches[t])
        unfixed = snapshot_params(model)
        report = gaugeopt.gauge_fix(None, opt, sites=sites, vo=True, transport_state=transport)
        fixed = snapshot_params(model)
        o = {n: offsets.get(n, 0.0) for n in fixed}
        scale = {n: (fixed[n] + o[n]) / (unfixed[n] + o[n]) for n in fixed}
        assert sum(int((s != 1).any()) for s in scale.values()) >= 4
        _step(case, model, opt, batches[STEPS])
        result = snapshot_params(model)
        ref = copy.deepcopy(initial)
        ref_opt = make_opt(ref.parameters())
        for t in range(STEPS):
            load_params(ref, {n: (snaps[t][n] + o[n]) * scale[n] - o[n] for n in scale})
            _step(case, ref, ref_opt, batches[t])
        load_params(ref, fixed)
        _step(case, ref, ref_opt, batches[STEPS])
    expected = snapshot_params(ref)
    # A LayerNorm's key bias is invisible (∂L/∂β_k ≡ 0: it shifts every score of a query alike), so its
    # gradient is rounding noise that Adam normalises into O(lr) steps; the two runs agree there only
    # to the noise level, whatever the transport (as for the key bias of plain attention).
    noise = {s.qk_norm.k_bias.name for s in sites if s.qk_norm.k_bias is not None}
    worst = max(gaugeopt.relative_change(expected[n], result[n]) for n in result if n not in noise)
    names = dict(zip(map(id, model.parameters()), (n for n, _ in model.named_parameters())))
    moments = max(gaugeopt.relative_change(ref_opt.state[q][k], opt.state[p][k])
                  for p, q in zip(model.parameters(), ref.parameters()) for k in ("exp_avg", "exp_avg_sq")
                  if k in opt.state.get(p, {}) and names[id(p)] not in noise)
    return worst, moments, report


ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731


@pytest.mark.parametrize("name", ["hf_qwen3", "hf_olmo2", "offset_norm", "timm_vit_qknorm"])
def test_adam_state_transport_matches_optimizer_in_new_coordinates(name):
    """Qwen3 (the acceptance case): the step after the fix equals AdamW re-run from scratch in the
    rescaled coordinates to ≤ 1e-12 (measured 7e-17; moments 2.1e-15); likewise OLMo 2
    (per-head gains), the ``1 + w`` gain (``exp_avg/s``, ``exp_avg_sq/s²``: the offset never reaches the
    moments) and timm (LayerNorm biases rescaled with their gains)."""
    worst, moments, report = _run(name, ADAMW)
    assert worst <= 1e-12 and moments <= 1e-12, (worst, moments)
    assert report.transported and not report.reset and not report.left


@pytest.mark.parametrize("name", ["hf_qwen3", "offset_norm"])
def test_negative_control_stale_state_differs(name):
    """Without transport the next step differs from the oracle (measured 2.3e-3 Qwen3, 2.1e-2 with a
    ``1 + w`` gain): the check above
    would see a missing or wrong rescale of the gains' moments."""
    worst, _, report = _run(name, ADAMW, transport=False)
    assert worst > 1e-6 and not report.transported
