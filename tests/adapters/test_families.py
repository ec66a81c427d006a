"""Every outside family gaugeopt supports, proved exact: each valid gauge action of every sector the
record claims leaves the output and every attention layer's output unchanged to ≤ 1e-12 (float64,
generic random weights), each negative control changes them by ≥ 1e-3; the certificate passes on
the model as a user builds it; and what is not supported is refused with a message naming it.

Attention outputs are measured as well as the model's output: RMSNorm in float32 (Hugging Face)
would hide a 1e-9 error in the logits. torchtitan rotates q and k in float32 even in a float64
model; its checks run with that rotation in float64 (``zoo.families.float64_islands_removed``,
precision only). The families of :data:`zoo.families.FLOAT32_STEP` keep a float32 step of their own
(Cohere's and Llama 4's RoPE and Q/K norms, ModernBERT's rounding of q and k): the sectors that
pass through it (``zoo.families.FLOAT32_STEP``: RoPE or a Q/K norm, or Bloom's softmax) are held to the certificate's
``1e-6``, and the record must name the step; every other sector to ``1e-12``. Families reached by
recognition (``zoo.families.RECOGNISED``) are certified first: their records are not verified.
"""

from __future__ import annotations

import copy

import torch.nn as nn

import pytest
import torch

import gaugeopt
import zoo.families as zf
from gaugeopt import GaugeError
from gaugeopt.transforms import applicable_invalid_kinds
from gaugeopt.trust.proof import FLOAT32_TOL, _valid, certify_with, claimed_sectors
from model_libraries import quiet, require

VALID_TOL = 1e-12
INVALID_MIN = 1e-3
# head_scalar rescales a head's queries by 0.01-0.1, which a norm with epsilon ~1e-6 sees only through
# that epsilon: its changes are ~1e-5-1e-3 (tests/adapters/test_qk_norm.py holds it to 1e-6 too)
HEAD_SCALAR_MIN = 1e-6


def _changes(case, y0, a0, moved) -> tuple[float, float]:
    y, a = zf.attention_outputs(case, moved)
    assert len(a) == len(a0)
    return gaugeopt.relative_change(y0, y), max(gaugeopt.relative_change(p, q) for p, q in zip(a0, a))


def _valid_kinds(sites) -> list[str]:
    """Every sector some site claims (the certificate's list: qk or qk_gain, vo, perm, bias sectors, lrm_*)."""
    return list(dict.fromkeys(k for s in sites for k in claimed_sectors(s)))


def _act(model, kind: str, seed: int) -> None:
    """One random valid element of ``kind`` on every site that claims it (a site without it is left)."""
    g = torch.Generator().manual_seed(seed)
    for site in gaugeopt.find_attention(model):
        if kind in claimed_sectors(site):
            _valid(site, kind, g)


def check_exact(name: str, case, sites, lrm: bool) -> list[str]:
    """Each valid sector keeps the output and every attention output (module docstring for the
    tolerance), each applicable control changes both by ≥ INVALID_MIN; returns the controls tried."""
    own_float32 = name in zf.FLOAT32_STEP
    assert not own_float32 or any(s.float32_steps for s in sites), [s.float32_steps for s in sites]  # named
    with zf.float64_islands_removed():
        y0, a0 = zf.attention_outputs(case, case.model, sites)
        for k in _valid_kinds(sites):
            moved = case.copy()
            _act(moved, k, 7)
            assert any(not torch.equal(p, q) for p, q in zip(case.model.parameters(), moved.parameters())), k
            out, att = _changes(case, y0, a0, moved)
            tol = FLOAT32_TOL if k in zf.FLOAT32_STEP.get(name, ()) else VALID_TOL
            assert out <= tol and att <= tol, (k, out, att)
        tried = []
        for k in applicable_invalid_kinds(sites):  # e.g. no gl_under_rope without RoPE, no QK-norm controls here
            moved = gaugeopt.invalid_gauge_transform(case.copy(), k, generator=torch.Generator().manual_seed(5))
            out, att = _changes(case, y0, a0, moved)
            floor = HEAD_SCALAR_MIN if k == "head_scalar" else INVALID_MIN
            assert out >= floor and att >= floor, (k, out, att)
            tried.append(k)
    return tried


CASES = [(n, False) for n in zf.NAMES] + [(n, True) for n in zf.LRM_NAMES]


@pytest.mark.parametrize("name, lrm", CASES, ids=[n + ("+lrm" if lrm else "") for n, lrm in CASES])
def test_family_gauge_is_exact_and_controls_break(name, lrm):
    case = zf.build(name, lrm=lrm)
    kind, h_kv, rope = zf.FAMILY[name][1:]
    sites = gaugeopt.find_attention(case.model)
    s = sites[0]
    recognised = name in zf.RECOGNISED
    assert all(x.verified != recognised and x.kind == kind for x in sites)
    assert all(any(f.startswith("recognised_as:") for f in x.features) == recognised for x in sites)
    assert (s.h_kv, f"{s.rope.kind}:{s.rope.rotary_dim}" if s.rope.active else "none") == (h_kv, rope)
    assert s.has_multipliers == lrm
    if recognised:
        gaugeopt.certify(case.model, case.inputs)  # what the gate does at first use
    tried = check_exact(name, case, sites, lrm)
    assert {"asymmetric_qk", "wrong_inverse", "vo_mismatch"} <= set(tried)


QK_NORM_CASES = [(n, False) for n in zf.QK_NORM_SUPPORTED] + [(n, True) for n in zf.QK_NORM_LRM]


@pytest.mark.parametrize("name, lrm", QK_NORM_CASES, ids=[n + ("+lrm" if lrm else "") for n, lrm in QK_NORM_CASES])
def test_qk_norm_family_gauge_is_exact_and_controls_break(name, lrm):
    """The Q/K-normalised families of the outside zoo, through the same check: the gain gauge, V/O,
    permutations, multipliers; the plain Q/K gauge under the norm is a control (qk_under_norm)."""
    case = zf.build(name, lrm=lrm)
    sites = gaugeopt.find_attention(case.model)
    assert all(s.qk_norm is not None and s.verified != (name in zf.RECOGNISED) for s in sites)
    if name in zf.RECOGNISED:
        gaugeopt.certify(case.model, case.inputs)
    tried = check_exact(name, case, sites, lrm)
    assert "qk_under_norm" in tried and "qk_gain" in _valid_kinds(sites)


@pytest.mark.parametrize("name", zf.NAMES)
def test_family_certifies_as_built(name):
    """The certificate passes on the model exactly as a user has it (float32, default init): every
    claimed sector, every layer, with power (controls ≥ 1e-3)."""
    model, x, forward = zf.raw(name)
    x = x.float() if x.is_floating_point() else x
    report = certify_with(model.eval(), lambda m: forward(m, x))
    sites = gaugeopt.find_attention(model)
    assert [layer.name for layer in report.layers] == [s.name for s in sites]
    for layer, site in zip(report.layers, sites):
        assert {"qk", "vo"} <= set(layer.sectors)
        assert ("perm" in layer.sectors) == (not site.fixed_head_order)
        assert layer.rerun_change is not None and layer.rerun_change < 1e-4  # the rerun is the real call
    tol = 1e-6 if sites[0].float32_steps else 1e-10
    assert report.worst_valid <= tol and report.weakest_control >= INVALID_MIN
    if sites[0].float32_steps.startswith("the softmax"):  # (Bloom) only the bias sectors see a float32 softmax
        assert max(c.valid for layer in report.layers for c in layer.sectors.values()
                   if c.sector not in ("key_bias", "value_bias")) <= 1e-10


# Q/K-normalised families whose gain gauge the suite verifies (tests/adapters/test_qk_norm.py and above); the others are refused
QK_NORM_SUPPORTED = zf.QK_NORM_SUPPORTED


@pytest.mark.parametrize("name", sorted(set(zf.QK_NORM) - set(QK_NORM_SUPPORTED)))
def test_qk_norm_families_are_recognised_and_refused(name):
    model, _, _ = zf.raw(name)
    with pytest.raises(GaugeError, match="per-head Q/K normalisation") as err:
        gaugeopt.find_attention(model)
    assert "no adapter understands" not in str(err.value)


@pytest.mark.parametrize("name", QK_NORM_SUPPORTED)
def test_supported_qk_norm_families_record_the_norm(name):
    model, _, _ = zf.raw(name)
    sites = gaugeopt.find_attention(model)
    assert sites and all(s.verified != (name in zf.RECOGNISED) and s.qk_norm is not None for s in sites)
    with pytest.raises(GaugeError, match="QK-norm"):
        sites[0].pair("qk")  # GL(d_k) on W_Q/W_K is not a symmetry there
    assert sites[0].pair("qk_gain").a.weight is sites[0].qk_norm.q_gain and sites[0].pair("qk_gain").a.kind == "gain"


def test_qk_norm_record_is_filled_before_the_refusal():
    """The adapters build the complete QKNorm record (kind, gains in (groups, d_k) layout, epsilon,
    scope, Gemma's offset) before the family's refusal function (the hook that Q/K-norm support
    replaces) sees it."""
    import dataclasses

    from gaugeopt.adapters import hf, litgpt, timm

    def record(name, spec, cls_name):
        model = zf.raw(name)[0]
        path, m = next((p, m) for p, m in model.named_modules() if type(m).__name__ == cls_name)
        kept = dataclasses.replace(spec, on_qk_norm=lambda site: site, rope=gaugeopt.RopeSpec())  # rope: not under test
        return kept.build(m, path).qk_norm

    spec = {k.rsplit(".", 1)[1]: v for k, v in hf.HF_SPECS.items()}
    q3 = record("hf_qwen3", spec["Qwen3Attention"], "Qwen3Attention")
    o2 = record("hf_olmo2", spec["Olmo2Attention"], "Olmo2Attention")
    g3 = record("hf_gemma3", spec["Gemma3Attention"], "Gemma3Attention")
    tm = record("timm_qk_norm", timm.TIMM_SPEC, "Attention")
    lg = record("litgpt_norm_qk", litgpt.LITGPT_SPEC, "CausalSelfAttention")
    assert (q3.kind, q3.scope, q3.q_gain.shape, q3.k_gain.shape, q3.gain_offset) == ("rms", "head", (1, 8), (1, 8), 0.0)
    assert (o2.scope, o2.q_gain.shape, o2.k_gain.shape) == ("full", (4, 8), (2, 8))
    assert (g3.gain_offset, g3.eps) == (1.0, 1e-6)
    assert (tm.kind, tm.q_bias.shape, tm.eps) == ("layer", (1, 8), 1e-6)
    assert (lg.kind, lg.q_gain.name) == ("layer", "transformer.h.0.attn.norm_q.weight")
    for n in (q3, o2, g3, tm, lg):  # the gain refs are views of the norms' own parameters
        assert n.q_gain.get().data_ptr() == n.q_gain.param.data_ptr()


# ---------------------------------------------------------------------- what is refused, and why
def _hf_model(cls, cfg, **kw):
    transformers = require("transformers")
    return quiet(getattr(transformers, cls), getattr(transformers, cfg)(**kw))


def test_falcon_grouped_gqa_layout_is_refused_with_the_reason():
    """new_decoder_architecture with 1 < num_kv_heads < num_heads: each group's K and V rows interrupt
    its query rows, so W_Q has no (h, d_k, d) view."""
    model = _hf_model("FalconForCausalLM", "FalconConfig", vocab_size=32, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2)
    with pytest.raises(GaugeError, match=r"grouped per KV group .* no strided view"):
        gaugeopt.find_attention(model)


def test_olmo_clip_qkv_is_refused_naming_the_clamp():
    model = _hf_model("OlmoForCausalLM", "OlmoConfig", **{**zf.SMALL, "num_hidden_layers": 1}, clip_qkv=0.5)
    with pytest.raises(GaugeError, match=r"clip_qkv=0.5 clamps the q, k and v projection outputs"):
        gaugeopt.find_attention(model)


def test_unverified_attention_kernel_is_refused():
    model = _hf_model("LlamaForCausalLM", "LlamaConfig", **{**zf.SMALL, "num_hidden_layers": 1})
    assert gaugeopt.find_attention(model)
    model.config._attn_implementation = "flex_attention"  # HF reads it at every forward
    with pytest.raises(GaugeError, match=r"_attn_implementation='flex_attention' selects an attention kernel"):
        gaugeopt.find_attention(model)


def test_x_transformers_is_refused_with_reasons():
    require("x_transformers")
    from x_transformers import Decoder, TransformerWrapper

    model = TransformerWrapper(num_tokens=32, max_seq_len=16, attn_layers=Decoder(dim=32, depth=1, heads=4, attn_kv_heads=2))
    with pytest.raises(GaugeError, match=r"x-transformers' Attention is not supported: its grouped-query attention is tiled"):
        gaugeopt.find_attention(model)


def test_modified_nanogpt_copy_is_refused(tmp_path):
    """A user's copy of nanoGPT with a changed forward is recognised as nanoGPT-like and refused;
    the same file with only comments and spacing changed is accepted."""
    import importlib.util

    from model_libraries import FIXTURES

    src = (FIXTURES / "nanogpt" / "model.py").read_text()
    variants = {
        "cosmetic": src.replace("# output projection", "# the output projection, reformatted").replace(
            "q, k, v  = self.c_attn(x)", "q, k, v = self.c_attn(x)"),
        "modified": src.replace("y = self.resid_dropout(self.c_proj(y))", "y = self.resid_dropout(self.c_proj(2 * y))"),
    }
    assert all(v != src for v in variants.values())
    for name, text in variants.items():
        path = tmp_path / f"{name}_model.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"user_{name}_model", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        model = quiet(mod.GPT, mod.GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=8, dropout=0.0))
        if name == "cosmetic":
            assert gaugeopt.find_attention(model)[0].kind == "nanogpt"
        else:
            with pytest.raises(GaugeError, match=r"its forward differs from nanoGPT's \(commit 3adf61e1\): a modified copy"):
                gaugeopt.find_attention(model)


def test_unclaimed_attention_points_to_the_spec_with_its_linears():
    class MyAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    with pytest.raises(GaugeError) as err:
        gaugeopt.find_attention(nn.Sequential(MyAttention()))
    msg = str(err.value)
    assert "gaugeopt.AttentionSpec(" in msg and "spec.register(MyAttention)" in msg and "gaugeopt.certify(model" in msg
    assert "qkv (16→48), proj (16→16)" in msg and "docs/adapters.md" in msg


def test_per_head_fused_layout_refuses_multipliers_and_include_skips_it():
    model = _hf_model("GPTNeoXForCausalLM", "GPTNeoXConfig", **{**zf.SMALL, "num_hidden_layers": 1}, rotary_pct=0.5)
    with pytest.raises(GaugeError, match=r"stores the rows of Q, K and V interleaved per head"):
        gaugeopt.apply_lrm(copy.deepcopy(model))
    converted = gaugeopt.apply_lrm(model, include=lambda name, m: not name.endswith("query_key_value"))
    site = gaugeopt.find_attention(converted)[0]
    assert site.q.row_mult is None and site.o.col_mult is not None


def test_heads_tied_to_their_positions_are_not_permuted():
    """ALiBi (Bloom, Falcon) and T5's relative bias give each head its own score term: the heads may
    not be permuted (GL gauges remain), and permute_heads says why."""
    from gaugeopt.transforms import permute_heads

    case = zf.build("hf_bloom")
    site = gaugeopt.find_attention(case.model)[0]
    assert "ALiBi" in site.fixed_head_order
    with pytest.raises(GaugeError, match="may not be permuted .*ALiBi"):
        permute_heads(site, torch.tensor([1, 0, 2, 3]))
    ref = case.logits()
    moved = gaugeopt.random_gauge_transform(case.copy(), ("perm",), generator=0)  # skipped where not a symmetry
    assert torch.equal(case.logits(moved), ref)


def test_timm_scale_norm_and_gate_are_refused():
    require("timm")
    from timm.layers.attention import Attention

    for kw, why in (({"scale_norm": True}, "scale_norm=True normalises all heads"),
                    ({"gated": True}, "gated=True multiplies the attention output elementwise")):
        with pytest.raises(GaugeError, match=why):
            gaugeopt.find_attention(nn.Sequential(Attention(32, 4, norm_layer=nn.LayerNorm, **kw)))
