"""Multi-head latent attention: Hugging Face DeepSeek-V2/V3, litgpt, torchtitan (never imports them).

Every MLA implementation computes the same layer (:mod:`gaugeopt.records.latent`, docs/mla.md)
from the same five linears; only the names, the RoPE layout and the norms differ:

=======================  ===========================================  ===============================================
class                    query / key–value / output                   RoPE of the shared key, norms, other
=======================  ===========================================  ===============================================
HF ``DeepseekV3Attention``  ``q_proj`` or ``q_a_proj``, ``q_a_layernorm``,  interleaved (``rope_interleave=True``, the
                         ``q_b_proj``; ``kv_a_proj_with_mqa``,          default) or split-half; ``DeepseekV3RMSNorm``
                         ``kv_a_layernorm``, ``kv_b_proj``; ``o_proj``   normalises in float32
HF ``DeepseekV2Attention``  the same names                              interleaved (a complex rotation in float32);
                                                                        ``DeepseekV2RMSNorm`` in float32
litgpt                   ``q_a_proj``, ``q_a_norm``, ``q_b_proj``;       interleaved (``rope_interleave``) or
``MultiheadLatentAttention``  ``kv_a_proj_with_mqa``, ``kv_a_norm``,      split-half; litgpt's ``RMSNorm`` in float32;
                         ``kv_b_proj``; ``proj`` (biases: ``bias``,      biases on the up-projections and ``proj``
                         ``attn_bias``)
torchtitan DeepSeek-V3   ``wq`` or ``wq_a``, ``q_norm``, ``wq_b``;       ``ComplexRoPE`` (interleaved) or ``CosSinRoPE``
``Attention``            ``wkv_a``, ``kv_norm``, ``wkv_b``; ``wo``      (split-half), rotated in float32; inner
                                                                        attention ``ScaledDotProductAttention`` only
=======================  ===========================================  ===============================================

The record is the no-RoPE part (``d_k = qk_nope_head_dim``, no RoPE, one key and value per head)
with a :class:`~gaugeopt.records.latent.LatentAttention`. Refused, with the reason: Hugging Face
attention kernels other than ``eager``/``sdpa``; ``num_key_value_heads ≠ num_attention_heads`` in
Hugging Face (its ``kv_b_proj`` already makes one key per head and ``repeat_kv`` would repeat them
again); ``qk_nope_head_dim = 0``; learnable multipliers (``gaugeopt.apply_lrm`` on these
projections); a norm or rotary embedding of another class, a patched ``forward``.

Example:
    >>> from gaugeopt.adapters.mla import MLA_ADAPTERS
    >>> sorted(MLA_ADAPTERS)[0]
    'litgpt.model.MultiheadLatentAttention'
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.adapters.common import refuse, require_stock_forward
from gaugeopt.records.latent import LatentAttention, LatentNorm
from gaugeopt.records.linears import linear_like, projection_refs
from gaugeopt.models.lrm import LRMLinear
from gaugeopt.records.rope import RopeSpec
from gaugeopt.records.site import AttentionSite, TensorRef

__all__ = ["MLA_ADAPTERS", "build_mla_site", "adapt_hf_deepseek", "adapt_litgpt_mla", "adapt_torchtitan_mla"]

HF_V2 = "transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention"
HF_V3 = "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention"
LITGPT_MLA = "litgpt.model.MultiheadLatentAttention"
TORCHTITAN_MLA = "torchtitan.models.deepseek_v3.model.Attention"
_TT_LINEAR = "torchtitan.models.common.linear.Linear"


def _path(module: nn.Module | None) -> str:
    return "None" if module is None else f"{type(module).__module__}.{type(module).__qualname__}"


def _qualify(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _norm(name: str, owner: nn.Module, attr: str, classes: Sequence[str]) -> tuple[nn.Module, float, float]:
    """``(norm, eps, gain_offset)`` of a latent RMSNorm, once its class and ``forward`` are the verified ones."""
    norm = getattr(owner, attr, None)
    if _path(norm) not in classes:
        raise refuse(name, f"{attr} of type {_path(norm)}", f"the adapter was verified with {' or '.join(classes)}")
    fwd_module = getattr(type(norm).forward, "__module__", None) or ""
    if "forward" in vars(norm) or not (fwd_module == type(norm).__module__ or fwd_module.startswith("torch.nn.")):
        raise refuse(name, f"{attr} with a patched forward", "gaugeopt cannot vouch for its normalisation")
    if getattr(norm, "weight", None) is None:
        raise refuse(name, f"{attr} without a learnable gain")
    eps = next((getattr(norm, e) for e in ("variance_epsilon", "eps") if getattr(norm, e, None) is not None), None)
    if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
        eps = 0.0
    if getattr(norm, "dim", -1) != -1:
        raise refuse(name, f"{attr} normalising over dim={norm.dim}")
    return norm, float(eps), 1.0 if getattr(norm, "add_unit_offset", False) else 0.0


def build_mla_site(
    module: nn.Module,
    name: str,
    *,
    h: int,
    h_kv: int,
    n: int,
    r: int,
    d_v: int,
    q: str | None,
    q_a: str | None,
    q_norm: str | None,
    q_b: str | None,
    kv_a: str,
    kv_norm: str,
    kv_b: str,
    o: str,
    rope_kind: str,
    kind: str,
    norm_classes: Sequence[str],
    linear_types: Sequence[str] = (),
    float32_steps: str = "",
) -> AttentionSite:
    """The :class:`~gaugeopt.AttentionSite` of one MLA module (attribute names relative to it; ``q`` for a
    plain query projection, or ``q_a``/``q_norm``/``q_b`` for a query latent)."""
    if n <= 0:
        raise refuse(name, "qk_nope_head_dim=0 (no part without RoPE)", "gaugeopt's MLA record needs both parts")
    if r <= 0 or r % 2:
        raise refuse(name, f"qk_rope_head_dim={r}", "RoPE needs an even, positive width")
    mods = {}
    for role, attr in (("q", q), ("q_a", q_a), ("q_b", q_b), ("kv_a", kv_a), ("kv_b", kv_b), ("o", o)):
        if attr is None:
            continue
        m = getattr(module, attr)
        if type(m) is LRMLinear:
            raise GaugeError(
                f"{name}: {attr} carries learnable multipliers (gaugeopt.apply_lrm); gaugeopt does not support them on "
                "multi-head latent attention (the up-projections interleave the heads' rows and their column multipliers "
                "would duplicate the latent norms' gains). Convert the model without these projections "
                "(apply_lrm(model, include=...))"
            )
        _, out, inp = linear_like(m, linear_types)
        mods[role] = (m, _qualify(name, attr), out, inp)
    _, qname, q_out, m_q = mods["q_b"] if q is None else mods["q"]
    qmod = mods["q_b" if q is None else "q"][0]
    if q_out != h * (n + r):
        raise GaugeError(f"{qname}: {q_out} output rows, expected {h} heads × ({n} + {r})")
    kv_amod, kv_aname, kv_a_out, d = mods["kv_a"]
    L_kv = kv_a_out - r
    kv_bmod, kv_bname, kv_b_out, kv_b_in = mods["kv_b"]
    if kv_b_in != L_kv or kv_b_out != h_kv * (n + d_v):
        raise GaugeError(f"{kv_bname}: {kv_b_in}→{kv_b_out}, expected {L_kv}→{h_kv}×({n} + {d_v})")
    omod, oname, d_out, o_in = mods["o"]
    if o_in != h * d_v:
        raise GaugeError(f"{oname}: {o_in} input columns, expected {h} heads × {d_v}")
    acc = tuple(linear_types)
    q_refs = projection_refs(qmod, qname, rows=slice(0, n), split=0, canon="in", heads=h, width=n, d_model=m_q,
                             groups=h, accept=acc)
    q_rope = projection_refs(qmod, qname, rows=slice(n, n + r), split=0, canon="in", heads=h, width=r, d_model=m_q,
                             groups=h, accept=acc)
    k_refs = projection_refs(kv_bmod, kv_bname, rows=slice(0, n), split=0, canon="in", heads=h_kv, width=n,
                             d_model=L_kv, groups=h_kv, accept=acc)
    v_refs = projection_refs(kv_bmod, kv_bname, rows=slice(n, n + d_v), split=0, canon="in", heads=h_kv, width=d_v,
                             d_model=L_kv, groups=h_kv, accept=acc)
    k_rope = projection_refs(kv_amod, kv_aname, rows=slice(L_kv, L_kv + r), split=0, canon="in", heads=1, width=r,
                             d_model=d, accept=acc)
    o_refs = projection_refs(omod, oname, rows=None, split=0, canon="out", heads=h, width=d_v, d_model=d_out, accept=acc)

    def latent(lname: str, down: nn.Module, down_name: str, rows: slice | None, width: int, norm_attr: str,
               up: nn.Module, up_name: str) -> LatentNorm:
        norm, eps, offset = _norm(name, module, norm_attr, norm_classes)
        if norm.weight.numel() != width:
            raise GaugeError(f"{_qualify(name, norm_attr)}: a gain of {norm.weight.numel()} entries for a latent of {width}")
        bias = None
        if getattr(down, "bias", None) is not None:
            bias = TensorRef(down, "bias", _qualify(down_name, "bias"), (width,), False, rows)
        return LatentNorm(
            lname, TensorRef(down, "weight", _qualify(down_name, "weight"), (width, d), False, rows), bias,
            TensorRef(norm, "weight", _qualify(name, norm_attr, "weight"), (width,)),
            TensorRef(up, "weight", _qualify(up_name, "weight"), tuple(up.weight.shape)), eps, offset,
        )

    kv_latent = latent("kv", kv_amod, kv_aname, slice(0, L_kv), L_kv, kv_norm, kv_bmod, kv_bname)
    q_latent = None
    if q is None:
        q_amod, q_aname, L_q, _ = mods["q_a"]
        if m_q != L_q:
            raise GaugeError(f"{qname}: reads {m_q} channels, {q_aname} makes {L_q}")
        q_latent = latent("q", q_amod, q_aname, None, L_q, q_norm, qmod, qname)
    lat = LatentAttention(q_rope.weight, q_rope.bias, k_rope.weight, k_rope.bias, RopeSpec(rope_kind, r),
                          kv_latent, q_latent)
    features = ("latent_attention", f"latent_rope_{rope_kind}") + (("query_latent",) if q_latent is not None else ())
    return AttentionSite(
        name=name, module=module, h=h, h_kv=h_kv, d_k=n, d_v=d_v, d_model=d, q=q_refs, k=k_refs, v=v_refs, o=o_refs,
        kind=kind, features=features, float32_steps=float32_steps, latent=lat,
    )


# ---------------------------------------------------------------------- Hugging Face
def _rotary_width(root: nn.Module, name: str, family: str) -> int:
    dims = {2 * buf.numel() for mod in root.modules() if type(mod).__name__ == f"{family}RotaryEmbedding"
            for bname, buf in mod.named_buffers(recurse=False) if bname == "inv_freq"}
    if len(dims) != 1:
        raise GaugeError(f"{name}: {family} attention takes its RoPE angles from the model's {family}RotaryEmbedding; "
                         f"found {len(dims)} (pass the whole model to find_attention)")
    return dims.pop()


def adapt_hf_deepseek(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    """HF ``DeepseekV2Attention`` / ``DeepseekV3Attention`` (module docstring)."""
    from gaugeopt.adapters.hf import implementation_refusal

    require_stock_forward(name, m)
    v3 = type(m).__name__ == "DeepseekV3Attention"
    family = "DeepseekV3" if v3 else "DeepseekV2"
    cfg = m.config
    reason = implementation_refusal(m)
    if reason:
        raise GaugeError(f"{name}: {reason}")
    if m.num_key_value_groups != 1:
        raise refuse(name, f"num_key_value_heads={cfg.num_key_value_heads} ≠ num_attention_heads={m.num_heads}",
                     "kv_b_proj already makes one key and value per head and repeat_kv would repeat them again "
                     "(Hugging Face's forward then fails or mixes heads); build the config with "
                     "num_key_value_heads=num_attention_heads")
    r = m.qk_rope_head_dim
    width = _rotary_width(root, name, family)
    if width != r:
        raise refuse(name, f"a rotary embedding of width {width} for qk_rope_head_dim={r}")
    rope_kind = "interleaved" if (not v3 or cfg.rope_interleave) else "split_half"
    steps = [f"the latent RMSNorms in float32 ({family}RMSNorm casts to float32 and back)"]
    if not v3:
        steps.append("RoPE in float32 (a complex64 rotation)")
    if cfg._attn_implementation in (None, "eager"):
        steps.append("the softmax in float32 (eager attention)")
    latent_q = m.q_lora_rank is not None
    return build_mla_site(
        m, name, h=m.num_heads, h_kv=m.num_heads, n=m.qk_nope_head_dim, r=r, d_v=m.v_head_dim,
        q=None if latent_q else "q_proj", q_a="q_a_proj" if latent_q else None,
        q_norm="q_a_layernorm" if latent_q else None, q_b="q_b_proj" if latent_q else None,
        kv_a="kv_a_proj_with_mqa", kv_norm="kv_a_layernorm", kv_b="kv_b_proj", o="o_proj", rope_kind=rope_kind,
        kind="hf_deepseek_v3" if v3 else "hf_deepseek_v2",
        norm_classes=(f"transformers.models.deepseek_v{3 if v3 else 2}.modeling_deepseek_v{3 if v3 else 2}.{family}RMSNorm",),
        float32_steps="; ".join(steps),
    )


# ---------------------------------------------------------------------- litgpt
def adapt_litgpt_mla(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    """litgpt ``MultiheadLatentAttention`` (module docstring)."""
    require_stock_forward(name, m)
    cfg = m.config
    return build_mla_site(
        m, name, h=cfg.n_head, h_kv=cfg.n_query_groups, n=cfg.qk_nope_head_dim, r=cfg.qk_rope_head_dim,
        d_v=cfg.v_head_dim, q=None, q_a="q_a_proj", q_norm="q_a_norm", q_b="q_b_proj", kv_a="kv_a_proj_with_mqa",
        kv_norm="kv_a_norm", kv_b="kv_b_proj", o="proj",
        rope_kind="interleaved" if getattr(cfg, "rope_interleave", False) else "split_half", kind="litgpt_mla",
        norm_classes=("litgpt.model.RMSNorm",), float32_steps="the latent RMSNorms in float32 (litgpt's RMSNorm)",
    )


# ---------------------------------------------------------------------- torchtitan
_TT_ROPES = {"ComplexRoPE": "interleaved", "CosSinRoPE": "split_half"}


def adapt_torchtitan_mla(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    """torchtitan DeepSeek-V3 ``Attention`` (module docstring)."""
    require_stock_forward(name, m)
    inner = type(m.inner_attention).__name__
    if inner != "ScaledDotProductAttention":
        raise refuse(name, f"inner_attention {inner}", "gaugeopt has verified torchtitan's ScaledDotProductAttention only")
    rope = type(m.rope).__name__
    if rope not in _TT_ROPES:
        raise refuse(name, f"rope {rope}", "gaugeopt knows torchtitan's ComplexRoPE and CosSinRoPE")
    for child in (m.rope, m.inner_attention):
        fwd = getattr(type(child), "forward", None)
        if "forward" in vars(child) or not getattr(fwd, "__module__", "").startswith("torchtitan."):
            raise refuse(name, f"{type(child).__qualname__}.forward patched")
    if m.rope.config.dim != m.qk_rope_head_dim:
        raise refuse(name, f"a rotary embedding of width {m.rope.config.dim} for qk_rope_head_dim={m.qk_rope_head_dim}")
    latent_q = m.q_lora_rank != 0
    return build_mla_site(
        m, name, h=m.n_heads, h_kv=m.n_heads, n=m.qk_nope_head_dim, r=m.qk_rope_head_dim, d_v=m.v_head_dim,
        q=None if latent_q else "wq", q_a="wq_a" if latent_q else None, q_norm="q_norm" if latent_q else None,
        q_b="wq_b" if latent_q else None, kv_a="wkv_a", kv_norm="kv_norm", kv_b="wkv_b", o="wo",
        rope_kind=_TT_ROPES[rope], kind="torchtitan_mla", norm_classes=("torchtitan.models.common.nn_modules.RMSNorm",),
        linear_types=(_TT_LINEAR,), float32_steps="RoPE in float32 (q and k are rotated in float32)",
    )


MLA_ADAPTERS = {HF_V2: adapt_hf_deepseek, HF_V3: adapt_hf_deepseek, LITGPT_MLA: adapt_litgpt_mla,
                TORCHTITAN_MLA: adapt_torchtitan_mla}
