"""Built-in adapters: the attention classes :func:`gaugeopt.find_attention` understands.

===========================================  ===================================================="""

from __future__ import annotations

from gaugeopt.adapters.table import register_builtin, register_builtin_recogniser, register_wrapper
from gaugeopt.adapters.gpt import adapt_gpt
from gaugeopt.adapters.hf import HF_ADAPTERS, HF_WRAPPERS, adapt_hf_gpt2
from gaugeopt.adapters.hf_recent import HF_RECENT_ADAPTERS
from gaugeopt.adapters.litgpt import LITGPT_ATTENTION, LITGPT_SPEC
from gaugeopt.adapters.mla import MLA_ADAPTERS
from gaugeopt.adapters.nanogpt import adapt_nanogpt, looks_like_nanogpt
from gaugeopt.adapters.timm import TIMM_ATTENTION, TIMM_SPEC
from gaugeopt.adapters.torch_mha import adapt_mha
from gaugeopt.adapters.torchtitan import TORCHTITAN_ATTENTION, adapt_torchtitan
from gaugeopt.adapters.x_transformers import X_TRANSFORMERS_ATTENTION, refuse_x_transformers

__all__ = ["adapt_gpt", "adapt_hf_gpt2", "adapt_mha", "adapt_nanogpt", "adapt_torchtitan"]


def _register() -> None:
    import torch.nn as nn

    from gaugeopt.models.gpt import CausalSelfAttention

    register_builtin(CausalSelfAttention, adapt_gpt)
    register_builtin(nn.MultiheadAttention, adapt_mha)
    register_builtin_recogniser(looks_like_nanogpt, adapt_nanogpt)
    register_builtin(LITGPT_ATTENTION, LITGPT_SPEC.adapter())
    register_builtin(TIMM_ATTENTION, TIMM_SPEC.adapter())
    register_builtin(TORCHTITAN_ATTENTION, adapt_torchtitan)
    register_builtin(X_TRANSFORMERS_ATTENTION, refuse_x_transformers)
    for path, adapter in {**HF_ADAPTERS, **HF_RECENT_ADAPTERS}.items():
        register_builtin(path, adapter)
    for path in HF_WRAPPERS:
        register_wrapper(path)
    for path, adapter in MLA_ADAPTERS.items():  # multi-head latent attention (DeepSeek-V2/V3, litgpt, torchtitan)
        register_builtin(path, adapter)


_register()
