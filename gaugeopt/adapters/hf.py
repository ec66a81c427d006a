"""Adapters for Hugging Face ``transformers`` attention classes (never imports transformers).

Every class is matched by its import path and written as a :class:`gaugeopt.AttentionSpec`:

=====================  ==========================================  ===========================================
class                  layout                                      position encoding, other
=====================  ==========================================  ===========================================
``GPT2Attention``      ``Conv1D`` (in×out), fused ``[Q|K|V]``      learned; cross-attention (``q_attn``) refused
``LlamaAttention``,    separate ``q/k/v/o_proj``, GQA, biases      RoPE split-half, whole head (partial refused)
``MistralAttention``,
``Qwen2Attention``,
``MixtralAttention``,
``GemmaAttention``,
``Gemma2Attention``,
``OlmoAttention``
``PhiAttention``       ``q/k/v_proj``, O = ``dense``               RoPE split-half on ``rotary_ndims``
``Phi3Attention``      fused ``qkv_proj`` ``[Q|K|V]``, GQA         RoPE split-half, partial
``StableLmAttention``  separate, GQA                               RoPE split-half on ``rotary_ndims``
``FalconAttention``    ``FalconLinear``; ``[Q|K|V]`` (multi-query),  RoPE split-half or ALiBi
                       ``[q_i,k_i,v_i]`` (old MHA), grouped (new)
``GPTNeoXAttention``   fused ``[q_i, k_i, v_i]``, O = ``dense``    RoPE split-half on ``rotary_ndims``
``GPTJAttention``      separate, no bias                           RoPE interleaved on ``rotary_dim``
``OPTAttention``       separate, biases                            learned
``BloomAttention``     fused ``[q_i, k_i, v_i]``, O = ``dense``    ALiBi (additive); adds the residual itself
``GPTBigCodeAttention`` fused ``[Q|K|V]`` (MQA) or ``[q_i,k_i,v_i]``  learned; cross-attention refused
``BertAttention``      ``self.query/key/value``, ``output.dense``  learned; the site includes the output LayerNorm
``ViTAttention``       separate ``q/k/v/o_proj``                   learned
``T5Attention``        ``q, k, v, o``, ``d_kv`` free               relative bias (additive); self and cross
``BartAttention``      ``q/k/v/out_proj``                          learned; self and cross
=====================  ==========================================  ===========================================

Position biases (ALiBi, T5's relative bias), sliding windows, logit soft-capping
(``attn_logit_softcapping``) and score scales (``query_pre_attn_scalar``) act on the scores after
the Q/K gauge has cancelled: they keep the gauge. Cross-attention reads K and V from another
stream; the Q/K and V/O gauges still hold.

Hugging Face picks the attention kernel at every forward from ``config._attn_implementation``;
``eager`` and ``sdpa`` are verified, anything else (flash, flex, a registered custom function) is
refused until it is, and so is a function registered in place of the stock ``sdpa`` (or under
``eager``) in transformers' ``AttentionInterface`` (:func:`kernel_check`). OLMo's ``clip_qkv`` clamps
the projections and breaks the gauge: refused while set. The Q/K-normalised families (Qwen3, OLMo 2,
Gemma 3, Phi and StableLM with ``qk_layernorm``) have their :class:`~gaugeopt.records.site.QKNorm`
recorded; the family's function in :mod:`gaugeopt.adapters.qk_norm` supports it (the gain
gauge) or refuses it (StableLM's norm modules per head). The 2025–26 families are in
:mod:`gaugeopt.adapters.hf_recent`.

Example:
    >>> import transformers, gaugeopt
    >>> cfg = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                                  num_attention_heads=4, rotary_pct=0.5)
    >>> s = gaugeopt.find_attention(transformers.GPTNeoXForCausalLM(cfg))[0]
    >>> (s.kind, s.h, s.d_k, s.rope.kind, s.rope.rotary_dim, s.q.weight.groups, s.verified)
    ('hf_gpt_neox', 4, 8, 'split_half', 4, 4, True)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.adapters import qk_norm as qkn
from gaugeopt.adapters.common import refuse, require_stock_forward
from gaugeopt.records.rope import NO_ROPE, RopeSpec
from gaugeopt.records.site import AttentionSite
from gaugeopt.adapters.spec import AttentionSpec, QKNormSpec

__all__ = ["HF_ADAPTERS", "HF_SPECS", "HF_WRAPPERS", "VERIFIED_IMPLEMENTATIONS", "adapt_hf_gpt2", "implementation_refusal"]

# Attention kernels measured exact (float64, every family): the others are refused until they are.
VERIFIED_IMPLEMENTATIONS = (None, "eager", "sdpa")


def _path(family: str, cls: str, module: str | None = None) -> str:
    return f"transformers.models.{family}.modeling_{module or family}.{cls}"


def implementation_refusal(module: nn.Module, config_attr: str = "config") -> str | None:
    """Refuse an attention kernel that was not verified (HF reads it at every forward)."""
    cfg = getattr(module, config_attr, None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl in VERIFIED_IMPLEMENTATIONS:
        return None
    return (
        f"config._attn_implementation={impl!r} selects an attention kernel gaugeopt has not verified (verified: "
        "'eager', 'sdpa'); load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"
    )


def _rotary_dims(root: nn.Module, name: str, family: str) -> set[int]:
    dims = {
        2 * buf.numel()
        for mod in root.modules()
        if type(mod).__name__.endswith("RotaryEmbedding")
        for bname, buf in mod.named_buffers(recurse=False)
        if bname.endswith("inv_freq")  # inv_freq, or one per layer type (Gemma 3: sliding_attention_inv_freq)
    }
    if not dims:
        raise GaugeError(
            f"{name}: {family} attention takes its RoPE angles from the model's rotary embedding, and none was "
            "found under the module passed to find_attention; pass the whole model"
        )
    if len(dims) > 1:
        raise refuse(name, f"several rotary embeddings of different widths {sorted(dims)}")
    return dims


def rotary_from_root(root: nn.Module, name: str, family: str, head_dim: int, *, partial: bool,
                     kind: str = "split_half") -> RopeSpec:
    """RoPE (``kind``: split-half or interleaved pairs) whose width is read from the model's
    ``<Family>RotaryEmbedding``."""
    (dim,) = _rotary_dims(root, name, family)
    if dim > head_dim or (dim != head_dim and not partial):
        raise refuse(name, f"partial rotary (rotary width {dim} < head_dim {head_dim})",
                     f"{family}'s apply_rotary_pos_emb rotates whole heads")
    return RopeSpec(kind, dim)


def _with_root_rope(spec: AttentionSpec, *, partial: bool, kind: str = "split_half", uses_rope=None):
    """An adapter that reads the rotary width from the model's rotary embedding, then builds ``spec``;
    ``uses_rope(module) -> bool`` marks layers that skip RoPE (NoPE layers: no rotation at all)."""
    def adapt(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
        require_stock_forward(name, m)
        if uses_rope is not None and not uses_rope(m):
            return dataclasses.replace(spec, rope=NO_ROPE).build(m, name, root)
        family = type(m).__name__.replace("Attention", "")
        head_dim = getattr(m, "head_dim", None) or m.head_size
        rope = rotary_from_root(root, name, family, head_dim, partial=partial, kind=kind)
        return dataclasses.replace(spec, rope=rope).build(m, name, root)

    adapt.spec = spec  # type: ignore[attr-defined]
    return adapt


# ---------------------------------------------------------------------- GPT-2
def _gpt2_refusal(m: nn.Module) -> str | None:
    if getattr(m, "is_cross_attention", False) or hasattr(m, "q_attn"):
        return ("GPT-2 cross-attention (q_attn reads another sequence, c_attn holds only [K|V]) is not handled; "
                "only self-attention layers are supported")
    return implementation_refusal(m)


GPT2_SPEC = AttentionSpec(
    qkv="c_attn", o="c_proj", num_heads="num_heads", head_dim="head_dim", kind="hf_gpt2", refuse=_gpt2_refusal,
    float32_steps=lambda m: "attention scores in float32 (reorder_and_upcast_attn)"
    if m.reorder_and_upcast_attn and m.config._attn_implementation in (None, "eager") else "",
)


def adapt_hf_gpt2(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    site = GPT2_SPEC.build(m, name, root)
    site.features = site.features + ("conv1d_layout",)
    return site


# ---------------------------------------------------------------------- Llama-like
def _llama_like(kind: str, refuse_fn=implementation_refusal, qk=None, on_qk=None) -> AttentionSpec:
    return AttentionSpec(
        q="q_proj", k="k_proj", v="v_proj", o="o_proj", num_heads="config.num_attention_heads",
        num_kv_heads="config.num_key_value_heads", head_dim="head_dim", kind=kind, refuse=refuse_fn,
        qk_norm=qk, on_qk_norm=on_qk,
    )


def _olmo_refusal(m: nn.Module) -> str | None:
    clip = getattr(m.config, "clip_qkv", None)
    if clip is not None:
        return (
            f"clip_qkv={clip} clamps the q, k and v projection outputs to [-{clip}, {clip}] before the heads are split: "
            "a clamp does not commute with GL(d_k) or GL(d_v) (only sign flips and signed permutations of channels "
            "survive), so the attention gauge group changes; build the model with clip_qkv=None"
        )
    return implementation_refusal(m)


# ---------------------------------------------------------------------- Phi, Phi3, StableLM, NeoX, GPT-J
def _partial(kind: str):
    return lambda m: RopeSpec(kind, m.rotary_ndims)


def _gptj_refusal(m: nn.Module) -> str | None:
    if m.rotary_dim is None:
        return ("rotary_dim=None: GPT-J then sizes its sin/cos table by n_embd, not head_dim, which gaugeopt has not "
                "verified; set rotary_dim in the config")
    return implementation_refusal(m)


def _gptj_float32(m: nn.Module) -> str:
    return "q·kᵀ in float32 (GPT-J's eager attention)" if m.config._attn_implementation in (None, "eager") else ""


ALIBI = "ALiBi adds a different fixed slope to each head's scores"
T5_BIAS = "T5's relative position bias, computed in each stack's first layer and shared by all, differs per head"


# ---------------------------------------------------------------------- Falcon
FALCON_LINEAR = _path("falcon", "FalconLinear")


def _falcon_kv(m: nn.Module) -> int:
    if m.new_decoder_architecture:
        return m.num_kv_heads
    return 1 if m.multi_query else m.num_heads


def _falcon_spec(layout: str) -> AttentionSpec:
    return AttentionSpec(
        qkv="query_key_value", fused=layout, o="dense", num_heads="num_heads", num_kv_heads=_falcon_kv,
        head_dim="head_dim", linear_types=(FALCON_LINEAR,), kind="hf_falcon", refuse=implementation_refusal,
    )


def _falcon_uses_alibi(root: nn.Module, name: str) -> bool:
    """What the forward does: FalconModel passes ALiBi biases iff its ``use_alibi`` (set from
    ``config.alibi`` at construction; a later edit of the config changes nothing)."""
    owners = [m for m in root.modules() if type(m).__name__ == "FalconModel" and hasattr(m, "use_alibi")]
    if len(owners) != 1:
        raise GaugeError(
            f"{name}: Falcon attention takes ALiBi or RoPE from its FalconModel, and {len(owners)} were found under the "
            "module passed to find_attention; pass the whole model"
        )
    return bool(owners[0].use_alibi)


def adapt_hf_falcon(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    layout = "grouped" if m.new_decoder_architecture else ("concat" if m.multi_query else "per_head")
    alibi = _falcon_uses_alibi(root, name)
    spec = dataclasses.replace(_falcon_spec(layout), fixed_head_order=ALIBI if alibi else "")
    if alibi:
        return spec.build(m, name, root)
    require_stock_forward(name, m)
    rope = rotary_from_root(root, name, "Falcon", m.head_dim, partial=False)
    return dataclasses.replace(spec, rope=rope).build(m, name, root)


# ---------------------------------------------------------------------- GPTBigCode, BERT
def _bigcode_refusal(m: nn.Module) -> str | None:
    if m.is_cross_attention:
        return ("GPTBigCode cross-attention splits c_attn(encoder states) into (head_dim, head_dim) although c_attn has "
                "2·embed_dim outputs; gaugeopt does not vouch for it")
    return implementation_refusal(m)


def adapt_hf_bigcode(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    spec = AttentionSpec(qkv="c_attn", fused="concat" if m.multi_query else "per_head", o="c_proj", num_heads="num_heads",
                         num_kv_heads="kv_heads", head_dim="head_dim", kind="hf_gpt_bigcode", refuse=_bigcode_refusal)
    return spec.build(m, name, root)


def _bert_refusal(m: nn.Module) -> str | None:
    for part in ("self", "output"):
        require_stock_forward(f"{type(m).__qualname__}.{part}", getattr(m, part))
    return implementation_refusal(m.self)


# ---------------------------------------------------------------------- the table
HF_SPECS: dict[str, AttentionSpec] = {
    _path("llama", "LlamaAttention"): _llama_like("hf_llama"),
    _path("mistral", "MistralAttention"): _llama_like("hf_mistral"),
    _path("qwen2", "Qwen2Attention"): _llama_like("hf_qwen2"),
    _path("mixtral", "MixtralAttention"): _llama_like("hf_mixtral"),
    _path("gemma", "GemmaAttention"): _llama_like("hf_gemma"),
    _path("gemma2", "Gemma2Attention"): _llama_like("hf_gemma2"),
    _path("olmo", "OlmoAttention"): _llama_like("hf_olmo", _olmo_refusal),
    # Q/K-normalised: recognised, recorded, refused (gaugeopt.adapters.qk_norm)
    _path("qwen3", "Qwen3Attention"): _llama_like(
        "hf_qwen3", qk=QKNormSpec("rms", "q_norm", "k_norm", eps="q_norm.variance_epsilon"), on_qk=qkn.hf_qwen3),
    _path("olmo2", "Olmo2Attention"): _llama_like(
        "hf_olmo2", qk=QKNormSpec("rms", "q_norm", "k_norm", eps="q_norm.variance_epsilon", scope="full"), on_qk=qkn.hf_olmo2),
    _path("gemma3", "Gemma3Attention"): _llama_like(
        "hf_gemma3", qk=QKNormSpec("rms", "q_norm", "k_norm", eps="q_norm.eps", gain_offset=1.0), on_qk=qkn.hf_gemma3),
    _path("phi", "PhiAttention"): AttentionSpec(
        q="q_proj", k="k_proj", v="v_proj", o="dense", num_heads="config.num_attention_heads",
        num_kv_heads="config.num_key_value_heads", head_dim="head_dim", rope=_partial("split_half"), kind="hf_phi",
        refuse=implementation_refusal, on_qk_norm=qkn.hf_phi,
        qk_norm=lambda m: QKNormSpec("layer", "q_layernorm", "k_layernorm", eps="q_layernorm.eps") if m.qk_layernorm else None),
    _path("stablelm", "StableLmAttention"): AttentionSpec(
        q="q_proj", k="k_proj", v="v_proj", o="o_proj", num_heads="num_heads", num_kv_heads="num_key_value_heads",
        head_dim="head_dim", rope=_partial("split_half"), kind="hf_stablelm", refuse=implementation_refusal,
        on_qk_norm=qkn.hf_stablelm,
        qk_norm=lambda m: QKNormSpec("layer", None, None, eps="q_layernorm.norms.0.eps") if m.qk_layernorm else None),
    _path("gpt_neox", "GPTNeoXAttention"): AttentionSpec(  # rotary width: the model's rotary embedding (_ROOT_ROPE)
        qkv="query_key_value", fused="per_head", o="dense", num_heads="config.num_attention_heads", head_dim="head_size",
        kind="hf_gpt_neox", refuse=implementation_refusal),
    _path("gptj", "GPTJAttention"): AttentionSpec(
        q="q_proj", k="k_proj", v="v_proj", o="out_proj", num_heads="num_attention_heads", head_dim="head_dim",
        rope=lambda m: RopeSpec("interleaved", m.rotary_dim), kind="hf_gptj", refuse=_gptj_refusal,
        float32_steps=_gptj_float32),
    _path("opt", "OPTAttention"): AttentionSpec(
        q="q_proj", k="k_proj", v="v_proj", o="out_proj", num_heads="num_heads", head_dim="head_dim", kind="hf_opt",
        refuse=implementation_refusal),
    _path("bloom", "BloomAttention"): AttentionSpec(
        qkv="query_key_value", fused="per_head", o="dense", num_heads="num_heads", head_dim="head_dim", kind="hf_bloom",
        fixed_head_order=ALIBI, float32_steps="the softmax in float32 (BloomAttention)"),
    _path("bert", "BertAttention"): AttentionSpec(
        q="self.query", k="self.key", v="self.value", o="output.dense", num_heads="self.num_attention_heads",
        head_dim="self.attention_head_size", kind="hf_bert", refuse=_bert_refusal),
    _path("vit", "ViTAttention"): AttentionSpec(
        q="q_proj", k="k_proj", v="v_proj", o="o_proj", num_heads="num_attention_heads", head_dim="head_dim",
        kind="hf_vit", refuse=implementation_refusal),
    _path("t5", "T5Attention"): AttentionSpec(
        q="q", k="k", v="v", o="o", num_heads="n_heads", head_dim="key_value_proj_dim", kind="hf_t5",
        refuse=implementation_refusal, fixed_head_order=T5_BIAS),
    _path("bart", "BartAttention"): AttentionSpec(
        q="q_proj", k="k_proj", v="v_proj", o="out_proj", num_heads="num_heads", head_dim="head_dim", kind="hf_bart",
        refuse=implementation_refusal),
}

# Families whose rotary width is read from the model's rotary embedding (whole head unless partial).
_ROOT_ROPE = {
    "llama": False, "mistral": False, "qwen2": False, "mixtral": False, "gemma": False, "gemma2": False,
    "olmo": False, "qwen3": False, "olmo2": False, "gemma3": False,
    # GPT-NeoX's forward rotates cos.shape[-1] channels, the width of the model's rotary embedding;
    # the attention's own rotary_ndims attribute is never read by it
    "gpt_neox": True,
}

# The stock function behind each verified kernel name (transformers' AttentionInterface registry).
_STOCK_KERNELS = {"sdpa": ("transformers.integrations.sdpa_attention", "sdpa_attention_forward")}


def kernel_check(site: AttentionSite) -> AttentionSite:
    """Refuse a kernel registered in place of the stock one, and bind the kernel the record was checked with.

    Hugging Face looks the kernel up at every forward: ``ALL_ATTENTION_FUNCTIONS.get_interface(
    config._attn_implementation, eager_attention_forward)``. ``AttentionInterface.register("sdpa", fn)``
    swaps the function behind a verified name for every model; registering ``"eager"`` overrides the
    module's own eager function. The record keeps :class:`~gaugeopt.adapters.stock.Binding` s of the
    implementation name and of both registry entries, which the gate re-checks before every use.
    """
    import sys

    from gaugeopt.adapters.stock import MISSING as _MISSING, Binding, global_problem as _global_problem

    bindings = []
    for _, m in site.module.named_modules():
        fwd = getattr(type(m), "forward", None)
        while hasattr(fwd, "__wrapped__"):  # a decorated forward: the module's globals are the innermost's
            fwd = fwd.__wrapped__
        registry = getattr(fwd, "__globals__", {}).get("ALL_ATTENTION_FUNCTIONS")
        cfg = getattr(m, "config", None)
        if registry is None or cfg is None or not hasattr(registry, "_global_mapping"):
            continue
        impl = getattr(cfg, "_attn_implementation", None)
        bindings.append(Binding(cfg, "_attn_implementation", impl, attribute=True))
        glob, local = type(registry)._global_mapping, registry._local_mapping
        for mapping in (glob, local):
            bindings.append(Binding(mapping, impl, mapping.get(impl, _MISSING) if impl is not None else _MISSING))
        if impl in (None, "eager"):
            eager = fwd.__globals__.get("eager_attention_forward")
            if not site.float32_steps and _softmax_in_float32(eager):
                site.float32_steps = "the softmax in float32 (eager attention)"
            if impl is not None and (impl in glob or impl in local):
                raise GaugeError(
                    f"{site.name}: a kernel is registered under the name 'eager', which replaces the module's own eager "
                    "attention and may compute something else; unregister it (docs/trust.md)"
                )
            continue
        module_name, fn_name = _STOCK_KERNELS.get(impl, (None, None))
        fn = local.get(impl, glob.get(impl))
        problem = None
        if module_name is None:
            problem = f"kernel {impl!r} is not one gaugeopt has verified"
        elif module_name not in sys.modules or getattr(sys.modules[module_name], fn_name, None) is not fn:
            problem = f"the function registered as {impl!r} is {getattr(fn, '__qualname__', fn)!r}, not {module_name}.{fn_name}"
        else:
            problem = _global_problem(fn, fn_name, module_name, f"the {impl!r} kernel")
        if problem:
            raise GaugeError(
                f"{site.name}: {problem}; a replaced attention kernel may compute something else. Unregister it "
                "(transformers' AttentionInterface), or load the model with attn_implementation='sdpa' (docs/trust.md)"
            )
    site.adapter_bindings = tuple(site.adapter_bindings) + tuple(bindings)
    return site


@functools.lru_cache(maxsize=256)
def _softmax_in_float32(fn) -> bool:
    """Whether an eager attention function computes its softmax in float32 whatever the input dtype (most
    Hugging Face families' ``eager_attention_forward``): the weights then sum to one only to float32
    rounding, which a float64 proof of the sectors through the softmax sees at ~1e-8."""
    if fn is None:
        return False
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return "softmax" in source and "dtype=torch.float32" in source


def _checking_kernels(adapter):
    def adapt(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
        return kernel_check(adapter(root, name, m))

    adapt.spec = getattr(adapter, "spec", None)  # type: ignore[attr-defined]
    return adapt


HF_ADAPTERS = {}
for _key, _spec in HF_SPECS.items():
    _family = _key.split(".")[2]
    HF_ADAPTERS[_key] = _with_root_rope(_spec, partial=_ROOT_ROPE[_family]) if _family in _ROOT_ROPE else _spec.adapter()
HF_ADAPTERS[_path("gpt2", "GPT2Attention")] = adapt_hf_gpt2
HF_ADAPTERS[_path("phi3", "Phi3Attention")] = _with_root_rope(AttentionSpec(
    qkv="qkv_proj", o="o_proj", num_heads="config.num_attention_heads", num_kv_heads="num_key_value_heads",
    head_dim="head_dim", kind="hf_phi3", refuse=implementation_refusal), partial=True)
HF_ADAPTERS[_path("falcon", "FalconAttention")] = adapt_hf_falcon
HF_ADAPTERS[_path("gpt_bigcode", "GPTBigCodeAttention")] = adapt_hf_bigcode
HF_ADAPTERS = {key: _checking_kernels(adapter) for key, adapter in HF_ADAPTERS.items()}

# Modules named like attention that only wrap one (their child is claimed).
HF_WRAPPERS = (_path("t5", "T5LayerSelfAttention"), _path("t5", "T5LayerCrossAttention"))
