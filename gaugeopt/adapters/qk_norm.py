"""Q/K-normalised attention, one function per family: supported where the gain gauge is verified.

These models normalise each head's queries and keys (``q_norm``/``k_norm``) before the scores,
which removes ``GL(d_k)`` from the Q/K gauge; what remains acts on the norm's gains
(``docs/qk_norm.md``). Their adapters build the full record (projections, heads, RoPE and the
:class:`~gaugeopt.records.site.QKNorm`: kind, gains, epsilon, scope, offset) and hand it to the
family's function below, which checks the norm itself — its exact class and stock ``forward``,
one epsilon for both norms — and returns the record, or refuses a family whose QK-norm gauge the
test suite does not verify, with a :class:`~gaugeopt.errors.GaugeError` naming per-head Q/K
normalisation.

=====================  ===========================================================================
function               family and norm
=====================  ===========================================================================
``hf_qwen3``           HF Qwen3: ``Qwen3RMSNorm(head_dim)``, one gain for all heads, before RoPE — supported
``hf_olmo2``           HF OLMo 2: ``Olmo2RMSNorm`` over all heads at once (``scope="full"``) — supported
``hf_gemma3``          HF Gemma 3: ``Gemma3RMSNorm(head_dim)``, gain ``1 + w`` (``gain_offset=1``) — supported
``timm``               timm ``Attention(qk_norm=True)``: ``LayerNorm(head_dim)`` shared by all heads — supported
``hf_phi``             HF Phi with ``qk_layernorm``: ``LayerNorm(head_dim)`` with bias, shared by all heads, before
                       partial RoPE — supported
``hf_cohere``          HF Cohere with ``use_qk_norm``: ``CohereLayerNorm((heads, head_dim))``, centred, no bias, a
                       gain per head, before RoPE — supported
``hf_stablelm``        HF StableLM with ``qk_layernorm``: one ``LayerNorm`` module per head (gains not one tensor) —
                       refused
``litgpt``             litgpt ``norm_qk``: ``norm_class(head_size)`` shared, or over all heads — refused
``torchtitan``         torchtitan ``qk_norm``: ``RMSNorm(head_dim)`` shared by all heads, before RoPE — supported
=====================  ===========================================================================

Example:
    >>> import transformers, gaugeopt
    >>> cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    ...                                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    >>> site = gaugeopt.find_attention(transformers.Qwen3ForCausalLM(cfg))[0]
    >>> site.qk_norm.kind, site.qk_norm.q_gain.shape, site.pair("qk_gain").groups
    ('rms', (1, 8), 1)
"""

from __future__ import annotations

import torch.nn as nn

from gaugeopt.adapters.common import refuse, require_stock_forward
from gaugeopt.adapters.recognise import equivalent_class
from gaugeopt.records.site import AttentionSite
from gaugeopt.adapters.spec import refuse_qk_norm

_TIMM_LAYER_NORMS = ("timm.layers.norm.LayerNorm", "torch.nn.modules.normalization.LayerNorm")


def _path(module: nn.Module | None) -> str:
    return "None" if module is None else f"{type(module).__module__}.{type(module).__qualname__}"


def _checked_norms(site: AttentionSite, classes: tuple[str, ...], attrs: tuple[str, str] = ("q_norm", "k_norm")) -> AttentionSite:
    """Return ``site`` once its ``q_norm``/``k_norm`` are of a norm class the family was verified with
    (or a renamed copy of one, :func:`~gaugeopt.adapters.recognise.equivalent_class`), with their stock
    ``forward``, a learnable gain and one epsilon."""
    m, name = site.module, site.name
    for attr in attrs:
        norm = getattr(m, attr, None)
        if _path(norm) not in classes and not (norm is not None and any(equivalent_class(type(norm), c) for c in classes)):
            raise refuse(name, f"{attr} of type {_path(norm)}", f"the adapter was verified with {' or '.join(classes)}")
        if type(norm).__module__.startswith("torch.nn"):
            if "forward" in vars(norm):
                raise refuse(name, f"{attr} with a patched forward")
        else:
            require_stock_forward(f"{name}.{attr}" if name else attr, norm)
        if getattr(norm, "weight", None) is None:
            raise refuse(name, f"{attr} without a learnable gain", "no continuous Q/K gauge is left; gaugeopt needs the gains")
    if site.qk_norm.q_gain is None or site.qk_norm.k_gain is None:
        raise refuse(name, "Q/K norms whose gains are not one tensor each")
    eps = {float(getattr(getattr(m, attr), e)) for attr in attrs for e in ("eps", "variance_epsilon")
           if hasattr(getattr(m, attr), e)}
    if len(eps) > 1:
        raise refuse(name, f"different epsilons on q_norm and k_norm {sorted(eps)}")
    return site


def _hf_norm(family: str, cls: str) -> tuple[str, ...]:
    return (f"transformers.models.{family}.modeling_{family}.{cls}",)


def _hf(site: AttentionSite, family: str, cls: str) -> AttentionSite:
    site = _checked_norms(site, _hf_norm(family, cls))
    if not site.float32_steps:  # Hugging Face RMSNorms upcast to float32 whatever the model's dtype
        site.float32_steps = "the Q/K RMSNorm in float32"
    return site

__all__ = ["hf_qwen3", "hf_olmo2", "hf_gemma3", "hf_phi", "hf_cohere", "hf_stablelm", "timm", "litgpt", "torchtitan"]


def hf_qwen3(site: AttentionSite) -> AttentionSite:
    """HF Qwen3 (``q_norm``/``k_norm``: ``Qwen3RMSNorm(head_dim)``, one gain for all heads): supported."""
    return _hf(site, "qwen3", "Qwen3RMSNorm")


def hf_olmo2(site: AttentionSite) -> AttentionSite:
    """HF OLMo 2 (``q_norm``/``k_norm`` over the full projection width, a gain per head channel): supported."""
    return _hf(site, "olmo2", "Olmo2RMSNorm")


def hf_gemma3(site: AttentionSite) -> AttentionSite:
    """HF Gemma 3 (``q_norm``/``k_norm``, gain ``1 + w``): supported."""
    return _hf(site, "gemma3", "Gemma3RMSNorm")


def hf_phi(site: AttentionSite) -> AttentionSite:
    """HF Phi with ``qk_layernorm=True`` (``nn.LayerNorm(head_dim)`` with bias, shared by all heads, then
    partial RoPE): supported — the gain gauge per RoPE plane with the biases travelling."""
    return _checked_norms(site, ("torch.nn.modules.normalization.LayerNorm",), ("q_layernorm", "k_layernorm"))


def hf_cohere(site: AttentionSite) -> AttentionSite:
    """HF Cohere with ``use_qk_norm=True`` (``CohereLayerNorm((heads, head_dim))``: centred, no bias, one
    gain vector per head, in float32, before RoPE): supported — the gain gauge per KV group and plane."""
    site = _checked_norms(site, _hf_norm("cohere", "CohereLayerNorm"))
    site.float32_steps = "; ".join(x for x in (site.float32_steps, "the Q/K LayerNorm in float32") if x)
    return site


def hf_stablelm(site: AttentionSite) -> AttentionSite:
    """HF StableLM with ``qk_layernorm=True``: refused. Each head has its own ``nn.LayerNorm`` module, so
    the per-head gains are ``h`` separate parameters; gaugeopt's records address one tensor per side
    (the group itself is Cohere's, which is supported)."""
    return refuse_qk_norm(site, "StableLM qk_layernorm=True, one LayerNorm module per head: its gains are separate "
                                "parameters, and gaugeopt's QK-norm record needs one gain tensor per side")


def timm(site: AttentionSite) -> AttentionSite:
    """timm ``Attention(qk_norm=True)`` with LayerNorm norms (the default ``norm_layer``): supported;
    other norm layers are refused."""
    if site.qk_norm.kind != "layer":
        return refuse_qk_norm(site, f"timm qk_norm=True with {_path(site.module.q_norm)}")
    return _checked_norms(site, _TIMM_LAYER_NORMS)


def litgpt(site: AttentionSite) -> AttentionSite:
    """litgpt ``norm_qk=True``: refused (a config with ``norm_qk=False``)."""
    return refuse_qk_norm(site, "litgpt norm_qk=True")


_TORCHTITAN_RMSNORM = "torchtitan.models.common.nn_modules.RMSNorm"


def torchtitan(site: AttentionSite) -> AttentionSite:
    """torchtitan ``qk_norm`` (its ``RMSNorm``, an ``nn.RMSNorm`` over ``head_dim`` shared by all heads, before
    RoPE — Qwen3's layout): supported. Its forward is ``nn.RMSNorm``'s, inherited."""
    m, name = site.module, site.name
    for attr in ("q_norm", "k_norm"):
        norm = getattr(m, attr)
        if _path(norm) != _TORCHTITAN_RMSNORM or "forward" in vars(norm) or type(norm).forward is not nn.RMSNorm.forward:
            raise refuse(name, f"{attr} of type {_path(norm)} (or with a replaced forward)",
                         f"the adapter was verified with {_TORCHTITAN_RMSNORM} and nn.RMSNorm's forward")
        if norm.weight is None:
            raise refuse(name, f"{attr} without a learnable gain", "no continuous Q/K gauge is left; gaugeopt needs the gains")
        if norm.eps is None:
            raise refuse(name, f"{attr} with eps=None (the dtype's machine epsilon)",
                         "set RMSNorm.Config(eps=...) so that the record's epsilon is the one the norm uses")
    if m.q_norm.eps != m.k_norm.eps:
        raise refuse(name, f"different epsilons on q_norm and k_norm {(m.q_norm.eps, m.k_norm.eps)}")
    return site
