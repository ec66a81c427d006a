"""Optimizer-state transport: the step after a gauge fix is the step the optimizer would take in
the new coordinates, derived independently by running the optimizer from scratch on a
reparameterised copy (autograd gives the transported gradients); policies for unknown
optimizers; storage-layout factors."""

import pytest
import torch

import gaugeopt
import zoo
from gaugefix_helpers import add_drift, snapshot_params
from gaugeopt import GaugeError
from gaugeopt.fix import gauge_fix
from gaugeopt.fix.transport import (
    classify_state, register_state_rule, rescale_param, rescale_state, state_rule, storage_factor,
)
from transport_helpers import Sign, batches, fixed_then_step, key_bias_mask, max_rel, oracle, step

OPTIMIZERS = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "adamw_wd_amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adamw_foreach": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True),
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=1e-1, momentum=0.9, nesterov=True),
    "sgd_dampening": lambda m: torch.optim.SGD(m.parameters(), lr=1e-1, momentum=0.9, dampening=0.2),
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2),
    "radam": lambda m: torch.optim.RAdam(m.parameters(), lr=1e-2),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-1),
}
MODELS = [("gpt_rope_split_half_gqa", True), ("hf_gpt2", False), ("gpt_gqa", False)]
_batches, _step = batches, step


def _fixed_then_step(name, lrm, make_opt, **fix_kwargs):
    return fixed_then_step(name, lrm, make_opt, **fix_kwargs)[:7]


def _oracle(name, initial, make_opt, batches, snapshots, scale, fixed):
    return oracle(name, initial, make_opt, batches, snapshots, scale, fixed)


_max_rel, _key_bias_mask = max_rel, key_bias_mask


# every optimizer on the LRM model (1-D multipliers), the main ones on the plain layouts
# (fused nn.Linear rows, transposed HF Conv1D columns)
COMBOS = [(opt, *MODELS[0]) for opt in OPTIMIZERS] + [
    (opt, *m) for m in MODELS[1:] for opt in ("adam", "adamw_wd_amsgrad", "sgd_nesterov")]


@pytest.mark.parametrize("opt_name, name, lrm", COMBOS, ids=[f"{o}-{n}" + ("+lrm" if l else "") for o, n, l in COMBOS])
def test_transport_equals_optimizer_in_new_coordinates(name, lrm, opt_name):
    make = OPTIMIZERS[opt_name]
    initial, batches, snaps, scale, fixed, result, report = _fixed_then_step(name, lrm, make)
    expected = _oracle(name, initial, make, batches, snaps, scale, fixed)
    noise = _key_bias_mask(initial)
    assert _max_rel(expected, result, skip=noise) <= 1e-12
    assert _max_rel(expected, result) <= 1e-8
    assert report.transported and not report.reset and not report.left


@pytest.mark.parametrize("opt_name", ["adam", "adamw_wd_amsgrad", "sgd_nesterov"])
def test_negative_control_stale_state_differs(opt_name):
    """Without transport (paper 002's setting) the next step is measurably different: the
    oracle comparison above would catch a missing rescale."""
    make = OPTIMIZERS[opt_name]
    initial, batches, snaps, scale, fixed, result, report = _fixed_then_step(
        "gpt_rope_split_half_gqa", True, make, transport_state=False)
    expected = _oracle("gpt_rope_split_half_gqa", initial, make, batches, snaps, scale, fixed)
    assert _max_rel(expected, result) > 1e-6
    assert not report.transported


def test_negative_control_wrong_power_differs():
    """A rule with the wrong power for exp_avg_sq (s instead of s²) fails the oracle."""
    make = OPTIMIZERS["adam"]
    good = state_rule(torch.optim.Adam(torch.nn.Linear(1, 1).parameters()))
    try:
        register_state_rule(torch.optim.Adam, {"exp_avg": 1, "exp_avg_sq": 1, "max_exp_avg_sq": 2})
        initial, batches, snaps, scale, fixed, result, _ = _fixed_then_step("hf_gpt2", False, make)
    finally:
        register_state_rule(torch.optim.Adam, good)
    expected = _oracle("hf_gpt2", initial, make, batches, snaps, scale, fixed)
    assert _max_rel(expected, result) > 1e-6


def test_rescale_state_formulas():
    p = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [3.0, 0.5]], dtype=torch.float64))
    opt = torch.optim.AdamW([p], amsgrad=True)
    p.grad = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=torch.float64)
    opt.step()
    st = {k: v.clone() for k, v in opt.state[p].items()}
    s = torch.tensor([[2.0], [0.25]], dtype=torch.float64)  # per row, broadcast over columns
    assert rescale_state(opt, p, s) == "transported"
    new = opt.state[p]
    assert torch.equal(new["exp_avg"], st["exp_avg"] / s)
    assert torch.equal(new["exp_avg_sq"], st["exp_avg_sq"] / s**2)
    assert torch.equal(new["max_exp_avg_sq"], st["max_exp_avg_sq"] / s**2)
    assert torch.equal(new["step"], st["step"])


def _trained(make_opt):
    case = zoo.build("gpt_gqa", lrm=True)
    add_drift(case.model, True)
    opt = make_opt(case.model.parameters())
    step("gpt_gqa", case.model, opt, batches(1)[0])
    return case.model, opt


def test_unknown_optimizer_error_names_options_and_writes_nothing():
    model, opt = _trained(Sign)
    before = snapshot_params(model)
    with pytest.raises(GaugeError) as err:
        gauge_fix(model, opt)
    msg = str(err.value)
    for fragment in ("Sign", "unknown_state='reset'", "'leave'", "transport_state=False", "register_state_rule"):
        assert fragment in msg
    after = snapshot_params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # refused before the first write


def test_unknown_optimizer_reset_and_leave():
    model, opt = _trained(Sign)
    touched = {id(p) for s in gaugeopt.find_attention(model) for p in (s.q.row_mult.param, s.k.row_mult.param)}
    bufs = {id(p): opt.state[p]["buf"].clone() for p in model.parameters()}
    report = gauge_fix(model, opt, unknown_state="leave")
    assert len(report.left) == 4 and not report.transported
    assert all(torch.equal(opt.state[p]["buf"], bufs[id(p)]) for p in model.parameters())
    report = gauge_fix(model, opt, unknown_state="reset")
    assert len(report.reset) == 4
    for p in model.parameters():
        assert (p not in opt.state) == (id(p) in touched)
    opt.step()  # the optimizer re-initialises the reset state lazily
    assert gauge_fix(model, opt, transport_state=False).transported == []


def test_unknown_state_key_on_a_known_class():
    class AdamPlus(torch.optim.Adam):
        @torch.no_grad()
        def step(self, closure=None):
            super().step(closure)
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["ema"] = p.detach().clone()

    model, opt = _trained(lambda ps: AdamPlus(ps))
    with pytest.raises(GaugeError, match=r"AdamPlus keeps state keys \['ema'\]"):
        gauge_fix(model, opt)


def test_registered_rule_and_wrapper_unwrapping():
    class Wrapper:  # like Lightning's LightningOptimizer
        def __init__(self, optimizer):
            self._optimizer = optimizer

    class Sign2(Sign):
        pass

    register_state_rule(Sign2, {"buf": 1})
    model, opt = _trained(Sign2)
    p = gaugeopt.find_attention(model)[0].q.row_mult.param
    buf = opt.state[p]["buf"].clone()
    old = p.detach().clone()
    report = gauge_fix(model, Wrapper(opt))
    assert len(report.transported) == 4
    torch.testing.assert_close(opt.state[p]["buf"], buf * old / p.detach(), rtol=1e-14, atol=0)
    with pytest.raises(GaugeError, match="powers must be integers"):
        register_state_rule(Sign2, {"buf": 1.5})
    with pytest.raises(GaugeError, match="wraps none"):
        classify_state(object(), p)


def test_no_state_yet_is_fine():
    case = zoo.build("gpt", lrm=True)
    opt = torch.optim.Adam(case.model.parameters())
    report = gauge_fix(case.model, opt)
    assert report.transported == [] and report.reset == [] and len(opt.state) == 0


@pytest.mark.parametrize("name", ["hf_gpt2", "gpt_gqa", "torch_mha"])
def test_storage_factor_layout(name):
    """A canonical per-channel factor lands on the right rows of the stored (possibly fused,
    possibly transposed) parameter, and nowhere else."""
    case = zoo.build(name)
    site = gaugeopt.find_attention(case.model)[0]
    g = torch.Generator().manual_seed(0)
    members = {m.role: m for kind in ("qk", "vo") for side in site.pair(kind).sides() for m in side.members("plain")}
    for proj, role in (("q", "weight"), ("k", "weight"), ("k", "bias"), ("o", "weight")):
        ref = getattr(getattr(site, proj), role)
        if ref is None:
            continue
        member = members[f"{proj}.{role}"]
        assert member.ref is ref
        heads, width = (site.h, site.d_v) if proj == "o" else (ref.shape[0], ref.shape[1])
        f = torch.rand(heads, width, generator=g, dtype=torch.float64) + 0.5
        p = ref.param
        old = p.detach().clone()
        view_before = ref.view(old).clone()
        with torch.no_grad():
            rescale_param(p, storage_factor(member, f))
        if proj == "o":
            expected = view_before * f[None]
        elif role == "weight":
            expected = view_before * f[..., None]
        else:
            expected = view_before * f
        assert torch.equal(ref.get(), expected)
        mask = torch.ones_like(old, dtype=torch.bool)
        ref.view(mask).fill_(False)
        assert torch.equal(p.detach()[mask], old[mask])  # the other rows of a fused parameter
        with torch.no_grad():
            p.copy_(old)
