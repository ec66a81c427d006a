"""QK-Clip in the training stacks: the step core (:class:`ClipSteps`) in a plain loop — the maxima of the
step's own forward, gradient accumulation, ``every``, clip-then-balance with GaugeFix (and the reverse
order as a control) —, the Lightning callback and the Hugging Face Trainer callback."""

from __future__ import annotations

import math

import pytest
import torch

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.integrations.clip import ClipSteps
from gaugeopt.integrations.steps import FixSteps
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.clip.logits import LogitTracker

TAU = 0.08


def _model(lrm: bool = True) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    return gaugeopt.apply_lrm(model) if lrm else model


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 17), generator=g) for _ in range(n)]


def _train_step(model, opt, xs) -> None:
    for x in xs:  # micro-batches
        (model(x[:, :-1], x[:, 1:])[1] / len(xs)).backward()
    opt.step()
    opt.zero_grad()


def test_clip_uses_the_maxima_of_the_steps_forward_and_gradient_accumulation():
    model = _model()
    opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2))
    clip = ClipSteps(tau=TAU).watch(model, opt)
    for step, (a, b) in enumerate(zip(_batches(4, 1), _batches(4, 2))):
        ma = gaugeopt.max_attention_logits(model, a[:, :-1])  # no gradients: not read by the clip
        mb = gaugeopt.max_attention_logits(model, b[:, :-1])
        _train_step(model, opt, [a, b])
        for lc in clip.last_report.layers:  # the maximum over both micro-batches, weights before the step
            assert torch.equal(torch.tensor(lc.max_before), torch.maximum(ma[lc.name], mb[lc.name]).double())
    assert clip.clips == 4 and clip.last_report.heads_over > 0
    clip.detach()
    assert all(not s.module._forward_pre_hooks for s in gaugeopt.find_attention(model))


def test_every_reads_only_the_clipping_steps(monkeypatch):
    model = _model(lrm=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reads = []
    original = LogitTracker.read

    def counting(self, site, args, kwargs):
        reads.append(clip.optimizer_steps)
        return original(self, site, args, kwargs)

    monkeypatch.setattr(LogitTracker, "read", counting)
    clip = ClipSteps(tau=TAU, every=3).watch(model, opt)
    for x in _batches(6):
        _train_step(model, opt, [x])
    assert clip.clips == 2 and clip.state_dict() == {"optimizer_steps": 6, "clips": 2}
    assert sorted(set(reads)) == [2, 5] and len(reads) == 4  # the forwards of steps 3 and 6, two layers each


@pytest.mark.parametrize("order", ["clip_then_fix", "fix_then_clip"])
def test_clip_runs_before_the_balance(monkeypatch, order):
    """Attached in either order, the clip (rank 0.5) runs before GaugeFix (rank 1): the balance after it
    leaves no drift. Forcing the reverse order (control) leaves the drift the GQA clip creates."""
    if order == "fix_then_clip":
        monkeypatch.setattr(ClipSteps, "hook_rank", 2)
    model = _model()
    opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2))
    clip = ClipSteps(tau=TAU).watch(model, opt)
    fix = FixSteps(every=1).watch(model, opt)
    drifts = []
    for x in _batches(5):
        _train_step(model, opt, [x])
        drifts.append(gaugeopt.qk_drift(model))
    assert clip.last_report.heads_over > 0 and fix.fixes == 5
    if order == "clip_then_fix":
        assert max(drifts) < 1e-6
    else:
        assert max(drifts) > 1e-3


def test_fix_inside_the_wrapper_is_refused():
    model = _model()
    opt = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters()), model, project=None, fix_every=2)
    with pytest.raises(GaugeError, match="clip first and balance after"):
        ClipSteps(tau=TAU).watch(model, opt)


@pytest.mark.parametrize("kw, match", [(dict(tau=0.0), "tau="), (dict(tau=math.inf), "tau="), (dict(alpha=2.0), "alpha="),
                                       (dict(every=0), "every="), (dict(unknown_state="drop"), "unknown_state=")])
def test_arguments_checked(kw, match):
    with pytest.raises(GaugeError, match=match):
        ClipSteps(**kw)


# ---------------------------------------------------------------------- Lightning
def test_lightning_callback_clips_then_balances_and_skips_validation(tmp_path):
    pytest.importorskip("lightning")
    from lightning_helpers import TinyLit, token_loader, trainer

    from gaugeopt.callbacks import GaugeFix, QKClip

    class WithVal(TinyLit):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", self.model(x, y)[1])

    module = WithVal(lr=1e-2)
    clip, fix = QKClip(tau=TAU), GaugeFix(every=1)
    reads = []
    original = LogitTracker.read

    def counting(self, site, args, kwargs):
        reads.append(torch.is_grad_enabled())
        return original(self, site, args, kwargs)

    LogitTracker.read = counting
    try:
        tr = trainer(tmp_path, max_steps=6, callbacks=[fix, clip], accumulate_grad_batches=2, val_check_interval=4,
                     limit_val_batches=2, precision="bf16-mixed")
        tr.fit(module, token_loader(12), token_loader(2, seed=1))
    finally:
        LogitTracker.read = original
    assert clip.state_dict() == {"optimizer_steps": 6, "clips": 6}
    assert len(reads) == 6 * 2 * 2 and all(reads)  # 6 steps × 2 micro-batches × 2 layers; no validation forward
    assert clip.last_report.heads_over > 0 and gaugeopt.qk_drift(module.model) < 1e-6
    logged = tr.logged_metrics
    assert "qk_clip/max_logit_before" in logged and "qk_clip/clips" in logged
    assert all(not s.module._forward_pre_hooks for s in gaugeopt.find_attention(module.model))  # teardown


# ---------------------------------------------------------------------- Hugging Face Trainer
def test_hf_trainer_callback(tmp_path):
    pytest.importorskip("transformers")
    from trainer_helpers import arguments, tiny_llama, trainer

    from gaugeopt.integrations.transformers import GaugeFixCallback, QKClipCallback

    model = tiny_llama()
    clip = QKClipCallback(tau=0.1)
    tr = trainer(model, arguments(tmp_path, steps=6, logging_steps=3), callbacks=[GaugeFixCallback(every=1), clip])
    tr.train()
    assert clip.state_dict() == {"optimizer_steps": 6, "clips": 6}
    assert clip.last_report.heads_over > 0 and gaugeopt.qk_drift(model) < 1e-6
    assert any("qk_clip/max_logit_before" in rec for rec in tr.state.log_history)
    assert QKClipCallback(tau=0.1).state()["args"] == clip.state()["args"]
