"""Tiny random models of every outside family gaugeopt supports, in float64, for the gauge tests.

``build(name)`` returns a :class:`zoo.Case` (model with generic random parameters, inputs,
``forward(model) -> output``) like :func:`zoo.build`, so the rest of the suite can reuse them.
Each model has 2 layers (Llama 4: 3, to have norm and NoPE layers), 4 heads of width 8 (T5: 6)
and GQA where the family has it. Hugging Face models use the ``sdpa`` kernel (float64 throughout)
unless a variant says otherwise (gpt-oss: ``eager``, its only kernel with sinks). :data:`FAMILY`
holds what :func:`gaugeopt.find_attention` must report for each: the adapter kind, the KV heads and
the RoPE convention of the first layer. :data:`QK_NORM` are the Q/K-normalised families
(:data:`QK_NORM_SUPPORTED` of them supported, the rest refused); :data:`RECOGNISED` the ones reached
by recognition by equivalence (unverified records: certify first); :data:`FLOAT32_STEP` the ones
that compute part of their attention in float32 even in float64, with the sectors that step touches.
"""

from __future__ import annotations

import contextlib
import os
import torch
import torch.nn as nn

import gaugeopt
from gaugeopt.trust.invariance import randomize_parameters
from model_libraries import nanogpt, quiet, require
from zoo import Case

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB, T, B = 61, 8, 2
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _ids(seed: int, t: int = T) -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, t), generator=torch.Generator().manual_seed(seed))


def _lm(m, x):
    return m(input_ids=x, use_cache=False).logits


# ---------------------------------------------------------------------- builders: name -> (model, inputs, forward)
def _nanogpt(**kw):
    mod = nanogpt()
    cfg = mod.GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=True, **kw)
    return quiet(mod.GPT, cfg), _ids(1), lambda m, x: m(x, x)[0]  # with targets: logits at every position


def _litgpt(**kw):
    require("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    base = dict(name="tiny", block_size=16, vocab_size=VOCAB, padding_multiple=1, n_layer=2, n_head=4, n_embd=32,
                n_query_groups=2, rotary_percentage=0.5, bias=True, norm_class_name="LayerNorm",
                mlp_class_name="GptNeoxMLP", intermediate_size=48, parallel_residual=True)
    return GPT(Config(**{**base, **kw})), _ids(2), lambda m, x: m(x)


def _timm(**kw):
    require("timm")
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=10,
                              qkv_bias=True, **kw)
    x = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return model, x, lambda m, x: m.forward_features(x)


def _torchtitan(fuse: bool = False, n_kv: int = 2, rope: str = "ComplexRoPE", qk_norm: bool = False):
    require("torchtitan")
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    init = {"weight": nn.init.normal_, "bias": nn.init.zeros_}
    rope_cls = {"ComplexRoPE": ComplexRoPE, "CosSinRoPE": CosSinRoPE}[rope]

    def layer():
        return Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=32), ffn_norm=RMSNorm.Config(normalized_shape=32),
            attention=make_gqa_config(
                dim=32, n_heads=4, n_kv_heads=n_kv, wqkv_param_init=init, wo_param_init=init,
                inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=fuse,
                rope=rope_cls.Config(dim=8, max_seq_len=32, theta=10000.0),
                qk_norm=RMSNorm.Config(normalized_shape=8) if qk_norm else None),
            feed_forward=make_ffn_config(dim=32, hidden_dim=48, w1_param_init=init, w2w3_param_init=init))

    cfg = Llama3Model.Config(dim=32, vocab_size=VOCAB, tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=32),
                             norm=RMSNorm.Config(normalized_shape=32), lm_head=Linear.Config(in_features=32, out_features=VOCAB),
                             layers=[layer() for _ in range(2)])
    return cfg.build(), _ids(4), lambda m, x: m(x)


def _hf(cls_name: str, cfg_name: str, impl: str = "sdpa", forward=_lm, inputs=None, **cfg):
    transformers = require("transformers")
    config = getattr(transformers, cfg_name)(**cfg)
    config._attn_implementation = impl
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    model = quiet(getattr(transformers, cls_name), config)
    return model, _ids(5) if inputs is None else inputs, forward


def _encdec(m, x):
    return m(input_ids=x, decoder_input_ids=x[:, :5], use_cache=False).logits


def _hf_llama_like(cls, cfg, **kw):
    return lambda: _hf(cls, cfg, **{**SMALL, "num_key_value_heads": 2, **kw})


FAMILY = {
    # name: (builder, expected kind, expected h_kv, expected rope "kind:dim" or "none")
    "nanogpt": (_nanogpt, "nanogpt", 4, "none"),
    "litgpt_gqa": (lambda: _litgpt(), "litgpt", 2, "split_half:4"),
    "litgpt_interleave": (lambda: _litgpt(rope_interleave=True, n_query_groups=4), "litgpt", 4, "interleaved:4"),
    "litgpt_mqa_softcap_sliding": (
        lambda: _litgpt(n_query_groups=1, attention_logit_softcapping=5.0, sliding_window_size=4,
                        sliding_window_indices=[1, 0], attn_bias=True, bias=False, rotary_percentage=1.0),
        "litgpt", 1, "split_half:8"),
    "timm_vit": (lambda: _timm(), "timm", 4, "none"),
    "torchtitan_separate": (lambda: _torchtitan(), "torchtitan", 2, "interleaved:8"),
    "torchtitan_fused_mha_cossin": (lambda: _torchtitan(fuse=True, n_kv=4, rope="CosSinRoPE"), "torchtitan", 4, "split_half:8"),
    "hf_mixtral": (_hf_llama_like("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
                   "hf_mixtral", 2, "split_half:8"),
    "hf_gemma": (_hf_llama_like("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1, head_dim=8), "hf_gemma", 1, "split_half:8"),
    "hf_gemma2_softcap": (_hf_llama_like("Gemma2ForCausalLM", "Gemma2Config", head_dim=8, query_pre_attn_scalar=8,
                                         attn_logit_softcapping=5.0, sliding_window=4, impl="eager"),
                          "hf_gemma2", 2, "split_half:8"),
    "hf_olmo": (_hf_llama_like("OlmoForCausalLM", "OlmoConfig", attention_bias=True), "hf_olmo", 2, "split_half:8"),
    "hf_phi_partial": (_hf_llama_like("PhiForCausalLM", "PhiConfig", partial_rotary_factor=0.5), "hf_phi", 2, "split_half:4"),
    "hf_phi3_partial": (_hf_llama_like("Phi3ForCausalLM", "Phi3Config", partial_rotary_factor=0.5), "hf_phi3", 2, "split_half:4"),
    "hf_stablelm": (_hf_llama_like("StableLmForCausalLM", "StableLmConfig", use_qkv_bias=True, partial_rotary_factor=0.5),
                    "hf_stablelm", 2, "split_half:4"),
    "hf_gpt_neox": (lambda: _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **SMALL, rotary_pct=0.5), "hf_gpt_neox", 4, "split_half:4"),
    "hf_gptj": (lambda: _hf("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                            rotary_dim=4, bos_token_id=0, eos_token_id=0), "hf_gptj", 4, "interleaved:4"),
    "hf_opt": (lambda: _hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=48,
                           num_attention_heads=4, max_position_embeddings=64, enable_bias=True, pad_token_id=1,
                           bos_token_id=2, eos_token_id=2), "hf_opt", 4, "none"),
    "hf_bloom": (lambda: _hf("BloomForCausalLM", "BloomConfig", impl="eager", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                             bos_token_id=0, eos_token_id=0), "hf_bloom", 4, "none"),
    "hf_bigcode_mqa": (lambda: _hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_positions=64, n_embd=32,
                                   n_layer=2, n_head=4, multi_query=True, bos_token_id=0, eos_token_id=0),
                       "hf_gpt_bigcode", 1, "none"),
    "hf_bigcode_mha": (lambda: _hf("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_positions=64, n_embd=32,
                                   n_layer=2, n_head=4, multi_query=False, bos_token_id=0, eos_token_id=0),
                       "hf_gpt_bigcode", 4, "none"),
    "hf_falcon_mqa": (lambda: _hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, new_decoder_architecture=False, multi_query=True,
                                  bos_token_id=0, eos_token_id=0), "hf_falcon", 1, "split_half:8"),
    "hf_falcon_mha_alibi": (lambda: _hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
                                        multi_query=False, alibi=True, bias=True, bos_token_id=0, eos_token_id=0),
                            "hf_falcon", 4, "none"),
    "hf_falcon_new_mha": (lambda: _hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
                                      num_kv_heads=4, bias=True, bos_token_id=0, eos_token_id=0),
                          "hf_falcon", 4, "split_half:8"),
    "hf_falcon_new_mqa": (lambda: _hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
                                      num_kv_heads=1, bos_token_id=0, eos_token_id=0),
                          "hf_falcon", 1, "split_half:8"),
    "hf_bert": (lambda: _hf("BertModel", "BertConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                            forward=lambda m, x: m(input_ids=x).last_hidden_state), "hf_bert", 4, "none"),
    "hf_vit": (lambda: _hf("ViTModel", "ViTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=48, image_size=16, patch_size=4,
                           inputs=torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64),
                           forward=lambda m, x: m(pixel_values=x).last_hidden_state), "hf_vit", 4, "none"),
    "hf_t5": (lambda: _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=6, d_ff=48,
                          num_layers=2, num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                          dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, forward=_encdec),
              "hf_t5", 4, "none"),
    "hf_bart": (lambda: _hf("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=32, encoder_layers=2,
                            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                            decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0, pad_token_id=1, bos_token_id=0,
                            eos_token_id=2, decoder_start_token_id=2, forward=_encdec), "hf_bart", 4, "none"),
    # 2025-26 families with their own adapters (gaugeopt.adapters.hf_recent)
    "hf_glm4": (_hf_llama_like("Glm4ForCausalLM", "Glm4Config", head_dim=8, attention_bias=True, partial_rotary_factor=0.5),
                "hf_glm4", 2, "interleaved:4"),
    "hf_smollm3_nope": (_hf_llama_like("SmolLM3ForCausalLM", "SmolLM3Config", attention_bias=True, no_rope_layers=[1, 0]),
                        "hf_smollm3", 2, "split_half:8"),  # layer 1: no RoPE
    "hf_cohere": (_hf_llama_like("CohereForCausalLM", "CohereConfig", attention_bias=True, logit_scale=0.5),
                  "hf_cohere", 2, "interleaved:8"),
    "hf_modernbert": (lambda: _hf("ModernBertModel", "ModernBertConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                                  global_attn_every_n_layers=2, local_attention=4, attention_bias=True, pad_token_id=0,
                                  bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0,
                                  forward=lambda m, x: m(input_ids=x).last_hidden_state), "hf_modernbert", 4, "split_half:8"),
    "hf_gpt_oss": (_hf_llama_like("GptOssForCausalLM", "GptOssConfig", impl="eager", head_dim=8, num_local_experts=2,
                                  num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                   "hf_gpt_oss", 2, "split_half:8"),
    "hf_llama4": (_hf_llama_like("Llama4ForCausalLM", "Llama4TextConfig", head_dim=8, attention_bias=True,
                                 intermediate_size_mlp=48, num_hidden_layers=3, num_local_experts=2, num_experts_per_tok=1,
                                 no_rope_layers=[1, 1, 0], use_qk_norm=True, attention_chunk_size=4,
                                 attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, interleave_moe_layer_step=2),
                  "hf_llama4", 2, "interleaved:8"),  # layers 0, 1: RoPE + L2 norm; layer 2: NoPE
    "hf_llama4_no_qk_norm": (_hf_llama_like("Llama4ForCausalLM", "Llama4TextConfig", head_dim=8, intermediate_size_mlp=48,
                                            num_local_experts=2, num_experts_per_tok=1, no_rope_layers=[1, 0],
                                            use_qk_norm=False, attention_chunk_size=4, interleave_moe_layer_step=1),
                             "hf_llama4", 2, "interleaved:8"),
    # renamed copies of verified classes, recognised by equivalence (gaugeopt.adapters.recognise): certified first
    "hf_granite": (_hf_llama_like("GraniteForCausalLM", "GraniteConfig", attention_bias=True, attention_multiplier=0.3,
                                  embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0),
                   "hf_llama", 2, "split_half:8"),
    "hf_roberta": (lambda: _hf("RobertaModel", "RobertaConfig", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=48, max_position_embeddings=64, pad_token_id=1,
                               forward=lambda m, x: m(input_ids=x).last_hidden_state), "hf_bert", 4, "none"),
    "hf_electra": (lambda: _hf("ElectraModel", "ElectraConfig", vocab_size=VOCAB, embedding_size=32, hidden_size=32,
                               num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                               forward=lambda m, x: m(input_ids=x).last_hidden_state), "hf_bert", 4, "none"),
}
# Families handled through recognition by equivalence: their records are not verified, so the tests
# certify them first (as the gate does at first use).
RECOGNISED = ("hf_granite", "hf_roberta", "hf_electra", "hf_qwen3_moe")

# The QK-normalised families: recognised by find_attention and refused (per-head Q/K normalisation).
QK_NORM = {
    "hf_qwen3": _hf_llama_like("Qwen3ForCausalLM", "Qwen3Config", head_dim=8),
    "hf_olmo2": _hf_llama_like("Olmo2ForCausalLM", "Olmo2Config"),
    "hf_gemma3": _hf_llama_like("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=8, query_pre_attn_scalar=8),
    "hf_phi_qk_layernorm": _hf_llama_like("PhiForCausalLM", "PhiConfig", qk_layernorm=True),
    "hf_stablelm_qk_layernorm": _hf_llama_like("StableLmForCausalLM", "StableLmConfig", qk_layernorm=True),
    "timm_qk_norm": lambda: _timm(qk_norm=True),
    "litgpt_norm_qk": lambda: _litgpt(norm_qk=True),
    "litgpt_norm_qk_olmo2": lambda: _litgpt(norm_qk=True, norm_qk_type="olmo2"),
    "torchtitan_qk_norm": lambda: _torchtitan(qk_norm=True),
    "hf_cohere_qk_norm": _hf_llama_like("CohereForCausalLM", "CohereConfig", attention_bias=True, use_qk_norm=True),
    "hf_qwen3_moe": _hf_llama_like("Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=8, attention_bias=True, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16),
}

# Q/K-normalised families whose gain gauge is verified; the rest of QK_NORM is refused
QK_NORM_SUPPORTED = ("hf_gemma3", "hf_olmo2", "hf_qwen3", "timm_qk_norm", "hf_phi_qk_layernorm", "hf_cohere_qk_norm",
                     "torchtitan_qk_norm", "hf_qwen3_moe")
QK_NORM_LRM = ("hf_phi_qk_layernorm", "hf_cohere_qk_norm", "hf_qwen3_moe")
# Families that keep a float32 step of their own in a float64 model (named in their records), and the sectors
# that pass through it: those are exact to float32 rounding only (tests/adapters/test_families.py)
_THROUGH_QK = ("qk", "qk_gain", "lrm_qk", "perm", "key_bias", "value_bias")  # RoPE, a Q/K norm: the certificate's list
FLOAT32_STEP = {**{n: _THROUGH_QK for n in ("hf_cohere", "hf_modernbert", "hf_llama4", "hf_llama4_no_qk_norm",
                                            "hf_cohere_qk_norm", "hf_qwen3_moe", "hf_qwen3", "hf_olmo2", "hf_gemma3",
                                            "torchtitan_qk_norm")},
                "hf_bloom": ("key_bias", "value_bias")}  # Bloom's softmax: the rows sum to one in float32

NAMES = tuple(FAMILY)
# Families whose attention projections apply_lrm converts (nn.Linear with [Q|K|V] blocks or separate
# projections). Not: Falcon and torchtitan (their own nn.Linear subclasses, left alone), GPT-NeoX,
# Bloom and GPTBigCode without multi-query (Q/K/V rows interleaved per head: refused).
LRM_NAMES = tuple(n for n in NAMES if not n.startswith(("hf_falcon", "torchtitan", "hf_gpt_neox", "hf_bloom", "hf_bigcode_mha")))


def raw(name: str):
    """``(model, inputs, forward)`` of a family, freshly built (float32, default init)."""
    builder = FAMILY[name][0] if name in FAMILY else QK_NORM[name]
    return builder()


def build(name: str, seed: int = 0, *, lrm: bool = False, dtype=torch.float64) -> Case:
    torch.manual_seed(seed)
    model, inputs, forward = raw(name)
    if lrm:
        gaugeopt.apply_lrm(model)
    # .double()/.float() cast floating tensors only: .to(dtype) would also cast torchtitan's complex
    # RoPE cache to real, discarding the rotation
    model = (model.double() if dtype == torch.float64 else model.float()).eval()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    if inputs.is_floating_point():
        inputs = inputs.to(dtype)
    return Case(name + ("+lrm" if lrm else ""), model, inputs, lambda m: forward(m, inputs))


@contextlib.contextmanager
def float64_islands_removed():
    """Precision only, same math: torchtitan rotates q and k in float32 even in a float64 model
    (``ComplexRoPE``/``CosSinRoPE.apply_rotary_emb``: ``query.float()``), which bounds what a float64
    check can see at ~1e-8; inside this context they rotate in the input's dtype. Nothing else is
    changed, and only while the context is active."""
    try:
        from torchtitan.models.common import rope
    except ImportError:
        yield
        return
    saved = {cls: cls.__dict__["apply_rotary_emb"] for cls in (rope.ComplexRoPE, rope.CosSinRoPE)}

    @gaugeopt.accept_patch  # the same rotation in the input's dtype: the certificate proves it as it runs
    def complex_rope(query, key, rope_cache):
        ct = torch.complex128 if query.dtype == torch.float64 else torch.complex64
        xq = torch.view_as_complex(query.to(ct.to_real()).reshape(*query.shape[:-1], -1, 2))
        xk = torch.view_as_complex(key.to(ct.to_real()).reshape(*key.shape[:-1], -1, 2))
        c = rope_cache.to(ct)
        return torch.view_as_real(xq * c).flatten(3).type_as(query), torch.view_as_real(xk * c).flatten(3).type_as(key)

    @gaugeopt.accept_patch
    def cossin_rope(query, key, rope_cache):
        d = query.shape[-1]
        cos, sin = rope_cache[..., :d].to(query.dtype), rope_cache[..., d:].to(query.dtype)
        rot = rope.CosSinRoPE._rotate_half
        return query * cos + rot(query) * sin, key * cos + rot(key) * sin

    rope.ComplexRoPE.apply_rotary_emb = staticmethod(complex_rope)
    rope.CosSinRoPE.apply_rotary_emb = staticmethod(cossin_rope)
    try:
        yield
    finally:
        for cls, fn in saved.items():
            cls.apply_rotary_emb = fn


def attention_outputs(case: Case, model: nn.Module, sites=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model output and every attention module's output (first tensor) in one forward."""
    from gaugeopt.trust.proof import _first_tensor

    sites = gaugeopt.find_attention(model) if sites is None else sites
    outs: list[torch.Tensor] = []
    hooks = [s.module.register_forward_hook(lambda mod, a, o: outs.append(_first_tensor(o).detach().clone()))
             for s in sites]
    try:
        with torch.no_grad():
            y = case.forward(model)
    finally:
        for h in hooks:
            h.remove()
    return y, outs

