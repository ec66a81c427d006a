"""Muon for the 2-D matrices beside AdamW for the rest, through every entry point: the step core
(rounds: the fix after both stepped; a skipped step; the order of the two), GaugeOptimizer over
both (projection of the joint update, fix_every, state_dict, GradScaler), Lightning, the Hugging
Face Trainer, Accelerate."""

from __future__ import annotations

import copy

import pytest
import torch

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.integrations.optim import GaugeOptimizer
from gaugeopt.integrations.steps import FixSteps, ProjectSteps
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.projection.projector import GaugeProjector
from gaugeopt.trust.invariance import randomize_parameters
from transport_helpers import matrices_and_rest

VOCAB, T = 32, 12


def _model(lrm=False, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                          rope="split_half"))
    if lrm:
        gaugeopt.apply_lrm(model)
    model = model.to(dtype)
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    return model


def _opts(model):
    mats, rest = matrices_and_rest(model)
    return torch.optim.Muon(mats, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, T), generator=g) for _ in range(n)]


def _backward(model, x):
    model(x, x.roll(-1, 1))[1].backward()


def _snap(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


# ---------------------------------------------------------------------- the step core
@pytest.mark.parametrize("lrm", [False, True])
@pytest.mark.parametrize("order", ["muon_first", "adamw_first"])
def test_fix_steps_fix_once_both_optimizers_stepped(lrm, order):
    """FixSteps.watch(model, [muon, adamw]) counts rounds (one per iteration, whichever steps first)
    and fixes right after the round's last step: bit-identical to the bare loop calling
    gauge_fix(model, [muon, adamw]) after both steps of every 2nd iteration."""
    model = _model(lrm)
    ref = copy.deepcopy(model)
    opts, ref_opts = _opts(model), _opts(ref)
    if order == "adamw_first":
        opts, ref_opts = opts[::-1], ref_opts[::-1]
    fix = FixSteps(every=2).watch(model, list(opts))
    for k, x in enumerate(_batches(6), 1):
        for m, os_ in ((model, opts), (ref, ref_opts)):
            for o in os_:
                o.zero_grad()
            _backward(m, x)
            for o in os_:
                o.step()
        if k % 2 == 0:
            report = gaugeopt.gauge_fix(ref, list(ref_opts))
            assert report.transported and report.max_drift_before > 1e-6
        assert _same(_snap(model), _snap(ref)), k
    assert fix.state_dict() == {"optimizer_steps": 6, "fixes": 3}
    assert fix.pop_metrics()["gauge/qk_drift_after"] <= 1e-10
    muon = opts[0] if order == "muon_first" else opts[1]
    named = dict(model.named_parameters())
    moved = [n for n in fix.last_report.transported if named[n] in muon.state]
    assert bool(moved) == (not lrm)  # plain: the Q/K rows are Muon's matrices; LRM: the multipliers are AdamW's


def test_a_skipped_step_keeps_the_round_open_and_the_fix_stays_exact():
    """Iteration 2: Muon's step is skipped (as a GradScaler skips an optimizer whose gradients
    overflowed). The round closes at Muon's next step — in the middle of iteration 3, before AdamW
    stepped — and the fix there moves AdamW's pending gradients with the parameters: bit-identical
    to gauge_fix by hand at that point, and the function is kept."""
    model = _model()
    ref = copy.deepcopy(model)
    (muon, adamw), (rmuon, radamw) = _opts(model), _opts(ref)
    fix = FixSteps(every=2).watch(model, [muon, adamw])
    xs = _batches(4)
    for k, x in enumerate(xs, 1):
        for m, (mu, ad) in ((model, (muon, adamw)), (ref, (rmuon, radamw))):
            mu.zero_grad()
            ad.zero_grad()
            _backward(m, x)
            if k != 2:
                mu.step()
            if m is ref and k == 3:  # the round (Muon at 2 skipped) closes at Muon's step 3: fix by hand there
                pending = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
                gaugeopt.gauge_fix(ref, [rmuon, radamw])
                moved = [n for n, p in ref.named_parameters() if p.grad is not None and not torch.equal(p.grad, pending[n])]
                assert moved  # AdamW's pending gradients of rescaled tensors were moved
            ad.step()
        assert _same(_snap(model), _snap(ref)), k
    assert fix.state_dict() == {"optimizer_steps": 3, "fixes": 1}


def test_projection_of_the_joint_update_of_both_optimizers():
    """ProjectSteps over [muon, adamw] snapshots before the first step of a round and projects the
    whole update after the last: every applied update is horizontal (the LRM internal gauges span
    Muon's matrices and AdamW's multipliers)."""
    model = _model(lrm=True)
    opts = _opts(model)
    proj = ProjectSteps(log_every=1).watch(model, list(opts))
    projector = GaugeProjector(model)
    for x in _batches(4):
        before = _snap(model)
        for o in opts:
            o.zero_grad()
        _backward(model, x)
        for o in opts:
            o.step()
        applied = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        assert gaugeopt.vertical_fraction(model, applied, projector=projector, at=before) <= 1e-10
        assert proj.pop_metrics()["gauge/vertical_fraction_update"] > 1e-3


# ---------------------------------------------------------------------- GaugeOptimizer over several
def test_gauge_projected_over_two_optimizers_projects_the_joint_update():
    model = _model(lrm=True)
    ref = copy.deepcopy(model)
    opt = GaugeOptimizer(list(_opts(model)), model)
    ref_opts = _opts(ref)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    projector = GaugeProjector(model)
    gauge = set(opt.projector.param_names())
    for x in _batches(4):
        before = _snap(model)
        opt.zero_grad()
        _backward(model, x)
        opt.step()
        sched.step()
        applied = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        assert gaugeopt.vertical_fraction(model, applied, projector=projector, at=before) <= 1e-10
        for o in ref_opts:
            o.zero_grad()
        _backward(ref, x)
        for o, lr in zip(ref_opts, (2e-2, 1e-2)):
            o.step()
    assert [g["lr"] for g in opt.param_groups] == [2e-2 * 0.5**4, 1e-2 * 0.5**4]  # each group from its own base
    assert len(opt.state) == len(opt.optimizers[0].state) + len(opt.optimizers[1].state)
    assert opt.last_vertical_fraction > 1e-3


def test_gauge_projected_fix_every_over_two_optimizers_equals_the_bare_loop():
    model = _model()
    ref = copy.deepcopy(model)
    opt = GaugeOptimizer(list(_opts(model)), model, project=None, fix_every=2)
    ref_opts = _opts(ref)
    for k, x in enumerate(_batches(4), 1):
        opt.zero_grad()
        _backward(model, x)
        opt.step()
        for o in ref_opts:
            o.zero_grad()
        _backward(ref, x)
        for o in ref_opts:
            o.step()
        if k % 2 == 0:
            gaugeopt.gauge_fix(ref, list(ref_opts))
        assert _same(_snap(model), _snap(ref)), k
    assert opt.last_report.transported and opt.state_dict()["gauge_projected"]["fixes"] == 2
    # state_dict over several: one entry per inner optimizer, and a round trip resumes identically
    sd = copy.deepcopy(opt.state_dict())
    assert len(sd["optimizers"]) == 2
    twin_model = copy.deepcopy(model)
    twin = GaugeOptimizer(list(_opts(twin_model)), twin_model, project=None, fix_every=2)
    twin.load_state_dict(sd)
    for x in _batches(2, seed=1):
        for m, o in ((model, opt), (twin_model, twin)):
            o.zero_grad()
            _backward(m, x)
            o.step()
    assert _same(_snap(model), _snap(twin_model))


def test_gauge_projected_over_two_optimizers_with_a_grad_scaler():
    """The scaler unscales every group of both and skips the whole step when a gradient overflows:
    no inner optimizer steps, the wrapper counts nothing."""
    model = _model(lrm=True, dtype=torch.float32)
    opt = GaugeOptimizer(list(_opts(model)), model, project=None, fix_every=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for k, x in enumerate(_batches(3), 1):
        opt.zero_grad()
        scaler.scale(model(x, x.roll(-1, 1))[1]).backward()
        if k == 2:
            next(model.parameters()).grad[0, 0] = float("inf")
        before = _snap(model)
        scaler.step(opt)
        scaler.update()
        assert _same(before, _snap(model)) == (k == 2)
    assert opt.state_dict()["gauge_projected"]["step"] == 2


def test_gauge_projected_refusals_over_several():
    model = _model()
    muon, adamw = _opts(model)
    with pytest.raises(GaugeError, match="in two of the inner optimizers"):
        GaugeOptimizer([muon, torch.optim.AdamW(model.parameters())], model)
    with pytest.raises(GaugeError, match="listed twice"):
        GaugeOptimizer([adamw, adamw], model)
    opt = GaugeOptimizer([muon, adamw], model)
    with pytest.raises(GaugeError, match="wrapper.optimizers"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(GaugeError, match="holds 2 optimizers"):
        opt.load_state_dict({"optimizers": [muon.state_dict()]})


# ---------------------------------------------------------------------- frameworks
def test_lightning_module_with_muon_and_adamw(tmp_path):
    """A LightningModule returning [Muon, AdamW] (manual optimization): the GaugeFix callback
    fixes after both stepped, moves Muon's momentum of the Q/K rows, and logs its metrics."""
    pl = pytest.importorskip("lightning.pytorch")
    from gaugeopt.callbacks import GaugeFix
    from lightning_helpers import TinyLit, token_loader, trainer

    class MuonLit(TinyLit):
        def __init__(self):
            super().__init__(lrm=False)
            self.automatic_optimization = False

        def configure_optimizers(self):
            return list(_opts(self.model))

        def training_step(self, batch, batch_idx):
            opts = self.optimizers()
            self.manual_backward(self.model(*batch)[1])
            for o in opts:
                o.step()
                o.zero_grad()

    class Record(GaugeFix):
        reports: list = []

        def _act(self, optimizer):
            out = super()._act(optimizer)
            self.reports.append(self.last_report)
            return out

    from lightning.pytorch.loggers import CSVLogger

    fix = Record(every=2)
    t = trainer(tmp_path, max_steps=8, callbacks=[fix], logger=CSVLogger(str(tmp_path), name="run"),
                log_every_n_steps=1)
    module = MuonLit()
    t.fit(module, token_loader(4))
    assert fix.optimizer_steps == 4 and fix.fixes == 2
    muon = t.optimizers[0]
    named = dict(module.named_parameters())
    assert any(named[n] in muon.state for n in fix.reports[-1].transported)
    assert all(r.max_drift_after <= 1e-6 for r in fix.reports)
    assert "gauge/fixes" in t.logged_metrics


def test_hf_trainer_with_a_muon_adamw_container(tmp_path):
    """Trainer(optimizers=(container of Muon and AdamW, None)): the callback hooks both members
    behind Accelerate's wrapper, fixes every 2 rounds and logs."""
    pytest.importorskip("accelerate")
    from gaugeopt.integrations.transformers import GaugeFixCallback
    from trainer_helpers import arguments, tiny_llama, trainer

    class Both(torch.optim.Optimizer):
        """A user's optimizer over Muon and AdamW (the shape of torchtitan's container)."""

        def __init__(self, optimizers):
            self.optimizers = list(optimizers)
            super().__init__([p for o in self.optimizers for g in o.param_groups for p in g["params"]], {"lr": 0.0})

        def step(self, closure=None):
            for o in self.optimizers:
                o.step()

        def zero_grad(self, set_to_none=True):
            for o in self.optimizers:
                o.zero_grad(set_to_none=set_to_none)

    model = tiny_llama(lrm=False)
    opt = Both(_opts(model))
    fix = GaugeFixCallback(every=2)
    tr = trainer(model, arguments(tmp_path, steps=4, logging_steps=1), callbacks=[fix], optimizer=opt, n=32)
    tr.train()
    assert (fix.optimizer_steps, fix.fixes) == (4, 2)
    rows = [r for r in tr.state.log_history if "gauge/fixes" in r]
    assert [r["step"] for r in rows] == [2, 4] and rows[-1]["gauge/qk_drift_after"] <= 1e-6
    assert fix.last_report.transported


def test_accelerate_gauge_projected_over_two_optimizers():
    pytest.importorskip("accelerate")
    from accelerate_helpers import fresh_accelerator

    accelerator = fresh_accelerator()
    model = _model(lrm=True, dtype=torch.float32)
    opt = accelerator.prepare_optimizer(GaugeOptimizer(list(_opts(model)), model, project=None, fix_every=2))
    for x in _batches(4):
        opt.zero_grad()
        _backward(model, x)
        opt.step()
    counters = opt.state_dict()["gauge_projected"]
    assert (counters["step"], counters["fixes"]) == (4, 2) and gaugeopt.qk_drift(model) <= 1e-6


def test_gradient_accumulation_counts_one_round_per_k_batches():
    """With accumulation over 3 batches both optimizers step once per 3 batches: one round, and the
    fix (every 2 rounds) runs after the 6th and 12th batch — bit-identical to fixing by hand there."""
    model = _model(lrm=True)
    ref = copy.deepcopy(model)
    opts, ref_opts = _opts(model), _opts(ref)
    fix = FixSteps(every=2).watch(model, list(opts))
    for k, x in enumerate(_batches(12), 1):
        for m, os_ in ((model, opts), (ref, ref_opts)):
            (m(x, x.roll(-1, 1))[1] / 3).backward()
            if k % 3 == 0:
                for o in os_:
                    o.step()
                for o in os_:
                    o.zero_grad()
        if k % 6 == 0:
            gaugeopt.gauge_fix(ref, list(ref_opts))
        assert _same(_snap(model), _snap(ref)), k
    assert fix.state_dict() == {"optimizer_steps": 4, "fixes": 2}
