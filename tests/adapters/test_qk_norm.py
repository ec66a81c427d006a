"""QK-norm models (docs/qk_norm.md): the reduced gauge group is exact and nothing else is.

Models (tiny, float64, ``randomize_parameters``: gains ``1 + N(0, 0.1²)`` and LayerNorm biases
``N(0, 0.1²)``, so no check passes on the non-generic stratum of all-equal gains where rotations
inside a RoPE plane are symmetries too): the project's GPT with ``qk_norm=True`` (split-half RoPE +
GQA, partial interleaved RoPE, no RoPE), Hugging Face Qwen3 (per-head RMSNorm, shared gains),
OLMo 2 (full-width RMSNorm, per-head gains), Gemma 3 (gain ``1 + w``), timm's ViT with
``qk_norm=True`` (LayerNorm with bias, no RoPE), and a float64 model with a ``1 + w`` gain, its norm
before or after RoPE.

Measurement: relative Frobenius change of the logits and of every attention module's output. The
HF norms' float32 round trip is removed for it (qk_norm_helpers.float64_norms; as shipped, OLMo 2's
full-width norm sums the heads in float32 and a head permutation moves its logits by 3.8e-8).
"""

from __future__ import annotations


import pytest
import torch

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.transforms import applicable_invalid_kinds
from qk_norm_helpers import changes, exact, float64_norms, measure
from reference_attention import reference_attention

VALID_TOL = 1e-12
INVALID_MIN = 1e-6

# the acceptance models and the extra layouts
ACCEPTANCE = ("hf_qwen3", "hf_olmo2", "timm_vit_qknorm", "gpt_qknorm")
MODELS = zoo.QK_NORM


def _sites(model):
    return gaugeopt.find_attention(model)


def _moved(case, kinds, seed=7):
    moved = case.copy()
    sites = _sites(moved)
    gaugeopt.random_gauge_transform(moved, kinds, generator=seed, sites=sites)
    return moved, sites


# ---------------------------------------------------------------------- the record
def _reference_kwargs(case, site):
    cfg = getattr(case.model, "config", None)
    kw = dict(base=zoo.rope_base(case.model), angle_dtype=zoo.rope_angle_dtype(case.model))
    if case.name == "hf_gemma3":
        layer_type = cfg.layer_types[site.layer_index]
        kw.update(inv_freq=getattr(case.model.model.rotary_emb, f"{layer_type}_inv_freq"), scale=cfg.query_pre_attn_scalar**-0.5,
                  window=cfg.sliding_window if layer_type == "sliding_attention" else None)
    if case.name.startswith("timm"):
        kw.update(causal=False)
    if case.name.startswith("offset_norm"):  # gaugeopt's Rotary: float64 angles in a float64 model
        kw.update(angle_dtype=torch.float64)
    return kw


@pytest.mark.parametrize("name", MODELS)
def test_site_reproduces_attention_output(name):
    """The record (projections, norm kind/scope/gains/offset/epsilon, RoPE) fed to a textbook
    attention reproduces every layer's output: 1e-12 in float64 (largest measured 3.7e-16)."""
    case = zoo.build(name)
    sites = _sites(case.model)
    assert all(s.qk_norm is not None for s in sites)
    records = []
    hooks = [s.module.register_forward_pre_hook(lambda m, a, k: records.append((a, k)), with_kwargs=True)
             for s in sites]
    with exact(name):
        _, outs = measure(case, case.model, sites)
    for h in hooks:
        h.remove()
    for site, (args, kwargs), out in zip(sites, records, outs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        ref = reference_attention(site, x, **_reference_kwargs(case, site))
        assert gaugeopt.relative_change(ref, out) < VALID_TOL, site


def test_reference_detects_a_wrong_record():
    """Negative controls for the test above: the wrong scope (OLMo 2 read as per-head), a missing
    gain offset (Gemma read as ``w``), the norm left out (Qwen3) each miss by ≥ 1e-3."""
    import dataclasses

    for name, wrong in (("hf_olmo2", dict(scope="head")), ("hf_gemma3", dict(gain_offset=0.0)), ("hf_qwen3", None)):
        case = zoo.build(name)
        site = _sites(case.model)[0]
        bad = dataclasses.replace(site, qk_norm=None if wrong is None else dataclasses.replace(site.qk_norm, **wrong))
        records = []
        h = site.module.register_forward_pre_hook(lambda m, a, k: records.append(k), with_kwargs=True)
        with float64_norms():
            _, (out,) = measure(case, case.model, [site])
        h.remove()
        kw = _reference_kwargs(case, site)
        x = records[0]["hidden_states"]
        assert gaugeopt.relative_change(reference_attention(site, x, **kw), out) < VALID_TOL
        assert gaugeopt.relative_change(reference_attention(bad, x, **kw), out) > 1e-3, name


def test_records_of_each_layout():
    expect = {
        "hf_qwen3": ("rms", "head", (1, 8), 0.0, 1), "hf_olmo2": ("rms", "full", (4, 8), 0.0, 2),
        "hf_gemma3": ("rms", "head", (1, 8), 1.0, 1), "timm_vit_qknorm": ("layer", "head", (1, 8), 0.0, 1),
        "gpt_qknorm": ("rms", "head", (1, 8), 0.0, 1),
    }
    for name, (kind, scope, shape, offset, groups) in expect.items():
        site = _sites(zoo.build(name).model)[1]
        n = site.qk_norm
        assert (n.kind, n.scope, n.q_gain.shape, n.gain_offset, site.pair("qk_gain").groups) == (kind, scope, shape, offset, groups)
        assert n.eps == (1e-5 if name == "hf_olmo2" else 1e-6)  # the configs' / LayerNorm's defaults
        assert (n.q_bias is not None) == (kind == "layer")
        assert "q.gain" in dict(site.refs()) and n.q_gain.name in site.parameter_names()


# ---------------------------------------------------------------------- acceptance: the group
@pytest.mark.parametrize("name", MODELS)
def test_each_valid_action_is_exact(name):
    """Every element of the reduced group — the gain gauge (per RoPE plane, random signs), V/O
    ``GL(d_v)``, head permutations, and all composed — moves the logits and each attention output
    by ≤ 1e-12 (measured: ≤ 8.9e-16), having changed some parameter."""
    case = zoo.build(name)
    ref_sites = _sites(case.model)
    for kinds in (("qk_gain",), ("vo",), ("perm",), "all"):
        moved, sites = _moved(case, kinds)
        assert any(not torch.equal(p, q) for p, q in zip(case.model.parameters(), moved.parameters())), kinds
        d_logits, d_attn = changes(case, moved, ref_sites, sites)
        assert d_logits <= VALID_TOL and max(d_attn) <= VALID_TOL, (kinds, d_logits, d_attn)


@pytest.mark.parametrize("name", ["gpt_qknorm", "hf_qwen3"])
def test_valid_actions_with_learnable_multipliers(name):
    """With LRM the internal rescalings and ``lrm_vo`` survive next to the gain gauge (``lrm_qk`` does not)."""
    case = zoo.build(name, lrm=True)
    ref_sites = _sites(case.model)
    moved, sites = _moved(case, "all")
    d_logits, d_attn = changes(case, moved, ref_sites, sites)
    assert d_logits <= VALID_TOL and max(d_attn) <= VALID_TOL
    with pytest.raises(GaugeError, match="qk_gain"):
        gaugeopt.random_gauge_transform(case.copy(), ("lrm_qk",))
    # why lrm_qk is refused here: paper 002's move r_Q ⊙ δ, r_K ⊘ δ (δ per RoPE plane) changes the
    # function, because the row multipliers act before the norm (measured ≥ 1e-3)
    moved = case.copy()
    sites = _sites(moved)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for site in sites:
            pid = gaugeopt.records.rope.plane_index(site.rope, site.d_k)
            delta = torch.exp(torch.rand(site.h_kv, int(pid.max()) + 1, generator=g, dtype=torch.float64) - 0.5)[:, pid]
            site.q.row_mult.get().mul_(site.per_query(delta))
            site.k.row_mult.get().div_(delta)
    d_logits, d_attn = changes(case, moved, ref_sites, sites)
    assert d_logits >= 1e-3 and min(d_attn) >= 1e-3, (d_logits, d_attn)


# Smallest change each control made over this file's models (logits / smallest over layers of the
# attention outputs), measured with these seeds:
#   qk_under_norm     GL(d_k) on W_Q/W_K: the RoPE commutant (all of GL(d_k) without RoPE)   3.8e-2 / 3.5e-2
#   gl_under_rope     a general GL(d_k) under RoPE                                         1.8e-1 / 1.3e-1
#   head_scalar       c_i in [0.01, 0.1) on W_Q[i], b_Q[i] (eps = 1e-6; 1e-5 for OLMo 2)    3.3e-5 / 7.4e-5 (Gemma 3;
#                                                                                         the others >= 1.3e-4)
#   gain_off_plane    a gain factor per channel under RoPE                                  2.9e-2 / 1.5e-2
#   gain_without_bias timm: the gains rescaled, the LayerNorm biases left in place          4.7e-3 / 7.0e-3
#   gain_untied       OLMo 2: a gain factor per query head                                 7.3e-2 / 6.8e-2
# The smallest margin over the 1e-6 threshold is x33 (Gemma 3's head_scalar logits).
@pytest.mark.parametrize("name", MODELS)
def test_invalid_controls_change_function(name):
    case = zoo.build(name)
    ref_sites = _sites(case.model)
    kinds = applicable_invalid_kinds(ref_sites)
    norm_first = ref_sites[0].qk_norm.before_rope
    needed = {"qk_under_norm", "head_scalar"} | ({"gain_off_plane", "gl_under_rope"} if ref_sites[0].rope.active and norm_first
                                                  else {"gain_without_bias"} if ref_sites[0].qk_norm.q_bias is not None
                                                  else {"gl_under_rope"} if ref_sites[0].rope.active else set())
    assert needed <= set(kinds), kinds
    for kind in kinds:
        moved = case.copy()
        sites = _sites(moved)
        gaugeopt.invalid_gauge_transform(moved, kind, generator=5, sites=sites)
        d_logits, d_attn = changes(case, moved, ref_sites, sites)
        assert d_logits >= INVALID_MIN and min(d_attn) >= INVALID_MIN, (kind, d_logits, d_attn)


def test_as_shipped_float32_norms_limit_exactness():
    """Why the HF checks remove the norms' float32 round trip: as shipped, an exact move shows a
    float32-sized change — OLMo 2's full-width norm sums permuted heads in another order (logits
    3.8e-8), Gemma 3 multiplies by its gain in float32 (9e-8) — which vanishes in float64."""
    for name, kinds in (("hf_olmo2", ("perm",)), ("hf_gemma3", ("qk_gain",))):
        case = zoo.build(name)
        moved, sites = _moved(case, kinds)
        shipped = gaugeopt.relative_change(case.logits(), case.logits(moved))
        assert 1e-12 < shipped < 1e-6, (name, shipped)
        d_logits, d_attn = changes(case, moved, _sites(case.model), sites)
        assert d_logits <= VALID_TOL and max(d_attn) <= VALID_TOL


def test_head_scalar_is_a_symmetry_without_epsilon():
    """Why the per-head scalar is a negative control only for ``eps > 0``: the same move on a model
    whose norm has ``eps = 0`` is exact (so the control measures the epsilon, as it should)."""
    case = zoo.build("gpt_qknorm")
    for block in case.model.transformer.h:
        block.attn.q_norm.eps = block.attn.k_norm.eps = 0.0
    sites = _sites(case.model)
    assert sites[0].qk_norm.eps == 0.0
    with pytest.raises(GaugeError, match="eps > 0"):
        gaugeopt.invalid_gauge_transform(case.copy(), "head_scalar")
    moved = case.copy()
    for site in _sites(moved):
        wq, bq = site.effective("q")
        c = torch.tensor([0.01, 0.03, 0.05, 0.09], dtype=torch.float64)
        site.set_effective("q", wq * c[:, None, None], bq * c[:, None])
    d_logits, d_attn = changes(case, moved, sites, _sites(moved))
    assert d_logits <= VALID_TOL and max(d_attn) <= VALID_TOL


def test_kinds_a_qk_norm_site_lacks_are_refused():
    case = zoo.build("gpt_qknorm")
    for kind in ("qk", "lrm_qk"):
        with pytest.raises(GaugeError, match="qk_gain"):
            gaugeopt.random_gauge_transform(case.copy(), (kind,))
    with pytest.raises(GaugeError, match="no QK-norm"):
        gaugeopt.random_gauge_transform(zoo.build("gpt").copy(), ("qk_gain",))
    site = _sites(case.model)[0]
    with pytest.raises(GaugeError, match="not a symmetry"):
        site.pair("qk")
    with pytest.raises(GaugeError, match="RoPE plane"):
        gaugeopt.transforms.scale_qk_gains(site, torch.rand(1, site.d_k, dtype=torch.float64) + 0.5)
    with pytest.raises(GaugeError, match="gain_off_plane.*needs"):
        gaugeopt.invalid_gauge_transform(zoo.build("timm_vit_qknorm").copy(), "gain_off_plane")


@pytest.mark.parametrize("name", ["hf_qwen3", "hf_olmo2", "hf_gemma3", "timm_vit_qknorm"])
def test_the_certificate_claims_the_gain_gauge(name):
    """certify() on a QK-norm model checks the gain gauge (not GL(d_k)) with the plain Q/K gauge as
    its negative control, on each layer's real call."""
    case = zoo.build(name)
    report = gaugeopt.certify(case.model, case.inputs)
    for layer in report.layers:
        assert "qk_gain" in layer.sectors and "qk" not in layer.sectors and "vo" in layer.sectors
        assert layer.sectors["qk_gain"].control_kind == "qk_under_norm"
        assert layer.sectors["qk_gain"].valid <= layer.sectors["qk_gain"].tolerance
    assert report.weakest_control >= 1e-3
