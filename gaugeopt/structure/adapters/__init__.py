"""Built-in adapters: the attention classes :func:`gaugeopt.find_attention` understands.

=====================================  =========================================  ==================
class                                  layout                                     position encoding
=====================================  =========================================  ==================
``gaugeopt.models.gpt.CausalSelfAttention``  fused ``c_attn`` ``[Q|K|V]``, GQA       none / interleaved / split-half, partial
``transformers`` ``GPT2Attention``     ``Conv1D`` (in×out), fused ``c_attn``      none (learned absolute)
``transformers`` ``LlamaAttention``    separate ``q/k/v/o_proj``, GQA, opt. bias  split-half, full
``transformers`` ``MistralAttention``  as Llama, no bias                          split-half, full
``transformers`` ``Qwen2Attention``    as Llama, Q/K/V biases                     split-half, full
``torch.nn.MultiheadAttention``        fused ``in_proj_weight`` or separate       none
``transformers`` ``Qwen3Attention``    as Llama + per-head RMSNorm QK-norm        split-half, full
``transformers`` ``Olmo2Attention``    as Llama + full-width RMSNorm QK-norm      split-half, full
``transformers`` ``Gemma3Attention``   as Llama + per-head ``(1+w)`` QK-norm      split-half, full
``timm`` ``Attention(qk_norm=True)``   fused ``qkv``, LayerNorm QK-norm           none
=====================================  =========================================  ==================

QK-norm sites (:mod:`.hf_qknorm`, :mod:`.timm_qknorm`, the own GPT with ``qk_norm=True``) record the
norm on :attr:`gaugeopt.AttentionSite.qk_norm`; their Q/K gauge acts on its gains (docs/qk_norm.md).

Hugging Face classes are matched by their import path, so gaugeopt never imports
``transformers`` itself; the adapters run only for models that already did.
"""

from __future__ import annotations

from gaugeopt.structure.registry import register_adapter, register_named_adapter
from gaugeopt.structure.adapters.gpt import adapt_gpt
from gaugeopt.structure.adapters.hf import adapt_hf_gpt2, adapt_hf_llama_like
from gaugeopt.structure.adapters.torch_mha import adapt_mha

__all__ = ["adapt_gpt", "adapt_hf_gpt2", "adapt_hf_llama_like", "adapt_mha"]


def _register() -> None:
    import torch.nn as nn

    from gaugeopt.models.gpt import CausalSelfAttention

    register_adapter(CausalSelfAttention, adapt_gpt)
    register_adapter(nn.MultiheadAttention, adapt_mha)
    register_named_adapter("transformers.models.gpt2.modeling_gpt2.GPT2Attention", adapt_hf_gpt2)
    for family, cls in (("llama", "LlamaAttention"), ("mistral", "MistralAttention"), ("qwen2", "Qwen2Attention")):
        register_named_adapter(f"transformers.models.{family}.modeling_{family}.{cls}", adapt_hf_llama_like)


_register()

# QK-norm adapters register last: the timm adapter hands instances without LayerNorm QK-norm to
# whatever adapter was registered for the class before it.
from gaugeopt.structure.adapters import hf_qknorm, timm_qknorm  # noqa: E402,F401
