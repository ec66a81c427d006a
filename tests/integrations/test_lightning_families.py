"""The models people train, trained with the Lightning callbacks: nanoGPT's real model.py and litgpt
with learnable multipliers and Trainer(callbacks=[GaugeFix(every=5)]); and a user's own attention,
certified on the first training batch."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.callbacks import GaugeFix, GaugeMonitor
from gaugeopt.adapters import find as registry
from lightning_helpers import T, VOCAB, token_loader, trainer
from model_libraries import nanogpt, quiet, require
from user_models import SPEC, MyAttention, MyLM

STEPS, EVERY = 20, 5


class LitLM(pl.LightningModule):
    """Any next-token model ``model(x) -> logits`` (or nanoGPT's ``model(x, y) -> (logits, loss)``),
    converted to learnable multipliers, trained with AdamW on paper 002's condition B groups."""

    def __init__(self, model: torch.nn.Module, lr: float = 3e-3, nanogpt_style: bool = False) -> None:
        super().__init__()
        self.model = gaugeopt.apply_lrm(model)
        self.lr, self.nanogpt_style = lr, nanogpt_style

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.nanogpt_style:
            return self.model(x, y)[1]
        return torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(gaugeopt.lrm_param_groups(self.model, "B"), lr=self.lr, betas=(0.9, 0.95))


class CheckedFix(GaugeFix):
    """GaugeFix that measures the model's output on a fixed batch right before and after each fix."""

    def __init__(self, probe, forward, **kw):
        super().__init__(**kw)
        self.probe, self.forward, self.changes, self.reports = probe, forward, [], []

    def _act(self, optimizer):
        with torch.no_grad():
            before = self.forward(self._module.model, self.probe)
            out = super()._act(optimizer)
            self.changes.append(gaugeopt.relative_change(before, self.forward(self._module.model, self.probe)))
        self.reports.append(self.last_report)
        return out


def _litgpt(**kw):
    require("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    torch.manual_seed(0)
    base = dict(name="tiny", block_size=T, vocab_size=VOCAB, padding_multiple=1, n_layer=2, n_head=4, n_embd=32,
                n_query_groups=2, rotary_percentage=0.5, bias=True, norm_class_name="RMSNorm",
                mlp_class_name="LLaMAMLP", intermediate_size=64)
    return GPT(Config(**{**base, **kw}))


def test_litgpt_gqa_gaugefix_keeps_drift_at_zero():
    """litgpt GQA 4/2 with partial RoPE: without the callback the Q/K scales drift apart (> 1e-3 in
    20 steps); with GaugeFix(every=5) the run ends on a fix and the drift is ≤ 1e-6."""
    drift = {}
    for with_fix in (False, True):
        lit = LitLM(_litgpt())
        fix = GaugeFix(every=EVERY)
        trainer(max_steps=STEPS, callbacks=[fix] if with_fix else []).fit(lit, token_loader(STEPS))
        drift[with_fix] = gaugeopt.qk_drift(lit.model)
        if with_fix:
            assert fix.fixes == STEPS // EVERY  # a built-in adapter's records are proved too, at setup:
            assert fix.certificate is not None and fix.certificate.worst_valid <= 1e-10
            assert fix.last_report.max_drift_before > 1e-4  # there was drift to remove at every fix
    assert drift[False] > 1e-3 and drift[True] <= 1e-6, drift


def test_nanogpt_model_py_trains_with_gaugefix():
    """nanoGPT's own model.py (vendored, multi-head only). With one K head per query head the Q/K
    multipliers do not drift apart in training (docs/gaugefix.md), so the run starts from a valid
    but unbalanced gauge (r_Q·δ, r_K/δ, the same function): the fixes ran, the first one removed
    that imbalance, and no fix changed the function."""
    mod = nanogpt()
    torch.manual_seed(0)
    model = quiet(mod.GPT, mod.GPTConfig(block_size=T, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                                          bias=True))
    assert [s.kind for s in gaugeopt.find_attention(model)] == ["nanogpt", "nanogpt"]
    lit = LitLM(model, nanogpt_style=True)
    gaugeopt.random_gauge_transform(lit.model, ("lrm_qk",), generator=0, log_scale=1.0)
    assert gaugeopt.qk_drift(lit.model) > 0.1
    probe = next(iter(token_loader(1)))[0]
    fix = CheckedFix(probe, lambda m, x: m(x, x)[0], every=EVERY)
    trainer(max_steps=STEPS, callbacks=[fix]).fit(lit, token_loader(STEPS))
    assert fix.fixes == STEPS // EVERY and len(fix.changes) == STEPS // EVERY
    assert fix.reports[0].max_drift_before > 0.1 and all(r.max_drift_after <= 1e-6 for r in fix.reports)
    assert max(fix.changes) < 1e-5  # float32 training: a fix is a rescale, exact up to rounding
    assert gaugeopt.qk_drift(lit.model) <= 1e-6


@pytest.fixture
def register(monkeypatch):
    def reg(cls, spec):
        monkeypatch.setitem(registry._ADAPTERS, cls, spec.adapter())
    return reg


def test_user_attention_is_certified_on_the_first_batch(register):
    register(MyAttention, SPEC)
    torch.manual_seed(0)
    fix, monitor = GaugeFix(every=EVERY), GaugeMonitor(every=EVERY)
    lit = LitLM(MyLM(vocab=VOCAB))
    trainer(max_steps=10, callbacks=[fix, monitor]).fit(lit, token_loader(10))
    assert fix.certificate is not None and monitor.certificate is None  # the second callback reuses the stamp
    assert [sorted(layer.sectors) for layer in fix.certificate.layers] == [
        ["key_bias", "lrm_internal", "lrm_qk", "lrm_vo", "perm", "qk", "value_bias", "vo"]] * 2
    assert fix.certificate.worst_valid <= 1e-10 and fix.certificate.weakest_control >= 1e-3
    assert fix.fixes == 2 and gaugeopt.qk_drift(lit.model) <= 1e-6


def test_wrong_user_attention_stops_the_run_before_any_step(register):
    register(MyAttention, dataclasses.replace(SPEC, rope=gaugeopt.RopeSpec("split_half", 8)))  # full head: wrong
    torch.manual_seed(0)
    lit = LitLM(MyLM(vocab=VOCAB))
    before = {n: p.detach().clone() for n, p in lit.named_parameters()}
    with pytest.raises(GaugeError, match=r"layer model\.blocks\.0\.attn \(spec\), sector qk"):
        trainer(max_steps=10, callbacks=[GaugeFix(every=EVERY)]).fit(lit, token_loader(10))
    assert all(torch.equal(p, before[n]) for n, p in lit.named_parameters())  # no step was taken


def test_certify_false_refuses_uncertified_records_at_setup(register):
    register(MyAttention, SPEC)
    lit = LitLM(MyLM(vocab=VOCAB))
    with pytest.raises(GaugeError, match=r"GaugeFix: 2 attention layer\(s\) .*certify=False asks for a proof made beforehand"):
        trainer(max_steps=2, callbacks=[GaugeFix(every=1, certify=False)]).fit(lit, token_loader(2))
    x = next(iter(token_loader(1)))[0]
    gaugeopt.certify(lit.model, x)  # certified beforehand: accepted
    fix = GaugeFix(every=1, certify=False)
    trainer(max_steps=2, callbacks=[fix]).fit(lit, token_loader(2))
    assert fix.fixes == 2


@pytest.mark.parametrize("target", ["grad", "update"])
def test_projection_callback_certifies_before_it_projects(register, target):
    from gaugeopt.callbacks import GaugeProjection

    register(MyAttention, SPEC)
    torch.manual_seed(0)
    proj = GaugeProjection(mode="exact", target=target, sectors=("qk", "vo"), log_every=1)
    lit = LitLM(MyLM(vocab=VOCAB))
    trainer(max_steps=3, callbacks=[proj]).fit(lit, token_loader(3))
    assert proj.certificate is not None and proj.optimizer_steps == 3
