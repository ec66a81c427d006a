"""``equivalent``, ``merge`` and ``spectral_fingerprint`` compare computations, not only parameters.

Each negative case builds model B with model A's parameters under a different configuration (or a
buffer or attribute changed by hand), checks that the two really compute different functions (the
logits move: the change the tools would otherwise have hidden), and then that ``compare`` says
"not equivalent" naming the difference, ``merge`` refuses naming it, and the fingerprints differ.
The controls: the same configuration built twice, and a gauge-transformed copy, stay equivalent and
merge; settings the forward does not read in evaluation (dropout) do not count.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo
from gaugeopt.errors import GaugeError
from gaugeopt.models import GPT
from gaugeopt.tools.computation import computation_difference, computation_state
from gaugeopt.tools.equivalence import compare, spectral_fingerprint
from gaugeopt.tools.merging import merge
from gaugeopt.trust.invariance import randomize_parameters

TOL = 1e-10


def _same_weights(model: nn.Module, build) -> nn.Module:
    """A model built by ``build()`` holding ``model``'s parameters (and persistent buffers)."""
    other = build().to(torch.float64)
    other.load_state_dict(model.state_dict())
    return other.eval()


def _gpt_rebuilt(case: zoo.Case, **changes) -> nn.Module:
    return _same_weights(case.model, lambda: GPT(dataclasses.replace(case.model.config, **changes)))


def _hf_rebuilt(case: zoo.Case, **changes) -> nn.Module:
    def build():
        cfg = copy.deepcopy(case.model.config)
        for k, v in changes.items():
            setattr(cfg, k, v)
        return type(case.model)(cfg)

    return _same_weights(case.model, build)


def _assert_told_apart(case: zoo.Case, other: nn.Module, *named: str) -> None:
    assert gaugeopt.relative_change(case.logits(), case.logits(other)) > 1e-6  # a different function
    report = compare(case.model, other, TOL)
    assert not report.equivalent and "different computations" in report.reason, report.reason
    for name in named:
        assert name in report.reason, (name, report.reason)
    with pytest.raises(GaugeError, match="besides their parameters") as caught:
        merge(case.model, other)
    for name in named:
        assert name in str(caught.value)
    fa, fb = spectral_fingerprint(case.model), spectral_fingerprint(other)
    assert fa.distance(fb) > 1e-3 and fa.digest() != fb.digest()  # inf for a setting, the norm gap for a buffer


def _assert_equivalent(case: zoo.Case, other: nn.Module) -> None:
    report = compare(case.model, other, TOL)
    assert report.equivalent, report.reason
    fa, fb = spectral_fingerprint(case.model), spectral_fingerprint(other)
    assert fa.distance(fb) <= 1e-12 and fa.digest() == fb.digest()
    merged = merge(case.model, other).merged
    assert gaugeopt.relative_change(case.logits(), case.logits(merged)) <= 1e-12


# ---------------------------------------------------------------------- gaugeopt's GPT
@pytest.fixture(scope="module")
def gpt():
    return zoo.build("gpt_rope_split_half_gqa", 3)  # RoPE split-half, GQA, RMSNorm, SwiGLU


def test_gpt_rope_base(gpt):
    _assert_told_apart(gpt, _gpt_rebuilt(gpt, rope_base=500.0), "rotary.base", "config.rope_base")


def test_gpt_norm_eps_set_on_the_modules(gpt):
    other = gpt.copy()
    for m in other.modules():
        if type(m).__name__ == "RMSNorm":
            m.eps = 1.0  # large enough to move float64 logits visibly
    _assert_told_apart(gpt, other, "ln_1.eps")


def test_gpt_controls(gpt):
    _assert_equivalent(gpt, _gpt_rebuilt(gpt))  # the same configuration, built again
    moved = gaugeopt.random_gauge_transform(gpt.copy(), ("qk", "vo", "perm"), torch.Generator().manual_seed(0))
    _assert_equivalent(gpt, moved)
    _assert_equivalent(gpt, _gpt_rebuilt(gpt, dropout=0.3))  # read in training mode only


# ---------------------------------------------------------------------- Hugging Face Llama, Qwen2, Mistral
@pytest.fixture(scope="module")
def llama():
    return zoo.build("hf_llama", 4)


def test_hf_llama_rope_theta(llama):
    rope = dict(llama.model.config.rope_parameters, rope_theta=100.0)
    _assert_told_apart(llama, _hf_rebuilt(llama, rope_parameters=rope), "rope_theta", "inv_freq")


def test_hf_llama_rope_scaling(llama):
    rope = dict(llama.model.config.rope_parameters, rope_type="linear", factor=4.0)
    _assert_told_apart(llama, _hf_rebuilt(llama, rope_parameters=rope), "rope_type", "inv_freq")


def test_hf_llama_rms_norm_eps(llama):
    _assert_told_apart(llama, _hf_rebuilt(llama, rms_norm_eps=0.5), "rms_norm_eps", "variance_epsilon")


def test_hf_llama_inv_freq_buffer_alone(llama):
    other = llama.copy()
    other.model.rotary_emb.inv_freq.mul_(1.5)  # a non-persistent buffer: in no state dict
    _assert_told_apart(llama, other, "model.rotary_emb.inv_freq")


def test_hf_llama_attention_scaling_attribute(llama):
    other = llama.copy()
    for layer in other.model.layers:
        layer.self_attn.scaling *= 2
    _assert_told_apart(llama, other, "self_attn.scaling")


def test_hf_llama_swapped_activation_module(llama):
    other = llama.copy()
    other.model.layers[0].mlp.act_fn = nn.GELU()  # no parameter to tell SiLU from GELU
    _assert_told_apart(llama, other, "model.layers.0.mlp.act_fn.__class__")


def test_hf_llama_controls(llama):
    _assert_equivalent(llama, _hf_rebuilt(llama))
    moved = gaugeopt.random_gauge_transform(llama.copy(), ("qk", "vo", "perm"), torch.Generator().manual_seed(1))
    _assert_equivalent(llama, moved)
    _assert_equivalent(llama, _hf_rebuilt(llama, attention_dropout=0.5))


def test_hf_mistral_sliding_window_read_from_the_config_at_each_call():
    case = zoo.build("hf_mistral", 5)  # MistralAttention passes self.config.sliding_window to the kernel
    other = _hf_rebuilt(case, sliding_window=3)
    _assert_told_apart(case, other, "config.sliding_window")
    _assert_equivalent(case, _hf_rebuilt(case, sliding_window=case.model.config.sliding_window))


def test_hf_qwen2_sliding_layers():
    case = zoo.build("hf_qwen2", 6)
    window = dict(use_sliding_window=True, sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    _assert_told_apart(case, _hf_rebuilt(case, **window), "config.sliding_window", "layer_types")
    _assert_equivalent(case, _hf_rebuilt(case))


# ---------------------------------------------------------------------- nn.MultiheadAttention
def test_mha_add_zero_attn():
    """A zero key and value appended to every sequence. Without biases every sector of the layer stays exact,
    so the gate proves both models and the difference has to come from the comparison itself; with biases
    the gate refuses the zero-attention model already (its key-bias shift no longer cancels)."""
    torch.manual_seed(7)
    model = zoo.MHAModel()
    model.attn = nn.MultiheadAttention(24, 4, batch_first=True, bias=False)
    model = model.double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(7))
    inputs = torch.randint(0, zoo.VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    case = zoo.Case("torch_mha_nobias", model, inputs, lambda m: m(inputs))
    other = case.copy()
    other.attn.add_zero_attn = True
    _assert_told_apart(case, other, "attn.add_zero_attn")
    moved = gaugeopt.random_gauge_transform(case.copy(), ("qk", "vo", "perm"), torch.Generator().manual_seed(2))
    _assert_equivalent(case, moved)

    biased = zoo.build("torch_mha", 7)
    other = biased.copy()
    other.attn.add_zero_attn = True
    with pytest.raises(GaugeError, match="key_bias"):
        compare(biased.model, other, TOL)


# ---------------------------------------------------------------------- the state itself
def test_state_reads_shared_configs_once_and_ignores_private_and_training_flags(llama):
    state = computation_state(llama.model)
    assert state.settings["model.layers.1.self_attn.config"] == "the object at config"
    assert "model.rotary_emb.inv_freq" in state.tensors
    assert not any(part.startswith("_") and part != "__class__" for path in state.settings for part in path.split("."))
    other = llama.copy().train()
    other.model._gaugeopt_note = "a private attribute"
    assert computation_difference(state, computation_state(other), 0.0) == ""


def test_state_skips_tensor_attributes_that_alias_parameters():
    """A module that caches a view of its own weight as a plain attribute: the view is a parameter's value
    (gauge-dependent), not a setting, and a gauge copy must still compare equal."""
    case, moved = zoo.build("torch_mha", 8), zoo.build("torch_mha", 8).model  # two identical models
    for m in (case.model, moved):
        m.attn.cached = m.attn.in_proj_weight.detach()[:2]
    assert "attn.cached" not in computation_state(case.model).tensors
    gaugeopt.random_gauge_transform(moved, ("qk", "vo"), torch.Generator().manual_seed(3))
    assert not torch.equal(moved.attn.cached, case.model.attn.cached)  # the view moved with the weight
    _assert_equivalent(case, moved)
