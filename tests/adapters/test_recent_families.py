"""The 2025–26 families through the training-time operations, and what is particular to each.

Every family added with them (gpt-oss, Llama 4, SmolLM3, Granite, Cohere, GLM-4, Qwen3-MoE, ModernBERT,
RoBERTa and Electra, Phi ``qk_layernorm``, torchtitan ``qk_norm``): ``gauge_fix`` keeps the function, and
a ``GaugeOptimizer`` step removes only vertical directions — the part it takes out of a step moves the
function at second order only, while a random direction of the same size moves it at first order.
Then the derivations: attention sinks remove the bias sectors and tie the sinks to their heads;
Llama 4's weight-free norm leaves only rotations of W_Q/W_K; the refusals say why. The exactness of
every sector and the controls are in tests/adapters/test_families.py, the gpt-oss count against the Jacobian
nullity in tests/tools/test_flat.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo.families as zf
from gaugeopt import GaugeError
from model_libraries import quiet, require

NEW = ("hf_glm4", "hf_smollm3_nope", "hf_cohere", "hf_modernbert", "hf_gpt_oss", "hf_llama4", "hf_llama4_no_qk_norm",
       "hf_granite", "hf_roberta", "hf_electra", "hf_phi_qk_layernorm", "hf_cohere_qk_norm", "torchtitan_qk_norm",
       "hf_qwen3_moe")
NEW_LRM = ("hf_glm4", "hf_gpt_oss", "hf_llama4", "hf_granite", "hf_cohere_qk_norm")


def _case(name: str, lrm: bool = False):
    case = zf.build(name, lrm=lrm)
    sites = gaugeopt.find_attention(case.model)
    if not all(s.verified for s in sites):
        gaugeopt.certify(case.model, case.inputs)  # recognised copies: what the gate does at first use
    return case, sites


def _tol(name: str) -> float:
    return 1e-6 if name in zf.FLOAT32_STEP else 1e-10


@pytest.mark.parametrize("name, lrm", [(n, False) for n in NEW] + [(n, True) for n in NEW_LRM],
                         ids=[n for n in NEW] + [n + "+lrm" for n in NEW_LRM])
def test_gauge_fix_keeps_the_function(name, lrm):
    case, sites = _case(name, lrm)
    with zf.float64_islands_removed():
        y0, a0 = zf.attention_outputs(case, case.model)
        before = {n: p.detach().clone() for n, p in case.model.named_parameters()}
        report = gaugeopt.gauge_fix(case.model, vo=True)
        y, a = zf.attention_outputs(case, case.model)
    changed = [n for n, p in case.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "the fix had something to balance"
    tol = _tol(name)
    assert gaugeopt.relative_change(y0, y) <= tol and max(gaugeopt.relative_change(p, q) for p, q in zip(a0, a)) <= tol
    assert report.max_drift_after <= 1e-6


def _step(model, grads, wrap: bool) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    if wrap:
        opt = gaugeopt.GaugeOptimizer(opt, m, sectors="all")
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    return {n: p.detach() - before[n] for n, p in m.named_parameters()}


def _moved(case, direction: dict[str, torch.Tensor], eps: float) -> float:
    """Largest relative change of the output and the attention outputs at θ + eps·direction/‖direction‖."""
    norm = torch.sqrt(sum((d.double() ** 2).sum() for d in direction.values()))
    m = case.copy()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.add_(eps * direction[n] / norm)
    y0, a0 = zf.attention_outputs(case, case.model)
    y, a = zf.attention_outputs(case, m)
    return max([gaugeopt.relative_change(y0, y)] + [gaugeopt.relative_change(p, q) for p, q in zip(a0, a)])


@pytest.mark.parametrize("name", NEW)
def test_gauge_projected_step_removes_only_vertical_directions(name):
    """SGD fed a random gradient, with and without GaugeOptimizer: the applied step is horizontal (vertical
    fraction ≤ 1e-10) and what the projection removed is vertical — along it the function moves by
    O(ε²), while a random direction of the same length moves it by O(ε) (ε = 1e-4: measured 2e-11–3e-9
    against 5e-6–1e-5 in float64; families with a float32 step of their own reach their rounding, ≤ 1e-7)."""
    case, sites = _case(name)
    g = torch.Generator().manual_seed(11)
    grads = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in case.model.named_parameters()}
    raw, projected = _step(case.model, grads, False), _step(case.model, grads, True)
    removed = {n: raw[n] - projected[n] for n in raw}
    before = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    assert gaugeopt.vertical_fraction(case.model, projected, at=before, sectors="all") <= 1e-10
    assert sum(float(r.norm()) for r in removed.values()) > 0, "an SGD step on a random gradient has a vertical part"
    eps = 1e-4
    with zf.float64_islands_removed():
        vertical = _moved(case, removed, eps)
        random_dir = _moved(case, {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in grads.items()}, eps)
    print(f"{name}: along the removed part {vertical:.1e}, along a random direction {random_dir:.1e}")
    # a float32 step of the model's own (RoPE, a Q/K norm) leaves ~1e-7 of rounding along any direction
    floor = 2e-7 if name in zf.FLOAT32_STEP else 0.0
    assert random_dir >= 1e-6 and vertical <= max(1e-2 * random_dir, floor)


@pytest.mark.parametrize("name", [n for n in NEW if n not in ("hf_llama4", "hf_phi_qk_layernorm", "hf_cohere_qk_norm")])
def test_canonical_form_and_equivalence(name):
    """The canonical form keeps the function, and a gauge copy is equivalent to the model (the
    families whose Q/K gauge has a section: not Llama 4's norm layers nor a LayerNorm QK-norm)."""
    from gaugeopt.tools.equivalence import compare

    case, sites = _case(name)
    kinds = [k for k in ("qk", "qk_gain", "vo", "perm") if any(k in _claimed(s) for s in sites)]
    copy_ = case.copy()
    for k in kinds:
        _act_all(copy_, k, 3)
    with zf.float64_islands_removed():
        canon = gaugeopt.canonicalize(case.model).model
        y, a = zf.attention_outputs(case, case.model)
        yc, ac = zf.attention_outputs(case, canon)
    tol = _tol(name)
    assert max([gaugeopt.relative_change(y, yc)] + [gaugeopt.relative_change(p, q) for p, q in zip(a, ac)]) <= tol
    assert compare(case.model, copy_, tol=1e-6).equivalent


def _claimed(site):
    from gaugeopt.trust.proof import claimed_sectors

    return claimed_sectors(site)


def _act_all(model, kind, seed):
    from gaugeopt.trust.proof import _valid

    g = torch.Generator().manual_seed(seed)
    for site in gaugeopt.find_attention(model):
        if kind in _claimed(site):
            _valid(site, kind, g)


@pytest.mark.parametrize("name", ["hf_llama4", "hf_phi_qk_layernorm", "hf_cohere_qk_norm"])
def test_canonical_form_refuses_a_q_k_gauge_without_a_section(name):
    case, _ = _case(name)
    with pytest.raises(GaugeError, match="LayerNorm|orthogonal part of the Q/K gauge"):
        gaugeopt.canonicalize(case.model)


# ---------------------------------------------------------------------- gpt-oss: attention sinks
def test_sinks_remove_the_bias_sectors_and_travel_with_their_heads():
    case, sites = _case("hf_gpt_oss")
    s = sites[0]
    assert s.sinks is not None and s.sinks.name == "model.layers.0.self_attn.sinks"
    assert all(b is not None for b in (s.k.bias, s.v.bias, s.o.bias)) and s.bias_kinds == ()
    with pytest.raises(GaugeError, match=r"1 − p_sink < 1 \(attention sinks\)"):
        s.bias_sector("value_bias")
    with pytest.raises(GaugeError, match="value_bias.*does not apply.*attention sinks"):
        gaugeopt.random_gauge_transform(case.copy(), ("value_bias",), generator=0)
    # a permutation moves each head's sink with it
    from gaugeopt.transforms import permute_heads

    m = case.copy()
    site = gaugeopt.find_attention(m)[0]
    sinks0 = site.sinks.get().clone()
    permute_heads(site, torch.tensor([1, 0]), torch.tensor([3, 2, 0, 1]))
    assert torch.equal(site.sinks.get(), sinks0[[3, 2, 0, 1]])
    assert gaugeopt.relative_change(case.logits(), case.logits(m)) <= 1e-12
    counts = gaugeopt.gauge_dimension(case.model, "complete", per_symmetry=True)
    assert "key_bias" not in counts and "value_bias" not in counts
    assert counts == gaugeopt.gauge_dimension(case.model.config, "complete", per_symmetry=True)


def test_sinks_are_part_of_equivalence_canonical_forms_and_merging():
    """A gauge copy (permuted heads carrying their sinks) is equivalent; one sink moved by 0.1 is not —
    the sinks are per-head invariants, not gauge-inert tensors. Canonical forms and merging with a gauge
    copy keep the function."""
    from gaugeopt.tools.equivalence import compare

    case, _ = _case("hf_gpt_oss")
    copy_ = gaugeopt.random_gauge_transform(case.copy(), ("qk", "vo", "perm"), generator=1)
    assert compare(case.model, copy_).equivalent
    moved = case.copy()
    with torch.no_grad():
        moved.model.layers[0].self_attn.sinks[0] += 0.1
    report = compare(case.model, moved)
    assert not report.equivalent and "model.layers.0.self_attn" in report.reason
    canon = gaugeopt.canonicalize(case.model).model
    merged = gaugeopt.merge(case.model, copy_)
    for m in (canon, merged.merged, merged.aligned):
        assert gaugeopt.relative_change(case.logits(), case.logits(m)) <= 1e-10


def test_gpt_oss_runs_only_with_its_eager_kernel():
    model, _, _ = zf.raw("hf_gpt_oss")
    model.config._attn_implementation = "sdpa"
    with pytest.raises(GaugeError, match="sinks are verified with the 'eager' kernel only"):
        gaugeopt.find_attention(model)


class SinkAttention(nn.Module):
    """No RoPE, biased keys, sinks: the key-bias shift is what the sinks break (gpt-oss has full RoPE)."""

    def __init__(self, d=16, h=4):
        super().__init__()
        self.h, self.d = h, d
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d)
        self.sinks = nn.Parameter(torch.zeros(h))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, self.h, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2) / (self.d // self.h) ** 0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        s = torch.cat([s, self.sinks.view(1, -1, 1, 1).expand(B, -1, T, 1)], -1)
        w = s.softmax(-1)[..., :-1]
        return self.o((w @ v).transpose(1, 2).reshape(B, T, -1))


def test_a_user_attention_with_sinks_is_certified_without_bias_sectors():
    """AttentionSpec(sinks=...): the certificate claims qk, vo and perm (controls: sinks left behind by
    a permutation) and no key-bias sector; the key-bias shift, exact without sinks, changes the output."""
    from gaugeopt.transforms import apply_invalid

    spec = gaugeopt.AttentionSpec(q="q", k="k", v="v", o="o", num_heads="h", sinks="sinks")
    torch.manual_seed(0)
    model = nn.Sequential(SinkAttention()).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    site = spec.build(model[0], "0")
    assert site.sinks is not None and site.bias_kinds == ()
    spec.register(SinkAttention)
    try:
        report = gaugeopt.certify(model, x)
        assert set(report.layers[0].sectors) == {"qk", "vo", "perm"}
        assert report.layers[0].sectors["perm"].control_kind == "sinks_unmoved"
        assert report.worst_valid <= 1e-10 and report.weakest_control >= 1e-3
        with torch.no_grad():
            model[0].sinks.normal_()
            y0 = model(x)
            moved = copy.deepcopy(model)
            apply_invalid(gaugeopt.find_attention(moved)[0], "bias_under_sinks", torch.Generator().manual_seed(0))
            assert gaugeopt.relative_change(y0, moved(x)) >= 1e-3  # the key-bias shift, broken by the sinks
            model[0].sinks.fill_(-float("inf"))  # no sink: the same shift is exact again
            y0 = model(x)
            moved = copy.deepcopy(model)
            apply_invalid(gaugeopt.find_attention(moved)[0], "bias_under_sinks", torch.Generator().manual_seed(0))
            assert gaugeopt.relative_change(y0, moved(x)) <= 1e-12
    finally:
        from gaugeopt.adapters import find as registry

        registry._ADAPTERS.pop(SinkAttention, None)


# ---------------------------------------------------------------------- Phi qk_layernorm: the count
def test_phi_qk_layernorm_count_equals_the_nullity_of_one_layer():
    """LayerNorm with bias over each head, shared, then partial RoPE: the gain gauge per plane (per channel
    on the non-rotary ones), the mean direction of every head's rows, and the key bias on the channels
    RoPE leaves alone — invisible there, since it adds a term that depends on the query only."""
    transformers = require("transformers")
    from gaugeopt.trust.invariance import randomize_parameters
    from paths import suite_module

    _layer_nullity = suite_module("tools/test_qk_norm_tools.py")._layer_nullity

    cfg = transformers.PhiConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, partial_rotary_factor=0.5,
                                 qk_layernorm=True, max_position_embeddings=64, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = quiet(transformers.PhiForCausalLM, cfg).double()
    g = torch.Generator().manual_seed(0)
    randomize_parameters(model, g)
    x = torch.randn(2, 40, 16, generator=g, dtype=torch.float64)
    cos_sin = model.model.rotary_emb(x, torch.arange(40)[None].expand(2, -1))

    class Layer(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn = attn

        def forward(self, h):
            return self.attn(h, position_embeddings=cos_sin, attention_mask=None)[0]

    layer = Layer(model.model.layers[0].self_attn)
    params = {n: p for n, p in layer.named_parameters() if n != "attn.dense.bias"}  # no V/O bias trade
    n, gap = _layer_nullity(layer, params, x)
    counts = gaugeopt.gauge_dimension(model, per_symmetry=True)
    d, h, d_k, r = 16, 2, 8, 4
    assert counts == {"qk_gain": r // 2 + (d_k - r), "qk_layernorm": 2 * h * (d + 1) + (d_k - r), "vo": h * d_k**2}
    assert n == sum(counts.values()) and gap > 1e4


# ---------------------------------------------------------------------- Llama 4: the weight-free norm
def test_llama4_norm_layers_keep_only_rotations():
    case, sites = _case("hf_llama4")
    orth, nope = sites[:2], sites[2]
    assert all(s.qk_orthogonal and s.rope.kind == "interleaved" for s in orth)
    assert not nope.qk_orthogonal and not nope.rope.active
    assert gaugeopt.gauge_dimension(case.model, per_symmetry=True)["qk"] == 2 * (2 * 4) + 2 * 8**2  # d_k/2 vs d_k²
    with pytest.raises(GaugeError, match="only the orthogonal part of GL"):
        orth[0].pair("qk")
    m = gaugeopt.apply_lrm(case.copy())
    gaugeopt.certify(m, case.inputs)
    with pytest.raises(GaugeError, match="lrm_qk.*does not apply.*weight-free L2 norm"):
        gaugeopt.random_gauge_transform(m, ("lrm_qk",), generator=0)
    # GaugeFix balances the NoPE layer's Q/K and leaves the norm layers' queries and keys alone
    fixed = case.copy()
    before = {n: p.detach().clone() for n, p in fixed.named_parameters()}
    gaugeopt.gauge_fix(fixed)
    changed = {n for n, p in fixed.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("model.layers.2.") for n in changed)
    with pytest.raises(GaugeError, match="orthogonal part of the Q/K gauge.*no canonical section"):
        gaugeopt.canonicalize(case.model)


@pytest.mark.parametrize("lrm", [False, True])
def test_llama4_projection_removes_exactly_the_plane_rotations(lrm):
    """On the L2-norm layers the qk sector is the rotation of each RoPE plane (d_k/2 generators per KV
    group): the exact projection equals least squares against those generators, built by the complex
    step of the finite action, leaves the field orthogonal to them and is idempotent (the suite's own
    check, tests/projection/test_projection.py)."""
    from paths import suite_module

    suite_module("projection/test_projection.py").test_exact_projection_matches_least_squares("hf_llama4", lrm, "qk")


def test_llama4_norm_without_epsilon_is_refused():
    model, _, _ = zf.raw("hf_llama4")
    model.model.layers[0].self_attn.qk_norm.eps = 0.0
    with pytest.raises(GaugeError, match="eps=0.0.*forgets each head's scale"):
        gaugeopt.find_attention(model)


# ---------------------------------------------------------------------- refused, with the reason
def test_torchtitan_fused_gqa_and_flex_are_refused_with_the_reason():
    require("torchtitan")
    model, _, _ = zf._torchtitan(fuse=True, n_kv=2)
    with pytest.raises(GaugeError, match=r"no strided view"):
        gaugeopt.find_attention(model)
    from torchtitan.models.common.attention import FlexAttention

    model, _, _ = zf._torchtitan()
    for layer in model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers:
        layer.attention.inner_attention = quiet(FlexAttention, FlexAttention.Config())
    with pytest.raises(GaugeError, match=r"inner_attention is FlexAttention \(flex_attention compiled with max-autotune"):
        gaugeopt.find_attention(model)
