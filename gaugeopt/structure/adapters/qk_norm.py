"""Q/K-normalised attention: recognised, recorded, refused — one function per family.

These models normalise each head's queries and keys (``q_norm``/``k_norm``) before the scores,
which removes ``GL(d_k)`` from the Q/K gauge; what remains acts on the norm's gains. Their
adapters build the full record (projections, heads, RoPE and the
:class:`~gaugeopt.structure.site.QKNorm`: kind, gains, epsilon, scope, offset) and then hand it
to the family's function below, which decides what gaugeopt does with it. **Today every one
refuses** with a :class:`~gaugeopt.errors.GaugeError` naming per-head Q/K normalisation; to
support a family, replace its function by one that returns the site.

=====================  ===========================================================================
function               family and norm
=====================  ===========================================================================
``hf_qwen3``           HF Qwen3: ``Qwen3RMSNorm(head_dim)``, one gain for all heads, before RoPE
``hf_olmo2``           HF OLMo 2: ``Olmo2RMSNorm`` over all heads at once (``scope="full"``)
``hf_gemma3``          HF Gemma 3: ``Gemma3RMSNorm(head_dim)``, gain ``1 + w`` (``gain_offset=1``)
``hf_phi``             HF Phi with ``qk_layernorm``: ``LayerNorm(head_dim)`` shared by all heads
``hf_stablelm``        HF StableLM with ``qk_layernorm``: one ``LayerNorm`` per head (gains not one tensor)
``timm``               timm ``Attention(qk_norm=True)``: ``norm_layer(head_dim)`` shared by all heads
``litgpt``             litgpt ``norm_qk``: ``norm_class(head_size)`` shared, or over all heads (``olmo2``)
``torchtitan``         torchtitan ``qk_norm``: ``RMSNorm(head_dim)`` shared by all heads
=====================  ===========================================================================

Example:
    >>> import transformers, gaugeopt
    >>> cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    ...                                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    >>> try:
    ...     gaugeopt.find_attention(transformers.Qwen3ForCausalLM(cfg))
    ... except gaugeopt.GaugeError as err:
    ...     print("per-head Q/K normalisation" in str(err))
    True
"""

from __future__ import annotations

from gaugeopt.structure.site import AttentionSite
from gaugeopt.structure.spec import refuse_qk_norm

__all__ = ["hf_qwen3", "hf_olmo2", "hf_gemma3", "hf_phi", "hf_stablelm", "timm", "litgpt", "torchtitan"]


def hf_qwen3(site: AttentionSite) -> AttentionSite:
    """HF Qwen3 (``q_norm``/``k_norm``): refused until the Q/K-norm gauge is supported."""
    return refuse_qk_norm(site, "Qwen3 q_norm/k_norm")


def hf_olmo2(site: AttentionSite) -> AttentionSite:
    """HF OLMo 2 (``q_norm``/``k_norm`` over the full projection width): refused."""
    return refuse_qk_norm(site, "OLMo 2 q_norm/k_norm over all heads")


def hf_gemma3(site: AttentionSite) -> AttentionSite:
    """HF Gemma 3 (``q_norm``/``k_norm``, gain ``1 + w``): refused."""
    return refuse_qk_norm(site, "Gemma 3 q_norm/k_norm")


def hf_phi(site: AttentionSite) -> AttentionSite:
    """HF Phi with ``qk_layernorm=True``: refused (build it with ``qk_layernorm=False``)."""
    return refuse_qk_norm(site, "Phi qk_layernorm=True")


def hf_stablelm(site: AttentionSite) -> AttentionSite:
    """HF StableLM with ``qk_layernorm=True`` (a LayerNorm per head): refused."""
    return refuse_qk_norm(site, "StableLM qk_layernorm=True, one LayerNorm per head")


def timm(site: AttentionSite) -> AttentionSite:
    """timm ``Attention(qk_norm=True)``: refused (build it with ``qk_norm=False``)."""
    return refuse_qk_norm(site, "timm qk_norm=True")


def litgpt(site: AttentionSite) -> AttentionSite:
    """litgpt ``norm_qk=True``: refused (a config with ``norm_qk=False``)."""
    return refuse_qk_norm(site, "litgpt norm_qk=True")


def torchtitan(site: AttentionSite) -> AttentionSite:
    """torchtitan ``qk_norm``: refused."""
    return refuse_qk_norm(site, "torchtitan qk_norm")
