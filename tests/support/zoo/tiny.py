"""Tiny float64 language models for the flat-direction meter, and Hugging Face Llama's RMSNorm in float64.

Each model is the architecture of a zoo family (:mod:`zoo`) at the smallest size that keeps it
generic: width 4–8, two layers, a vocabulary at least as wide as the model (a head with fewer rows
than ``d_model`` has a kernel, and every direction into it is flat), 4 positions. Parameters are
generic (``randomize_parameters``), inputs are :func:`gaugeopt.flat.meter.covering_tokens` with
:func:`gaugeopt.flat.meter.suggested_sequences` rows, so no coordinate is unused.

**Hugging Face Llama.** ``LlamaRMSNorm.forward`` casts the hidden states to float32 and back, so a
float64 model is only float32-accurate after every norm and the null space is buried at ~1e-7.
:func:`float64_rmsnorm` replaces the forward (for the duration of a test) by the same formula
``γ ⊙ x / sqrt(mean x² + ε)`` in the input's dtype.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

import gaugeopt
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.trust.invariance import randomize_parameters
from gaugeopt.tools.checkpoint import context_length
from gaugeopt.flat.meter import covering_tokens, suggested_sequences

LENGTH = 4


@contextlib.contextmanager
def float64_rmsnorm():
    """``LlamaRMSNorm`` (and Mistral's, Qwen2's, gpt-oss's) computing in the input's dtype (module docstring)."""
    from transformers.models.gpt_oss import modeling_gpt_oss as mg
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.mistral import modeling_mistral as mm
    from transformers.models.qwen2 import modeling_qwen2 as mq

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    classes = (ml.LlamaRMSNorm, mm.MistralRMSNorm, mq.Qwen2RMSNorm, mg.GptOssRMSNorm)
    saved = [c.forward for c in classes]
    for c in classes:
        c.forward = forward
    try:
        yield
    finally:
        for c, f in zip(classes, saved):
            c.forward = f


def _gpt(**kw) -> nn.Module:
    base = dict(vocab_size=7, block_size=LENGTH, n_layer=2, n_head=2, n_embd=4, mlp_hidden=8)
    return GPT(GPTConfig(**{**base, **kw}))


def _hf(kind: str, **kw) -> nn.Module:
    import transformers

    # SDPA: the eager attention of the Llama family takes its softmax in float32, which leaves the rows of
    # attention summing to one only to float32 rounding (the value-bias trade relies on that sum)
    common = dict(bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=4, n_inner=8, vocab_size=7, n_positions=LENGTH,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common, **kw)
        return transformers.GPT2LMHeadModel(cfg)
    llama_like = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=8, vocab_size=11, max_position_embeddings=16, pad_token_id=None, **common)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_like, **kw))
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like, **kw))
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**llama_like, **kw))
    if kind == "gpt_oss":  # attention sinks, biases, sliding window on one layer, two experts (both always chosen)
        cfg = transformers.GptOssConfig(**{**llama_like, "attn_implementation": "eager"}, head_dim=2, num_local_experts=2,
                                        num_experts_per_tok=2, sliding_window=2, layer_types=["sliding_attention", "full_attention"],
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)
        cfg._experts_implementation = "eager"
        return transformers.GptOssForCausalLM(cfg)
    raise KeyError(kind)


# name -> builder; the acceptance set first, then one tiny model per further zoo family
MODELS = {
    "hf_gpt2": lambda: _hf("gpt2"),
    "hf_gpt2_untied": lambda: _hf("gpt2", tie_word_embeddings=False),
    "hf_llama": lambda: _hf("llama"),
    "gpt": lambda: _gpt(),
    "gpt_nobias": lambda: _gpt(bias=False),
    "gpt+lrm": lambda: gaugeopt.apply_lrm(_gpt()),
    # the rest of the zoo's families (tests/support/zoo/__init__.py), tiny
    "gpt_gqa": lambda: _gpt(n_head=4, n_kv_head=2, n_embd=8, vocab_size=11),
    "gpt_mqa": lambda: _gpt(n_head=4, n_kv_head=1, n_embd=8, vocab_size=11),
    "gpt_rope_interleaved": lambda: _gpt(rope="interleaved"),
    "gpt_rope_split_half_gqa": lambda: _gpt(rope="split_half", n_head=4, n_kv_head=2, n_embd=8, vocab_size=11,
                                            norm="rmsnorm", mlp="swiglu"),
    "gpt_rope_partial_interleaved": lambda: _gpt(rope="interleaved", n_embd=8, head_dim=4, rotary_dim=2, vocab_size=11),
    "gpt_rope_partial_split_half": lambda: _gpt(rope="split_half", n_head=4, n_kv_head=2, n_embd=8, rotary_dim=2,
                                                vocab_size=11),
    "gpt_qknorm": lambda: _gpt(rope="split_half", n_head=4, n_kv_head=2, n_embd=8, vocab_size=11, qk_norm=True),
    "gpt_untied_rmsnorm_positions": lambda: _gpt(norm="rmsnorm", tie_weights=False, n_embd=6, vocab_size=7),
    "hf_llama_bias": lambda: _hf("llama", attention_bias=True),
    "hf_qwen2": lambda: _hf("qwen2"),
    "hf_mistral": lambda: _hf("mistral"),
    "hf_gpt_oss": lambda: _hf("gpt_oss"),
}
ACCEPTANCE = ("hf_gpt2", "hf_gpt2_untied", "hf_llama", "gpt", "gpt_nobias", "gpt+lrm")


def _qk_norm(name: str) -> nn.Module:
    """Tiny Hugging Face QK-norm models: ``d = 8``, 4 query and 2 KV heads of width 4 (two RoPE planes)."""
    import transformers

    common = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=8,
                  vocab_size=11, max_position_embeddings=16, pad_token_id=None, bos_token_id=0, eos_token_id=0,
                  attn_implementation="sdpa")
    tied = name.endswith("_tied") or (name.startswith("gemma3") and not name.endswith("_untied"))
    if name.startswith("qwen3"):
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=4, tie_word_embeddings=tied, **common))
    if name == "olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common))
    # ε = 1e-3: the global rescale of the stream, broken only by ε, then sits clear of the null space
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(head_dim=4, query_pre_attn_scalar=4, rms_norm_eps=1e-3,
                                                                        tie_word_embeddings=tied, **common))


def build_qk_norm(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """``(model, tokens)`` for :func:`_qk_norm`'s ``qwen3``, ``qwen3_tied``, ``olmo2``, ``gemma3``, ``gemma3_untied``."""
    torch.manual_seed(seed)
    model = _qk_norm(name).double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    vocab, _ = context_length(model)
    return model, covering_tokens(vocab, LENGTH, suggested_sequences(model, vocab, LENGTH), seed=seed)


def build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """``(model, tokens)``: the float64 model with generic parameters and covering inputs."""
    torch.manual_seed(seed)
    model = MODELS[name]().double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    vocab, _ = context_length(model)
    return model, covering_tokens(vocab, LENGTH, suggested_sequences(model, vocab, LENGTH), seed=seed)


def as_logits(out) -> torch.Tensor:
    """The logits of a model output (``.logits``, else the first element of a tuple)."""
    return out.logits if hasattr(out, "logits") else out[0]


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return as_logits(model(x))


def build_llama(seed: int = 0, **kw) -> tuple[nn.Module, torch.Tensor]:
    """A tiny float64 HF ``LlamaForCausalLM`` (untied) with generic weights and covering inputs; ``kw``
    overrides its config (``hidden_size``, ``head_dim``, …)."""
    import transformers

    torch.manual_seed(seed)
    cfg = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=8,
               vocab_size=11, max_position_embeddings=16, pad_token_id=None, bos_token_id=0, eos_token_id=0,
               attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **kw})).double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    vocab, _ = context_length(model)
    return model, covering_tokens(vocab, LENGTH, suggested_sequences(model, vocab, LENGTH), seed=seed)
