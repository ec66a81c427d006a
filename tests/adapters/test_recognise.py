"""Recognition by equivalence (gaugeopt.adapters.recognise): a renamed copy of a verified attention
class is handled with that class's adapter and its records must be certified first; a copy with one
changed line — in ``forward`` or in a helper it calls — is refused with the message an unknown class
gets. The copies are Hugging Face's own ``modeling_llama.py`` (the installed version), renamed and
loaded as a user's module, as one does when forking a model file."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys

import pytest
import torch
import torch.nn as nn

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.adapters.recognise import equivalent_class, same_code
from model_libraries import quiet, require

CFG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, bos_token_id=0, eos_token_id=0)
UNKNOWN = "look like attention but no adapter understands them"


def _llama_copy(tmp_path, tag: str, edit=lambda s: s):
    """``modeling_llama.py`` with ``Llama`` renamed ``Fork`` (the config class kept), ``edit`` applied,
    imported as ``my_lab_<tag>.modeling_fork``."""
    transformers = require("transformers")
    from transformers.models.llama import modeling_llama

    src = inspect.getsource(modeling_llama)
    src = re.sub(r"from \.\.\.(\S*) import", lambda m: f"from transformers.{m.group(1)} import".replace(". import", " import"), src)
    src = src.replace("from .configuration_llama import", "from transformers.models.llama.configuration_llama import")
    src = src.replace("LlamaConfig", "CONFIG_CLASS").replace("Llama", "Fork").replace("CONFIG_CLASS", "LlamaConfig")
    edited = edit(src)
    assert tag == "copy" or edited != src, "the edit must change the file"
    name = f"my_lab_{tag}.modeling_fork"
    path = tmp_path / f"{tag}_modeling_fork.py"
    path.write_text(edited)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    cfg = transformers.LlamaConfig(**CFG)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return mod, quiet(mod.ForkForCausalLM, cfg).double().eval()


def test_a_renamed_copy_is_handled_as_llama_and_must_be_certified(tmp_path):
    mod, model = _llama_copy(tmp_path, "copy")
    sites = gaugeopt.find_attention(model)
    assert [type(s.module) for s in sites] == [mod.ForkAttention] * 2
    s = sites[0]
    assert s.kind == "hf_llama" and not s.verified
    assert "recognised_as:transformers.models.llama.modeling_llama.LlamaAttention" in s.features
    assert (s.h, s.h_kv, s.d_k, s.rope.kind, s.rope.rotary_dim) == (4, 2, 8, "split_half", 8)
    x = torch.randint(1, 61, (2, 8))
    from gaugeopt.trust.stamps import is_certified

    assert not any(is_certified(t) for t in sites)  # recognised, not verified: the gate proves it before use
    with torch.no_grad():
        before = model(input_ids=x).logits
        gaugeopt.random_gauge_transform(model, ("qk",), generator=0)
        assert gaugeopt.relative_change(before, model(input_ids=x).logits) <= 1e-10
    assert all(is_certified(t) for t in gaugeopt.find_attention(model))
    report = gaugeopt.certify(model, x)
    assert report.worst_valid <= 1e-10 and report.weakest_control >= 1e-3
    assert {"qk", "vo", "perm", "value_bias"} <= set(report.layers[0].sectors)  # full RoPE: no key_bias
    with torch.no_grad():
        before = model(input_ids=x).logits
        gaugeopt.random_gauge_transform(model, "all", generator=1)
        assert gaugeopt.relative_change(before, model(input_ids=x).logits) <= 1e-10


@pytest.mark.parametrize("where, edit", [
    ("forward", lambda s: s.replace("attn_output = self.o_proj(attn_output)",
                                    "attn_output = self.o_proj(attn_output.tanh())", 1)),
    ("helper", lambda s: s.replace("return torch.cat((-x2, x1), dim=-1)", "return torch.cat((x2, -x1), dim=-1)", 1)),
    ("kernel", lambda s: s.replace("attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling",
                                   "attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling * 0.5", 1)),
])
def test_a_copy_with_one_changed_line_is_refused(tmp_path, where, edit):
    """One line changed in forward, in rotate_half (reached through apply_rotary_pos_emb; reversing the
    rotation is still a RoPE, but not Llama's), or in eager_attention_forward (the kernel forward
    dispatches to): refused as an unknown class, never handled as Llama."""
    _, model = _llama_copy(tmp_path, where, edit)
    with pytest.raises(GaugeError, match=UNKNOWN) as err:
        gaugeopt.find_attention(model)
    assert "ForkAttention" in str(err.value) and "gaugeopt.AttentionSpec(" in str(err.value)


def test_cosmetic_differences_are_normalised(tmp_path):
    """Docstrings, comments, blank lines and line positions do not count; names are compared after
    the family stem is replaced (Fork* against Llama*)."""
    def cosmetic(s):
        s = s.replace('"""Multi-headed attention from \'Attention Is All You Need\' paper"""',
                      '"""A forked attention."""\n\n    # a comment\n')
        return s.replace("def rotate_half(x):", "\n\n# moved down\ndef rotate_half(x):")

    mod, model = _llama_copy(tmp_path, "cosmetic", cosmetic)
    assert gaugeopt.find_attention(model)[0].kind == "hf_llama"
    from transformers.models.llama import modeling_llama

    assert same_code(mod.ForkAttention, modeling_llama.LlamaAttention)
    assert equivalent_class(mod.ForkRMSNorm, "transformers.models.llama.modeling_llama.LlamaRMSNorm")
    assert not equivalent_class(mod.ForkMLP, "transformers.models.llama.modeling_llama.LlamaRMSNorm")


def test_equal_forward_with_another_helper_is_not_recognised():
    """GLM-4's forward is Llama's line for line, but the apply_rotary_pos_emb it calls is a partial,
    interleaved RoPE: recognition compares the helpers too, and GLM-4 has its own adapter."""
    require("transformers")
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.llama import modeling_llama
    from gaugeopt.adapters.recognise import _compare

    src = lambda c: inspect.getsource(c.forward).replace("Glm4", "Llama")  # noqa: E731
    assert src(modeling_glm4.Glm4Attention) == inspect.getsource(modeling_llama.LlamaAttention.forward)
    ok, why = _compare(modeling_glm4.Glm4Attention, modeling_llama.LlamaAttention, None)
    assert not ok and "apply_rotary_pos_emb" in why


@pytest.mark.parametrize("family, cls, reference", [
    ("qwen3_moe", "Qwen3MoeAttention", "Qwen3Attention"),
    ("granite", "GraniteAttention", "LlamaAttention"),
    ("roberta", "RobertaAttention", "BertAttention"),
    ("xlm_roberta", "XLMRobertaAttention", "BertAttention"),
    ("camembert", "CamembertAttention", "BertAttention"),
    ("electra", "ElectraAttention", "BertAttention"),
])
def test_hugging_face_copies_are_recognised(family, cls, reference):
    """Classes transformers generates from another family's modular file."""
    require("transformers")
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    ref_family = {"Qwen3Attention": "qwen3", "LlamaAttention": "llama", "BertAttention": "bert"}[reference]
    ref = getattr(importlib.import_module(f"transformers.models.{ref_family}.modeling_{ref_family}"), reference)
    assert same_code(getattr(mod, cls), ref)


def test_subclasses_of_listed_classes_are_not_recognised():
    """A subclass of a class in the adapter table is left to the subclass rule (find_attention
    refuses it), even when it changes nothing: recognition is for copies, not for subclasses."""
    require("transformers")
    from transformers.models.llama import modeling_llama

    class MyLlamaAttention(modeling_llama.LlamaAttention):
        pass

    model = quiet(__import__("transformers").LlamaForCausalLM, __import__("transformers").LlamaConfig(**CFG))
    for layer in model.model.layers:
        old = layer.self_attn
        layer.self_attn = MyLlamaAttention(model.config, old.layer_idx)
    with pytest.raises(GaugeError, match="subclass a supported attention class"):
        gaugeopt.find_attention(model)


def test_user_classes_are_compared_with_verified_ones_only():
    """Recognition only ever hands out a verified built-in adapter: a class that copies a user's
    registered (unverified) class is not recognised through it."""
    class TeamAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            return self.o(self.v(x))

    class OtherAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            return self.o(self.v(x))

    assert same_code(OtherAttention, TeamAttention)
    spec = gaugeopt.AttentionSpec(q="q", k="k", v="v", o="o", num_heads=2)
    with pytest.raises(GaugeError, match=UNKNOWN):
        gaugeopt.find_attention(nn.Sequential(OtherAttention()), adapters={TeamAttention: spec.adapter()})
