"""Lightning callbacks: step counting, function preservation, logging, checkpoints, errors."""

from __future__ import annotations

import csv
import glob
import os

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.callbacks import GaugeFix, GaugeMonitor, GaugeProjection
from lightning_helpers import TinyLit, token_loader, trainer


class RecordFixes(GaugeFix):
    """GaugeFix that keeps every report (the reports are the callback's own output)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.reports = []

    def _act(self, optimizer):
        out = super()._act(optimizer)
        self.reports.append(self.last_report)
        return out


def test_every_100_with_accumulation_fixes_exactly_3_times(tmp_path):
    """300 optimizer steps x accumulate_grad_batches=2 = 600 batches: the fix runs after steps
    100, 200, 300 (not after batches), leaves drift <= 1e-6 and its metrics reach the logger."""
    fix = RecordFixes(every=100)
    logger = CSVLogger(str(tmp_path), name="run")
    t = trainer(tmp_path, max_steps=300, accumulate_grad_batches=2, logger=logger, log_every_n_steps=1, callbacks=[fix])
    t.fit(TinyLit(n_layer=1, n_embd=16), token_loader(600, batch_size=2))
    assert t.global_step == 300 and fix.optimizer_steps == 300
    assert fix.fixes == 3 and len(fix.reports) == 3
    for report in fix.reports:
        assert report.max_drift_before > 1e-4  # there was drift to fix: not a vacuous check
        assert report.max_drift_after <= 1e-6
    assert gaugeopt.qk_drift(t.lightning_module.model) <= 1e-6  # step 300 was the last and a fix
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))[0])))
    logged = [r for r in rows if r.get("gauge/qk_drift_after")]
    # Lightning repeats a step metric's latest value until a new one is logged: the fix counter
    # says which fix a row belongs to, and it must change exactly at optimizer steps 100/200/300.
    new_fix = [r for k, r in enumerate(logged) if k == 0 or r["gauge/fixes"] != logged[k - 1]["gauge/fixes"]]
    assert [(int(r["step"]), float(r["gauge/fixes"])) for r in new_fix] == [(99, 1.0), (199, 2.0), (299, 3.0)]
    for r, report in zip(new_fix, fix.reports):
        assert float(r["gauge/qk_drift_before"]) == pytest.approx(report.max_drift_before, rel=1e-6)
        assert float(r["gauge/qk_drift_after"]) <= 1e-6
        assert float(r["gauge/qk_scale_product_mean"]) > 0


class Probe(pl.Callback):
    """Records the logits of a fixed batch at each optimizer step, from a step post-hook
    registered before (``when="before"``) or after (``"after"``) GaugeFix's own hook."""

    def __init__(self, when: str, batch: torch.Tensor) -> None:
        self.when, self.batch, self.logits = when, batch, []

    def on_fit_start(self, trainer, pl_module):
        def hook(opt, args, kwargs):
            with torch.no_grad():
                self.logits.append(pl_module(self.batch).clone())

        trainer.optimizers[0].register_step_post_hook(hook)


def test_fix_every_step_never_changes_the_function(tmp_path):
    batch = next(iter(token_loader(1, batch_size=3, seed=9)))[0]
    before, after = Probe("before", batch), Probe("after", batch)
    fix = RecordFixes(every=1)
    t = trainer(tmp_path, max_steps=25, callbacks=[before, fix, after])
    t.fit(TinyLit(lr=1e-2), token_loader(25))
    assert fix.fixes == 25 and len(before.logits) == len(after.logits) == 25
    assert max(r.max_drift_before for r in fix.reports) > 1e-4  # the fix moved parameters
    for a, b in zip(before.logits, after.logits):
        assert gaugeopt.relative_change(a, b) <= 1e-5


def test_monitor_measures_without_changing(tmp_path):
    logger = CSVLogger(str(tmp_path), name="mon")
    mon = GaugeMonitor(every=5)
    t = trainer(tmp_path, max_steps=20, logger=logger, log_every_n_steps=1, callbacks=[mon])
    lit = TinyLit(lr=1e-2)
    t.fit(lit, token_loader(20))
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "mon" / "*" / "metrics.csv"))[0])))
    logged = [r for r in rows if r.get("gauge/qk_drift")]
    assert int(logged[0]["step"]) == 4  # first measurement after optimizer step 5
    logged = [r for r in logged if int(r["step"]) in (4, 9, 14, 19)]
    assert float(logged[-1]["gauge/qk_drift"]) == pytest.approx(gaugeopt.qk_drift(lit.model), rel=1e-6)
    assert float(logged[-1]["gauge/qk_drift"]) > 1e-4  # monitor never fixes
    vf = [float(r["gauge/vertical_fraction"]) for r in logged]
    assert all(0.0 < v < 1.0 for v in vf)  # AdamW updates have a vertical part


# ---------------------------------------------------------------------- counting
def test_counts_real_steps_under_amp_overflow(tmp_path):
    """A GradScaler skips optimizer.step after an overflow: that step must not count."""
    from lightning.pytorch.plugins import MixedPrecision

    class Overflow(TinyLit):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if batch_idx in (3, 4) else loss

    changed = []

    class CountChanges(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.snap = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            changed.append(any(not torch.equal(a, b) for a, b in zip(self.snap, pl_module.parameters())))

    fix = GaugeFix(every=3)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**4))
    t = trainer(tmp_path, max_steps=12, plugins=[plugin], callbacks=[CountChanges(), fix])
    t.fit(Overflow(), token_loader(12))
    real_steps = sum(changed)
    assert real_steps < t.global_step  # the overflows were really skipped
    assert fix.optimizer_steps == real_steps
    assert fix.fixes == real_steps // 3


def test_manual_optimization_with_two_optimizers(tmp_path):
    """Only the optimizer owning the attention parameters counts; manual opt.step() fires the fix."""

    class TwoOpt(TinyLit):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self):
            attn = {n for s in gaugeopt.find_attention(self.model) for n in s.parameter_names()}
            named = dict(self.model.named_parameters())
            a = [p for n, p in named.items() if n in attn]
            rest = [p for n, p in named.items() if n not in attn]
            return torch.optim.AdamW(a, lr=1e-2), torch.optim.SGD(rest, lr=1e-2)

        def training_step(self, batch, batch_idx):
            opt_attn, opt_rest = self.optimizers()
            loss = self.model(*batch)[1]
            self.manual_backward(loss)
            opt_rest.step()  # every batch
            if batch_idx % 2 == 0:  # every other batch
                opt_attn.step()
            opt_attn.zero_grad()
            opt_rest.zero_grad()

    fix = RecordFixes(every=2)
    t = trainer(tmp_path, max_epochs=1, callbacks=[fix])
    t.fit(TwoOpt(), token_loader(10))
    assert fix.optimizer_steps == 5 and fix.fixes == 2
    assert all(r.max_drift_after <= 1e-6 for r in fix.reports)


# ---------------------------------------------------------------------- checkpoints
def _params(module):
    return {n: p.detach().clone() for n, p in module.state_dict().items()}


def test_resume_from_checkpoint_is_bit_identical(tmp_path):
    """every=7 does not divide the stop step 30: a resumed run that forgot the step counter
    would fix at 37 instead of 35 and diverge."""
    loader = lambda: token_loader(30)  # one epoch = 30 steps, so the resume starts a fresh epoch  # noqa: E731
    full_fix = GaugeFix(every=7)
    t = trainer(tmp_path / "full", max_steps=60, callbacks=[full_fix])
    t.fit(TinyLit(lr=1e-2), loader())
    want = _params(t.lightning_module)

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=30)
    t1 = trainer(tmp_path / "a", max_steps=30, enable_checkpointing=True, callbacks=[GaugeFix(every=7), ckpt])
    t1.fit(TinyLit(lr=1e-2), loader())
    resumed_fix = GaugeFix(every=7)
    t2 = trainer(tmp_path / "b", max_steps=60, callbacks=[resumed_fix])
    t2.fit(TinyLit(lr=1e-2), loader(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    got = _params(t2.lightning_module)
    assert resumed_fix.optimizer_steps == full_fix.optimizer_steps == 60
    assert resumed_fix.fixes == full_fix.fixes == 8
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_state_dict_round_trip():
    a = GaugeFix(every=4)
    a.optimizer_steps, a.fixes = 13, 3
    b = GaugeFix(every=4)
    b.load_state_dict(a.state_dict())
    assert (b.optimizer_steps, b.fixes) == (13, 3)


# ---------------------------------------------------------------------- misconfiguration
@pytest.mark.parametrize("every", [0, -3, 2.5, True, "100"])
def test_bad_every(every):
    with pytest.raises(GaugeError, match="every="):
        GaugeFix(every=every)


def test_bad_options():
    with pytest.raises(GaugeError, match="granularity='row'"):
        GaugeFix(granularity="row")
    with pytest.raises(GaugeError, match="unknown_state"):
        GaugeFix(unknown_state="drop")


def test_channel_granularity_under_rope_fails_at_setup(tmp_path):
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, *a):
            seen.append(1)

    t = trainer(tmp_path, max_steps=2, callbacks=[GaugeFix(every=1, granularity="channel"), Spy()])
    with pytest.raises(GaugeError, match="RoPE"):
        t.fit(TinyLit(rope="split_half"), token_loader(2))
    assert not seen  # refused before any training


def test_model_without_attention_fails_at_setup(tmp_path):
    class MLPOnly(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0].float()[:, :4]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    t = trainer(tmp_path, max_steps=1, callbacks=[GaugeFix(every=1)])
    with pytest.raises(GaugeError, match="no attention layer found"):
        t.fit(MLPOnly(), token_loader(1))


def test_wrapper_with_fix_every_and_callback_conflict(tmp_path):
    class Wrapped(TinyLit):
        def configure_optimizers(self):
            inner = super().configure_optimizers()
            return gaugeopt.GaugeOptimizer(inner, self.model, fix_every=10)

    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, *a):
            seen.append(1)

    t = trainer(tmp_path, max_steps=2, callbacks=[GaugeFix(every=1), Spy()])
    with pytest.raises(GaugeError, match="fixed twice"):
        t.fit(Wrapped(), token_loader(2))
    assert not seen


# ---------------------------------------------------------------------- precision
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_precisions(tmp_path, precision):
    fix = RecordFixes(every=5)
    t = trainer(tmp_path, max_steps=10, precision=precision, callbacks=[fix])
    t.fit(TinyLit(lr=1e-2), token_loader(10))
    assert fix.fixes == 2
    assert all(r.max_drift_after <= 1e-6 for r in fix.reports)  # parameters stay float32 (master weights)


# ---------------------------------------------------------------------- distributed
class SaveParams(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module):
        fix = next(c for c in trainer.callbacks if isinstance(c, GaugeFix))
        torch.save(
            {"params": _params(pl_module), "fixes": fix.fixes, "drift": gaugeopt.qk_drift(pl_module.model)},
            os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"),
        )


@pytest.mark.slow
def test_ddp_two_processes_keep_replicas_identical(tmp_path):
    t = trainer(tmp_path, max_steps=20, devices=2, strategy="ddp_spawn",
                callbacks=[GaugeFix(every=4), SaveParams(str(tmp_path))])
    t.fit(TinyLit(lr=1e-2), token_loader(40))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["fixes"] == r1["fixes"] == 5
    assert r0["drift"] <= 1e-6
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])


# ---------------------------------------------------------------------- projection callback
@pytest.mark.parametrize("target", ["update", "grad"])
def test_projection_callback_matches_the_wrapper(tmp_path, target):
    """The callback and GaugeOptimizer share one implementation: same training, same parameters."""

    class Wrapped(TinyLit):
        def configure_optimizers(self):
            return gaugeopt.GaugeOptimizer(super().configure_optimizers(), self.model, project=target)

    t1 = trainer(tmp_path / "cb", max_steps=6, callbacks=[GaugeProjection(target=target, log_every=1)])
    t1.fit(TinyLit(lr=1e-2), token_loader(6))
    t2 = trainer(tmp_path / "wrap", max_steps=6)
    t2.fit(Wrapped(lr=1e-2), token_loader(6))
    a, b = _params(t1.lightning_module), _params(t2.lightning_module)
    assert all(torch.equal(a[k], b[k]) for k in a)
    t3 = trainer(tmp_path / "plain", max_steps=6)
    t3.fit(TinyLit(lr=1e-2), token_loader(6))
    c = _params(t3.lightning_module)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # the projection did something


def test_projected_updates_are_horizontal(tmp_path):
    """Every applied update of a run with GaugeProjection(target='update') is horizontal."""
    seen = []

    class CheckUpdates(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            update = {n: p.detach() - self.before[n] for n, p in pl_module.named_parameters()}
            seen.append(gaugeopt.vertical_fraction(pl_module, update, at=self.before))

    t = trainer(tmp_path, max_steps=5, callbacks=[GaugeProjection(), CheckUpdates()])
    t.fit(TinyLit(lr=1e-2, lrm=False), token_loader(5))
    assert len(seen) == 5 and max(seen) <= 1e-5  # float32 model: rounding of the projected step


def test_projection_callback_and_wrapper_conflict(tmp_path):
    class Wrapped(TinyLit):
        def configure_optimizers(self):
            return gaugeopt.GaugeOptimizer(super().configure_optimizers(), self.model)

    t = trainer(tmp_path, max_steps=1, callbacks=[GaugeProjection()])
    with pytest.raises(GaugeError, match="projected twice"):
        t.fit(Wrapped(), token_loader(1))


# ---------------------------------------------------------------------- loggers
def test_wandb_offline_receives_the_curves(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="gaugeopt-test")
    keys = set()
    original = logger.log_metrics

    def spy(metrics, step=None):
        keys.update(metrics)
        return original(metrics, step)

    monkeypatch.setattr(logger, "log_metrics", spy)
    t = trainer(tmp_path, max_steps=4, logger=logger, log_every_n_steps=1, callbacks=[GaugeFix(every=2), GaugeMonitor(every=2)])
    t.fit(TinyLit(lr=1e-2), token_loader(4))
    logger.experiment.finish()
    assert {"gauge/qk_drift_before", "gauge/qk_drift_after", "gauge/qk_scale_product_mean", "gauge/qk_drift"} <= keys
    assert glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))  # written locally, no network


# ---------------------------------------------------------------------- FSDP2
@pytest.mark.slow
def test_fsdp2_model_parallel_strategy(tmp_path):
    """ModelParallelStrategy re-launches its command for the second rank (like plain "ddp"),
    so the run lives in its own script, started here as a subprocess."""
    import subprocess
    import sys

    from paths import REPO, SUPPORT

    script = str(SUPPORT / "fsdp_lightning_run.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(REPO)])}
    proc = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "fsdp.pt")
    assert out["fixes"] == 3
    assert out["sharded"]  # the attention parameters really were DTensors
    assert max(out["before"]) > 1e-4 and max(out["after"]) <= 1e-6
    assert out["drift_full"] <= 1e-6  # measured again on the gathered parameters after the run


def test_attention_split_over_two_optimizers(tmp_path):
    """Q multipliers in one optimizer, everything else in another (manual optimization, both step
    every batch): the fix runs once both have stepped and moves each tensor's state in the optimizer
    that owns it; a tensor in both optimizers is refused before the first batch."""

    class Split(TinyLit):
        def __init__(self, overlap=False):
            super().__init__()
            self.automatic_optimization = False
            self.overlap = overlap

        def configure_optimizers(self):
            site = gaugeopt.find_attention(self.model)[0]
            q_mults = [site.q.row_mult.param]
            rest = [p for p in self.model.parameters() if p is not q_mults[0] or self.overlap]
            return torch.optim.AdamW(q_mults, lr=1e-2), torch.optim.AdamW(rest, lr=1e-2)

        def training_step(self, batch, batch_idx):
            opts = self.optimizers()
            self.manual_backward(self.model(*batch)[1])
            for o in opts:
                o.step()
                o.zero_grad()

    fix = RecordFixes(every=2)
    t = trainer(tmp_path, max_steps=8, callbacks=[fix])  # Lightning counts each optimizer's step: 4 batches
    t.fit(Split(), token_loader(4))
    assert t.global_step == 8
    assert fix.optimizer_steps == 4 and fix.fixes == 2  # one round per batch, not one per optimizer step
    site = gaugeopt.find_attention(t.lightning_module)[0]  # names as the callback sees them
    assert site.q.row_mult.name in fix.reports[-1].transported and site.k.row_mult.name in fix.reports[-1].transported
    assert all(r.max_drift_after <= 1e-6 for r in fix.reports) and fix.reports[0].max_drift_before > 0
    t = trainer(tmp_path, max_steps=1, callbacks=[GaugeFix(every=1)])
    with pytest.raises(GaugeError, match="two optimizers"):
        t.fit(Split(overlap=True), token_loader(1))
