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


# ---------------------------------------------------------------------- the complete count of the QK-norm families
QWEN3_0_6B = {"model_type": "qwen3", "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072, "vocab_size": 151936,
              "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
OLMO2_1B = {"model_type": "olmo2", "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
            "hidden_size": 2048, "intermediate_size": 8192, "vocab_size": 100352, "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6}
GEMMA3_1B = {"model_type": "gemma3_text", "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 256, "hidden_size": 1152, "intermediate_size": 6912, "vocab_size": 262144,
             "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6}


def test_complete_count_qk_norm_families():
    """The derivation (docs/qk_norm.md, "The complete count"), term by term. Per layer: the gain gauge
    (one factor per RoPE plane; per KV group for OLMo 2's per-head gains), GL(d_v) per KV group, the
    SwiGLU/GeGLU rescales (d_ff), and a pre-norm's gain against its readers (d per pre-norm: Qwen3 two,
    Gemma 3 two — its post-norms none —, OLMo 2 none). Once, with an untied head: the final norm's gain
    (d) and, only without post-norms, the rotations of the stream (d(d−1)/2)."""
    L, h_kv, dk, d, ff = 28, 8, 128, 1024, 3072  # Qwen3-0.6B: tied
    qwen3 = {"qk_gain": L * dk // 2, "vo": L * h_kv * dk**2, "norm_gain": L * 2 * d, "mlp_scale": L * ff}
    assert gaugeopt.gauge_dimension(QWEN3_0_6B, "complete", per_symmetry=True) == qwen3
    assert sum(qwen3.values()) == 3_815_168
    untied = gaugeopt.gauge_dimension({**QWEN3_0_6B, "tie_word_embeddings": False}, "complete", per_symmetry=True)
    assert untied == {**qwen3, "norm_gain": qwen3["norm_gain"] + d, "residual_rotation": d * (d - 1) // 2}
    L, h_kv, dk, d, ff = 16, 16, 128, 2048, 8192  # OLMo 2 1B: post-norms only, untied
    olmo2 = {"qk_gain": L * h_kv * dk // 2, "vo": L * h_kv * dk**2, "mlp_scale": L * ff, "norm_gain": d}
    assert gaugeopt.gauge_dimension(OLMO2_1B, "complete", per_symmetry=True) == olmo2
    L, h_kv, dk, d, ff = 26, 1, 256, 1152, 6912  # Gemma 3 1B: pre- and post-norms, tied
    gemma3 = {"qk_gain": L * dk // 2, "vo": L * h_kv * dk**2, "norm_gain": L * 2 * d, "mlp_scale": L * ff}
    assert gaugeopt.gauge_dimension(GEMMA3_1B, "complete", per_symmetry=True) == gemma3
    multimodal = {"model_type": "gemma3", "text_config": {k: v for k, v in GEMMA3_1B.items() if k != "model_type"}}
    assert gaugeopt.gauge_dimension(multimodal, "complete", per_symmetry=True) == gemma3
    with pytest.raises(GaugeError, match="gated MLP"):
        gaugeopt.gauge_dimension({**OLMO2_1B, "hidden_act": "relu"}, "complete")


def test_complete_count_qk_norm_model_and_config_agree():
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=64)
    for hf, cls in ((transformers.Qwen3Config(head_dim=8, **common), transformers.Qwen3ForCausalLM),
                    (transformers.Qwen3Config(head_dim=8, tie_word_embeddings=True, **common), transformers.Qwen3ForCausalLM),
                    (transformers.Olmo2Config(**common), transformers.Olmo2ForCausalLM),
                    (transformers.Gemma3TextConfig(head_dim=8, **common), transformers.Gemma3ForCausalLM),
                    (transformers.Gemma3TextConfig(head_dim=8, tie_word_embeddings=False, **common), transformers.Gemma3ForCausalLM)):
        from_model = gaugeopt.gauge_dimension(cls(hf), "complete", per_symmetry=True)
        assert from_model == gaugeopt.gauge_dimension(hf, "complete", per_symmetry=True)
        assert from_model == gaugeopt.gauge_dimension(hf.to_dict(), "complete", per_symmetry=True)
