"""QK-Clip: cap every head's maximum attention logit at ``τ`` by rescaling its query and key rows.

Kimi K2's MuonClip (and Megatron-LM's ``qk_clip``) bound attention-logit growth after the
optimizer step: a head ``i`` whose largest logit on the batch is ``m_i > τ`` gets

    η_i = τ / m_i,    W_Q[i] ← η_i^α · W_Q[i],    W_K[i] ← η_i^(1−α) · W_K[i]

so that ``q·k`` of that head shrinks by ``η_i`` and its maximum lands on ``τ``. gaugeopt applies it
through the attention records, on every model it supports:

* **GQA / MQA.** The keys of KV group ``g`` are shared, so they take the group's worst head,
  ``f_K[g] = (min_{i∈g, m_i>τ} η_i)^(1−α)``, and each query head only what is still needed,
  ``f_Q[i] = min(1, τ / (m_i · f_K[g]))``: the worst head ends at ``τ``, every head of the group at
  or below it, and no logit grows. Heads of an unclipped group are not written at all
  (bit-identical); with ``α = 1`` the groups never move their keys and heads are clipped alone.
* **What carries the rescale.** The biases travel with their rows (``q = W_Q x + b_Q`` scales as a
  whole); with learnable multipliers ``r_Q[i]``, ``r_K[g]`` carry it (``W̄`` untouched); under a
  QK-norm the rows cannot (the norm removes their scale), so the norm's *gains* do (with a LayerNorm's
  bias; Gemma's ``1 + w`` as ``w ← (1 + w)·f − 1``). A factor is one number per head, constant on
  every RoPE plane. Gains shared by all heads (Qwen3, Gemma 3, ``GPT(qk_norm=True)``) make the layer
  one group: it takes its worst head's ``η``, split ``α / 1−α`` between the query and key gain.
* **Optimizer state.** A clip is the diagonal rescale ``p ← f ⊙ p`` of the rows it touches; their
  state is rewritten in the new coordinates as for GaugeFix (:mod:`gaugeopt.fix.transport`:
  ``exp_avg/f``, ``exp_avg_sq/f²``) — the next step is the one the optimizer would take had it
  always worked in the clipped coordinates. ``transport_state=False`` leaves it.
* **Distributed.** The maxima are MAX-reduced across ranks first (:func:`gaugeopt.distributed.all_reduce_max`),
  so DDP ranks that saw different batches clip identically; the writes are shard-local under FSDP2.
* **NaN-safe.** A head whose maximum is non-finite (on any rank) or ``≤ 0`` is skipped — ``τ/m``
  would be NaN, negative or infinite — and the report says so (Megatron's users met NaNs there).

Clipping changes the function on purpose (the logits of clipped heads shrink by up to ``η``).
Combine it with GaugeFix by clipping the magnitude first and balancing after
(:class:`gaugeopt.integrations.clip.ClipSteps` hooks run before :class:`~gaugeopt.integrations.steps.FixSteps`).

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> x = torch.randint(0, 64, (2, 16))
    >>> m = gaugeopt.max_attention_logits(model, x)
    >>> tau = 0.5 * float(m["transformer.h.0.attn"].max())
    >>> report = gaugeopt.qk_clip(model, opt, m, tau=tau)
    >>> after = gaugeopt.max_attention_logits(model, x)["transformer.h.0.attn"]
    >>> bool(after.max() <= tau * (1 + 1e-5)), report.heads_over > 0
    (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn as nn

from gaugeopt.distributed import all_reduce_max, local_factor, local_view
from gaugeopt.errors import GaugeError
from gaugeopt.fix.transport import (
    UNKNOWN_STATE_POLICIES, param_owners, plan_state, rescale_param, rescale_tensor, storage_factor, unwrap_optimizer,
)
from gaugeopt.trust.gate import trusted_sites
from gaugeopt.records.pair import GaugePair
from gaugeopt.records.site import AttentionSite

__all__ = ["qk_clip", "clip_factors", "QKClipReport", "LayerClip"]


@dataclass
class LayerClip:
    """One layer of a :class:`QKClipReport`: per query head its maximum (after the cross-rank
    reduction), the factors applied, and why a head was skipped.

    Attributes:
        target: what carried the rescale: ``"rows"`` (``W_Q``/``W_K`` rows and biases),
            ``"multipliers"`` (``r_Q``/``r_K``) or ``"gains"`` (the QK-norm's).
        max_before: ``(h,)`` the maxima the clip acted on.
        q_factor: ``(h,)`` the factor on each query head's ``q``; k_factor ``(h_kv,)`` on each KV head's ``k``.
        skipped: ``{head: reason}`` for non-finite or non-positive maxima.
    """

    name: str
    layer_index: int
    target: str
    max_before: list[float]
    q_factor: list[float]
    k_factor: list[float]
    skipped: dict[int, str] = field(default_factory=dict)

    @property
    def logit_factor(self) -> list[float]:
        """``(h,)``: the factor on each head's logits, ``f_Q[i]·f_K[g(i)]``."""
        rep = len(self.q_factor) // len(self.k_factor)
        return [fq * self.k_factor[i // rep] for i, fq in enumerate(self.q_factor)]

    @property
    def max_after(self) -> list[float]:
        """``(h,)``: the maxima on the same batch after the clip (``m_i·f_Q[i]·f_K[g(i)]``; exact up to rounding)."""
        return [m * f for m, f in zip(self.max_before, self.logit_factor)]


@dataclass
class QKClipReport:
    """What :func:`qk_clip` did; ``as_dict()`` for a logger, ``str()`` for a table."""

    tau: float
    alpha: float
    layers: list[LayerClip] = field(default_factory=list)
    reduced: bool = False
    transported: list[str] = field(default_factory=list)
    approximate: list[str] = field(default_factory=list)  # state moved by a declared approximation (docs/optimizers.md)
    reset: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    @property
    def heads_over(self) -> int:
        """Heads whose (finite, positive) maximum exceeded ``τ``."""
        return sum(m > self.tau and i not in lc.skipped for lc in self.layers for i, m in enumerate(lc.max_before))

    @property
    def heads_rescaled(self) -> int:
        """Heads whose logits changed (those over ``τ`` and the others of their clipped KV groups)."""
        return sum(f < 1.0 for lc in self.layers for f in lc.logit_factor)

    @property
    def skipped(self) -> list[tuple[str, int, float, str]]:
        """``(layer, head, maximum, reason)`` of every head left alone because its maximum was unusable."""
        return [(lc.name, i, lc.max_before[i], why) for lc in self.layers for i, why in sorted(lc.skipped.items())]

    def _finite(self, values) -> list[float]:
        return [v for v in values if math.isfinite(v)]

    @property
    def max_logit_before(self) -> float:
        return max(self._finite(m for lc in self.layers for m in lc.max_before), default=float("nan"))

    @property
    def max_logit_after(self) -> float:
        return max(self._finite(m for lc in self.layers for m in lc.max_after), default=float("nan"))

    def as_dict(self, prefix: str = "qk_clip/") -> dict[str, float]:
        factors = [f for lc in self.layers for f in lc.logit_factor]
        return {
            f"{prefix}max_logit_before": self.max_logit_before,
            f"{prefix}max_logit_after": self.max_logit_after,
            f"{prefix}heads_over": float(self.heads_over),
            f"{prefix}heads_rescaled": float(self.heads_rescaled),
            f"{prefix}heads_skipped": float(len(self.skipped)),
            f"{prefix}min_factor": min(factors, default=1.0),
        }

    def __str__(self) -> str:
        rows = [f"QK-Clip τ={self.tau:g}, α={self.alpha:g}{' (maxima MAX-reduced across ranks)' if self.reduced else ''}"]
        for lc in self.layers:
            over = [i for i, f in enumerate(lc.logit_factor) if f < 1.0]
            rows.append(f"  {lc.name:<36} {lc.target:<11} max {max(self._finite(lc.max_before), default=float('nan')):9.3g} "
                        f"-> {max(self._finite(lc.max_after), default=float('nan')):9.3g}  heads rescaled {over}")
        for name, i, m, why in self.skipped:
            rows.append(f"  skipped {name} head {i}: maximum {m} ({why})")
        return "\n".join(rows)


# ---------------------------------------------------------------------- the factors
def clip_factors(maxima: torch.Tensor, h_kv: int, tau: float, alpha: float) -> tuple[torch.Tensor, torch.Tensor, dict[int, str]]:
    """``(f_Q (h,), f_K (h_kv,), skipped)`` for one layer's per-head maxima (float64; module docstring).

    Query head ``i`` belongs to group ``i // (h/h_kv)``; ``h_kv = 1`` with ``h`` query heads describes
    both MQA and gains shared by the whole layer (then every ``f_Q`` is equal: see :func:`qk_clip`).

    Example:
        >>> import torch
        >>> from gaugeopt.clip.qk_clip import clip_factors
        >>> fq, fk, skipped = clip_factors(torch.tensor([400.0, 50.0, float("nan"), -3.0]), 2, 100.0, 0.5)
        >>> fq.tolist(), fk.tolist(), skipped
        ([0.5, 1.0, 1.0, 1.0], [0.5, 1.0], {2: 'not finite', 3: 'not positive'})
    """
    m = maxima.detach().to(dtype=torch.float64, device="cpu")
    h = m.shape[0]
    skipped = {i: ("not finite" if not math.isfinite(v) else "not positive")
               for i, v in enumerate(m.tolist()) if not (math.isfinite(v) and v > 0)}
    usable = torch.isfinite(m) & (m > 0)
    over = usable & (m > tau)
    eta = torch.where(over, tau / torch.where(usable, m, torch.ones_like(m)), torch.ones_like(m))
    f_k = eta.view(h_kv, h // h_kv).amin(1) ** (1.0 - alpha)
    # τ / (m_i · f_K) written as η_i / f_K: the worst head gets exactly η^α (and 1 when α = 0)
    f_q = torch.where(over, (eta / f_k.repeat_interleave(h // h_kv)).clamp_max(1.0), torch.ones_like(m))
    return f_q, f_k, skipped


def _pair_and_mode(site: AttentionSite) -> tuple[GaugePair, str, str]:
    if site.qk_norm is not None:
        return site.pair("qk_gain"), "gain", "gains"
    pair = site.pair("qk")
    return (pair, "lrm", "multipliers") if pair.has_multipliers else (pair, "plain", "rows")


def _canonical(factor: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """A per-head factor ``(n,)`` as ``(rows, width)``: one value per row (``rows = n``) or, for a gain
    shared by every head (``rows = 1``), the common value."""
    f = factor if rows == factor.shape[0] else factor[:1]
    return f[:, None].expand(rows, width)


@torch.no_grad()
def _rescale(param: torch.Tensor, factor: torch.Tensor, offset: float) -> None:
    """``param ← factor ⊙ param`` (with an ``offset``: ``(param + offset)·factor − offset`` where the factor
    is not 1, so that unclipped entries stay bit-identical)."""
    if not offset:
        rescale_param(param, factor)
        return
    t = local_view(param)
    f = local_factor(factor, param).to(torch.promote_types(t.dtype, torch.float32))
    t.copy_(torch.where(f != 1, (t.to(f.dtype) + offset) * f - offset, t.to(f.dtype)))


def qk_clip(
    model: nn.Module | None,
    optimizer=None,
    max_logits: Mapping[str, torch.Tensor] | None = None,
    tau: float = 100.0,
    alpha: float = 0.5,
    *,
    sites: Sequence[AttentionSite] | None = None,
    transport_state: bool = True,
    unknown_state: str = "error",
    reduce: bool = True,
    group=None,
) -> QKClipReport:
    """Rescale the query and key side of every head whose maximum logit exceeds ``tau`` (module docstring).

    Args:
        model: the model (DDP / FSDP2 wrappers are fine); ignored when ``sites`` is given.
        optimizer: whose state of the rescaled tensors is transported (``None``: parameters only) — one
            or several (Muon beside AdamW): every tensor the clip may rescale must be stepped by exactly one.
        max_logits: ``{layer name: (h,) tensor}`` — what :func:`gaugeopt.max_attention_logits` (or the
            training-loop tracker) returned for this model; every layer must be present.
        tau: the cap (> 0).
        alpha: the query side's share of the rescale, in ``[0, 1]`` (Kimi K2: 0.5).
        sites: precomputed records.
        transport_state: transport the optimizer state (``False``: leave it as it is).
        unknown_state: ``"error"``, ``"reset"`` or ``"leave"`` for an optimizer without a state rule.
        reduce: MAX-reduce the maxima over the ranks of ``group`` when ``torch.distributed`` is
            initialised (every rank must call ``qk_clip`` then).
        group: the process group (default: the world).

    Returns:
        :class:`QKClipReport`.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
        raise GaugeError(f"qk_clip: tau={tau!r} must be a positive finite number (the largest logit a head may keep)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise GaugeError(f"qk_clip: alpha={alpha!r} must be in [0, 1] (the query side's share of the rescale)")
    if unknown_state not in UNKNOWN_STATE_POLICIES:
        raise GaugeError(f"qk_clip: unknown_state={unknown_state!r} is not one of {UNKNOWN_STATE_POLICIES}")
    if model is None and sites is None:
        raise GaugeError("qk_clip: pass a model or sites=find_attention(model)")
    sites = trusted_sites(model, "qk_clip", sites=sites)
    return clip_sites(sites, optimizer, max_logits, tau, alpha, transport_state=transport_state,
                      unknown_state=unknown_state, reduce=reduce, group=group)


def clip_sites(sites: Sequence[AttentionSite], optimizer, max_logits: Mapping[str, torch.Tensor], tau: float,
               alpha: float, *, transport_state: bool = True, unknown_state: str = "error", reduce: bool = True,
               group=None) -> QKClipReport:
    """:func:`qk_clip` on records that passed the gate already (a training-loop host's
    :class:`~gaugeopt.trust.gate.Gate`, re-checked before each step): the arguments are the same."""
    if not isinstance(max_logits, Mapping):
        raise GaugeError(f"qk_clip: max_logits must be the dict gaugeopt.max_attention_logits returns, got "
                         f"{type(max_logits).__name__}")
    for s in sites:
        m = max_logits.get(s.name)
        if m is None or tuple(torch.as_tensor(m).shape) != (s.h,):
            seen = "missing" if m is None else f"of shape {tuple(torch.as_tensor(m).shape)}"
            raise GaugeError(f"qk_clip: max_logits[{s.name!r}] is {seen}; expected one value per query head ({s.h},) — "
                             "pass gaugeopt.max_attention_logits(model, batch) of this model")
    flat = torch.cat([torch.as_tensor(max_logits[s.name]).detach().reshape(-1).to("cpu", torch.float64) for s in sites])
    reduced = False
    if reduce:
        flat, reduced = all_reduce_max(flat, group)
    report = QKClipReport(float(tau), float(alpha), reduced=reduced)

    # the factors, per parameter in storage layout (members of one fused parameter multiply into one factor)
    factors: dict[int, list] = {}  # id(param) -> [name, param, storage factor, offset]
    start = 0
    for s in sites:
        m = flat[start:start + s.h]
        start += s.h
        pair, mode, target = _pair_and_mode(s)
        shared = pair.groups == 1 and pair.a.heads == 1  # one gain vector for the whole layer
        f_q, f_k, skipped = clip_factors(m, 1 if shared else s.h_kv, tau, alpha)
        if shared:  # one group: every query head takes the worst head's share
            f_q = torch.full_like(f_q, float(f_q.min()))
            f_k = f_k.expand(s.h_kv).clone()
        report.layers.append(LayerClip(s.name, s.layer_index, target, m.tolist(), f_q.tolist(), f_k.tolist(), skipped))
        for side, per_head in ((pair.a, f_q), (pair.b, f_k)):
            if bool((per_head == 1).all()):
                continue
            for member in side.members(mode):
                p = member.ref.param
                entry = factors.setdefault(id(p), [member.ref.name, p, None, member.offset])
                canon = _canonical(per_head, member.ref.shape[0], pair.width).to(p.device)
                entry[2] = storage_factor(member, canon.to(torch.float64), out=entry[2])

    # state first (raising before any write), then parameters and state together: the one transport core
    # (gaugeopt.fix.transport) the fix uses, so every optimizer it knows — several at once — is handled alike
    if factors and optimizer is not None and transport_state:
        params = {pid: (e[0], e[1]) for pid, e in factors.items()}
        owners = param_owners(optimizer, params, "qk_clip")
        planned = {pid: plan_state(owners[pid], e[1], unknown_state=unknown_state, factor=e[2], name=e[0])
                   for pid, e in factors.items()}
        for pid, (name, p, f, offset) in factors.items():
            what, moves = planned[pid]
            if what == "reset":
                unwrap_optimizer(owners[pid]).state.pop(p, None)
                report.reset.append(name)
            elif what == "left":
                report.left.append(name)
            for m in moves:
                if m.apply is not None:
                    m.apply(f)
                elif m.power:
                    rescale_tensor(m.tensor, f, -m.power)
            if what in ("transported", "approximate"):
                getattr(report, what).append(name)
    for name, p, f, offset in factors.values():
        _rescale(p, f, offset)
    return report
