"""State rules beyond Adam/SGD/Adagrad: Muon beside AdamW, RMSprop, Adamax, ASGD, Rprop, Adafactor
(torch's and Hugging Face's), schedule-free AdamW/RAdam/SGD, Adam-mini; what is exact, what is
declared approximate and by how much, what is refused and when.

Every exact rule is checked against the independent reference of tests/support/transport_helpers.py (the
optimizer run from scratch in the new coordinates), float64, ≤ 1e-12, with the function unchanged
by the fix to ≤ 1e-12.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import gaugeopt
import zoo
from gaugefix_helpers import add_drift, load_params, snapshot_params
from gaugeopt import GaugeError
from gaugeopt.fix import gauge_fix
from gaugeopt.fix.gaugefix import GaugeFixer
from gaugeopt.fix.state_rules import state_rule
from gaugeopt.fix.transport import register_state_rule
from model_libraries import require
from transport_helpers import (
    Sign, as_list, batches, fixed_then_step, key_bias_mask, matrices_and_rest, max_rel, oracle, step,
)


def _muon_adamw(m):
    mats, rest = matrices_and_rest(m)
    return [torch.optim.Muon(mats, lr=2e-2, weight_decay=0.1), torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)]


def _sf(cls_name, **kw):
    def make(m):
        sf = require("schedulefree")
        opt = getattr(sf, cls_name)(m.parameters(), **kw)
        opt.train()
        return opt
    return make


def _adam_mini(m):
    am = require("adam_mini")
    cfg = m.config
    opt = am.Adam_mini(m.named_parameters(), lr=1e-2, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
                       n_kv_heads=cfg.num_key_value_heads, verbose=False)
    return opt


def _hf_adafactor(**kw):
    def make(m):
        from transformers.optimization import Adafactor

        return Adafactor(m.parameters(), **kw)
    return make


# name -> (model, lrm, make, forced keys, fix options): the exact cases
LRM = "gpt_rope_split_half_gqa"
EXACT = {
    "muon+adamw": ("gpt_gqa", False, _muon_adamw, (), {}),
    "muon+adamw-rope": ("gpt_rope_split_half_gqa", False, _muon_adamw, (), {}),
    "rmsprop": (LRM, True, lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2), (), {}),
    "rmsprop_centered": (LRM, True, lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, centered=True), (), {}),
    "rmsprop_momentum_eps0": (LRM, True, lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.9,
                                                                       centered=True, eps=0.0), (), {}),
    "adamax_eps0": (LRM, True, lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2, eps=0.0), (), {}),
    "adagrad_initial_accumulator": (LRM, True, lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-1,
                                                                             initial_accumulator_value=0.1), (), {}),
    "asgd": (LRM, True, lambda m: torch.optim.ASGD(m.parameters(), lr=1e-2, t0=1), (), {}),
    "rprop": (LRM, True, lambda m: torch.optim.Rprop(m.parameters(), lr=1e-2), (), {}),
    "adafactor_1d": (LRM, True, lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2), (), {}),
    "hf_adafactor_1d": (LRM, True, _hf_adafactor(lr=1e-2, relative_step=False, scale_parameter=False,
                                                 eps=(0.0, 1e-3), beta1=0.9), (), {}),
    "schedulefree_adamw": (LRM, True, _sf("AdamWScheduleFree", lr=1e-2, warmup_steps=2, weight_decay=0.1), ("z",), {}),
    "schedulefree_radam": (LRM, True, _sf("RAdamScheduleFree", lr=1e-2), ("z",), {}),
    "schedulefree_sgd": (LRM, True, _sf("SGDScheduleFree", lr=1e-1, warmup_steps=2), ("z",), {}),
    # Adam-mini keeps one second moment per head of q_proj/k_proj: exact for a per-head scalar gauge
    # (its o_proj keeps one per row, which V/O's column rescale would split: refused, below)
    "adam_mini": ("hf_mistral", False, _adam_mini, (), dict(granularity="head", vo=False)),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_exact_rules_equal_the_optimizer_run_in_the_new_coordinates(case):
    name, lrm, make, forced, opts = EXACT[case]
    base = zoo.build(name, lrm=lrm)
    seen = {}

    def before(model, opt):
        seen["logits"] = base.logits(model)
        seen["state"] = _states(model, opt)

    def after(model, opt):
        seen["logits_after"] = base.logits(model)
        seen["state_after"] = _states(model, opt)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exact rule warns about nothing
        initial, data, snaps, scale, fixed, result, report, opt, model = fixed_then_step(
            name, lrm, make, forced=forced, before_fix=before, after_fix=after, **opts)
    expected = oracle(name, initial, make, data, snaps, scale, fixed, forced=forced)
    assert max_rel(expected, result, skip=key_bias_mask(initial)) <= 1e-12
    assert report.transported and not report.approximate and not report.reset and not report.left
    assert gaugeopt.relative_change(seen["logits"], seen["logits_after"]) <= 1e-12  # the fix kept the function
    # the report is truthful: a parameter is listed exactly when a state tensor of it moved
    moved = {n for (n, k), v in seen["state"].items() if not torch.equal(v, seen["state_after"][(n, k)])}
    assert moved == set(report.transported)


def _states(model, opt):
    return {(n, k): v.clone() for o in as_list(opt) for n, p in model.named_parameters()
            for k, v in o.state.get(p, {}).items() if torch.is_tensor(v) and v.dim() > 0}


def test_muon_momentum_after_the_fix_is_the_momentum_in_the_new_coordinates():
    """Muon's momentum buffer (a sum of gradients) divides by s: compared with the reference's
    buffers after the next step, and the matrices the fix rescaled are Muon's."""
    name = "gpt_gqa"
    initial, data, snaps, scale, fixed, result, report, opt, model = fixed_then_step(name, False, _muon_adamw)
    ref = copy.deepcopy(initial)
    ref_opt = _muon_adamw(ref)
    for t in range(len(snaps)):
        load_params(ref, {n: scale[n] * snaps[t][0][n] for n in scale})
        if t == len(snaps) - 1:
            load_params(ref, fixed)
        step(name, ref, ref_opt, data[t])
    muon, ref_muon = opt[0], ref_opt[0]
    named, ref_named = dict(model.named_parameters()), dict(ref.named_parameters())
    c_attn = [n for n in report.transported if n.endswith("c_attn.weight")]
    assert c_attn and all(named[n] in muon.state for n in c_attn)
    for n in c_attn:
        got, want = muon.state[named[n]]["momentum_buffer"], ref_muon.state[ref_named[n]]["momentum_buffer"]
        assert gaugeopt.relative_change(want, got) <= 1e-12


# ---------------------------------------------------------------------- approximate, declared
# name -> (make, key warned about, a bound on the next step's relative error measured here)
APPROX = {
    "adamax": (lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2), "exp_inf", 1e-4),
    "rmsprop_momentum": (lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.9), "momentum_buffer",
                         1e-4),
}


@pytest.mark.parametrize("case", list(APPROX))
def test_approximate_moves_are_declared_and_small(case):
    make, key, bound = APPROX[case]
    with pytest.warns(UserWarning, match=rf"'{key}'.*approximately"):
        initial, data, snaps, scale, fixed, result, report, *_ = fixed_then_step(LRM, True, make)
    expected = oracle(LRM, initial, make, data, snaps, scale, fixed)
    assert report.approximate and not report.transported
    assert report.as_dict()["gaugefix/params_approximate"] == len(report.approximate)
    err = max_rel(expected, result)
    assert 1e-14 < err < bound, err  # really approximate (the declaration is needed), and within its bound


# ---------------------------------------------------------------------- factored second moments
def _adafactor_case(name, make):
    initial, data, snaps, scale, fixed, result, report, opt, model = fixed_then_step(name, False, make)
    expected = oracle(name, initial, make, data, snaps, scale, fixed)
    return report, max_rel(expected, result, skip=key_bias_mask(initial)), scale


@pytest.mark.parametrize("which", ["torch", "hf"])
@pytest.mark.parametrize("name", ["gpt_gqa", "hf_gpt2"])
def test_adafactor_factors_exact_where_the_rescale_allows_and_the_rest_declared(name, which):
    """nn.Linear stores Q/K channels as rows (the row factor moves exactly), HF GPT-2's Conv1D as
    columns (the column factor does); the other factor is declared approximate, and the
    preconditioner r·cᵀ/mean(r) itself moves exactly (v̂ / s²)."""
    make = (lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2)) if which == "torch" else _hf_adafactor(
        lr=1e-2, relative_step=False, scale_parameter=False)  # eps[0] = 1e-30 > 0: the K bias's gradient is 0
    row, col = ("row_var", "col_var") if which == "torch" else ("exp_avg_sq_row", "exp_avg_sq_col")
    case = zoo.build(name)
    add_drift(case.model, False, vo=True)
    opt = make(case.model)
    for x in batches(3):
        step(name, case.model, opt, x)
    site = gaugeopt.find_attention(case.model)[0]
    w = site.q.weight.param
    st = opt.state[w]

    def vhat():
        r = st[row] if which == "torch" else st[row].unsqueeze(-1)
        c = st[col] if which == "torch" else st[col].unsqueeze(-2)
        return r @ c / r.mean(dim=-2, keepdim=True)

    r0, c0, v0, w0 = st[row].clone(), st[col].clone(), vhat(), w.detach().clone()
    logits = case.logits()
    with pytest.warns(UserWarning, match="approximately"):
        report = gauge_fix(case.model, opt, vo=True)
    assert gaugeopt.relative_change(logits, case.logits()) <= 1e-12
    rows = name == "gpt_gqa"  # nn.Linear: a Q/K channel is a row; Conv1D (in × out): a column
    axis = 1 if rows else 0  # the axis the factor is constant along
    s = w.detach().norm(dim=axis, keepdim=True) / w0.norm(dim=axis, keepdim=True)  # (R, 1) or (1, C)
    assert float((s - 1).abs().max()) > 1e-3  # the fix rescaled this matrix
    torch.testing.assert_close(w.detach(), w0 * s, rtol=1e-13, atol=0)
    assert site.q.weight.name in report.approximate and site.q.weight.name not in report.transported
    torch.testing.assert_close(vhat(), v0 / s**2, rtol=1e-12, atol=0)  # the preconditioner: exact
    if rows:
        torch.testing.assert_close(st[row], (r0.reshape(-1, 1) / s**2).reshape(st[row].shape), rtol=1e-13, atol=0)
        assert not torch.allclose(st[col], c0, rtol=1e-6)  # the column factor moved too, approximately
    else:
        torch.testing.assert_close(st[col], (c0.reshape(1, -1) / s**2).reshape(st[col].shape), rtol=1e-13, atol=0)
        assert not torch.allclose(st[row], r0, rtol=1e-6)


@pytest.mark.parametrize("which", ["torch", "hf"])
def test_adafactor_next_steps_close_to_the_optimizer_in_the_new_coordinates(which):
    """The measured effect of the approximate factor on the next step: small (≤ 1e-2 relative, the
    preconditioner itself is exact) but not rounding (docs/optimizers.md has the numbers)."""
    make = (lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2)) if which == "torch" else _hf_adafactor(
        lr=1e-2, relative_step=False, scale_parameter=False)
    with pytest.warns(UserWarning):
        report, err, _ = _adafactor_case("gpt_gqa", make)
    assert report.approximate and 1e-14 < err < 1e-2


# ---------------------------------------------------------------------- schedule-free: eval weights
@pytest.mark.parametrize("cls", ["AdamWScheduleFree", "SGDScheduleFree"])
@pytest.mark.parametrize("fix_in", ["train", "eval"])
def test_schedule_free_eval_weights_keep_their_function(cls, fix_in):
    """z moves like the weight (power −1): the weights the optimizer shows in eval mode
    (x = (y − (1−β)z)/β) keep their function through a fix made in either mode; with z left
    untouched (power 0) they do not (negative control)."""
    sf = require("schedulefree")

    def functions(model, opt):
        out = []
        for mode in ("train", "eval"):
            getattr(opt, mode)()
            out.append(zoo.build(LRM, lrm=True).forward(model).detach())
        return out

    def run(rule=None):
        case = zoo.build(LRM, lrm=True)
        add_drift(case.model, True)
        opt = getattr(sf, cls)(case.model.parameters(), lr=5e-2, warmup_steps=1)
        opt.train()
        for x in batches(4):
            step(LRM, case.model, opt, x)
        before = functions(*copy.deepcopy((case.model, opt)))
        getattr(opt, fix_in)()
        saved = state_rule(opt)
        try:
            if rule is not None:
                register_state_rule(type(opt), rule)
            gauge_fix(case.model, opt)
        finally:
            register_state_rule(type(opt), saved)
        after = functions(case.model, opt)
        return max(gaugeopt.relative_change(b, a) for b, a in zip(before, after))

    assert run() <= 1e-12  # the weights of both modes keep their function
    keys = {"z": 0, "exp_avg_sq": 2} if cls.startswith("AdamW") else {"z": 0}
    assert run(keys) > 1e-4


# ---------------------------------------------------------------------- refusals, and when
class Int8Adam(torch.optim.Optimizer):
    """A stand-in for an 8-bit optimizer: its moments are uint8 codes with a per-block scale."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st.setdefault("state1", torch.zeros_like(p, dtype=torch.uint8))
                st["absmax1"] = p.grad.abs().amax().reshape(1)
                st["state1"].copy_((p.grad / st["absmax1"] * 127 + 128).round().to(torch.uint8))
                p.add_(p.grad.sign(), alpha=-group["lr"])


register_state_rule(Int8Adam, {"state1": 1, "absmax1": 1})  # a wrong rule: quantised codes are refused anyway


def _refusal_cases():
    cases = {
        "unknown class": (LRM, True, lambda m: Sign(m.parameters()), "has no state rule"),
        "8-bit stand-in": (LRM, True, lambda m: Int8Adam(m.parameters()), "quantised"),
        "lbfgs": (LRM, True, lambda m: torch.optim.LBFGS(m.parameters()), "flattened curvature pairs"),
        "adam-mini per plane": ("hf_mistral", False, _adam_mini, "split a block"),
        "adam coupled L2": (LRM, True, lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.1), "coupled L2"),
        "sgd coupled L2": (LRM, True, lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                                                weight_decay=0.1), "coupled L2"),
        "hf adafactor beta1": (LRM, True, _hf_adafactor(lr=1e-2, relative_step=False, beta1=0.9), "scale_parameter"),
    }
    return cases


@pytest.mark.parametrize("case", list(_refusal_cases()))
def test_unknown_state_is_refused_at_setup_or_at_the_first_optimizer_step(case):
    """Classified when the fixer is built (state present) or right after the optimizer's first
    step (no state yet) — never first at step `every`; nothing is written."""
    name, lrm, make, fragment = _refusal_cases()[case]
    base = zoo.build(name, lrm=lrm)
    add_drift(base.model, lrm)
    model = base.model
    opt = make(model)
    if case == "lbfgs":  # refused by class, before it holds any state
        with pytest.raises(GaugeError, match=fragment):
            GaugeFixer(model, opt)
        return
    fixer = GaugeFixer(model, opt)  # no state yet: accepted for now
    x = batches(1)[0]
    with pytest.raises(GaugeError, match=fragment):
        opt.zero_grad()
        zoo_loss(name, model, x).backward()
        opt.step()
    before = snapshot_params(model)
    with pytest.raises(GaugeError, match=fragment):
        GaugeFixer(model, opt)  # state exists now: refused at construction
    with pytest.raises(GaugeError, match=fragment):
        fixer()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert gauge_fix(model, opt, unknown_state="reset").reset


def zoo_loss(name, model, x):
    from transport_helpers import loss

    return loss(name, model, x)


@pytest.mark.parametrize("lib", ["bitsandbytes", "torchao"])
def test_eight_bit_optimizers_are_refused_clearly(lib):
    case = zoo.build(LRM, lrm=True, dtype=torch.float32)
    add_drift(case.model, True)
    big = torch.nn.Linear(128, 128)  # large enough for quantised blocks
    if lib == "bitsandbytes":
        bnb = require("bitsandbytes")
        opt = bnb.optim.Adam8bit(list(case.model.parameters()) + list(big.parameters()), lr=1e-3, min_8bit_size=1)
    else:
        ao = require("torchao.optim")
        opt = ao.AdamW8bit(list(case.model.parameters()) + list(big.parameters()), lr=1e-3, block_size=32)
    step(LRM, case.model, opt, batches(1)[0])
    with pytest.raises(GaugeError, match="quantised"):
        gauge_fix(case.model, opt)


# ---------------------------------------------------------------------- several optimizers
def test_a_parameter_in_two_optimizers_or_in_none_is_refused():
    case = zoo.build("gpt_gqa")
    mats, rest = matrices_and_rest(case.model)
    with pytest.raises(GaugeError, match="in two optimizers"):
        GaugeFixer(case.model, [torch.optim.Muon(mats), torch.optim.AdamW(mats + rest)])
    with pytest.raises(GaugeError, match="missing e.g."):
        gauge_fix(case.model, [torch.optim.AdamW(rest)])
    with pytest.raises(GaugeError, match="holds no optimizer"):
        gauge_fix(case.model, [])


def test_pending_gradients_move_with_the_fix():
    """A fix between a backward and the step that consumes it: the gradients of the rescaled
    parameters become g/s — the gradient autograd computes at the fixed point."""
    case = zoo.build("gpt_gqa", lrm=True)
    add_drift(case.model, True)
    model = case.model
    x = batches(1)[0]
    zoo_loss("gpt_gqa", model, x).backward()
    grads_before = {n: p.grad.clone() for n, p in model.named_parameters()}
    w0 = snapshot_params(model)
    gauge_fix(model, torch.optim.AdamW(model.parameters()))
    pending = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    zoo_loss("gpt_gqa", model, x).backward()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, w0[n])]
    assert changed
    for n, p in model.named_parameters():
        torch.testing.assert_close(pending[n], p.grad, rtol=1e-10, atol=1e-14)
    assert any(not torch.equal(grads_before[n], pending[n]) for n in changed)  # not vacuous


@pytest.mark.parametrize("host", ["FixSteps", "GaugeOptimizer"])
def test_hosts_refuse_unknown_state_at_the_first_step_not_at_step_every(host):
    """The step core and the wrapper (fix every 100) refuse an unknown optimizer when its first
    step creates the state, before any write."""
    from gaugeopt.integrations.optim import GaugeOptimizer
    from gaugeopt.integrations.steps import FixSteps

    case = zoo.build(LRM, lrm=True)
    add_drift(case.model, True)
    inner = Sign(case.model.parameters())
    opt = inner
    if host == "FixSteps":
        FixSteps(every=100).watch(case.model, inner)
    else:
        opt = GaugeOptimizer(inner, case.model, project=None, fix_every=100)
    zoo_loss(LRM, case.model, batches(1)[0]).backward()
    with pytest.raises(GaugeError, match="Sign has no state rule"):
        opt.step()
