"""Shared pieces of the QK-norm tests: an exact float64 forward for the Hugging Face families, the
measurement of logits and attention outputs, and a small model whose norm gain is ``1 + w``.

**Why a patch.** ``Qwen3RMSNorm`` and ``Olmo2RMSNorm`` normalise in float32 even in a float64
model (``hidden_states.to(torch.float32)``) and ``Gemma3RMSNorm`` also multiplies by its gain in
float32. Every decoder layer's input norm is such a module, so the residual stream is rounded to
float32 before each attention layer, and an exact gauge move may show a float32-sized difference —
or none at all, by rounding the same way on both sides (which would hide a real 1e-9 error).
:func:`float64_norms` runs the same formulas in the input dtype; inside it the whole forward is
float64 (the zoo's HF models use SDPA, float64 in a float64 model). gaugeopt's adapters refuse a
norm whose ``forward`` is not the stock one, so sites are found *before* entering the context and
passed explicitly.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

import gaugeopt
from gaugeopt.models.gpt import Rotary
from gaugeopt import register_adapter, site_from_linears
from gaugeopt.records.rope import RopeSpec
from gaugeopt.records.site import QKNorm, TensorRef


@contextlib.contextmanager
def float64_norms():
    """The three HF QK-norm families' RMSNorms without their float32 round trip (same formulas)."""
    from transformers.models.gemma3 import modeling_gemma3 as mg
    from transformers.models.olmo2 import modeling_olmo2 as mo
    from transformers.models.qwen3 import modeling_qwen3 as mq

    @gaugeopt.accept_patch  # the same formulas in the input's dtype: the certificate proves them as they run
    def rms(self, x):  # Qwen3RMSNorm / Olmo2RMSNorm: weight · x / sqrt(mean x² + ε)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    @gaugeopt.accept_patch
    def gemma(self, x):  # Gemma3RMSNorm: (1 + weight) · x / sqrt(mean x² + ε)
        return self._norm(x) * (1.0 + self.weight)

    saved = [(c, c.forward) for c in (mq.Qwen3RMSNorm, mo.Olmo2RMSNorm, mg.Gemma3RMSNorm)]
    mq.Qwen3RMSNorm.forward = rms
    mo.Olmo2RMSNorm.forward = rms
    mg.Gemma3RMSNorm.forward = gemma
    try:
        yield
    finally:
        for cls, fwd in saved:
            cls.forward = fwd


def exact(name: str):
    """:func:`float64_norms` for the HF families, nothing for the others (float64 throughout)."""
    return float64_norms() if name.startswith("hf_") else contextlib.nullcontext()


@torch.no_grad()
def measure(case, model, sites) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(logits, [attention output per site])`` of ``model`` on the case's inputs."""
    outs: list[torch.Tensor] = []
    hooks = [s.module.register_forward_hook(lambda mod, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for s in sites]
    try:
        logits = case.forward(model)
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


def changes(case, moved, sites_ref, sites_moved) -> tuple[float, list[float]]:
    """Relative change of the logits and of each attention output, measured exactly (module docstring)."""
    with exact(case.name):
        la, oa = measure(case, case.model, sites_ref)
        lb, ob = measure(case, moved, sites_moved)
    return gaugeopt.relative_change(la, lb), [gaugeopt.relative_change(a, b) for a, b in zip(oa, ob)]


# ---------------------------------------------------------------------- a norm gain stored as 1 + w
class OffsetNormAttention(nn.Module):
    """Causal GQA attention whose per-head RMSNorm has the gain ``1 + w`` (Gemma's convention), before
    split-half RoPE (or after it, ``norm_after_rope=True``: no model in use has that order); plain
    float64 arithmetic, so every gauge move on ``w`` is exact here."""

    def __init__(self, d_model: int = 32, h: int = 4, h_kv: int = 2, d: int = 8, eps: float = 1e-6,
                 norm_after_rope: bool = False) -> None:
        super().__init__()
        self.h, self.h_kv, self.d, self.eps = h, h_kv, d, eps
        self.norm_after_rope = norm_after_rope
        self.q, self.k = nn.Linear(d_model, h * d), nn.Linear(d_model, h_kv * d)
        self.v, self.o = nn.Linear(d_model, h_kv * d), nn.Linear(h * d, d_model)
        self.q_w, self.k_w = nn.Parameter(torch.zeros(d)), nn.Parameter(torch.zeros(d))
        self.rotary = Rotary("split_half", d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(B, T, self.h_kv, self.d).transpose(1, 2)
        v = self.v(x).view(B, T, self.h_kv, self.d).transpose(1, 2)
        if self.norm_after_rope:
            q, k = self.rotary(q), self.rotary(k)
        q = F.rms_norm(q, (self.d,), eps=self.eps) * (1 + self.q_w)
        k = F.rms_norm(k, (self.d,), eps=self.eps) * (1 + self.k_w)
        if not self.norm_after_rope:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, self.h * self.d))


class OffsetNormLM(nn.Module):
    def __init__(self, vocab: int = 61, d_model: int = 32, layers: int = 2, norm_after_rope: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList([OffsetNormAttention(d_model, norm_after_rope=norm_after_rope) for _ in range(layers)])
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _adapt_offset(root: nn.Module, name: str, m: OffsetNormAttention):
    site = site_from_linears(m, name, q="q", k="k", v="v", o="o", num_heads=m.h, num_kv_heads=m.h_kv,
                             rope=RopeSpec("split_half", m.d))
    ref = lambda attr: TensorRef(m, attr, f"{name}.{attr}", (1, m.d))  # noqa: E731
    norm = QKNorm("rms", ref("q_w"), ref("k_w"), eps=m.eps, gain_offset=1.0, before_rope=not m.norm_after_rope)
    return dataclasses.replace(site, qk_norm=norm)


register_adapter(OffsetNormAttention, _adapt_offset)
