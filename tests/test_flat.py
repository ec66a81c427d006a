"""The flat-direction meter against the complete count, on tiny float64 models of every zoo family.

The meter (gaugeopt.flat_directions) and the count (gauge_dimension(convention="complete")) are
independent: one is the numerical nullity of the logits' Jacobian, the other a formula of the
architecture. They must agree, and the null space must be exactly the span of the exact sectors
(remainder 0), with the known non-symmetries (residual rotations under a tied head, the key-bias
shift on RoPE-rotated channels) outside it. Hugging Face Llama runs with its RMSNorm computed in
float64 (flat_helpers.float64_rmsnorm): as shipped it rounds through float32.
"""

from __future__ import annotations

import pytest
import torch

import gaugeopt
import flat_helpers
from gaugeopt import GaugeError
from gaugeopt.tools.flat import covering_tokens, flat_directions

# the measured nullity of each tiny model (flat_helpers.MODELS, seed 0): a change here is a change in
# the meter, the count or the model
NULLITY = {"hf_gpt2": 152, "hf_gpt2_untied": 173, "hf_llama": 108, "gpt": 152, "gpt_nobias": 117, "gpt+lrm": 264,
           "gpt_gqa": 200, "gpt_mqa": 168, "gpt_rope_interleaved": 132, "gpt_rope_split_half_gqa": 80,
           "gpt_rope_partial_interleaved": 276, "gpt_rope_partial_split_half": 180, "gpt_qknorm": 174,
           "gpt_untied_rmsnorm_positions": 147, "hf_llama_bias": 116, "hf_qwen2": 108, "hf_mistral": 108,
           "hf_gpt_oss": 142}
# exact sectors each model must show (beyond qk/vo), and the non-symmetries it must show outside the null space
SHOWN = {"hf_gpt2": ({"key_bias", "value_bias", "norm_bias", "norm_meanfree", "residual_ones"},
                     {"residual_rotation", "embedding_shift"}),
         "hf_gpt2_untied": ({"residual_rotation", "embedding_shift", "residual_ones"}, {"norm_meanfree"}),
         "hf_llama": ({"norm_gain", "mlp_scale", "residual_rotation"}, set()),
         "gpt": ({"key_bias", "value_bias"}, {"residual_rotation"}),
         "gpt_nobias": ({"embedding_shift", "norm_meanfree"}, {"residual_rotation"}),
         "gpt+lrm": ({"lrm_qk", "lrm_vo", "lrm_internal", "key_bias"}, {"residual_rotation"})}


def _measure(name: str):
    model, x = flat_helpers.build(name)
    with flat_helpers.float64_rmsnorm():
        rep = flat_directions(model, x, progress=False)
    counts = gaugeopt.gauge_dimension(model, "complete", per_symmetry=True)
    print(f"\n{name}: nullity {rep.nullity}, complete {sum(counts.values())} {counts}, gap x{rep.gap:.1e} "
          f"(null <= {rep.sigma_null:.1e}, kept >= {rep.sigma_kept:.1e})")
    return model, rep, counts


def _check(name, rep, counts):
    assert rep.nullity == sum(counts.values()) == NULLITY[name]
    assert not rep.unused and rep.remainder == 0 and rep.saturated
    assert rep.sectors[-1].cum_dim == rep.nullity  # the exact sectors span the null space, no more, no less
    assert rep.gap > 1e3 and rep.sigma_null < 1e-11  # a clear rank: zeros at rounding level
    assert all(r.in_null == r.dim and r.leak < 1e-14 and r.finite <= 1e-12 for r in rep.sectors)
    assert not [r.name for r in rep.near_flat if r.expected]  # nothing that claims a symmetry failed
    for r in rep.near_flat:  # the known non-symmetries: outside the null space, and finitely far from flat
        assert r.in_null == 0 and r.finite > 1e-3 and r.sigma_perp > 1e-6, r
    sectors = {r.name for r in rep.sectors}
    assert set(counts) - {"embedding_shift"} <= sectors | {"qk_head_scale"}
    return sectors, {r.name for r in rep.near_flat}


@pytest.mark.parametrize("name", flat_helpers.ACCEPTANCE)
def test_nullity_equals_complete_count(name):
    """Tiny HF GPT-2 (tied and untied), HF Llama (GQA, RoPE), gaugeopt's GPT with and without biases
    and with learnable multipliers."""
    _, rep, counts = _measure(name)
    sectors, near = _check(name, rep, counts)
    must, outside = SHOWN[name]
    assert must <= sectors and outside <= near


@pytest.mark.parametrize("name", [n for n in flat_helpers.MODELS if n not in flat_helpers.ACCEPTANCE])
def test_nullity_equals_complete_count_every_zoo_family(name):
    """GQA, MQA, RoPE (interleaved, split-half, partial), QK-norm, RMSNorm with learned positions,
    Llama with biases, Qwen2, Mistral, gpt-oss (attention sinks, a top-k router over two experts)."""
    _, rep, counts = _measure(name)
    sectors, near = _check(name, rep, counts)
    if "rope" in name or name.startswith(("hf_qwen2", "hf_llama_bias", "hf_gpt_oss")):
        assert "key_bias_rope" in near  # under RoPE the key-bias shift on rotated channels is not flat
    if name == "hf_gpt_oss":  # the sinks remove the value-bias trade: biased V and O, and the trade is not flat
        assert "value_bias_sink" in near and not {"key_bias", "value_bias"} & (sectors | set(counts))
        assert {"router_shift", "expert_up_scale", "residual_rotation"} <= sectors and "mlp_scale" not in counts


def test_paper_counts_fall_short_of_the_null_space():
    """wang and van_nierop are symmetry counts, not flat-direction counts (docs/errata.md)."""
    model, rep, counts = _measure("gpt")
    wang, vn = gaugeopt.gauge_dimension(model), gaugeopt.gauge_dimension(model, "van_nierop")
    print(f"gpt: nullity {rep.nullity}, wang {wang}, van_nierop {vn}")
    assert wang < rep.nullity and vn < rep.nullity and wang == counts["qk"] + counts["vo"]


def test_unused_coordinates_are_reported_apart():
    """Tokens the inputs never use leave their embedding rows flat: reported as unused, not as symmetries."""
    model, _ = flat_helpers.build("gpt_untied_rmsnorm_positions")
    x = covering_tokens(5, flat_helpers.LENGTH, 60)  # ids 5 and 6 never appear
    rep = flat_directions(model, x, progress=False)
    d = model.config.n_embd
    print(f"unused: {len(rep.unused)} coordinates, nullity {rep.nullity}")
    assert sorted(rep.unused) == sorted(f"transformer.wte.weight[{t}, {c}]" for t in (5, 6) for c in range(d))
    assert rep.sectors[0].name == "unused" and rep.sectors[0].in_null == 2 * d
    assert rep.nullity >= NULLITY["gpt_untied_rmsnorm_positions"] + 2 * d - 1  # a row's ones-direction may overlap


def test_too_little_data_is_not_saturated():
    """With fewer positions × width than parameters the nullity is inflated and the remainder says so."""
    model, x = flat_helpers.build("gpt")
    rep = flat_directions(model, x[:8], progress=False)
    print(f"8 sequences: nullity {rep.nullity} (saturated {NULLITY['gpt']}), remainder {rep.remainder}")
    assert rep.nullity > NULLITY["gpt"] and rep.remainder == rep.nullity - NULLITY["gpt"] and not rep.saturated


def test_refusals_and_progress():
    model, x = flat_helpers.build("gpt_nobias")
    with pytest.raises(GaugeError, match="max_params=100.*gauge_dimension"):
        flat_directions(model, x, max_params=100)
    with pytest.raises(GaugeError, match="float64"):
        flat_directions(flat_helpers.MODELS["gpt_nobias"](), x)
    with pytest.raises(GaugeError, match="example inputs"):
        flat_directions(model)
    lines: list[str] = []
    rep = flat_directions(model, x, progress=lines.append, attribute=False)
    assert rep.remainder is None and not rep.sectors
    assert any("Jacobian" in s for s in lines) and all(s.startswith("flat_directions: ") for s in lines)


def test_complete_count_refuses_what_it_does_not_describe():
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 5, 8)
    gaugeopt.certify(mha, x, x, x)  # a bare module: gaugeopt cannot make up its input
    with pytest.raises(GaugeError, match="no residual-stream description"):
        gaugeopt.gauge_dimension(mha, "complete")
    with pytest.raises(GaugeError, match="model_type='qwen3'"):
        gaugeopt.gauge_dimension({"model_type": "qwen3", "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "hidden_size": 8, "vocab_size": 11, "intermediate_size": 8}, "complete")


def test_a_float32_step_is_reported_not_hidden():
    """HF Llama as shipped rounds its RMSNorm through float32: the report says so, and the residual rotations —
    exact in float64 arithmetic — show as a sector that claims a symmetry and fails its finite check."""
    model, x = flat_helpers.build("hf_llama")
    rep = flat_directions(model, x, progress=False)
    failed = [r for r in rep.near_flat if r.expected]
    print(f"\nunpatched HF Llama: nullity {rep.nullity} (float64 RMSNorm: {NULLITY['hf_llama']}); "
          f"failed: {[(r.name, f'{r.finite:.1e}') for r in failed]}")
    assert "LlamaRMSNorm casts to float32" in rep.note and "EXPECTED EXACT BUT IS NOT" in rep.table()
    assert [r.name for r in failed] == ["residual_rotation"] and 1e-12 < failed[0].finite < 1e-5
    assert rep.nullity < NULLITY["hf_llama"]
    from gaugeopt.structure.stream import find_stream

    with flat_helpers.float64_rmsnorm():  # a replaced forward is not reported
        assert find_stream(model).float32_steps == ""
