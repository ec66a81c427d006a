"""GaugeOptimizer behaves as the optimizer it wraps, and its steps are gauge-orthogonal."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch

import gaugeopt
import projection_helpers as H
from gaugeopt import GaugeError
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.integrations.optim import GaugeOptimizer
from gaugeopt.projection.projector import GaugeProjector
from gaugeopt.trust.invariance import randomize_parameters


VOCAB, T = 32, 12


def _model(dtype=torch.float64, lrm=False, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=16)
    model = GPT(GPTConfig(**{**cfg, **kw}))
    if lrm:
        gaugeopt.apply_lrm(model)
    model = model.to(dtype)
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    return model


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, T), generator=g) for _ in range(n)]


def _train(model, opt, batches, sched=None, scaler=None):
    for x in batches:
        opt.zero_grad()
        loss = model(x, x.roll(-1, 1))[1]
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if sched is not None:
            sched.step()
    return loss


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("lrm, rope", [(False, "none"), (False, "split_half"), (True, "none")])
def test_training_with_scheduler_every_update_is_horizontal(lrm, rope):
    """AdamW + LR scheduler through the wrapper: each applied update has vertical fraction <= 1e-10
    at the point it starts from, while the unwrapped AdamW update is far from horizontal."""
    model = _model(lrm=lrm, rope=rope)
    ref_model = copy.deepcopy(model)
    opt = GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=1e-2, total_steps=8)
    proj = GaugeProjector(model)
    raw = []
    for x in _batches(6):
        before = _snapshot(model)
        opt.zero_grad()
        model(x, x.roll(-1, 1))[1].backward()
        opt.step()
        sched.step()
        applied = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        assert gaugeopt.vertical_fraction(model, applied, projector=proj, at=before) <= 1e-10
        # the same step unprojected (the wrapper reports it) is not horizontal
        raw.append(opt.last_vertical_fraction)
        ref_opt.zero_grad()
        ref_model(x, x.roll(-1, 1))[1].backward()
        ref_opt.step()
        ref_sched.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]  # the scheduler drives the inner groups
    assert min(raw) > 1e-3
    assert opt.state_dict()["gauge_projected"]["step"] == 6


def test_parameters_outside_the_gauge_are_bit_identical_to_the_unwrapped_optimizer():
    """Fed the same gradients, embeddings/MLP/norms evolve exactly as without the wrapper."""
    model = _model(dtype=torch.float32)
    ref = copy.deepcopy(model)
    opt = GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    gauge = set(opt.projector.param_names())
    assert "transformer.h.0.mlp.c_fc.weight" not in gauge and "transformer.ln_f.weight" not in gauge
    assert "transformer.h.0.attn.c_proj.bias" not in gauge  # only the value-bias trade moves it: "all", not "auto"
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    moved = 0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if n in gauge:
            moved += int(not torch.equal(p, q))
        else:
            assert torch.equal(p, q), n
    assert moved == len(gauge)


def test_state_dict_round_trip_resumes_bit_identically():
    batches = _batches(8, seed=1)

    def make():
        model = _model(dtype=torch.float32, lrm=True, seed=2)
        opt = GaugeOptimizer(torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=3e-3)), model, fix_every=3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched

    model, opt, sched = make()
    _train(model, opt, batches, sched)
    straight = _snapshot(model)

    model, opt, sched = make()
    _train(model, opt, batches[:4], sched)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    saved_own = opt.state_dict()["gauge_projected"]
    assert saved_own == {"version": 1, "step": 4, "fixes": 1, "nonfinite_steps": 0, "project": "update", "mode": "exact",
                         "fix_every": 3, "sectors": "auto"}

    model, opt, sched = make()
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"])
    assert opt.state_dict()["gauge_projected"] == saved_own
    _train(model, opt, batches[4:], sched)
    for n, p in model.named_parameters():
        assert torch.equal(p, straight[n]), n
    assert opt.state_dict()["gauge_projected"]["fixes"] == 2  # steps 3 and 6


def test_load_state_dict_restores_counters_reports_option_conflicts_and_accepts_a_plain_inner_state():
    model = _model()
    opt = GaugeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    _train(model, opt, _batches(2))
    other = GaugeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, project="grad", mode="approx")
    with pytest.warns(RuntimeWarning, match=r"project: checkpoint 'update', constructor 'grad'; mode: checkpoint 'exact', "
                                            r"constructor 'approx'\). The constructor's options are kept"):
        other.load_state_dict(opt.state_dict())
    assert (other.project, other.mode, other.state_dict()["gauge_projected"]["step"]) == ("grad", "approx", 2)
    plain = GaugeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    plain.load_state_dict(opt.optimizer.state_dict())
    assert plain.state_dict()["gauge_projected"]["step"] == 0
    assert len(plain.state) == len(opt.state)


def test_pickle_round_trip():
    model = _model()
    opt = GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    _train(model, opt, _batches(2))
    model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    assert isinstance(opt2, GaugeOptimizer) and opt2.param_groups[0]["params"][0] is next(model2.parameters())
    batches = _batches(2, seed=5)
    _train(model, opt, batches)
    _train(model2, opt2, batches)
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n


def test_grad_mode_projects_gradients_before_the_inner_step():
    model = _model()
    proj = GaugeProjector(model)
    seen = {}

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return super().step(closure)

    opt = GaugeOptimizer(Spy(model.parameters(), lr=0.1), model, project="grad")
    x = _batches(1)[0]
    opt.zero_grad()
    model(x, x.roll(-1, 1))[1].backward()
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    # the gradient of a gauge-invariant loss is horizontal already: only rounding is removed
    assert gaugeopt.vertical_fraction(model, raw, projector=proj) <= 1e-12
    opt.step()
    assert H.norm({n: seen[n] - raw[n] for n in raw}) <= 1e-12 * H.norm(raw)
    # a synthetic vertical-heavy gradient is made horizontal before the inner optimizer sees it
    opt.zero_grad()
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    theta = _snapshot(model)
    assert gaugeopt.vertical_fraction(model, before, projector=proj) > 1e-2
    opt.step()
    assert opt.last_vertical_fraction > 1e-2
    assert gaugeopt.vertical_fraction(model, {n: seen[n] for n in before}, projector=proj, at=theta) <= 1e-12
    for n in ("transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight"):
        assert torch.equal(seen[n], before[n])


@pytest.mark.parametrize("project", ["update", "grad"])
def test_step_with_closure(project):
    model = _model()
    x = _batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = model(x, x.roll(-1, 1))[1]
        loss.backward()
        return loss

    opt = GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, project=project)
    first = float(opt.step(closure))
    for _ in range(3):
        last = float(opt.step(closure))
    assert last < first
    if project == "update":  # an optimizer that re-evaluates the closure
        lb = GaugeOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3), model)
        before = _snapshot(model)
        lb.step(closure)
        applied = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        assert gaugeopt.vertical_fraction(model, applied, at=before) <= 1e-10
    else:
        with pytest.raises(GaugeError, match="LBFGS"):
            GaugeOptimizer(torch.optim.LBFGS(model.parameters()), model, project="grad")


def test_grad_scaler_on_cpu():
    """scaler.step(opt): unscaling acts on the shared groups (power-of-two scales are exact, so the
    result equals the unscaled run bit for bit), and a step with inf gradients is skipped."""
    batches = _batches(3, seed=4)
    a, b = _model(dtype=torch.float32), _model(dtype=torch.float32)
    opt_a = GaugeOptimizer(torch.optim.AdamW(a.parameters(), lr=1e-2), a)
    opt_b = GaugeOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2), b)
    scaler = torch.amp.GradScaler(device="cpu", init_scale=2.0**10)
    _train(a, opt_a, batches, scaler=scaler)
    _train(b, opt_b, batches)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    # an overflowing step is skipped by the scaler: nothing moves, the wrapper does not count it
    before, steps, scale = _snapshot(a), opt_a.state_dict()["gauge_projected"]["step"], scaler.get_scale()
    opt_a.zero_grad()
    x = batches[0]
    scaler.scale(a(x, x.roll(-1, 1))[1]).backward()
    next(a.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt_a)
    scaler.update()
    assert all(torch.equal(p, before[n]) for n, p in a.named_parameters())
    assert opt_a.state_dict()["gauge_projected"]["step"] == steps and scaler.get_scale() < scale


def test_param_groups_zero_grad_add_param_group():
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = GaugeOptimizer(inner, model)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert len(inner.param_groups) == 2 and inner.param_groups[1]["lr"] == 0.5
    extra.grad = torch.ones(3, dtype=torch.float64)
    _train(model, opt, _batches(1))  # zero_grad inside clears extra.grad before the step
    assert extra.grad is None and torch.equal(extra, torch.zeros(3, dtype=torch.float64))
    calls = []
    handle = opt.register_step_post_hook(lambda o, a, k: calls.append(type(o).__name__))
    _train(model, opt, _batches(1))
    handle.remove()
    assert calls == ["GaugeOptimizer"]
    assert "GaugeOptimizer(project='update'" in repr(opt)


def test_refusals():
    model = _model()
    inner = torch.optim.AdamW(model.parameters())
    for kw, match in (
        (dict(project="both"), "project="),
        (dict(mode="fast"), "mode="),
        (dict(fix_every=0), "fix_every"),
    ):
        with pytest.raises(GaugeError, match=match):
            GaugeOptimizer(inner, model, **kw)
    with pytest.raises(GaugeError, match="already wrapped"):
        GaugeOptimizer(GaugeOptimizer(inner, model), model)
    with pytest.raises(GaugeError, match="torch.optim.Optimizer"):
        GaugeOptimizer(object(), model)
    attn_free = [p for n, p in model.named_parameters() if "c_attn" not in n]
    with pytest.raises(GaugeError, match="not in the optimizer"):
        GaugeOptimizer(torch.optim.AdamW(attn_free), model)
    # restricting the projection to the layers the optimizer owns is the way out
    sites = gaugeopt.find_attention(model)
    layer1 = [p for n, p in model.named_parameters() if n.startswith("transformer.h.1.")]
    GaugeOptimizer(torch.optim.AdamW(layer1), model, sites=sites[1:])


def test_fix_every_runs_gaugefix_with_the_inner_optimizer():
    """GaugeFix-LRM every N steps (gaugeopt.fix.gaugefix): the Q/K multiplier drift is reset to 0."""
    model = _model(lrm=True, dtype=torch.float32)
    opt = GaugeOptimizer(torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2)), model, fix_every=2)
    _train(model, opt, _batches(3))
    assert opt.state_dict()["gauge_projected"]["fixes"] == 1
    _train(model, opt, _batches(1, seed=9))
    assert opt.state_dict()["gauge_projected"]["fixes"] == 2
    assert gaugeopt.qk_drift(model) < 1e-5


def test_lightning_configure_optimizers():
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model(dtype=torch.float32)
            self.fractions = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model(x, y)[1]

        def on_train_batch_end(self, *args):
            self.fractions.append(self.trainer.optimizers[0].last_vertical_fraction)

        def configure_optimizers(self):
            opt = GaugeOptimizer(torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1), self.model)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    x = torch.stack(_batches(2, seed=7)).reshape(-1, T)
    data = DataLoader(TensorDataset(x, x.roll(-1, 1)), batch_size=4)
    lit = Lit()
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lit, data)
    opt = trainer.optimizers[0]
    assert isinstance(opt, GaugeOptimizer)
    assert opt.state_dict()["gauge_projected"]["step"] == 4
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**4)
    assert len(lit.fractions) == 4 and min(lit.fractions) > 1e-3


# ---------------------------------------------------------------------- project=None: GaugeFix alone
def _lrm_gqa(seed=2):
    return _model(dtype=torch.float32, lrm=True, seed=seed)


def test_fix_only_leaves_everything_but_the_qk_multipliers_bit_identical():
    """project=None, fix_every=3, 30 steps fed the same gradients as a bare AdamW: every parameter
    and every optimizer state entry outside r_Q, r_K is bit-identical to the bare run's; r_Q, r_K
    are rescaled (their drift is ~0 after each fix) and their Adam moments transported."""
    model = _lrm_gqa()
    ref = copy.deepcopy(model)
    opt = GaugeOptimizer(torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2)), model,
                         project=None, fix_every=3)
    ref_opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(ref, "B", lr=1e-2))
    qk = gaugeopt.adapters.apply_lrm.qk_multiplier_names(model)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 31):
        opt.zero_grad()
        ref_opt.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        if step % 3 == 0:
            assert opt.last_report.max_drift_before > 1e-3 and gaugeopt.qk_drift(model) <= 1e-6
    assert opt.state_dict()["gauge_projected"]["fixes"] == 10
    ref_params = dict(ref.named_parameters())
    moved = 0
    for n, p in model.named_parameters():
        q = ref_params[n]
        if n in qk:
            moved += int(not torch.equal(p, q))
            continue
        assert torch.equal(p, q), n
        for key, value in opt.state[p].items():
            assert torch.equal(value, ref_opt.state[q][key]), (n, key)
    assert moved == len(qk) == 4


def test_fix_only_equals_the_bare_optimizer_with_gauge_fix_after_every_nth_step():
    """Real training: the wrapper is the bare optimizer plus gauge_fix(model, inner) after steps
    4, 8, ... — every parameter bit-identical, with an LR scheduler on the wrapper."""
    batches = _batches(12, seed=6)

    def make():
        model = _lrm_gqa()
        inner = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2))
        return model, inner, torch.optim.lr_scheduler.StepLR(inner, step_size=5, gamma=0.5)

    model, inner, _ = make()
    opt = GaugeOptimizer(inner, model, project=None, fix_every=4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    _train(model, opt, batches, sched)
    ref, ref_opt, ref_sched = make()
    for k, x in enumerate(batches, 1):
        ref_opt.zero_grad()
        ref(x, x.roll(-1, 1))[1].backward()
        ref_opt.step()
        if k % 4 == 0:
            gaugeopt.gauge_fix(ref, ref_opt)
        ref_sched.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    assert opt.state_dict()["gauge_projected"]["fixes"] == 3 and opt.last_vertical_fraction != opt.last_vertical_fraction


def test_fix_only_with_grad_scaler_counts_real_steps_and_resumes_bit_identically():
    """scaler.step(opt) skips the overflowing steps 3 and 7: the wrapper counts 8 of 10 and fixes
    after real steps 4 and 8 (iterations 5 and 10); a copy restored from the state dict after
    iteration 6 (5 real steps) ends identical — with a forgotten counter it would not fix at 10."""
    batches = _batches(10, seed=8)

    def make():
        model = _lrm_gqa()
        opt = GaugeOptimizer(torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2)), model,
                             project=None, fix_every=4)
        return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**8)

    def run(model, opt, scaler, ks):
        for k in ks:
            x = batches[k - 1]
            opt.zero_grad()
            scaler.scale(model(x, x.roll(-1, 1))[1]).backward()
            if k in (3, 7):
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()

    model, opt, scaler = make()
    run(model, opt, scaler, range(1, 11))
    own = opt.state_dict()["gauge_projected"]
    assert (own["step"], own["fixes"], own["project"]) == (8, 2, None)

    half, half_opt, half_scaler = make()
    run(half, half_opt, half_scaler, range(1, 7))
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "opt": half_opt.state_dict(), "scaler": half_scaler.state_dict()}, buf)
    resumed, resumed_opt, resumed_scaler = make()
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    resumed.load_state_dict(ck["model"])
    resumed_opt.load_state_dict(ck["opt"])
    resumed_scaler.load_state_dict(ck["scaler"])
    assert resumed_opt.state_dict()["gauge_projected"]["step"] == 5
    run(resumed, resumed_opt, resumed_scaler, range(7, 11))
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
    assert resumed_opt.state_dict()["gauge_projected"] == own


def test_fix_only_refusals():
    model = _lrm_gqa()
    inner = torch.optim.AdamW(model.parameters())
    with pytest.raises(GaugeError, match="fix_every=None does nothing"):
        GaugeOptimizer(inner, model, project=None)
    with pytest.raises(GaugeError, match="project=None turns off"):
        GaugeOptimizer(inner, model, project=None, fix_every=2, rtol=1e-3)
    with pytest.raises(GaugeError, match="fix_every"):
        GaugeOptimizer(inner, model, project=None, fix_every=True)
    # the fix's options and the optimizer are checked at construction, not at step N
    with pytest.raises(GaugeError, match="granularity"):
        GaugeOptimizer(inner, model, project=None, fix_every=2, fix_kwargs={"granularity": "row"})
    with pytest.raises(GaugeError, match="steps none of the"):
        GaugeOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), model, project=None, fix_every=2)


def test_grad_mode_reports_the_fraction_of_the_gradient_it_received():
    """last_vertical_fraction = ‖Π_vert g‖/‖g‖ of the gradient before projection (not of what is left)."""
    model = _model()
    proj = GaugeProjector(model)
    opt = GaugeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, project="grad")
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    expected = gaugeopt.vertical_fraction(model, {n: p.grad.clone() for n, p in model.named_parameters()
                                                  if n in set(proj.param_names())}, projector=proj)
    opt.step()
    assert expected > 0.1 and opt.last_vertical_fraction == pytest.approx(expected, rel=1e-9)
