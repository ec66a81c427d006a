"""Hugging Face Trainer callbacks: real optimizer steps counted, drift removed, metrics in the
Trainer's log, counters in its checkpoints, AMP-skipped steps, bf16, projection, refusals."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import gaugeopt  # noqa: E402
from gaugeopt import GaugeError  # noqa: E402
from gaugeopt.integrations.transformers import GaugeFixCallback, GaugeProjectionCallback  # noqa: E402
from trainer_helpers import arguments, condition_b, tiny_llama, trainer  # noqa: E402


class RecordFixes(GaugeFixCallback):
    """GaugeFixCallback that keeps every report (the reports are the callback's own output)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.reports = []

    def _act(self, optimizer):
        out = super()._act(optimizer)
        self.reports.append(self.last_report)
        return out


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fix_every_20_with_accumulation_2_removes_the_drift(tmp_path):
    """60 optimizer steps x gradient_accumulation_steps=2 on a GQA Llama with multipliers
    (condition B: no decay on r_Q, r_K): without the callback the Q/K drift exceeds 1e-3; with
    GaugeFixCallback(every=20) exactly 3 fixes run, after steps 20, 40, 60, the final drift is
    <= 1e-6, and each fix's drift is in trainer.state.log_history at its step."""
    bare = tiny_llama()
    trainer(bare, arguments(tmp_path / "bare")).train()
    drift_without = gaugeopt.qk_drift(bare)
    assert drift_without > 1e-3

    model = tiny_llama()
    fix = RecordFixes(every=20)
    t = trainer(model, arguments(tmp_path / "fixed"), callbacks=[fix])
    t.train()
    assert t.state.global_step == 60 and fix.optimizer_steps == 60
    assert fix.fixes == 3 and len(fix.reports) == 3
    assert gaugeopt.qk_drift(model) <= 1e-6  # step 60 was the last and a fix
    for report in fix.reports:
        assert report.max_drift_before > 1e-4  # there was drift to fix: not a vacuous check
        assert report.max_drift_after <= 1e-6
    logged = [r for r in t.state.log_history if "gauge/qk_drift_before" in r]
    assert [(r["step"], r["gauge/fixes"]) for r in logged] == [(20, 1.0), (40, 2.0), (60, 3.0)]
    for r, report in zip(logged, fix.reports):
        assert r["gauge/qk_drift_before"] == report.max_drift_before
        assert r["gauge/qk_drift_after"] <= 1e-6 and "loss" in r  # merged into the Trainer's own record


def _resume_case(tmp_path, every: int, restore_flag: bool):
    def run(out, **kw):
        cb = GaugeFixCallback(every=every)
        model = tiny_llama()
        args = arguments(out, save_strategy="steps", save_steps=20,
                         restore_callback_states_from_checkpoint=restore_flag)
        t = trainer(model, args, callbacks=[cb])
        t.train(**kw)
        live = next(c for c in t.callback_handler.callbacks if isinstance(c, GaugeFixCallback))
        return model, live

    straight, full = run(tmp_path / "full")
    resumed, again = run(tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-40"))
    return straight, full, resumed, again


class Logger(transformers.TrainerCallback):
    """A logging integration's stand-in: what its on_log receives."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs or {}))


@pytest.mark.parametrize("restore_flag", [False, True])
def test_loggers_listed_first_receive_the_metrics_also_after_a_restored_resume(tmp_path, restore_flag):
    """A logger placed before the gauge callback (where the Trainer puts its report_to integrations),
    and a resume that rebuilds the gauge callback from its checkpoint (appending it last): the logger
    still receives gauge/* at every fix."""
    def run(out, **kw):
        log = Logger()
        args = arguments(out, save_strategy="steps", save_steps=20, restore_callback_states_from_checkpoint=restore_flag)
        t = trainer(tiny_llama(), args, callbacks=[log, GaugeFixCallback(every=20)])
        t.train(**kw)
        return [r["gauge/fixes"] for r in log.seen if "gauge/fixes" in r]

    assert run(tmp_path / "full") == [1.0, 2.0, 3.0]
    assert run(tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-40")) == [3.0]


@pytest.mark.parametrize("every, restore_flag", [(20, False), (15, False), (15, True)])
def test_resume_from_the_step_40_checkpoint_is_bit_identical(tmp_path, every, restore_flag):
    """A run resumed from checkpoint-40 ends with every parameter equal, bit for bit, to the
    uninterrupted run's. every=15 puts fixes at 45 and 60 after the resume point, so a forgotten
    counter (which would fix at 55) breaks it; the Trainer's own callback restoration
    (restore_callback_states_from_checkpoint=True) rebuilds the callback from its stored
    arguments and must give the same."""
    straight, full, resumed, again = _resume_case(tmp_path, every, restore_flag)
    assert (full.optimizer_steps, full.fixes) == (60, 60 // every)
    assert (again.optimizer_steps, again.fixes) == (60, 60 // every)
    ref = dict(straight.named_parameters())
    for n, p in resumed.named_parameters():
        assert torch.equal(p, ref[n]), n
    assert gaugeopt.qk_drift(resumed) <= 1e-6


class InjectInf(transformers.TrainerCallback):
    """Makes the gradients infinite before the optimizer step of the given Trainer steps (1-based),
    and records which steps the AcceleratedOptimizer reported as skipped."""

    def __init__(self, at):
        self.at, self.skipped = set(at), []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 in self.at:
            next(model.parameters()).grad.fill_(float("inf"))

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer.step_was_skipped:
            self.skipped.append(state.global_step + 1)


def test_steps_skipped_by_the_grad_scaler_do_not_count(tmp_path):
    """The fp16 path on CPU: a GradScaler on the Trainer's Accelerator (CUDA gets one from
    fp16=True). Steps 5 and 10 overflow and are skipped: the callback counts 18 real steps of 20
    and fixes after real steps 5, 10, 15 = Trainer steps 6, 12, 17 (counting every on_optimizer_step
    would give 4 fixes, at 5, 10, 15, 20)."""
    model = tiny_llama()
    fix, inf = GaugeFixCallback(every=5), InjectInf(at=(5, 10))
    t = trainer(model, arguments(tmp_path, steps=20, max_grad_norm=0.0), callbacks=[inf, fix])
    t.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    t.train()
    assert inf.skipped == [5, 10]
    assert (t.state.global_step, fix.optimizer_steps, fix.fixes) == (20, 18, 3)
    assert [r["step"] for r in t.state.log_history if "gauge/fixes" in r] == [6, 12, 17]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_autocast_on_cpu(tmp_path):
    """bf16=True: the forward runs under CPU autocast, the parameters stay fp32 and the fix acts
    on them."""
    model = tiny_llama()
    fix = GaugeFixCallback(every=10)
    t = trainer(model, arguments(tmp_path, steps=20, bf16=True), callbacks=[fix])
    t.train()
    assert t.accelerator.mixed_precision == "bf16"
    assert fix.fixes == 2 and next(model.parameters()).dtype == torch.float32
    assert gaugeopt.qk_drift(model) <= 1e-6


def test_projection_callback_equals_the_projected_optimizer(tmp_path):
    """GaugeProjectionCallback(target="update") and GaugeOptimizer share the projected step:
    the two runs end bit-identical, and every applied update is horizontal (to float32 rounding:
    the update is ~1e-2 of parameters of size ~1, each stored to ~6e-8) while the step AdamW
    took had a vertical fraction > 1e-3 (logged)."""
    seen = []

    class Horizontal(GaugeProjectionCallback):
        def _pre_step(self, optimizer, args, kwargs):
            super()._pre_step(optimizer, args, kwargs)
            self._at = dict(self._before)

        def _post_step(self, optimizer, args, kwargs):
            super()._post_step(optimizer, args, kwargs)
            named = dict(self._module.named_parameters())
            applied = {n: named[n].detach() - self._at[n] for n in self._at}
            seen.append(gaugeopt.vertical_fraction(self._module, applied, projector=self.projector, at=self._at))

    a = tiny_llama()
    ta = trainer(a, arguments(tmp_path / "cb", steps=6, logging_steps=100), callbacks=[Horizontal(log_every=3)])
    ta.train()
    b = tiny_llama()
    trainer(b, arguments(tmp_path / "opt", steps=6), optimizer=gaugeopt.GaugeOptimizer(condition_b(b), b)).train()
    ref = dict(b.named_parameters())
    for n, p in a.named_parameters():
        assert torch.equal(p, ref[n]), n
    assert len(seen) == 6 and max(seen) <= 1e-5
    logged = [r for r in ta.state.log_history if "gauge/vertical_fraction_update" in r]
    assert [r["step"] for r in logged] == [3, 6] and min(r["gauge/vertical_fraction_update"] for r in logged) > 1e-3


def test_projection_of_gradients_in_the_step_pre_hook(tmp_path):
    """target="grad": the gradient of a gauge-invariant loss is horizontal already (only rounding),
    so a callback that runs before the step (after clipping) adds random noise, whose vertical
    fraction is > 1e-2; the gradients the optimizer steps with have none left (float32 rounding)."""
    seen, noisy = [], []

    class Noise(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            g = torch.Generator().manual_seed(state.global_step)
            for p in model.parameters():
                p.grad.add_(torch.randn(p.shape, generator=g))
            named = dict(model.named_parameters())  # over the gauge parameters, as the callback reports it
            noisy.append(gaugeopt.vertical_fraction(model, {n: named[n].grad for n in cb.projector.param_names()},
                                                    projector=cb.projector))

    class Spy(transformers.TrainerCallback):  # a step pre-hook registered after the callback's runs after it
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            optimizer.optimizer.register_step_pre_hook(
                lambda o, a, k: seen.append(({n: p.grad.clone() for n, p in model.named_parameters()}, _params(model))))

    model = tiny_llama()
    cb = GaugeProjectionCallback(target="grad", log_every=1)
    t = trainer(model, arguments(tmp_path, steps=3), callbacks=[Noise(), cb, Spy()])
    t.train()
    assert len(seen) == 3 and min(noisy) > 1e-2
    for grads, at in seen:
        assert gaugeopt.vertical_fraction(model, grads, projector=cb.projector, at=at) <= 1e-6
    logged = [r["gauge/vertical_fraction_grad"] for r in t.state.log_history if "gauge/vertical_fraction_grad" in r]
    assert logged == pytest.approx(noisy, rel=1e-4)  # the fraction removed is the noise's


def test_refusals(tmp_path):
    with pytest.raises(GaugeError, match="every="):
        GaugeFixCallback(every=0)
    with pytest.raises(GaugeError, match="granularity="):
        GaugeFixCallback(granularity="row")
    with pytest.raises(GaugeError, match="cannot be stored"):
        GaugeProjectionCallback(dtype=torch.float64)
    # a RoPE model refuses per-channel scales when the Trainer is built, not at step N
    with pytest.raises(GaugeError, match="RoPE"):
        trainer(tiny_llama(), arguments(tmp_path), callbacks=[GaugeFixCallback(granularity="channel")])
    model = tiny_llama()
    fixing = gaugeopt.GaugeOptimizer(condition_b(model), model, project=None, fix_every=5)
    with pytest.raises(GaugeError, match="fixed twice"):
        trainer(model, arguments(tmp_path, steps=2), callbacks=[GaugeFixCallback(every=5)], optimizer=fixing).train()
    projecting = gaugeopt.GaugeOptimizer(condition_b(model), model)
    with pytest.raises(GaugeError, match="projected twice"):
        trainer(model, arguments(tmp_path, steps=2), callbacks=[GaugeProjectionCallback()], optimizer=projecting).train()
    with pytest.raises(GaugeError, match="undo the fixes"):
        trainer(model, arguments(tmp_path, steps=2), callbacks=[GaugeProjectionCallback()], optimizer=fixing).train()
    with pytest.raises(GaugeError, match="one is enough"):
        trainer(model, arguments(tmp_path, steps=2), callbacks=[GaugeFixCallback(), GaugeFixCallback()]).train()


@pytest.mark.parametrize("order", ["project_first", "fix_first"])
def test_fix_and_projection_callbacks_in_either_order(tmp_path, order):
    """On one optimizer the projection's hooks run before the fix's whatever the list order: the
    projection sees the step AdamW took, the fix then balances the point reached (a projection
    after the fix would take the rescale for a vertical step and undo it)."""
    model = tiny_llama()
    fix, proj = GaugeFixCallback(every=4), GaugeProjectionCallback(log_every=4)
    t = trainer(model, arguments(tmp_path, steps=8), callbacks=[proj, fix] if order == "project_first" else [fix, proj])
    t.train()
    assert fix.fixes == 2 and gaugeopt.qk_drift(model) <= 1e-6
    if order == "fix_first":
        other = tiny_llama()
        trainer(other, arguments(tmp_path / "other", steps=8), callbacks=[GaugeProjectionCallback(log_every=4),
                                                                          GaugeFixCallback(every=4)]).train()
        ref = dict(other.named_parameters())
        for n, p in model.named_parameters():
            assert torch.equal(p, ref[n]), n


@pytest.mark.slow
def test_ddp_two_processes_via_accelerate(tmp_path):
    """torchrun with 2 CPU processes (gloo): the Trainer wraps the model in DDP through Accelerate;
    every rank fixes its replica identically, so the replicas stay bit-identical."""
    from paths import REPO, SUPPORT

    script = str(SUPPORT / "trainer_ddp_run.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SUPPORT) + os.pathsep + str(REPO)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", script, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in out:
        assert (r["world"], r["ddp"], r["steps"], r["fixes"]) == (2, True, 12, 3)
        assert r["drift"] <= 1e-6 and r["logged"] == [4, 8, 12]
    for n, p in out[0]["params"].items():
        assert torch.equal(p, out[1]["params"][n]), n
