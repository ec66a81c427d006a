"""The framework-free core of the integrations (gaugeopt.integrations.steps) and the optimizer
wrappers it and the fix look through: Accelerate's AcceleratedOptimizer, GaugeOptimizer,
containers of optimizers."""

from __future__ import annotations

import copy

import pytest
import torch

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.fix.transport import unwrap_optimizer
from gaugeopt.integrations.steps import FixSteps, ProjectSteps, owning_optimizer
from gaugeopt.models import GPT, GPTConfig
from accelerate_helpers import fresh_accelerator

VOCAB, T = 32, 12


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=16)
    return gaugeopt.apply_lrm(GPT(cfg))


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, T), generator=g) for _ in range(n)]


def _step(model, opt, x):
    opt.zero_grad()
    model(x, x.roll(-1, 1))[1].backward()
    opt.step()


class Container(torch.optim.Optimizer):
    """The shape of torchtitan's OptimizersContainer: an Optimizer over all parameters (for its
    hooks) whose state lives in the optimizers it holds in ``.optimizers``."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        super().__init__([p for o in self.optimizers for g in o.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def _split(model):
    """AdamW on the attention and everything else, Adam on the token embedding."""
    wte = model.transformer.wte.weight
    return torch.optim.AdamW([p for p in model.parameters() if p is not wte], lr=1e-2), torch.optim.Adam([wte], lr=1e-2)


def test_gauge_fix_looks_through_wrappers_to_the_state_it_transports():
    """gauge_fix(model, wrapper) transports the Adam moments exactly as gauge_fix(model, inner):
    for Accelerate's AcceleratedOptimizer and GaugeOptimizer (optimizers whose state is the inner
    one's and whose class has no state rule) and for a container holding one optimizer; a
    container of two names the problem."""
    pytest.importorskip("accelerate")
    accelerator = fresh_accelerator()
    x = _batches(1)[0]
    results = []
    for wrap in (lambda o, m: o, lambda o, m: accelerator.prepare_optimizer(o),
                 lambda o, m: gaugeopt.GaugeOptimizer(o, m), lambda o, m: Container([o])):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = wrap(inner, model)
        assert unwrap_optimizer(opt) is inner
        for _ in range(3):
            _step(model, inner, x)
        report = gaugeopt.gauge_fix(model, opt)
        assert len(report.transported) == 4 and report.max_drift_before > 1e-5
        results.append((dict(model.named_parameters()), {n: inner.state[p] for n, p in model.named_parameters()}))
    ref_params, ref_state = results[0]
    for params, state in results[1:]:
        for n, p in params.items():
            assert torch.equal(p, ref_params[n]), n
            assert all(torch.equal(v, ref_state[n][k]) for k, v in state[n].items()), n
    # a container of two: each parameter's state is found in the member that steps it
    model = _model()
    adamw, adam = _split(model)
    for _ in range(2):
        _step(model, Container([adamw, adam]), x)
    assert len(gaugeopt.gauge_fix(model, Container([adam, adamw])).transported) == 4
    with pytest.raises(GaugeError, match="holds 2 optimizers"):
        unwrap_optimizer(Container([adam, adamw]))


def test_owning_optimizer_watches_the_optimizer_behind_accelerate_and_inside_containers():
    pytest.importorskip("accelerate")
    accelerator = fresh_accelerator()
    model = _model()
    fix = FixSteps(every=1)
    fix.bind(model)
    inner = torch.optim.AdamW(model.parameters())
    # AcceleratedOptimizer.step runs for skipped steps too (it reports step_was_skipped): watch the inner one
    assert owning_optimizer(accelerator.prepare_optimizer(inner), fix.watched_params(), "x") is inner
    projected = gaugeopt.GaugeOptimizer(inner, model)  # its step runs only for real steps: watched itself
    assert owning_optimizer([projected], fix.watched_params(), "x") is projected
    adamw, adam = _split(model)
    assert owning_optimizer(Container([adam, adamw]), fix.watched_params(), "x") is adamw
    with pytest.raises(GaugeError, match="split over 2 optimizers"):
        site = gaugeopt.find_attention(model)[0]
        q = site.q.row_mult.param
        owning_optimizer([torch.optim.AdamW([q]), torch.optim.AdamW([p for p in model.parameters() if p is not q])],
                         fix.watched_params(), "x")
    with pytest.raises(GaugeError, match="no optimizer of this run"):
        owning_optimizer(adam, fix.watched_params(), "x")


def test_fix_steps_on_a_container_of_two_optimizers():
    """FixSteps.watch(model, container): counts the container's steps through the member that
    owns the attention, fixes every 3rd and transports that member's state — the same as
    gauge_fix(model, member) after steps 3 and 6 of a bare run."""
    batches = _batches(7, seed=1)
    model = _model()
    container = Container(_split(model))
    fix = FixSteps(every=3).watch(model, container)
    ref = copy.deepcopy(model)
    ref_adamw, ref_adam = _split(ref)
    for k, x in enumerate(batches, 1):
        _step(model, container, x)
        for o in (ref_adamw, ref_adam):
            o.zero_grad()
        ref(x, x.roll(-1, 1))[1].backward()
        ref_adamw.step()
        ref_adam.step()
        if k % 3 == 0:
            gaugeopt.gauge_fix(ref, ref_adamw)
    assert fix.state_dict() == {"optimizer_steps": 7, "fixes": 2}
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    metrics = fix.pop_metrics()
    assert metrics["gauge/fixes"] == 2.0 and metrics["gauge/qk_drift_after"] <= 1e-6 and fix.pop_metrics() == {}
    fix.detach()
    _step(model, container, batches[0])
    assert fix.optimizer_steps == 7  # no hooks left


@pytest.mark.parametrize("order", [("fix", "project"), ("project", "fix")])
def test_a_projection_runs_before_a_fix_on_the_same_optimizer(order):
    """Attached in either order, the projection's hooks run first: the fix balances the point the
    projected step reached (a projection after the fix would undo it: drift ~1e-2)."""
    batches = _batches(4, seed=2)
    model = _model()
    opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=3e-2))
    counters = {"fix": FixSteps(every=2), "project": ProjectSteps(log_every=2)}
    for name in order:
        counters[name].watch(model, opt)
    for x in batches:
        _step(model, opt, x)
    assert counters["fix"].last_report.max_drift_before > 1e-4
    assert gaugeopt.qk_drift(model) <= 1e-6
    assert counters["project"].pop_metrics()["gauge/vertical_fraction_update"] > 1e-3


def test_state_dict_round_trip_and_refusals():
    a = FixSteps(every=4)
    a.optimizer_steps, a.fixes = 13, 3
    b = FixSteps(every=4)
    b.load_state_dict(a.state_dict())
    assert (b.optimizer_steps, b.fixes) == (13, 3)
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(GaugeError, match="every="):
            FixSteps(every=bad)
    with pytest.raises(GaugeError, match="log_every="):
        ProjectSteps(log_every=0)
    with pytest.raises(GaugeError, match="target="):
        ProjectSteps(target="both")
    with pytest.raises(GaugeError, match="granularity"):
        FixSteps(granularity="row")
