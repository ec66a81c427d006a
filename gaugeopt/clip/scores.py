"""What an attention call adds to ``q·k``: the score terms a record does not hold, read off the call.

An :class:`~gaugeopt.AttentionSite` says where ``W_Q``, ``W_K`` (biases, multipliers, QK-norm gains)
live and how RoPE pairs the coordinates. The logits a layer computes also depend on its *call*:
the input streams, the RoPE angles of each position, the score scale, which key each query may
see (causal, padding, sliding windows) and a soft cap. A *reader* per adapter kind turns one call
— its positional and keyword arguments, as :class:`~gaugeopt.trust.proof.CallRecorder`
or a forward pre-hook sees them — into a :class:`ScoreCall`:

    s_ij = scale · ⟨rot_i(q_i), rot_j(k_j)⟩    over the pairs (i, j) with allowed[i, j]
    q_i = N_q(W_Q x_i + b_Q),  k_j = N_k(W_K x'_j + b_K)        (N: the record's QK-norm, if any)

``rot_t`` turns plane ``m`` of a head by the call's angle ``θ[t, m]`` (given as ``cos``, ``sin``),
``(x_p, x_q) ← (x_p cos − x_q sin, x_p sin + x_q cos)``, on the planes of the record's
:class:`~gaugeopt.RopeSpec`. A soft cap ``c`` (Gemma 2) is applied by the kernel after the scale,
``c·tanh(s/c)``; :class:`ScoreCall` records it so that a reconstruction of the layer's output can
apply it (:mod:`gaugeopt.clip.logits` checks every reader that way).

Readers exist for the kinds in :data:`READERS` (gaugeopt's GPT, nanoGPT, Hugging Face GPT-2 and the
Llama family with its QK-norm members, ``torch.nn.MultiheadAttention``); any other kind is refused
with a :class:`~gaugeopt.GaugeError` that names it: a family whose scores add a term per head
(ALiBi, T5's relative bias) or a kernel-specific rule would otherwise give a wrong maximum.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.clip.scores import score_call
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, rope="interleaved"))
    >>> site = gaugeopt.find_attention(model)[0]
    >>> sc = score_call(site, (torch.randn(2, 5, 8),), {})
    >>> tuple(sc.x_q.shape), round(sc.scale, 4), tuple(sc.rope_q[0].shape), sc.allowed.tolist()[0][0][1][:3]
    ((2, 5, 8), 0.5, (1, 5, 2), [True, True, False])
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.records.site import AttentionSite

__all__ = ["ScoreCall", "READERS", "score_call", "causal"]


@dataclass
class ScoreCall:
    """The inputs and score terms of one attention call (see the module docstring).

    Attributes:
        x_q: input of the query projection, ``(B, T_q, d_model)``.
        x_kv: input of the key projection, ``(B, T_k, d_model)``.
        x_v: input of the value projection (``x_kv`` unless the call passes another).
        scale: the factor on ``q·k``.
        rope_q, rope_k: ``(cos, sin)`` per RoPE plane, each ``(B or 1, T, r/2)`` (plane ``m`` is the
            record's ``rope.planes(d_k)[m]``); ``None`` without RoPE.
        allowed: bool, broadcastable to ``(B, h, T_q, T_k)``: the pairs the softmax sees; ``None``: all.
        softcap: the kernel's soft cap ``c`` (``c·tanh(s/c)`` after the scale), or ``None``.
    """

    x_q: torch.Tensor
    x_kv: torch.Tensor
    scale: float
    x_v: torch.Tensor | None = None
    rope_q: tuple[torch.Tensor, torch.Tensor] | None = None
    rope_k: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed: torch.Tensor | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.x_v is None:
            self.x_v = self.x_kv


def causal(t_q: int, t_k: int, device=None) -> torch.Tensor:
    """``(1, 1, T_q, T_k)`` bool: query ``i`` sees keys ``j ≤ i`` (upper-left aligned, as SDPA's ``is_causal``)."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril()[None, None]


# ---------------------------------------------------------------------- helpers
_SIGNATURES: dict[type, inspect.Signature] = {}


def _bound(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name (``forward``'s signature, positional ones included)."""
    cls = type(module)
    sig = _SIGNATURES.get(cls)
    if sig is None:
        sig = _SIGNATURES[cls] = inspect.signature(cls.forward)
    bound = dict(sig.bind_partial(module, *args, **kwargs).arguments)
    for name, param in sig.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in bound:
            bound.update(bound.pop(name))
    return bound


def _need(site: AttentionSite, bound: dict, name: str) -> Any:
    value = bound.get(name)
    if value is None:
        raise GaugeError(f"attention logits: {site.name} ({site.kind}) was called without {name!r}; gaugeopt reads "
                         "the scores from that argument")
    return value


def _angles(inv_freq: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.outer(torch.arange(t, device=inv_freq.device, dtype=inv_freq.dtype), inv_freq)
    return ang.cos()[None], ang.sin()[None]


def _hf_planes(site: AttentionSite, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``(cos, sin)``, ``(B, T, r)`` with each angle twice (``cat(θ, θ)``), as one angle per plane."""
    r = site.rope.rotary_dim
    if site.rope.kind != "split_half" or cos.shape[-1] != r:
        raise GaugeError(
            f"attention logits: {site.name}: the call's rotary table has width {cos.shape[-1]}, the record rotates "
            f"{r} coordinates ({site.rope.kind}); gaugeopt cannot tell which angle turns which plane"
        )
    half = r // 2
    for t in (cos, sin):
        if not torch.equal(t[..., :half], t[..., half:]):
            raise GaugeError(f"attention logits: {site.name}: the rotary table is not split-half (its two halves "
                             "differ); gaugeopt cannot tell which angle turns which plane")
    cos, sin = cos[..., :half], sin[..., :half]
    return (cos if cos.dim() == 3 else cos[None]), (sin if sin.dim() == 3 else sin[None])


def _cached_length(cache: Any, layer: int) -> int:
    """Positions a Hugging Face cache already holds for ``layer`` (a tuple cache counts as non-empty)."""
    length = getattr(cache, "get_seq_length", None)
    return int(length(layer)) if callable(length) else 1


def _allowed_from_mask(site: AttentionSite, mask: torch.Tensor, t_q: int, t_k: int, *, true_means: str) -> torch.Tensor:
    """A boolean or additive float mask as ``allowed`` ``(B|1, 1|h, T_q, T_k)``. An additive mask must
    hold only 0 (allowed) and its dtype's large negatives (masked): any other value is a score term
    gaugeopt would have to add to the logits, and is refused."""
    while mask.dim() < 4:
        mask = mask[None]
    mask = mask[..., :t_q, :t_k] if mask.shape[-1] >= t_k else mask
    if mask.dtype == torch.bool:
        return mask if true_means == "allowed" else ~mask
    neg = mask <= torch.finfo(mask.dtype).min / 2
    if bool(((mask != 0) & ~neg & ~torch.isneginf(mask)).any()):
        raise GaugeError(
            f"attention logits: {site.name}: the attention mask adds finite values other than 0 to the scores (a position "
            "bias); gaugeopt reports q·k logits only where the mask is 0 or -inf-like"
        )
    return ~neg


# ---------------------------------------------------------------------- readers
def _read_gpt(site: AttentionSite, args: tuple, kwargs: dict) -> ScoreCall:
    m = site.module
    x = _need(site, _bound(m, args, kwargs), "x")
    t = x.shape[1]
    rope = None
    if m.rotary is not None:  # the module's own rule: angles in float32 (float64 in a float64 model)
        r = m.rotary.rotary_dim
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        inv = m.rotary.base ** (-torch.arange(0, r, 2, device=x.device, dtype=dtype) / r)
        rope = _angles(inv, t)
    return ScoreCall(x, x, 1 / math.sqrt(site.d_k), rope_q=rope, rope_k=rope, allowed=causal(t, t, x.device))


def _read_nanogpt(site: AttentionSite, args: tuple, kwargs: dict) -> ScoreCall:
    x = _need(site, _bound(site.module, args, kwargs), "x")
    t = x.shape[1]
    return ScoreCall(x, x, 1 / math.sqrt(site.d_k), allowed=causal(t, t, x.device))


def _read_hf(site: AttentionSite, args: tuple, kwargs: dict) -> ScoreCall:
    """Hugging Face decoder self-attention with the ``eager`` or ``sdpa`` kernel (the verified ones):
    the scores are ``module.scaling · q·k``, plus the 4-D ``attention_mask`` when one is passed; without
    one, SDPA is causal (``module.is_causal`` and more than one query) and eager sees every key."""
    m = site.module
    bound = _bound(m, args, kwargs)
    if bound.get("encoder_hidden_states") is not None:
        raise GaugeError(f"attention logits: {site.name} was called with encoder_hidden_states; only self-attention "
                         "is read")
    for name in ("cache", "past_key_values", "layer_past"):  # a training forward passes an empty cache at most
        cache = bound.get(name)
        if cache is not None and _cached_length(cache, getattr(m, "layer_idx", 0)):
            raise GaugeError(f"attention logits: {site.name} was called with a key/value cache that holds earlier "
                             "positions (generation); gaugeopt reads the logits of training forwards, without a cache")
    x = _need(site, bound, "hidden_states")
    t = x.shape[1]
    rope = None
    if site.rope.active:
        cos, sin = _need(site, bound, "position_embeddings")
        rope = _hf_planes(site, cos, sin)
    mask = bound.get("attention_mask")
    impl = getattr(m.config, "_attn_implementation", None)
    if mask is not None:
        allowed = _allowed_from_mask(site, mask, t, t, true_means="allowed")
    elif impl in (None, "sdpa") and getattr(m, "is_causal", True) and t > 1:
        allowed = causal(t, t, x.device)
    else:
        allowed = None
    softcap = getattr(m, "attn_logit_softcapping", None)
    return ScoreCall(x, x, float(m.scaling), rope_q=rope, rope_k=rope, allowed=allowed, softcap=softcap)


def _read_torch_mha(site: AttentionSite, args: tuple, kwargs: dict) -> ScoreCall:
    """``nn.MultiheadAttention``: ``attn_mask`` (bool: True = masked; or additive) and
    ``key_padding_mask`` (True = ignore that key), batch-first or not; ``is_causal`` is only a hint
    about ``attn_mask`` there."""
    m = site.module
    bound = _bound(m, args, kwargs)
    q, k, v = (_need(site, bound, n) for n in ("query", "key", "value"))
    if not m.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    if q.dim() != 3:
        raise GaugeError(f"attention logits: {site.name}: unbatched MultiheadAttention inputs are not read; add a batch axis")
    b, t_q, t_k = q.shape[0], q.shape[1], k.shape[1]
    allowed = None
    mask = bound.get("attn_mask")
    if mask is not None:
        if mask.dim() == 3:  # (B·h, T_q, T_k)
            mask = mask.reshape(b, site.h, t_q, t_k)
        allowed = _allowed_from_mask(site, mask, t_q, t_k, true_means="masked")
    pad = bound.get("key_padding_mask")
    if pad is not None:
        keep = _allowed_from_mask(site, pad[:, None, None, :], 1, t_k, true_means="masked")
        allowed = keep if allowed is None else allowed & keep
    return ScoreCall(q, k, 1 / math.sqrt(site.d_k), x_v=v, allowed=allowed)


_HF_KINDS = ("hf_gpt2", "hf_llama", "hf_mistral", "hf_qwen2", "hf_mixtral", "hf_gemma", "hf_gemma2", "hf_olmo",
             "hf_qwen3", "hf_olmo2", "hf_gemma3", "hf_phi3")

READERS: dict[str, Callable[[AttentionSite, tuple, dict], ScoreCall]] = {
    "gpt": _read_gpt, "nanogpt": _read_nanogpt, "torch_mha": _read_torch_mha, **{k: _read_hf for k in _HF_KINDS},
}


def score_call(site: AttentionSite, args: tuple, kwargs: dict) -> ScoreCall:
    """The :class:`ScoreCall` of one call of ``site.module`` with ``args``, ``kwargs``.

    Raises:
        GaugeError: the site's kind has no reader (the message lists those that do), or the call
            lacks what the reader needs.
    """
    reader = READERS.get(site.kind)
    if reader is None:
        raise GaugeError(
            f"attention logits: {site.name} is a {site.kind!r} layer ({type(site.module).__qualname__}), whose score terms "
            f"gaugeopt does not read yet (it reads {', '.join(sorted(READERS))}): a family that adds a term per head "
            "(ALiBi, T5's relative bias) or its own mask rule would get a wrong maximum, so it is refused"
        )
    return reader(site, args, kwargs)
