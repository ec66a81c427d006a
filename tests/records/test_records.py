"""find_attention: every adapter's record reproduces its layer's output from the formulas,
and everything it cannot vouch for is refused."""

import copy

import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.models import GPT, GPTConfig
from reference_attention import reference_attention


def _attn_input(case_name, args, kwargs):
    if case_name.startswith("torch_mha"):
        return args[0], args[1]
    x = kwargs.get("hidden_states", args[0] if args else None)
    return x, None


@pytest.mark.parametrize("name, lrm", zoo.CASES, ids=zoo.CASE_IDS)
def test_site_reproduces_attention_output(name, lrm):
    """The site's effective weights, fed to a head-by-head textbook attention, give exactly the
    module's output: proves head blocks, fused-row order, GQA mapping, RoPE planes, biases."""
    case = zoo.build(name, lrm=lrm)
    sites = gaugeopt.find_attention(case.model)
    io = zoo.attention_io(case, case.model)
    assert len(io) == len(sites) == 2 - (name.startswith("torch_mha"))
    base = zoo.rope_base(case.model)
    for site, (args, kwargs, out) in zip(sites, io):
        x, kv = _attn_input(name, args, kwargs)
        ref = reference_attention(site, x, kv, base=base, angle_dtype=zoo.rope_angle_dtype(case.model))
        assert gaugeopt.relative_change(ref, out) < 1e-12, site


@pytest.mark.parametrize("name", ["gpt_rope_interleaved", "gpt_rope_partial_split_half", "hf_llama"])
def test_reference_detects_wrong_rope_pairing(name):
    """Negative control for the test above: the other RoPE convention does not match."""
    case = zoo.build(name)
    site = gaugeopt.find_attention(case.model)[0]
    other = "split_half" if site.rope.kind == "interleaved" else "interleaved"
    wrong = copy.copy(site)
    wrong.rope = gaugeopt.RopeSpec(other, site.rope.rotary_dim)
    args, kwargs, out = zoo.attention_io(case, case.model)[0]
    x, _ = _attn_input(name, args, kwargs)
    kw = dict(base=zoo.rope_base(case.model), angle_dtype=zoo.rope_angle_dtype(case.model))
    assert gaugeopt.relative_change(reference_attention(site, x, **kw), out) < 1e-12
    assert gaugeopt.relative_change(reference_attention(wrong, x, **kw), out) > 1e-3


def test_site_fields_and_names():
    case = zoo.build("gpt_rope_partial_split_half", lrm=True)
    s = gaugeopt.find_attention(case.model)[1]
    assert (s.name, s.h, s.h_kv, s.d_k, s.d_v, s.d_model) == ("transformer.h.1.attn", 4, 2, 8, 8, 32)
    assert (s.rope.kind, s.rope.rotary_dim) == ("split_half", 6)
    assert s.has_multipliers and s.layer_index == 1
    assert s.q.row_mult.name == "transformer.h.1.attn.c_attn.row_mults.0"
    assert s.k.row_mult.name == "transformer.h.1.attn.c_attn.row_mults.1"
    assert s.o.col_mult.name == "transformer.h.1.attn.c_proj.col_mults.0"
    params = dict(case.model.named_parameters())
    for name in s.parameter_names():
        assert name in params


def test_views_alias_parameters_and_map_any_tensor():
    case = zoo.build("hf_gpt2")  # Conv1D: transposed storage
    s = gaugeopt.find_attention(case.model)[0]
    conv = case.model.transformer.h[0].attn.c_attn
    with torch.no_grad():
        s.k.weight.get()[2, 3, 5] = 7.0
    # K rows are columns E..2E of the (in, out) Conv1D weight; head 2, channel 3 is column E + 2*8 + 3
    assert conv.weight[5, 32 + 2 * 8 + 3] == 7.0
    fake_grad = torch.arange(conv.weight.numel(), dtype=torch.float64).view_as(conv.weight)
    assert s.k.weight.view(fake_grad)[2, 3, 5] == fake_grad[5, 32 + 19]
    assert s.o.weight.view(torch.zeros_like(case.model.transformer.h[0].attn.c_proj.weight)).shape == (32, 4, 8)


def test_compiled_and_wrapped_models():
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    wrapped = nn.Sequential(model)
    assert [s.name for s in gaugeopt.find_attention(wrapped)] == ["0.transformer.h.0.attn"]
    compiled = torch.compile(model)  # no compilation happens until called
    (site,) = gaugeopt.find_attention(compiled)
    assert site.q.weight.name.startswith("_orig_mod.")


# ---------------------------------------------------------------------- refusals
def test_no_attention_names_what_was_searched():
    with pytest.raises(GaugeError) as err:
        gaugeopt.find_attention(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    msg = str(err.value)
    assert "no attention layer found" in msg and "GPT2Attention" in msg and "MultiheadAttention" in msg
    assert "register_adapter" in msg


def test_unknown_attention_class_is_refused_not_skipped():
    class MyAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

    model = nn.Sequential(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)), MyAttention())
    with pytest.raises(GaugeError, match="look like attention but no adapter"):
        gaugeopt.find_attention(model)
    assert len(gaugeopt.find_attention(model, allow_unclaimed=["1"])) == 1


def test_qk_norm_is_recorded_and_its_dense_pair_refused():
    """GPT(qk_norm=True): the site records the norm; the dense Q/K pair is refused (docs/qk_norm.md),
    and a norm module the adapter does not know is refused."""
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, qk_norm=True))
    (site,) = gaugeopt.find_attention(model)
    n = site.qk_norm
    assert (n.kind, n.scope, n.q_gain.name, n.k_gain.shape, n.eps) == ("rms", "head", "transformer.h.0.attn.q_norm.weight", (1, 4), 1e-6)
    assert site.qk_kind == "qk_gain" and "qk_norm" in site.features
    with pytest.raises(GaugeError, match="not a symmetry"):
        site.pair("qk")
    model.transformer.h[0].attn.k_norm = nn.LayerNorm(4)
    with pytest.raises(GaugeError, match="k_norm of type LayerNorm"):
        gaugeopt.find_attention(model)


def test_patched_forward_is_refused():
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    attn = model.transformer.h[0].attn
    attn.forward = lambda x: attn.c_proj(x)
    with pytest.raises(GaugeError, match="forward was overridden"):
        gaugeopt.find_attention(model)


def test_subclass_is_not_matched_by_parent_adapter():
    from gaugeopt.models.gpt import CausalSelfAttention

    class Scaled(CausalSelfAttention):
        def forward(self, x):
            return 2 * super().forward(x)

    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    model.transformer.h[0].attn.__class__ = Scaled
    with pytest.raises(GaugeError, match=r"subclass a supported attention class.*Scaled, a subclass of "
                                         r"gaugeopt\.models\.gpt\.CausalSelfAttention"):
        gaugeopt.find_attention(model)


def test_a_subclass_is_refused_whatever_its_name_and_allow_unclaimed():
    """A subclass under a name without "attn" used to be skipped silently; now it is refused, never skipped,
    and allow_unclaimed (for modules that are not attention) does not waive it."""
    from gaugeopt.models.gpt import CausalSelfAttention

    class Mixer(CausalSelfAttention):
        pass

    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8))
    model.transformer.h[1].attn.__class__ = Mixer
    for allow in ((), ("transformer.h.1.attn",)):
        with pytest.raises(GaugeError, match=r"transformer\.h\.1\.attn \(.*Mixer, a subclass of"):
            gaugeopt.find_attention(model, allow_unclaimed=allow)
        with pytest.raises(GaugeError, match="subclass"):
            gaugeopt.gauge_fix(model)


def test_wrapped_projection_is_refused():
    class LoRALinear(nn.Linear):
        pass

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    model = transformers.LlamaForCausalLM(cfg)
    attn = model.model.layers[0].self_attn
    attn.q_proj = LoRALinear(16, 16, bias=False)
    with pytest.raises(GaugeError, match="LoRALinear"):
        gaugeopt.find_attention(model)


def test_mha_add_bias_kv_is_refused():
    model = nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(GaugeError, match="add_bias_kv"):
        gaugeopt.find_attention(model)


def test_gpt2_cross_attention_is_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, add_cross_attention=True)
    with pytest.raises(GaugeError, match="cross-attention"):
        gaugeopt.find_attention(transformers.GPT2LMHeadModel(cfg))


def test_llama_attention_without_rotary_embedding_is_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
    layer = transformers.LlamaForCausalLM(cfg).model.layers[0]
    with pytest.raises(GaugeError, match="rotary embedding"):
        gaugeopt.find_attention(layer)


def test_manual_spec_api():
    class TwoTower(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = nn.Linear(12, 8), nn.Linear(12, 4), nn.Linear(12, 6)
            self.wo = nn.Linear(12, 12)

    site = gaugeopt.site_from_linears(TwoTower(), "blk", q="wq", k="wk", v="wv", o="wo", num_heads=2, num_kv_heads=1,
                                      head_dim=4, v_head_dim=6, rope=gaugeopt.RopeSpec("interleaved", 2))
    assert (site.h, site.h_kv, site.d_k, site.d_v, site.d_model) == (2, 1, 4, 6, 12)
    assert site.q.weight.name == "blk.wq.weight" and site.q.weight.shape == (2, 4, 12)
    with pytest.raises(GaugeError, match="output rows"):
        gaugeopt.site_from_linears(TwoTower(), "blk", q="wq", k="wk", v="wv", o="wo", num_heads=3)
    with pytest.raises(GaugeError, match="no attribute 'nope'"):
        gaugeopt.site_from_linears(TwoTower(), "blk", q="nope", k="wk", v="wv", o="wo", num_heads=2)
