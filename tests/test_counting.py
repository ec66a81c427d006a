"""Gauge dimension counts reproduce the papers' figures, from configs and from models."""

import pytest
import torch

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.models import GPT, GPTConfig

GPT2_SMALL = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}
GPT2_XL = {"model_type": "gpt2", "n_layer": 48, "n_head": 25, "n_embd": 1600}
LLAMA_65B = {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 64, "hidden_size": 8192}


def test_paper_000_gpt2_small():
    assert gaugeopt.gauge_dimension(GPT2_SMALL) == 1_179_648
    assert gaugeopt.gauge_dimension(GPT2_SMALL, per_symmetry=True) == {"qk": 589_824, "vo": 589_824}


def test_paper_003_table_1():
    assert gaugeopt.gauge_dimension(GPT2_SMALL, convention="van_nierop") == 1_473_409  # exact in the paper
    xl = gaugeopt.gauge_dimension(GPT2_XL, convention="van_nierop")
    assert round(xl / 1e6, 1) == 11.1  # "11.1M"
    llama = gaugeopt.gauge_dimension(LLAMA_65B, convention="van_nierop")
    assert round(llama / 1e6) == 201  # "201M" (paper 003 ignores RoPE)
    parts = gaugeopt.gauge_dimension(GPT2_SMALL, convention="van_nierop", per_symmetry=True)
    assert parts["residual_rotation"] == 767 * 766 // 2


def test_rope_reduced_count():
    """Paper 000: h(d_k + d_v²) per layer with full RoPE; r + (d_k - r)² per group when partial."""
    L, h, d = 80, 64, 128
    assert gaugeopt.gauge_dimension(LLAMA_65B) == L * h * (d + d * d)
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, rope="split_half", rotary_dim=6)
    assert gaugeopt.gauge_dimension(cfg, per_symmetry=True) == {"qk": 2 * 2 * (6 + 2 * 2), "vo": 2 * 2 * 64}


def test_model_and_config_agree_without_allocating():
    cfg = GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, vocab_size=64, block_size=16, rope="interleaved")
    assert gaugeopt.gauge_dimension(GPT(cfg)) == gaugeopt.gauge_dimension(cfg)
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=64)
    assert gaugeopt.gauge_dimension(transformers.LlamaForCausalLM(hf)) == gaugeopt.gauge_dimension(hf) == 2 * 2 * (8 + 64)
    g2 = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32)
    assert gaugeopt.gauge_dimension(g2) == gaugeopt.gauge_dimension(g2.to_dict()) == 2 * 4 * 2 * 64


def test_lrm_adds_internal_rescalings():
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=8)
    with torch.device("meta"):
        unmade = gaugeopt.apply_lrm(GPT(cfg))
    with pytest.raises(GaugeError, match=r"on the meta device .* pass its config: gaugeopt\.gauge_dimension\(config\)"):
        gaugeopt.gauge_dimension(unmade)  # no values: nothing can be proved, and no raw crash either
    model = gaugeopt.apply_lrm(GPT(cfg))
    parts = gaugeopt.gauge_dimension(model, per_symmetry=True)
    # c_attn: 3 blocks of (8 rows + 8 cols); c_proj 8+8; c_fc 32+8; mlp c_proj 8+32
    assert parts["lrm_internal"] == 3 * 16 + 16 + 40 + 40
    assert gaugeopt.gauge_dimension(model) == parts["qk"] + parts["vo"] + parts["lrm_internal"]


def test_bad_inputs():
    with pytest.raises(GaugeError, match="convention"):
        gaugeopt.gauge_dimension(GPT2_SMALL, convention="paper")
    with pytest.raises(GaugeError, match="model_type='bert'"):
        gaugeopt.gauge_dimension({"model_type": "bert"})


GPT2_SMALL_FULL = {**GPT2_SMALL, "vocab_size": 50257, "n_positions": 1024}


def test_complete_count_at_scale():
    """Every exact symmetry, per sector (docs/model_tools.md): GPT-2 small (tied head: no residual
    rotation), GPT-2 XL, LLaMA-65B (untied: the rotations are symmetries, d(d−1)/2)."""
    parts = gaugeopt.gauge_dimension(GPT2_SMALL_FULL, "complete", per_symmetry=True)
    L, h, d, dk, V, T, dff = 12, 12, 768, 64, 50257, 1024, 3072
    assert parts == {
        "qk": L * h * dk**2, "vo": L * h * dk**2, "key_bias": L * h * dk, "value_bias": L * h * dk,
        "norm_gain": L * 2 * d, "norm_bias": L * 2 * d, "norm_meanfree": L * (3 * h * dk + dff),
        "residual_ones": L * (h * dk + 1 + dff + 1) + T,
    }
    assert sum(parts.values()) == 1_346_584
    assert gaugeopt.gauge_dimension({**GPT2_XL, "vocab_size": 50257, "n_positions": 1024}, "complete") == 11_213_920
    llama = gaugeopt.gauge_dimension({**LLAMA_65B, "intermediate_size": 22016, "vocab_size": 32000}, "complete",
                                     per_symmetry=True)
    assert llama["residual_rotation"] == 8192 * 8191 // 2 and llama["mlp_scale"] == 80 * 22016
    assert sum(llama.values()) == 121_171_968
    untied = gaugeopt.gauge_dimension({**GPT2_SMALL_FULL, "tie_word_embeddings": False}, "complete", per_symmetry=True)
    assert untied["residual_rotation"] == 767 * 766 // 2 and untied["embedding_shift"] == d - 1


def test_complete_count_model_and_config_agree():
    transformers = pytest.importorskip("transformers")
    for cfg in (GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, vocab_size=64, block_size=16, rope="split_half",
                          rotary_dim=6),
                GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16, bias=False, tie_weights=False),
                GPTConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=32, vocab_size=64, block_size=16, norm="rmsnorm",
                          mlp="swiglu", rope="interleaved", qk_norm=True)):
        assert gaugeopt.gauge_dimension(GPT(cfg), "complete", per_symmetry=True) == \
            gaugeopt.gauge_dimension(cfg, "complete", per_symmetry=True)
    for hf, cls in ((transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=16),
                     transformers.GPT2LMHeadModel),
                    (transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, vocab_size=64, attention_bias=True),
                     transformers.LlamaForCausalLM),
                    (transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, vocab_size=64), transformers.Qwen2ForCausalLM)):
        from_model = gaugeopt.gauge_dimension(cls(hf), "complete", per_symmetry=True)
        assert from_model == gaugeopt.gauge_dimension(hf, "complete", per_symmetry=True)
        assert from_model == gaugeopt.gauge_dimension(hf.to_dict(), "complete", per_symmetry=True)


def test_complete_count_bias_sectors():
    """key_bias h_kv(d_k − r) where K has a bias (none under full RoPE or QK-norm), value_bias h_kv·d_v where V and O do."""
    partial = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, vocab_size=64, block_size=16, rope="split_half",
                        rotary_dim=6)
    parts = gaugeopt.gauge_dimension(partial, "complete", per_symmetry=True)
    assert parts["key_bias"] == 2 * 2 * (8 - 6) and parts["value_bias"] == 2 * 2 * 8
    full = gaugeopt.gauge_dimension(GPTConfig(n_layer=2, n_head=4, n_embd=32, rope="interleaved"), "complete", per_symmetry=True)
    assert "key_bias" not in full and full["value_bias"] == 2 * 4 * 8
    qwen2 = {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "hidden_size": 32, "intermediate_size": 64, "vocab_size": 64}
    assert not {"key_bias", "value_bias"} & set(gaugeopt.gauge_dimension(qwen2, "complete", per_symmetry=True))
