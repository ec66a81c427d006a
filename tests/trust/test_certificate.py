"""gaugeopt.certify: passes correct records, catches wrong ones with a GaugeError that names the
layer, the sector and the measured change, and gates every operation that changes parameters."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo.families as zf
from gaugeopt import GaugeError
from gaugeopt.adapters import find as registry
from gaugeopt.trust.proof import certify_with
from gaugeopt.trust.stamps import is_certified
from gaugeopt.trust.invariance import randomize_parameters
from model_libraries import require
from user_models import SPEC, MyAttention, MyLM

CERTIFY_HINT = "gaugeopt.certify(model, example_batch)"


@pytest.fixture
def register(monkeypatch):
    """Register an adapter for a class for one test only."""
    def reg(cls, spec):
        monkeypatch.setitem(registry._ADAPTERS, cls, spec.adapter())
    return reg


def _measured(err) -> float:
    """The relative change a certificate error reports."""
    return float(re.search(r"output by (\S+) \(", str(err.value)).group(1))


def _lm(seed=0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return MyLM(), torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- a correct user adapter
class _BatchLM(MyLM):
    """MyLM fed a dict: gaugeopt cannot make an input for it, so its proofs need a batch."""

    def forward(self, batch: dict) -> torch.Tensor:
        return super().forward(batch["tokens"])


def test_user_adapter_is_refused_until_certified_then_used_exactly(register):
    register(MyAttention, SPEC)
    torch.manual_seed(0)
    model = gaugeopt.apply_lrm(_BatchLM()).double()
    x = {"tokens": torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))}
    randomize_parameters(model, torch.Generator().manual_seed(1))
    sites = gaugeopt.find_attention(model)
    assert [(s.verified, s.h, s.h_kv, s.rope.kind, s.rope.rotary_dim) for s in sites] == [(False, 4, 2, "split_half", 4)] * 2
    opt = torch.optim.AdamW(model.parameters())
    refusals = {
        "gauge_fix": lambda: gaugeopt.gauge_fix(model, opt),
        "GaugeProjector": lambda: gaugeopt.GaugeProjector(model).vertical({n: torch.ones_like(p) for n, p in model.named_parameters()}),
        "random_gauge_transform": lambda: gaugeopt.random_gauge_transform(copy.deepcopy(model)),
        "canonicalize": lambda: gaugeopt.canonicalize(model),
        "gauge_dimension": lambda: gaugeopt.gauge_dimension(model),
        "equivalent": lambda: gaugeopt.equivalent(model, copy.deepcopy(model)),
    }
    before_params = [p.detach().clone() for p in model.parameters()]
    for what, call in refusals.items():
        with pytest.raises(GaugeError, match="no proof for the model as it is now") as err:
            call()
        assert CERTIFY_HINT in str(err.value) and what in str(err.value) and "no example input" in str(err.value)
    assert all(torch.equal(a, p) for a, p in zip(before_params, model.parameters())), "a refusal writes nothing"

    report = gaugeopt.certify(model, x)
    assert [sorted(layer.sectors) for layer in report.layers] == [["key_bias", "lrm_internal", "lrm_qk", "lrm_vo", "perm", "qk", "value_bias", "vo"]] * 2  # MyAttention: biases, partial RoPE
    assert report.worst_valid <= 1e-10 and report.weakest_control >= 1e-3
    assert all(is_certified(s) for s in gaugeopt.find_attention(model))
    assert "transformer" not in str(report) and "blocks.1.attn" in str(report)

    before = model(x)
    with torch.no_grad():  # drift the Q/K multipliers (a valid gauge move) so that the fix has work to do
        sites[0].q.row_mult.get().mul_(3.0)
        sites[0].k.row_mult.get().div_(3.0)
    report = gaugeopt.gauge_fix(model, opt)
    assert report.max_drift_before > 1.0 and report.max_drift_after < 1e-6
    assert gaugeopt.relative_change(before, model(x)) < 1e-12
    moved = gaugeopt.random_gauge_transform(copy.deepcopy(model), "all", generator=1)
    assert gaugeopt.relative_change(before, moved(x)) < 1e-12


def test_user_adapter_on_a_model_gaugeopt_can_run_is_proved_automatically(register):
    """A token model (forward(idx), an nn.Embedding): the gate makes up an input and proves the records
    itself — a right spec is then used exactly, a wrong one refused with the certificate's message."""
    register(MyAttention, SPEC)
    model, x = _lm()
    model = model.double()
    randomize_parameters(model, torch.Generator().manual_seed(1))
    assert not any(is_certified(s) for s in gaugeopt.find_attention(model))
    before = model(x)
    moved = gaugeopt.random_gauge_transform(copy.deepcopy(model), "all", generator=1)
    assert gaugeopt.relative_change(before, moved(x)) < 1e-12
    assert all(is_certified(s) for s in gaugeopt.find_attention(moved))  # the proof is stamped on the modules

    register(MyAttention, dataclasses.replace(SPEC, rope=lambda m: gaugeopt.RopeSpec("interleaved", m.rotary)))
    wrong, _ = _lm()
    params = [p.detach().clone() for p in wrong.parameters()]
    with pytest.raises(GaugeError, match=r"certify: layer blocks\.0\.attn \(spec\), sector qk: a valid gauge transformation"):
        gaugeopt.gauge_fix(wrong)
    assert all(torch.equal(a, p) for a, p in zip(params, wrong.parameters()))


def test_certificate_travels_with_copies_and_expires_when_the_record_changes(register):
    register(MyAttention, SPEC)
    model = _BatchLM()
    x = {"tokens": torch.randint(0, 32, (2, 12))}
    gaugeopt.certify(model, x)
    assert all(is_certified(s) for s in gaugeopt.find_attention(copy.deepcopy(model)))
    gaugeopt.apply_lrm(model)  # the records gain multipliers: what was proved no longer covers them
    assert not any(is_certified(s) for s in gaugeopt.find_attention(model))
    with pytest.raises(GaugeError, match="no proof for the model as it is now"):
        gaugeopt.gauge_fix(model)
    gaugeopt.certify(model, x)
    assert gaugeopt.gauge_fix(model).max_drift_after < 1e-6


# ---------------------------------------------------------------------- wrong records are caught
def _litgpt_case():
    require("litgpt")
    from litgpt.model import CausalSelfAttention

    model, x, forward = zf.raw("litgpt_gqa")  # GQA 4/2, head 8, split-half RoPE on the first 4 channels
    return CausalSelfAttention, model.eval(), x, forward


def _litgpt_spec(**changes):
    from gaugeopt.adapters.litgpt import LITGPT_SPEC

    return dataclasses.replace(LITGPT_SPEC, kind="user", **changes)


def test_correct_user_litgpt_spec_passes(register):
    cls, model, x, forward = _litgpt_case()
    register(cls, _litgpt_spec())
    assert not gaugeopt.find_attention(model)[0].verified
    report = certify_with(model, lambda m: forward(m, x))
    assert report.worst_valid <= 1e-10 and report.weakest_control >= 1e-3


@pytest.mark.parametrize("what, changes", [
    ("wrong head count", dict(num_heads=2, num_kv_heads=1, head_dim=16)),
    ("forgotten partial rotary", dict(rope=gaugeopt.RopeSpec("split_half", 8))),
    ("missing RoPE", dict(rope=gaugeopt.RopeSpec())),
    ("wrong RoPE pairing", dict(rope=gaugeopt.RopeSpec("interleaved", 4))),
])
def test_wrong_litgpt_record_is_caught(register, what, changes):
    cls, model, x, forward = _litgpt_case()
    register(cls, _litgpt_spec(**changes))
    site = gaugeopt.find_attention(model)[0]  # the record builds: the shapes are consistent
    with torch.no_grad():
        y0 = forward(model, x)
    with pytest.raises(GaugeError, match=r"layer transformer\.h\.0\.attn \(user\), sector qk: a valid gauge "
                                         r"transformation changed the module's output by") as err:
        certify_with(model, lambda m: forward(m, x))
    assert _measured(err) > 1e-3, what
    assert not is_certified(site)
    with torch.no_grad():
        assert torch.equal(forward(model, x), y0)  # the certificate never touches the model


def test_qk_norm_model_registered_as_plain_is_caught(register):
    transformers = require("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from gaugeopt.adapters.hf import HF_SPECS

    plain = dataclasses.replace(HF_SPECS["transformers.models.llama.modeling_llama.LlamaAttention"], kind="user",
                                rope=gaugeopt.RopeSpec("split_half", 8))
    register(Qwen3Attention, plain)
    model, x, forward = zf.raw("hf_qwen3")
    assert isinstance(model, transformers.Qwen3ForCausalLM) and gaugeopt.find_attention(model)[0].qk_norm is None
    with pytest.raises(GaugeError, match=r"layer model\.layers\.0\.self_attn \(user\), sector qk: a valid gauge "
                                         r"transformation changed the module's output by") as err:
        certify_with(model.eval(), lambda m: forward(m, x))
    assert _measured(err) > 1e-3


def test_a_user_spec_with_a_qk_norm_is_certified_on_its_gain_gauge(register):
    """A user's spec that records the Q/K norm gets the gain gauge: the certificate proves it (and
    would refuse the plain Q/K gauge, its control), then GaugeFix balances the gains."""
    require("transformers")
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    from gaugeopt.adapters.hf import HF_SPECS

    mine = dataclasses.replace(
        HF_SPECS["transformers.models.llama.modeling_llama.LlamaAttention"], kind="user",
        rope=gaugeopt.RopeSpec("split_half", 8), float32_steps="the Q/K RMSNorm in float32",
        qk_norm=gaugeopt.QKNormSpec("rms", "q_norm", "k_norm", eps="q_norm.variance_epsilon"),
    )
    register(Qwen3Attention, mine)
    model, x, forward = zf.raw("hf_qwen3")
    sites = gaugeopt.find_attention(model)
    assert sites[0].kind == "user" and sites[0].qk_norm is not None and not is_certified(sites[0])
    with pytest.raises(GaugeError, match="certify"):
        gaugeopt.gauge_fix(None, sites=[dataclasses.replace(sites[0], root=None)])  # records without their model
    report = certify_with(model.eval(), lambda m: forward(m, x))
    layer = report.layers[0]
    assert layer.sectors["qk_gain"].control_kind == "qk_under_norm" and layer.sectors["qk_gain"].control >= 1e-3
    assert layer.sectors["qk_gain"].valid <= 1e-6  # the float32 norm, declared
    with torch.no_grad():
        model.model.layers[0].self_attn.q_norm.weight.mul_(3.0)
    fixed = gaugeopt.gauge_fix(model)
    assert fixed.max_drift_before > 0.5 and gaugeopt.qk_drift(model) <= 1e-6


def test_record_of_unused_tensors_has_no_power(register):
    class Shadowed(MyAttention):
        def __init__(self):
            super().__init__()
            self.shadow = nn.Linear(32, 64)  # never called by forward

    register(Shadowed, dataclasses.replace(SPEC, qkv="shadow", stock_forward=False))
    model = nn.Sequential(Shadowed())
    with pytest.raises(GaugeError, match=r"sector qk: the negative control \(gl_under_rope\) changed the module's output "
                                         r"by only 0\.0e\+00 \(< 1e-03\), so the check has no power"):
        gaugeopt.certify(model, torch.randn(1, 6, 32))


def test_layer_the_forward_skips_is_an_error(register):
    register(MyAttention, SPEC)
    model = nn.ModuleDict({"used": MyAttention(), "unused": MyAttention()})
    with pytest.raises(GaugeError, match="never called unused"):
        certify_with(model, lambda m: m["used"](torch.randn(1, 5, 32)))


def test_output_projection_outside_the_module_is_refused():
    """A record whose O lives outside its module cannot be proved by rerunning the module alone:
    BERT's self-attention without BertAttention's output.dense."""
    transformers = require("transformers")
    model = transformers.BertModel(transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                           num_attention_heads=2, intermediate_size=32))
    site = gaugeopt.find_attention(model)[0]  # the built-in record, on BertAttention
    inner = dataclasses.replace(site, name=site.name + ".self", module=site.module.self)
    with pytest.raises(GaugeError, match=r"output\.dense\.weight is not held by the attention module "
                                         r"encoder\.layer\.0\.attention\.self"):
        certify_with(model, lambda m: m(input_ids=torch.randint(0, 32, (1, 5))), sites=[inner])


def test_a_module_the_recording_cannot_replay_is_refused(register):
    class Counting(MyAttention):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls += 1
            return super().forward(x) * self.calls

    register(Counting, SPEC)
    with pytest.raises(GaugeError, match="rerunning the module alone on its recorded inputs changes its output"):
        gaugeopt.certify(nn.Sequential(Counting()).eval(), torch.randn(1, 5, 32))


def test_float32_steps_loosen_the_tolerance_and_are_reported():
    require("torchtitan")
    model, x, forward = zf.raw("torchtitan_separate")
    report = certify_with(model.eval(), lambda m: forward(m, x))
    layer = report.layers[0]
    assert "float32" in layer.float32_steps and layer.sectors["qk"].tolerance == 1e-6
    assert layer.sectors["vo"].tolerance == 1e-10 and layer.sectors["vo"].valid <= 1e-10  # V/O does not see it
    assert 1e-10 < report.worst_valid <= 1e-6  # the float32 rotation is visible, and bounded
    assert report.weakest_control >= 1e-3
