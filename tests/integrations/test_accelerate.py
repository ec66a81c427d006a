"""Accelerate: the fix-only GaugeOptimizer wrapped before accelerator.prepare, in a loop with
accelerator.accumulate (CPU, bf16 autocast), skipped GradScaler steps, save_state/load_state."""

from __future__ import annotations

import pytest
import torch

import gaugeopt
from accelerate_helpers import fresh_accelerator
from gaugeopt.models import GPT, GPTConfig

pytest.importorskip("accelerate")

VOCAB, T = 32, 12


def _model():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=16)
    return gaugeopt.apply_lrm(GPT(cfg))


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, T), generator=g) for _ in range(n)]


def _loop(accelerator, model, optimizer, batches, inf_at=(), after_step=None):
    """The Accelerate training loop; ``inf_at``: micro-batches whose gradients overflow."""
    for k, x in enumerate(batches, 1):
        with accelerator.accumulate(model):
            loss = model(x, x.roll(-1, 1))[1]
            accelerator.backward(loss)
            if k in inf_at:
                next(model.parameters()).grad[0, 0] = float("inf")
            optimizer.step()
            if after_step is not None and accelerator.sync_gradients and not optimizer.step_was_skipped:
                after_step()
            optimizer.zero_grad()


def test_fix_only_wrapper_before_prepare_equals_the_bare_loop_with_gauge_fix():
    """12 micro-batches, accumulation 2, bf16 autocast: the wrapper steps 6 times and fixes after
    steps 3 and 6; the bare loop calling gauge_fix(model, inner) after its 3rd and 6th real step
    ends bit-identical."""
    batches = _batches(12)
    acc = fresh_accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    model = _model()
    opt = gaugeopt.GaugeOptimizer(torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2)), model,
                                  project=None, fix_every=3)
    pmodel, popt = acc.prepare(model, opt)
    _loop(acc, pmodel, popt, batches)
    assert opt.state_dict()["gauge_projected"]["step"] == 6 and opt.state_dict()["gauge_projected"]["fixes"] == 2
    assert opt.last_report.max_drift_before > 1e-4 and gaugeopt.qk_drift(model) <= 1e-6

    acc = fresh_accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    ref = _model()
    inner = torch.optim.AdamW(gaugeopt.lrm_param_groups(ref, "B", lr=1e-2))
    rmodel, ropt = acc.prepare(ref, inner)
    real = []

    def fix_every_third():
        real.append(1)
        if len(real) % 3 == 0:
            gaugeopt.gauge_fix(ref, ropt)  # through the AcceleratedOptimizer: its state is the inner one's

    _loop(acc, rmodel, ropt, batches, after_step=fix_every_third)
    assert len(real) == 6
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_skipped_steps_and_save_state(tmp_path):
    """A GradScaler on the Accelerator (CUDA fp16 has one; CPU gets it by hand): the overflowing
    accumulation window of micro-batch 6 is skipped (step_was_skipped), the wrapper counts 5 of
    6 steps and fixes after real steps 2 and 4; accelerator.save_state after micro-batch 8 and
    load_state into a fresh run restore the counters, and the two runs end bit-identical."""
    batches = _batches(12, seed=1)

    def setup():
        acc = fresh_accelerator(gradient_accumulation_steps=2)
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        model = _model()
        opt = gaugeopt.GaugeOptimizer(torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2)), model,
                                      project=None, fix_every=2)
        pmodel, popt = acc.prepare(model, opt)
        return acc, model, opt, pmodel, popt

    acc, model, opt, pmodel, popt = setup()
    skipped = []
    for k in range(1, 13):
        _loop(acc, pmodel, popt, [batches[k - 1]], inf_at=(1,) if k == 6 else ())
        if k % 2 == 0 and popt.step_was_skipped:
            skipped.append(k)
        if k == 8:
            acc.save_state(str(tmp_path / "state"))
    assert skipped == [6]
    own = opt.state_dict()["gauge_projected"]
    assert (own["step"], own["fixes"]) == (5, 2)

    acc, resumed, ropt, rmodel, rpopt = setup()
    acc.load_state(str(tmp_path / "state"))
    assert ropt.state_dict()["gauge_projected"]["step"] == 3  # micro-batches 2, 4, 8 (6 was skipped)
    _loop(acc, rmodel, rpopt, batches[8:])
    assert ropt.state_dict()["gauge_projected"] == own
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
