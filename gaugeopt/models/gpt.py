"""A nanoGPT-style GPT: GPT-2 architecture, with optional RoPE, GQA and LLaMA-style blocks.

The project's own model, used by the recipes, the demo and the tests. With the defaults it is
GPT-2 (learned positions, LayerNorm, GELU MLP, fused ``c_attn``, tied output head, vocab
padded to 50304); ``rope=...``, ``n_kv_head``, ``norm="rmsnorm"`` and ``mlp="swiglu"`` turn
it into a LLaMA-style block. Attention runs through ``F.scaled_dot_product_attention`` (flash
kernels on GPU). ``torch.compile``-able; bf16 autocast friendly.

Layouts (``B`` batch, ``T`` time, ``h``/``h_kv`` heads, ``d`` head width):
``c_attn`` maps ``n_embd → (h + 2·h_kv)·d`` as ``[Q | K | V]``; query head ``i`` reads
KV head ``i // (h // h_kv)``.

Example:
    >>> import torch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
    ...                 n_embd=32, rope="split_half", norm="rmsnorm", mlp="swiglu")
    >>> model = GPT(cfg)
    >>> logits, loss = model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    >>> tuple(logits.shape), loss.ndim
    ((2, 16, 64), 0)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from gaugeopt.errors import GaugeError

__all__ = ["GPTConfig", "GPT", "CausalSelfAttention", "Rotary"]


@dataclass
class GPTConfig:
    """Architecture of :class:`GPT`.

    Attributes:
        block_size: maximum sequence length.
        vocab_size: vocabulary size (GPT-2's 50257 padded to 50304, a multiple of 64).
        n_layer, n_head, n_embd: depth, query heads, model width.
        n_kv_head: key/value heads (GQA when fewer than ``n_head``; ``None`` = ``n_head``).
        head_dim: per-head width (``None`` = ``n_embd // n_head``).
        dropout: dropout probability (0 for pre-training à la nanoGPT).
        bias: biases in linears and LayerNorms (GPT-2: True).
        rope: ``"none"`` (learned absolute positions), ``"interleaved"`` or ``"split_half"``.
        rotary_dim: rotated coordinates per head (``None`` = ``head_dim``; partial rotary below).
        rope_base: RoPE frequency base.
        qk_norm: RMS-normalise each query/key head before RoPE (one gain vector per side shared by all
            heads); the Q/K gauge then acts on the gains (docs/qk_norm.md).
        norm: ``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (LLaMA).
        mlp: ``"gelu"`` (GPT-2, 4× width) or ``"swiglu"`` (LLaMA, ``mlp_hidden`` width).
        mlp_hidden: MLP hidden width (``None`` = 4·n_embd for GELU, ≈ 8/3·n_embd rounded to 64 for SwiGLU).
        tie_weights: share the token embedding with the output head.
    """

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_kv_head: int | None = None
    head_dim: int | None = None
    dropout: float = 0.0
    bias: bool = True
    rope: str = "none"
    rotary_dim: int | None = None
    rope_base: float = 10000.0
    qk_norm: bool = False
    norm: str = "layernorm"
    mlp: str = "gelu"
    mlp_hidden: int | None = None
    tie_weights: bool = True

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise GaugeError(f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; set head_dim")
            self.head_dim = self.n_embd // self.n_head
        if self.n_head % self.n_kv_head:
            raise GaugeError(f"GPTConfig: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.rope not in ("none", "interleaved", "split_half"):
            raise GaugeError(f"GPTConfig.rope={self.rope!r} must be 'none', 'interleaved' or 'split_half'")
        if self.rope == "none":
            self.rotary_dim = 0
        elif self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if self.rope != "none" and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise GaugeError(f"GPTConfig.rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise GaugeError(f"GPTConfig.norm={self.norm!r} must be 'layernorm' or 'rmsnorm'")
        if self.mlp not in ("gelu", "swiglu"):
            raise GaugeError(f"GPTConfig.mlp={self.mlp!r} must be 'gelu' or 'swiglu'")
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.n_embd if self.mlp == "gelu" else 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(cfg: GPTConfig, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, bias=cfg.bias) if cfg.norm == "layernorm" else RMSNorm(dim)


class Rotary(nn.Module):
    """Rotary embedding of the first ``rotary_dim`` coordinates of each head.

    ``kind="interleaved"`` rotates planes ``(2m, 2m+1)``; ``"split_half"`` planes
    ``(m, m + r/2)``; plane ``m`` turns by ``t · base^(-2m/r)`` at position ``t``.
    """

    def __init__(self, kind: str, rotary_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.kind = kind
        self.rotary_dim = rotary_dim
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, heads, T, d). Angles in float32 (float64 for a float64 model), as usual for RoPE.
        r, T = self.rotary_dim, x.shape[-2]
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        inv_freq = self.base ** (-torch.arange(0, r, 2, device=x.device, dtype=dtype) / r)
        ang = torch.outer(torch.arange(T, device=x.device, dtype=dtype), inv_freq)  # (T, r/2)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        xr, rest = x[..., :r], x[..., r:]
        if self.kind == "interleaved":
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        else:
            x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention with fused ``c_attn`` (``[Q | K | V]``) and ``c_proj``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.n_embd = cfg.n_embd
        d = cfg.head_dim
        self.split_sizes = (cfg.n_head * d, cfg.n_kv_head * d, cfg.n_kv_head * d)
        self.c_attn = nn.Linear(cfg.n_embd, sum(self.split_sizes), bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_head * d, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.rotary = Rotary(cfg.rope, cfg.rotary_dim, cfg.rope_base) if cfg.rope != "none" else None
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d), RMSNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.split_sizes, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, h, T, d)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, h_kv, T, d)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, h_kv, T, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_head != self.n_head,
        )  # (B, h, T, d)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        hidden = cfg.mlp_hidden
        self.c_fc = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        if self.swiglu:
            self.c_gate = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hid = F.silu(self.c_gate(x)) * self.c_fc(x) if self.swiglu else F.gelu(self.c_fc(x))
        return self.dropout(self.c_proj(hid))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = _norm(cfg, cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=_norm(cfg, cfg.n_embd),
            )
        )
        if cfg.rope == "none":
            self.transformer["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2L)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (shared tensors once); without position embeddings by default."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, ``6·N + 12·L·h·d·T`` (PaLM appendix B, as in nanoGPT)."""
        cfg, T = self.config, seq_len or self.config.block_size
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise GaugeError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        x = self.transformer.wte(idx)  # (B, T, n_embd)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(torch.arange(T, device=idx.device))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, generator=None) -> torch.Tensor:
        """Append ``max_new_tokens`` tokens; ``temperature=0`` decodes greedily."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])
            logits = logits[:, -1, :]
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
