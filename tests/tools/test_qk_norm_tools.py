"""QK-norm models in the projection, counting, canonical forms, equivalence, merging and the
Lightning callbacks (docs/qk_norm.md)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.projection.projector import GaugeProjector
from gaugeopt.tools.canonical import canonicalize, section_residual
from gaugeopt.tools.equivalence import compare
from qk_norm_helpers import exact


def _gradient(case):
    """``{name: ∂L/∂θ}`` of a cross-entropy loss, computed exactly (float64 norms for HF)."""
    model = case.model
    model.zero_grad(set_to_none=True)
    with exact(case.name):
        logits = zoo.forward_fn(case.name)(model, case.inputs)
        if case.name.startswith("timm"):
            target = torch.arange(logits.shape[0]) % logits.shape[-1]
        else:
            logits, target = logits.reshape(-1, logits.shape[-1]), case.inputs.roll(-1, 1).reshape(-1)
        F.cross_entropy(logits, target).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------- projection
@pytest.mark.parametrize("name", ["hf_qwen3", "hf_olmo2", "offset_norm", "timm_vit_qknorm", "gpt_qknorm_partial_interleaved"])
def test_gradient_is_horizontal_for_the_gain_generators(name):
    """The loss gradient is orthogonal to every ``qk_gain`` generator (paper 000 Prop. 38): its
    vertical fraction is rounding (≤ 1e-12; measured ≤ 1e-16), while a random field's is not."""
    case = zoo.build(name)
    sites = gaugeopt.find_attention(case.model)
    grad = _gradient(case)
    proj = GaugeProjector(case.model, sites=sites)
    assert "qk_gain" in proj.sectors and "qk" not in proj.sectors and "lrm_qk" not in proj.sectors
    assert gaugeopt.vertical_fraction(case.model, grad, projector=proj) <= 1e-12
    g = torch.Generator().manual_seed(0)
    rand = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in case.model.named_parameters()}
    assert gaugeopt.vertical_fraction(case.model, rand, projector=proj) > 1e-3
    assert gaugeopt.vertical_fraction(case.model, proj.project(rand), projector=proj) <= 1e-12


@pytest.mark.parametrize("name, wrong", [("hf_qwen3", "channel"), ("hf_olmo2", "query_head"), ("offset_norm", "no_offset")])
def test_gradient_is_not_orthogonal_to_wrong_generators(name, wrong):
    """Negative control: the gradient has a component along generators that are *not* symmetries —
    a gain factor per channel under RoPE, per query head where the key gain is shared (OLMo 2),
    ``w ⊙ δ`` instead of ``(1 + w) ⊙ δ`` — so the check above can tell right generators from wrong."""
    case = zoo.build(name)
    site = gaugeopt.find_attention(case.model)[0]
    grad = _gradient(case)
    n = site.qk_norm
    gq, gk = n.q_gain.get().detach(), n.k_gain.get().detach()
    dq, dk = n.q_gain.view(grad[n.q_gain.name]), n.k_gain.view(grad[n.k_gain.name])
    off = 0.0 if wrong == "no_offset" else n.gain_offset
    if wrong == "channel":  # generator of channel 0 alone
        num = ((gq + off) * dq)[:, 0].sum() - ((gk + off) * dk)[:, 0].sum()
        den = ((gq + off) ** 2)[:, 0].sum() + ((gk + off) ** 2)[:, 0].sum()
    elif wrong == "query_head":  # plane 0 of query head 0 against its key head
        p, q = site.rope.planes(site.d_k)[0]
        num = ((gq * dq)[0, [p, q]]).sum() - ((gk * dk)[0, [p, q]]).sum()
        den = (gq[0, [p, q]] ** 2).sum() + (gk[0, [p, q]] ** 2).sum()
    else:  # plane 0 with w instead of 1 + w
        p, q = site.rope.planes(site.d_k)[0]
        num = ((gq * dq)[:, [p, q]]).sum() - ((gk * dk)[:, [p, q]]).sum()
        den = (gq[:, [p, q]] ** 2).sum() + (gk[:, [p, q]] ** 2).sum()
    scale = torch.cat([dq.flatten(), dk.flatten()]).norm()
    assert float(num.abs() / den.sqrt() / scale) > 1e-3


def test_closed_form_equals_least_squares():
    """The ``qk_gain`` projection equals least squares over generators built independently — the
    complex-step derivatives of the finite gain action (projection_helpers.generator_images) — for
    shared gains under RoPE, per-head gains (OLMo 2), a ``1 + w`` gain and LayerNorm biases (timm);
    the projector's own basis spans the same space."""
    import numpy as np
    import projection_helpers as H

    for name in ("hf_qwen3", "hf_olmo2", "offset_norm", "timm_vit_qknorm"):
        model = zoo.build(name).model
        proj = GaugeProjector(model, sectors=("qk_gain",))
        names, shapes = [n for n, _ in model.named_parameters()], {n: p.shape for n, p in model.named_parameters()}
        A = np.stack([H.flatten(model, img, names, shapes) for _, img in H.generator_images(model, "qk_gain")], 1)
        assert A.shape[1] == {"hf_qwen3": 2 * 4, "hf_olmo2": 2 * 2 * 4, "offset_norm": 2 * 4, "timm_vit_qknorm": 2 * 8}[name]
        u = H.random_field(model, seed=1)
        ref, rank = H.ls_vertical(A, H.flatten(model, u, names, shapes))
        assert rank == A.shape[1]
        ours = H.flatten(model, proj.vertical(u), names, shapes)
        assert np.linalg.norm(ours - ref) <= 1e-12 * np.linalg.norm(ref), name
        M = np.stack([H.flatten(model, img, names, shapes) for _, img in proj.basis()], 1)
        assert np.linalg.norm(A - M @ np.linalg.lstsq(M, A, rcond=None)[0]) <= 1e-12 * np.linalg.norm(A)


def test_sector_choice_and_refusals():
    case = zoo.build("gpt_qknorm", lrm=True)
    proj = GaugeProjector(case.model, "all")
    assert proj.sectors == ("vo", "lrm_vo", "lrm_internal", "qk_gain", "value_bias")  # no key bias sector under QK-norm
    assert GaugeProjector(case.model).sectors == ("vo", "lrm_vo", "lrm_internal", "qk_gain")  # "auto": no value_bias
    for sector in ("qk", "lrm_qk"):
        with pytest.raises(GaugeError, match="qk_gain"):
            GaugeProjector(case.model, sectors=(sector,))
    plain = GaugeProjector(zoo.build("gpt_rope_split_half_gqa").model)
    assert "qk_gain" not in plain.sectors and "qk" in plain.sectors


def test_projected_optimizer_step_is_horizontal():
    """GaugeOptimizer on a QK-norm model: every applied update is horizontal (float64: ≤ 1e-12)."""
    case = zoo.build("gpt_qknorm")
    model = case.model.train()
    opt = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    for _ in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = model(case.inputs, case.inputs.roll(-1, 1))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
        assert gaugeopt.vertical_fraction(model, update, at=before) <= 1e-12
    assert opt.last_vertical_fraction > 1e-6  # AdamW's raw update had a vertical part to remove


# ---------------------------------------------------------------------- counting
def _qwen3_0_6b():
    """Qwen3-0.6B's config.json (the fields a count reads)."""
    return {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "attention_bias": False,
            "rope_theta": 1000000, "tie_word_embeddings": True}


def test_qwen3_0_6b_count():
    """An independent count from the derivation: per layer, one gain factor per RoPE plane (the gain
    vectors are shared by all 16 heads: 128/2 = 64 planes; RoPE ignored: 128 channels) plus ``GL(d_v)``
    per KV group (8·128²); nothing of ``GL(d_k)`` on ``W_Q``/``W_K`` survives the norm (ε = 1e-6 > 0).
    ``van_nierop`` adds the residual rotations ``(d − 1)(d − 2)/2`` once."""
    L, h_kv, d_k, d = 28, 8, 128, 1024
    vo = L * h_kv * d_k**2
    wang = L * (d_k // 2) + vo
    van_nierop = L * d_k + vo + (d - 1) * (d - 2) // 2
    assert (wang, van_nierop) == (3_671_808, 4_196_353)
    cfg = _qwen3_0_6b()
    assert gaugeopt.gauge_dimension(cfg) == wang
    assert gaugeopt.gauge_dimension(cfg, convention="van_nierop") == van_nierop
    assert gaugeopt.gauge_dimension(cfg, per_symmetry=True) == {"qk_gain": 28 * 64, "vo": vo}
    transformers = pytest.importorskip("transformers")
    assert gaugeopt.gauge_dimension(transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k != "model_type"})) == wang
    llama = {**cfg, "model_type": "llama"}  # the same shapes without the norm keep GL(d_k)'s RoPE commutant
    assert gaugeopt.gauge_dimension(llama) == L * h_kv * (d_k + d_k**2) != wang


@pytest.mark.parametrize("name", ["hf_qwen3", "hf_olmo2", "hf_gemma3", "gpt_qknorm", "gpt_qknorm_partial_interleaved"])
def test_model_and_config_counts_agree(name):
    case = zoo.build(name)
    cfg = case.model.config
    from_model = gaugeopt.gauge_dimension(case.model, per_symmetry=True)
    assert from_model == gaugeopt.gauge_dimension(cfg, per_symmetry=True)
    site = gaugeopt.find_attention(case.model)[0]
    planes = site.rope.n_slots(site.d_k)
    gains = {"hf_olmo2": 2 * site.h_kv * planes}.get(name, 2 * planes)  # 2 layers
    assert from_model["qk_gain"] == gains and "qk" not in from_model
    if name == "hf_gemma3":  # the multimodal config holds the language model's in text_config
        assert gaugeopt.gauge_dimension({"model_type": "gemma3", "text_config": cfg.to_dict()}, per_symmetry=True) == from_model


def _layer_nullity(module, params: dict[str, torch.nn.Parameter], inputs: torch.Tensor) -> tuple[int, float]:
    """Dimension of the null space of the Jacobian of ``module(inputs)`` with respect to ``params``
    (float64), and the gap: the smallest nonzero singular value over the largest zero one."""
    names = list(params)
    flat0 = torch.cat([params[n].detach().reshape(-1) for n in names])

    def f(flat):
        vals, i = {}, 0
        for n in names:
            vals[n] = flat[i:i + params[n].numel()].view(params[n].shape)
            i += params[n].numel()
        return torch.func.functional_call(module, vals, (inputs,)).reshape(-1)

    J = torch.func.jacrev(f)(flat0)
    assert J.shape[0] >= J.shape[1], "too few outputs to see every direction"
    sv = torch.linalg.svdvals(J)
    zero = sv <= 1e-10 * sv[0]
    n = int(zero.sum())
    return n, float(sv[~zero].min() / sv[zero].max().clamp_min(1e-300)) if n else float("inf")


def test_count_equals_jacobian_nullity_of_one_layer():
    """An independent check of the per-layer formulas: the null space of the Jacobian of one attention
    layer's output with respect to its parameters has exactly the counted dimension — own GPT layer
    (per-head RMSNorm, shared gains, split-half RoPE, GQA; no biases, so no V/O bias trade) and timm's
    ``Attention(qk_norm=True)`` (LayerNorm with bias; the output bias left out for the same reason)."""
    from gaugeopt.models import GPT, GPTConfig
    from gaugeopt.trust.invariance import randomize_parameters

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=8, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, bias=False,
                        rope="split_half", qk_norm=True)).double()
    randomize_parameters(gpt, g)
    attn = gpt.transformer.h[0].attn
    x = torch.randn(2, 32, 16, generator=g, dtype=torch.float64)
    n, gap = _layer_nullity(attn, dict(attn.named_parameters()), x)
    per_layer = gaugeopt.gauge_dimension(gpt)
    assert n == per_layer == 4 + 64 and gap > 1e4

    from model_libraries import require

    require("timm")
    from timm.layers import Attention, LayerNorm

    d, h, d_k = 16, 2, 8
    layer = torch.nn.Sequential(Attention(d, num_heads=h, qkv_bias=True, qk_norm=True, norm_layer=LayerNorm)).double()
    randomize_parameters(layer, g)
    attn = layer[0]
    params = {k: v for k, v in attn.named_parameters() if k != "proj.bias"}
    x = torch.randn(2, 40, d, generator=g, dtype=torch.float64)
    n, gap = _layer_nullity(attn, params, x)
    gaugeopt.certify(layer, x)  # a bare layer: gaugeopt cannot make up its input
    counts = gaugeopt.gauge_dimension(layer, per_symmetry=True)
    assert n == sum(counts.values()) and gap > 1e4
    # gains per channel; each head's mean direction (rows and bias), one centred rotation, the key
    # bias, one query-bias shift; GL(d_v) per head
    assert counts == {"qk_gain": d_k, "qk_layernorm": (h + h) * (d + 1) + 1 + d_k + 1, "vo": h * d_k**2}


# ---------------------------------------------------------------------- canonical forms, equivalence
@pytest.mark.parametrize("name", ["gpt_qknorm", "hf_olmo2", "offset_norm"])
@pytest.mark.parametrize("section", ["qr", "balanced"])
def test_canonical_form_is_a_gauge_invariant(name, section):
    """Two models of one orbit of the reduced group get the same canonical form (≤ 1e-12), which
    computes the same function and satisfies the section's equations."""
    case = zoo.build(name)
    other = gaugeopt.random_gauge_transform(case.copy(), "all", generator=3)
    ca, cb = canonicalize(case.model, section), canonicalize(other, section)
    assert section_residual(ca.model, section) <= 1e-12
    assert max(gaugeopt.relative_change(p, q) for p, q in zip(ca.model.parameters(), cb.model.parameters())) <= 1e-12
    with exact(name):
        assert gaugeopt.relative_change(case.logits(), case.logits(ca.model)) <= 1e-12


def test_equivalence_decides_the_reduced_group():
    case = zoo.build("hf_qwen3")
    moved = gaugeopt.random_gauge_transform(case.copy(), "all", generator=4)
    assert compare(case.model, moved, tol=1e-10).equivalent
    for tweak in ("gain", "plain_qk_gauge"):
        other = copy.deepcopy(moved)
        site = gaugeopt.find_attention(other)[1]
        if tweak == "gain":  # a gain off its orbit by 1e-6
            with torch.no_grad():
                site.qk_norm.q_gain.get()[0, 3] *= 1 + 1e-6
        else:  # the plain-attention Q/K gauge: a symmetry without the norm, not with it
            gaugeopt.invalid_gauge_transform(other, "qk_under_norm", generator=2)
        report = compare(case.model, other, tol=1e-10)
        assert not report.equivalent and "QK" in report.reason, tweak
    for kind in ("head_scalar", "gain_off_plane"):
        other = gaugeopt.invalid_gauge_transform(copy.deepcopy(moved), kind, generator=2)
        assert not compare(case.model, other, tol=1e-6).equivalent, kind
    plain = zoo.build("hf_llama").model
    assert "different architectures" in compare(case.model, plain).reason


def test_layer_norm_qk_norm_is_refused_by_canonical_forms():
    model = zoo.build("timm_vit_qknorm").model
    for fn in (lambda: canonicalize(model), lambda: compare(model, model)):
        with pytest.raises(GaugeError, match="LayerNorm.*not section"):
            fn()


def test_merge_aligns_qk_norm_models():
    """Merging two gauge-moved copies of one QK-norm model aligns them exactly (no Procrustes on W_Q/W_K)."""
    from gaugeopt.tools.merging import align

    case = zoo.build("gpt_qknorm")
    other = gaugeopt.random_gauge_transform(case.copy(), "all", generator=6)
    result = align(case.model, other)
    assert max(layer.procrustes for layer in result.layers) <= 1e-12


# ---------------------------------------------------------------------- Lightning
def test_lightning_callbacks_run_unchanged(tmp_path):
    """GaugeFix, GaugeMonitor and GaugeProjection on a QK-norm GPT, as configured for any model: the
    fix balances the gains (drift ≤ 1e-6 after each fix), the monitor reports the gain drift."""
    pytest.importorskip("lightning")
    from gaugeopt.callbacks import GaugeFix, GaugeMonitor, GaugeProjection
    from lightning_helpers import TinyLit, token_loader, trainer

    lit = TinyLit(lr=1e-2, lrm=False, qk_norm=True, rope="split_half")
    mon, fix = GaugeMonitor(every=1), GaugeFix(every=5)
    t = trainer(tmp_path, max_steps=10, callbacks=[GaugeProjection(), mon, fix])
    t.fit(lit, token_loader(10))
    assert fix.fixes == 2 and fix.last_report.pairs[0].kind == "qk_gain"
    assert fix.last_report.max_drift_after <= 1e-6
    assert gaugeopt.qk_drift(lit.model) <= 1e-6
