"""nanoGPT's train.py with the line docs/integrations.md adds, on nanoGPT's own model.py.

tests/fixtures/nanogpt/model.py is karpathy/nanoGPT's model.py (MIT, LICENSE beside it, commit
3adf61e154c3fe3fca428ad6bc3818b27a3b8291), unmodified. ``_train`` is train.py's loop from
``optimizer = model.configure_optimizers(...)`` to ``optimizer.zero_grad(set_to_none=True)``:
gradient accumulation with the loss divided by the number of micro-steps, ``scaler.scale(loss).backward()``,
``scaler.unscale_`` + ``clip_grad_norm_``, ``scaler.step(optimizer)``, ``scaler.update()``; its
checkpoint is train.py's dict. The GradScaler is enabled on CPU (train.py enables it for float16
on CUDA) so that overflowing steps can be skipped as they are there.
"""

from __future__ import annotations

import importlib.util
import io
import pathlib

import pytest
import torch

import gaugeopt
from gaugeopt.trust.invariance import randomize_parameters

MODEL_PY = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "nanogpt" / "model.py"
VOCAB, T = 64, 16


@pytest.fixture(scope="module")
def nanogpt():
    """The vendored model.py, imported under a module name of its own (as a user's copy would be):
    gaugeopt recognises its attention by structure and by the source of its forward."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(nanogpt, lrm: bool, seed: int = 0):
    torch.manual_seed(seed)
    conf = nanogpt.GPTConfig(block_size=T, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True)
    model = nanogpt.GPT(conf)
    if lrm:
        gaugeopt.apply_lrm(model)
    # a function-preserving imbalance of the Q/K scales, so that the first fix has work to do
    gaugeopt.random_gauge_transform(model, ("lrm_qk",) if lrm else ("qk",), generator=torch.Generator().manual_seed(1))
    return model


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, 4, T + 1), generator=g)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in x]  # get_batch stacks copies


def _train(model, optimizer, scaler, batches, iters, *, inf_at=(), after_step=None,
           gradient_accumulation_steps=2, grad_clip=1.0):
    """train.py, lines 292-314 (iteration numbers ``iters``; ``inf_at``: iterations that overflow)."""
    for iter_num in iters:
        for micro_step in range(gradient_accumulation_steps):
            X, Y = batches[iter_num * gradient_accumulation_steps + micro_step]
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
            scaler.scale(loss).backward()
        if iter_num in inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        if after_step is not None:
            after_step(iter_num)
        optimizer.zero_grad(set_to_none=True)


def _optimizer(model, wrap: bool, fix_every: int = 4):
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")  # train.py line 199
    if wrap:  # the line docs/integrations.md adds after it
        optimizer = gaugeopt.GaugeOptimizer(optimizer, model, project=None, fix_every=fix_every)
    return optimizer


@pytest.mark.parametrize("lrm", [False, True], ids=["plain", "lrm"])
def test_the_builtin_adapter_describes_nanogpt_attention(nanogpt, lrm):
    """nanoGPT's attention is recognised (its record is verified) and its certificate passes on the
    real call: every valid element of every sector exact, every negative control visible."""
    model = _model(nanogpt, lrm).double()
    randomize_parameters(model, torch.Generator().manual_seed(0))
    x = torch.randint(0, VOCAB, (2, T))
    sites = gaugeopt.find_attention(model)
    assert [s.kind for s in sites] == ["nanogpt", "nanogpt"] and all(s.verified for s in sites)
    report = gaugeopt.certify(model, x, x)
    assert {"qk", "vo", "perm"} <= set(report.layers[0].sectors) and (not lrm or "lrm_qk" in report.layers[0].sectors)
    assert report.worst_valid < 1e-12 and report.weakest_control > 1e-3


@pytest.mark.parametrize("lrm", [False, True], ids=["plain", "lrm"])
def test_train_py_with_the_gaugefix_line(nanogpt, capsys, lrm):
    """12 iterations x 2 micro-steps, fix every 4, iteration 2 overflowing: the wrapper steps 11
    times (scaler.step skips iteration 2 without calling it) and fixes after its 4th and 8th steps
    (iterations 4 and 8), each time from drift > 1e-2 (the first) to <= 1e-6; the run equals
    train.py without the line plus gauge_fix(model, optimizer) after those two iterations, bit for bit.
    Stopped after iteration 6 and resumed from train.py's checkpoint dict, it ends identical too."""
    batches = _batches(24)
    model = _model(nanogpt, lrm)
    optimizer = _optimizer(model, wrap=True)
    reports = []
    _train(model, optimizer, torch.amp.GradScaler("cpu", init_scale=2.0**10), batches, range(12), inf_at=(2,),
           after_step=lambda k: reports.append(optimizer.last_report) if k in (4, 8) else None)
    own = optimizer.state_dict()["gauge_projected"]
    assert (own["step"], own["fixes"]) == (11, 2)
    assert reports[0].max_drift_before > 1e-2 and all(r.max_drift_after <= 1e-6 for r in reports)
    assert reports[0] is not reports[1]

    ref = _model(nanogpt, lrm)
    ref_opt = _optimizer(ref, wrap=False)

    def fix_by_hand(iter_num):
        if iter_num in (4, 8):
            gaugeopt.gauge_fix(ref, ref_opt)

    _train(ref, ref_opt, torch.amp.GradScaler("cpu", init_scale=2.0**10), batches, range(12), inf_at=(2,),
           after_step=fix_by_hand)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n

    # train.py's checkpoint and resume (lines 160-201, 277-286); the scaler is not saved there
    half = _model(nanogpt, lrm)
    half_opt = _optimizer(half, wrap=True)
    _train(half, half_opt, torch.amp.GradScaler("cpu", init_scale=2.0**10), batches, range(7), inf_at=(2,))
    buf = io.BytesIO()
    torch.save({"model": half.state_dict(), "optimizer": half_opt.state_dict(), "iter_num": 7}, buf)
    buf.seek(0)
    checkpoint = torch.load(buf, weights_only=True)
    resumed = _model(nanogpt, lrm, seed=5)  # other initial values: everything must come from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = _optimizer(resumed, wrap=True)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert resumed_opt.state_dict()["gauge_projected"]["step"] == 6
    _train(resumed, resumed_opt, torch.amp.GradScaler("cpu", init_scale=2.0**10), batches, range(checkpoint["iter_num"], 12))
    assert resumed_opt.state_dict()["gauge_projected"] == own
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
    capsys.readouterr()  # configure_optimizers prints its parameter counts
