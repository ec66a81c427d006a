"""Tiny multi-head latent attention models (DeepSeek-V2/V3 in Hugging Face, litgpt, torchtitan) for the MLA tests.

``build(name)`` returns a :class:`zoo.Case` (float64, generic random parameters, inputs, forward), like
``zoo.build``. Widths are chosen so that nothing is degenerate: ``n = qk_nope_head_dim ≤`` both latents,
the latents narrower than the up-projections' rows and ``kv_lora_rank + qk_rope_head_dim ≤ hidden``.

**Float32 steps, removed for precision only.** Every implementation computes part of the layer in float32
even in a float64 model: the latent RMSNorms (``DeepseekV2/V3RMSNorm`` cast to float32 and back; litgpt's
``RMSNorm`` multiplies its gain in float32), DeepSeek-V2's complex RoPE (complex64) and torchtitan's RoPE.
That bounds what a float64 check can see at ~1e-7. :func:`float64_steps` replaces those computations, while
it is active, by the same formulas in the input's dtype. The replacement forwards are given the module name
of the class they replace: the adapters' patched-forward check then sees the library's normalisation (the
math is the same), which is the point — the record under test is the one the stock model gets.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.nn as nn

import gaugeopt
from gaugeopt.trust.invariance import randomize_parameters
from model_libraries import quiet, require
from zoo import Case
from zoo.families import attention_outputs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB, T, B = 61, 8, 2
DIMS = dict(q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _hf(version: int, moe: bool = True, **kw):
    transformers = require("transformers")
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                first_k_dense_replace=1 if moe else 2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                pad_token_id=0, **DIMS)
    if version == 3:
        base.update(n_group=1, topk_group=1)
    impl = kw.pop("impl", "sdpa")
    cfg = getattr(transformers, f"DeepseekV{version}Config")(**{**base, **kw})
    cfg._attn_implementation = impl
    cfg._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    model = quiet(getattr(transformers, f"DeepseekV{version}ForCausalLM"), cfg)
    return model, _ids(5), lambda m, x: m(input_ids=x, use_cache=False).logits


def _litgpt(**kw):
    require("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    base = dict(name="tiny-mla", block_size=16, vocab_size=VOCAB, padding_multiple=1, n_layer=2, n_head=4, n_embd=32,
                n_query_groups=4, bias=True, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=48,
                latent_attention=dict(DIMS))
    return GPT(Config(**{**base, **kw})), _ids(2), lambda m, x: m(x)


def _torchtitan(q_lora: int = 16, rope: str = "ComplexRoPE"):
    require("torchtitan")
    import dataclasses

    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3TransformerBlock, make_mla_attention_config

    init = {"weight": nn.init.normal_, "bias": nn.init.zeros_}
    rope_cls = {"ComplexRoPE": ComplexRoPE, "CosSinRoPE": CosSinRoPE}[rope]

    def layer(i):
        dims = {**DIMS, "q_lora_rank": q_lora}
        att = make_mla_attention_config(layer_id=i, dim=32, n_heads=4, attn_backend="flex", linear_init=init,
                                        norm_init={"weight": nn.init.ones_}, depth_init=lambda _: init,
                                        rope=rope_cls.Config(dim=4, max_seq_len=32, theta=10000.0), **dims)
        att = dataclasses.replace(att, inner_attention=ScaledDotProductAttention.Config())
        return DeepSeekV3TransformerBlock.Config(
            attention=att, attention_norm=RMSNorm.Config(normalized_shape=32), ffn_norm=RMSNorm.Config(normalized_shape=32),
            feed_forward=make_ffn_config(dim=32, hidden_dim=48, w1_param_init=init, w2w3_param_init=init))

    cfg = DeepSeekV3Model.Config(dim=32, vocab_size=VOCAB,
                                 tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=32),
                                 norm=RMSNorm.Config(normalized_shape=32),
                                 lm_head=Linear.Config(in_features=32, out_features=VOCAB), layers=[layer(i) for i in range(2)])
    return cfg.build(), _ids(4), lambda m, x: m(x)


# name: (builder, adapter kind, RoPE layout of the shared key, has a query latent)
FAMILY = {
    "hf_deepseek_v3": (lambda: _hf(3), "hf_deepseek_v3", "interleaved", True),
    "hf_deepseek_v3_split_half_bias": (lambda: _hf(3, rope_interleave=False, attention_bias=True), "hf_deepseek_v3",
                                       "split_half", True),
    "hf_deepseek_v3_lite": (lambda: _hf(3, q_lora_rank=None), "hf_deepseek_v3", "interleaved", False),
    "hf_deepseek_v2": (lambda: _hf(2), "hf_deepseek_v2", "interleaved", True),
    "hf_deepseek_v2_lite": (lambda: _hf(2, q_lora_rank=None), "hf_deepseek_v2", "interleaved", False),
    "litgpt_mla": (lambda: _litgpt(rope_interleave=True, attn_bias=True), "litgpt_mla", "interleaved", True),
    "litgpt_mla_split_half": (lambda: _litgpt(bias=False), "litgpt_mla", "split_half", True),
    "torchtitan_mla": (lambda: _torchtitan(), "torchtitan_mla", "interleaved", True),
    "torchtitan_mla_cossin_no_q_latent": (lambda: _torchtitan(q_lora=0, rope="CosSinRoPE"), "torchtitan_mla",
                                          "split_half", False),
}
NAMES = tuple(FAMILY)


def raw(name: str):
    """``(model, inputs, forward)`` as a user builds it (float32, the library's own initialisation)."""
    return FAMILY[name][0]()


def build(name: str, seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model, inputs, forward = raw(name)
    model = model.double().eval()  # .double(): casts floating tensors only (torchtitan's complex RoPE cache stays complex)
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    return Case(name, model, inputs, lambda m: forward(m, inputs))


def changes(case: Case, y0, a0, moved) -> tuple[float, float]:
    """Relative change of the output and the largest one over the attention outputs."""
    y, a = attention_outputs(case, moved)
    assert len(a) == len(a0)
    return gaugeopt.relative_change(y0, y), max(gaugeopt.relative_change(p, q) for p, q in zip(a0, a))


# ---------------------------------------------------------------------- float64 in place of the float32 steps
def _hf_rmsnorm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _litgpt_rmsnorm(self, x):
    x_normed = x * torch.rsqrt(torch.mean(x * x, dim=self.dim, keepdim=True) + self.eps)
    return x_normed * ((1 + self.weight) if self.add_unit_offset else self.weight)


@gaugeopt.accept_patch
def _v2_rope(xq, xk, freqs_cis):
    ct = torch.complex128 if xq.dtype == torch.float64 else torch.complex64
    xq_ = torch.view_as_complex(xq.to(ct.to_real()).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.to(ct.to_real()).reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.unsqueeze(1).to(xq_.device, ct)
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


def _as_of(fn, module_name: str):
    import types

    g = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    g.__module__ = module_name
    return gaugeopt.accept_patch(g)  # the same formula in float64: the certificate proves it as it runs


@contextlib.contextmanager
def float64_steps():
    """The implementations' float32 steps computed in the input's dtype (module docstring), while active."""
    from zoo import families as zoo_families

    saved = []
    try:
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m2
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3

        for mod, cls in ((m2, m2.DeepseekV2RMSNorm), (m3, m3.DeepseekV3RMSNorm)):
            saved.append((cls, "forward", cls.forward))
            cls.forward = _as_of(_hf_rmsnorm, mod.__name__)
        saved.append((m2, "apply_rotary_emb", m2.apply_rotary_emb))
        m2.apply_rotary_emb = _v2_rope
    except ImportError:
        pass
    try:
        import litgpt.model as lm

        saved.append((lm.RMSNorm, "forward", lm.RMSNorm.forward))
        lm.RMSNorm.forward = _as_of(_litgpt_rmsnorm, lm.__name__)
    except ImportError:
        pass
    try:
        with zoo_families.float64_islands_removed():  # torchtitan's RoPE
            yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


# ---------------------------------------------------------------------- tiny models for the flat-direction meter
FLAT_LENGTH = 4


def flat_model(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """A dense 2-layer DeepSeek of width 8 (``n = r = d_v = 2``, 2 heads, latents of 4) with covering inputs.

    The vocabulary (23) is wide enough that the first layer, whose inputs depend on the token alone,
    sees more distinct inputs than its latent down-projections have parameters per latent direction;
    with 11 tokens a biased down-projection has flat directions that more data would not remove."""
    from gaugeopt.flat.meter import covering_tokens

    transformers = require("transformers")
    vocab = 23
    common = dict(vocab_size=vocab, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, q_lora_rank=4, kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2,
                  v_head_dim=2, first_k_dense_replace=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
                  pad_token_id=None)
    if name == "hf_deepseek_v3_bias":
        cfg = transformers.DeepseekV3Config(**common, attention_bias=True, n_group=1, topk_group=1)
    elif name == "hf_deepseek_v2_lite":
        cfg = transformers.DeepseekV2Config(**{**common, "q_lora_rank": None, "num_attention_heads": 4,
                                               "num_key_value_heads": 4})
    else:
        raise KeyError(name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = quiet(getattr(transformers, type(cfg).__name__.replace("Config", "ForCausalLM")), cfg).double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    n = sum(p.numel() for p in model.parameters())
    sequences = math.ceil(2 * n / (FLAT_LENGTH * 8)) + math.ceil(vocab / FLAT_LENGTH)
    return model, covering_tokens(vocab, FLAT_LENGTH, sequences, seed=seed)
