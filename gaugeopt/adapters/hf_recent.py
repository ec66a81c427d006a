"""Adapters for the Hugging Face families of 2025–26 whose attention is not a copy of a verified class.

Matched by import path like the other Hugging Face adapters (:mod:`gaugeopt.adapters.hf`);
the renamed copies (Qwen3-MoE, Granite, RoBERTa and the BERT copies) need no entry: they are
recognised by equivalence (:mod:`gaugeopt.adapters.recognise`).

=========================  ==============================================  ==========================================
class                      what differs from Llama                         gauge group
=========================  ==============================================  ==========================================
``Glm4Attention``          RoPE *interleaved* on the first                 the commutant of the interleaved planes
                           ``partial_rotary_factor·head_dim`` channels     plus ``GL`` of the pass-through channels
``SmolLM3Attention``       no RoPE on the layers ``no_rope_layers`` marks  ``GL(d_k)`` there (a larger group)
``CohereAttention``        RoPE interleaved, in float32; optional          the interleaved commutant; with the norm,
                           ``use_qk_norm`` (a centred LayerNorm with a     the gain gauge per KV group and plane
                           gain per head, float32)                         (:mod:`~gaugeopt.adapters.qk_norm`)
``ModernBertAttention``    fused ``Wqkv`` ``[Q|K|V]``, O = ``Wo``,          plain (bidirectional; local/global windows
                           queries and keys rounded to float32 for RoPE    only mask)
``GptOssAttention``        a learned *sink* logit per head in the          ``qk``, ``vo``, head permutations that move
                           softmax; sliding windows on alternate layers    the sinks; no bias sectors
                                                                           (:mod:`gaugeopt.records.bias_sector`)
``Llama4TextAttention``    RoPE interleaved (complex, float32) on the      RoPE layers with the norm: only the
                           layers ``no_rope_layers`` marks, then a         *orthogonal* commutant (a rotation per
                           weight-free L2 norm of each head                plane: ``d_k/2`` per KV group); NoPE
                           (``use_qk_norm``); NoPE layers scale q by a     layers: all of ``GL(d_k)``; chunked
                           per-position temperature; chunked attention     attention only masks
=========================  ==============================================  ==========================================

Llama 4's weight-free norm: ``ν(u) = u/sqrt(mean(u²) + ε)`` keeps ``ν(Ou) = Oν(u)`` for orthogonal ``O``
and nothing else with ``ε > 0`` (docs/qk_norm.md, "Why GL(d_k) dies", with all gains 1), and it
acts after RoPE, whose rotations commute with the commutant: so ``A`` must be orthogonal *and* in
the commutant. The per-position temperature on NoPE layers multiplies every query channel by one
scalar, which commutes with all of ``GL(d_k)``.

gpt-oss: Hugging Face runs its sinks in the ``eager`` kernel (SDPA has no sink column and the
model does not offer it); any other kernel is refused.

Example:
    >>> import transformers, gaugeopt
    >>> cfg = transformers.Glm4Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    ...                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0)
    >>> s = gaugeopt.find_attention(transformers.Glm4ForCausalLM(cfg))[0]
    >>> (s.kind, s.rope.kind, s.rope.rotary_dim, s.verified)
    ('hf_glm4', 'interleaved', 4, True)
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.adapters import qk_norm as qkn
from gaugeopt.adapters.hf import _llama_like, _path, _with_root_rope, implementation_refusal
from gaugeopt.adapters.recognise import equivalent_class
from gaugeopt.adapters.spec import AttentionSpec, QKNormSpec

__all__ = ["HF_RECENT_ADAPTERS"]


def _cohere_qk_norm(m: nn.Module) -> QKNormSpec | None:
    return QKNormSpec("layer", "q_norm", "k_norm", eps="q_norm.variance_epsilon") if m.use_qk_norm else None


COHERE_SPEC = AttentionSpec(
    q="q_proj", k="k_proj", v="v_proj", o="o_proj", num_heads="config.num_attention_heads",
    num_kv_heads="config.num_key_value_heads", head_dim="head_dim", kind="hf_cohere", refuse=implementation_refusal,
    qk_norm=_cohere_qk_norm, on_qk_norm=qkn.hf_cohere,
    float32_steps="RoPE in float32 (Cohere's apply_rotary_pos_emb casts q and k)",
)

MODERNBERT_SPEC = AttentionSpec(
    qkv="Wqkv", fused="concat", o="Wo", num_heads="config.num_attention_heads", head_dim="head_dim",
    kind="hf_modernbert", refuse=implementation_refusal,
    float32_steps="queries and keys rounded to float32 for RoPE (ModernBERT's apply_rotary_pos_emb)",
)

def _gpt_oss_refusal(m: nn.Module) -> str | None:
    impl = getattr(m.config, "_attn_implementation", None)
    if impl in (None, "eager"):
        return None
    return (f"config._attn_implementation={impl!r}: gpt-oss's attention sinks are verified with the 'eager' kernel "
            "only (the sink column is part of its softmax); load the model with attn_implementation='eager'")


GPT_OSS_SPEC = AttentionSpec(
    q="q_proj", k="k_proj", v="v_proj", o="o_proj", num_heads="config.num_attention_heads",
    num_kv_heads="config.num_key_value_heads", head_dim="head_dim", kind="hf_gpt_oss", refuse=_gpt_oss_refusal,
    sinks="sinks",
)

_LLAMA4_L2 = "transformers.models.llama4.modeling_llama4.Llama4TextL2Norm"


def _llama4_refusal(m: nn.Module) -> str | None:
    norm = getattr(m, "qk_norm", None)
    if norm is not None:
        path = f"{type(norm).__module__}.{type(norm).__qualname__}"
        if path != _LLAMA4_L2 and not equivalent_class(type(norm), _LLAMA4_L2):
            return f"qk_norm of type {path}: the adapter was verified with {_LLAMA4_L2}"
        if "forward" in vars(norm):
            return "qk_norm with a patched forward"
        if not float(norm.eps) > 0:
            return (f"qk_norm with eps={norm.eps}: without an epsilon the norm also forgets each head's scale, a "
                    "larger Q/K group that gaugeopt has not derived for this model")
    return implementation_refusal(m)


def _llama4_orthogonal(m: nn.Module) -> str:
    return "a weight-free L2 norm of each query and key head after RoPE (Llama 4 use_qk_norm)" if hasattr(m, "qk_norm") else ""


def _llama4_float32(m: nn.Module) -> str:
    steps = (["RoPE in float32 (Llama 4's apply_rotary_emb)"] if m.use_rope else []) + \
        (["the L2 norm of q and k in float32"] if hasattr(m, "qk_norm") else [])
    return "; ".join(steps)


LLAMA4_SPEC = AttentionSpec(
    q="q_proj", k="k_proj", v="v_proj", o="o_proj", num_heads="config.num_attention_heads",
    num_kv_heads="config.num_key_value_heads", head_dim="head_dim", kind="hf_llama4", refuse=_llama4_refusal,
    qk_orthogonal=_llama4_orthogonal, float32_steps=_llama4_float32,
)

HF_RECENT_ADAPTERS = {
    _path("llama4", "Llama4TextAttention"): _with_root_rope(LLAMA4_SPEC, partial=False, kind="interleaved",
                                                            uses_rope=lambda m: bool(m.use_rope)),
    _path("gpt_oss", "GptOssAttention"): _with_root_rope(GPT_OSS_SPEC, partial=False),
    _path("glm4", "Glm4Attention"): _with_root_rope(_llama_like("hf_glm4"), partial=True, kind="interleaved"),
    _path("smollm3", "SmolLM3Attention"): _with_root_rope(_llama_like("hf_smollm3"), partial=False,
                                                          uses_rope=lambda m: bool(m.use_rope)),
    _path("cohere", "CohereAttention"): _with_root_rope(COHERE_SPEC, partial=False, kind="interleaved"),
    _path("modernbert", "ModernBertAttention"): _with_root_rope(MODERNBERT_SPEC, partial=False),
}
