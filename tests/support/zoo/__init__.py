"""Small random models of every adapter kind, in float64, for the gauge tests.

``build(name, seed)`` returns a :class:`Case`: the model (random generic parameters), an
input batch and ``forward(model) -> logits``. Hugging Face models are built from configs (no
hub access). The outside families (nanoGPT, litgpt, timm, torchtitan and the other Hugging Face
classes) live in :mod:`zoo.families`, and the smallest models (whole Jacobians: the flat-direction meter, the
errata) in :mod:`zoo.tiny`; ``build`` hands the families' names to :mod:`zoo.families`. This package is the
suite's one model zoo: the models more than one test file uses are built here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

import gaugeopt
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.trust.invariance import randomize_parameters

VOCAB, T, B = 61, 12, 2


@dataclass
class Case:
    name: str
    model: nn.Module
    inputs: torch.Tensor
    forward: Callable[[nn.Module], torch.Tensor]

    def logits(self, model: nn.Module | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.forward(self.model if model is None else model)

    def copy(self) -> nn.Module:
        return copy.deepcopy(self.model)


def _gpt(**kw) -> nn.Module:
    base = dict(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32)
    return GPT(GPTConfig(**{**base, **kw}))


GPT_CONFIGS = {
    "gpt": {},
    "gpt_nobias": dict(bias=False),
    "gpt_gqa": dict(n_kv_head=2),
    "gpt_mqa": dict(n_kv_head=1),
    "gpt_rope_interleaved": dict(rope="interleaved"),
    "gpt_rope_split_half_gqa": dict(rope="split_half", n_kv_head=2, norm="rmsnorm", mlp="swiglu"),
    "gpt_rope_partial_interleaved": dict(rope="interleaved", rotary_dim=4),
    "gpt_rope_partial_split_half": dict(rope="split_half", rotary_dim=6, n_kv_head=2),
}


def _hf(kind: str) -> nn.Module:
    transformers = __import__("transformers")
    common = dict(vocab_size=VOCAB, attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    if kind == "hf_gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=32, **common)
        return transformers.GPT2LMHeadModel(cfg)
    llama_like = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **common)
    if kind == "hf_llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=True, **llama_like))
    if kind == "hf_qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama_like))
    if kind == "hf_mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**llama_like))
    raise KeyError(kind)


class MHAModel(nn.Module):
    """Embedding → nn.MultiheadAttention (self, or cross with kdim/vdim) → residual → head."""

    def __init__(self, separate_kv: bool = False) -> None:
        super().__init__()
        E = 24
        self.emb = nn.Embedding(VOCAB, E)
        self.separate_kv = separate_kv
        if separate_kv:
            self.kv_emb = nn.Embedding(VOCAB, 20)
            self.attn = nn.MultiheadAttention(E, 4, batch_first=True, kdim=20, vdim=20)
        else:
            self.attn = nn.MultiheadAttention(E, 4, batch_first=True)
        self.ln = nn.LayerNorm(E)
        self.head = nn.Linear(E, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        kv = self.kv_emb(idx.flip(1)) if self.separate_kv else x
        mask = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool), 1)
        y, _ = self.attn(x, kv, kv, attn_mask=mask, need_weights=False)
        return self.head(self.ln(x + y))


def _hf_qk_norm(kind: str) -> nn.Module:
    """Qwen3 / OLMo 2 / Gemma 3 with Q/K biases and GQA; SDPA attention (float64 in a float64 model;
    their RMSNorms still round through float32: qk_norm_helpers.float64_norms)."""
    transformers = __import__("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_bias=True,
                  bos_token_id=0, eos_token_id=0)
    if kind == "hf_qwen3":
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    elif kind == "hf_olmo2":
        cfg, cls = transformers.Olmo2Config(**common), transformers.Olmo2ForCausalLM
    elif kind == "hf_gemma3":
        cfg = transformers.Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention"],
                                            sliding_window=4, query_pre_attn_scalar=8)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise KeyError(kind)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False  # a recorded attention call can be replayed (no KV cache to grow)
    return cls(cfg)


def _timm_vit() -> nn.Module:
    from model_libraries import require

    require("timm")
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=VOCAB,
                             qk_norm=True, qkv_bias=True)


HF_KINDS = ("hf_gpt2", "hf_llama", "hf_qwen2", "hf_mistral")
# QK-norm models (docs/qk_norm.md): kept out of ALL, whose tests exercise the dense Q/K gauge.
QK_NORM_GPT = {
    "gpt_qknorm": dict(rope="split_half", n_kv_head=2, norm="rmsnorm", mlp="swiglu", qk_norm=True),
    "gpt_qknorm_partial_interleaved": dict(rope="interleaved", rotary_dim=4, qk_norm=True),
    "gpt_qknorm_norope": dict(qk_norm=True),
}
QK_NORM_HF = ("hf_qwen3", "hf_olmo2", "hf_gemma3")
# "offset_norm": a float64 model whose norm gain is 1 + w (Gemma's convention), qk_norm_helpers.OffsetNormLM
# "offset_norm_after_rope": the same with the norm after RoPE (a gain factor per channel is exact there)
QK_NORM = tuple(QK_NORM_GPT) + QK_NORM_HF + ("timm_vit_qknorm", "offset_norm", "offset_norm_after_rope")
ALL = tuple(GPT_CONFIGS) + HF_KINDS + ("torch_mha", "torch_mha_kdim")
# One representative of each adapter, with and without multipliers, for the slower tests.
LRM_CAPABLE = ("gpt", "gpt_rope_split_half_gqa", "gpt_rope_interleaved", "hf_gpt2", "hf_llama", "hf_qwen2")
# (name, lrm) pairs: every model plain, the representatives also with learnable multipliers.
CASES = [(n, False) for n in ALL] + [(n, True) for n in LRM_CAPABLE]
CASE_IDS = [n + ("+lrm" if lrm else "") for n, lrm in CASES]


def raw_model(name: str) -> nn.Module:
    if name in GPT_CONFIGS:
        return _gpt(**GPT_CONFIGS[name])
    if name in QK_NORM_GPT:
        return _gpt(**QK_NORM_GPT[name])
    if name in HF_KINDS:
        return _hf(name)
    if name in QK_NORM_HF:
        return _hf_qk_norm(name)
    if name == "timm_vit_qknorm":
        return _timm_vit()
    if name in ("offset_norm", "offset_norm_after_rope"):
        from qk_norm_helpers import OffsetNormLM

        return OffsetNormLM(VOCAB, norm_after_rope=name.endswith("after_rope"))
    if name == "torch_mha":
        return MHAModel()
    if name == "torch_mha_kdim":
        return MHAModel(separate_kv=True)
    raise KeyError(name)


def forward_fn(name: str) -> Callable[[nn.Module], torch.Tensor]:
    if name.startswith("gpt"):
        return lambda m, x=None: m(x)[0]
    if name.startswith("hf_"):
        return lambda m, x=None: m(input_ids=x).logits
    return lambda m, x=None: m(x)


def build(name: str, seed: int = 0, *, lrm: bool = False, dtype=torch.float64) -> Case:
    from zoo import families as zoo_families  # the outside families (a submodule: it builds on Case)

    if name in zoo_families.FAMILY:
        return zoo_families.build(name, seed, lrm=lrm, dtype=dtype)
    torch.manual_seed(seed)
    model = raw_model(name)
    if lrm:
        gaugeopt.apply_lrm(model)
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    randomize_parameters(model, g)
    if name.startswith("timm"):
        inputs = torch.randn(B, 3, 16, 16, generator=g, dtype=dtype)
    else:
        inputs = torch.randint(0, VOCAB, (B, T), generator=g)
    f = forward_fn(name)
    if name.startswith("offset_norm"):  # a test-defined attention with a user adapter: certified, as a user would
        gaugeopt.certify(model, inputs)
    return Case(name + ("+lrm" if lrm else ""), model, inputs, lambda m: f(m, inputs))


def attention_io(case: Case, model: nn.Module) -> list[tuple[tuple, dict, torch.Tensor]]:
    """Run ``case`` on ``model`` and return, per attention site, its (args, kwargs, output)."""
    records: list = []
    hooks = []
    for site in gaugeopt.find_attention(model):
        def pre(mod, args, kwargs, _r=records):
            _r.append([args, kwargs, None])

        def post(mod, args, kwargs, out, _r=records):
            _r[-1][2] = out[0] if isinstance(out, tuple) else out

        hooks.append(site.module.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(site.module.register_forward_hook(post, with_kwargs=True))
    try:
        case.logits(model)
    finally:
        for h in hooks:
            h.remove()
    return [tuple(r) for r in records]


def rope_angle_dtype(model: nn.Module) -> torch.dtype:
    """Precision of the model's RoPE angles: Hugging Face uses float32 whatever the model dtype."""
    return torch.float64 if isinstance(getattr(model, "config", None), GPTConfig) else torch.float32


def rope_base(model: nn.Module) -> float:
    cfg = getattr(model, "config", None)
    if isinstance(cfg, GPTConfig):
        return cfg.rope_base
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
