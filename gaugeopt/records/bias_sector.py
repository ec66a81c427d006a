"""The bias sectors of attention: the key-bias shift and the value-bias trade.

Two exact continuous symmetries of attention that the head gauges (:mod:`gaugeopt.records.pair`)
do not contain. Per KV group ``j`` (shared by its query heads ``i``), on the *effective* biases
(``r ⊙ b̄`` under learnable multipliers):

==============  ===============================================  =====================================
sector          finite action                                    dimension per layer
==============  ===============================================  =====================================
``key_bias``    ``b_K[j][c] += δ[j, c]`` on the channels ``c``    ``h_kv·(d_k − r)``  (``r`` rotated
                that RoPE does not rotate                        coordinates; needs ``b_K``)
``value_bias``  ``b_V[j] += δ[j]``,                              ``h_kv·d_v`` (needs ``b_V`` and ``b_O``)
                ``b_O −= Σ_{i∈j} W_O[:, i] δ[j]``
==============  ===============================================  =====================================

**Why they are exact.** Key bias: the score of query ``i`` against key ``j`` becomes
``q_i·(k_j + δ) = q_i·k_j + q_i·δ``, the same for every key ``j``, and softmax over the keys ignores
a shift common to all of them (a causal or padding mask only removes keys). Value bias: every row
of attention weights ``α_i·`` sums to one, so ``Σ_j α_ij (v_j + δ) = Σ_j α_ij v_j + δ`` — every head
of the group adds ``W_O[:, i] δ`` to the output, which the output bias takes back.

**Attention sinks** (gpt-oss: a learned logit ``s_i`` per query head joins the softmax as a column
with no value) remove both. The key-bias shift moves every key score by ``q_i·δ`` but not the sink's,
so the weights change; and a row of weights over the keys sums to ``1 − p_sink(i, t) < 1``, which
depends on the query, so ``Σ_j α_ij (v_j + δ) = Σ_j α_ij v_j + (1 − p_sink)δ`` is no longer a constant
the output bias can take back.

**Where they are not symmetries.** Under RoPE the key at position ``p`` is rotated, so on a rotary
coordinate the shift becomes ``q_iᵀ R_{p−i} δ``, which depends on the key's position: it changes
the function (``invalid_gauge_transform(kind="key_bias_rope")`` measures it); only the ``d_k − r``
non-rotary channels carry the key-bias sector, none under full RoPE. A QK-norm normalises the keys
after the bias, so a shift is not constant over keys there either (no ``key_bias`` on a QK-norm
site). Without an output bias nothing can absorb ``W_O δ`` (no ``value_bias``). Neither moves
``W_Q``, ``W_K``, ``W_V``, ``W_O``: the sectors act on the biases alone, and the head gauges carry
``b_K``, ``b_V`` with their rows (``b_K ← A⁻¹b_K``, ``b_V ← Cᵀb_V``), so the two families overlap
on those biases (docs/projection.md: the joint projection).

This module is the one place that says which tensors a bias sector moves; the finite actions
(:func:`gaugeopt.transforms.shift_key_bias`, :func:`gaugeopt.transforms.trade_value_bias`),
counting, the certificate, projection, canonical forms and equivalence read it through
:meth:`gaugeopt.AttentionSite.bias_sector`.

Example:
    >>> import gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_kv_head=2, n_embd=32,
    ...                 rope="split_half", rotary_dim=6)
    >>> site = gaugeopt.find_attention(GPT(cfg))[0]
    >>> site.bias_kinds
    ('key_bias', 'value_bias')
    >>> kb = site.bias_sector("key_bias")
    >>> kb.channels, kb.dim, site.bias_sector("value_bias").dim
    ((6, 7), 4, 16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gaugeopt.errors import GaugeError

if TYPE_CHECKING:  # pragma: no cover
    from gaugeopt.records.site import AttentionSite, TensorRef

__all__ = ["BIAS_SECTORS", "BiasSector", "bias_kinds", "free_key_channels", "missing_reason", "sector_dims"]

# the sectors whose actions this module defines (registered with the rest in gaugeopt.sectors.biases)
BIAS_SECTORS = ("key_bias", "value_bias")


def free_key_channels(site: "AttentionSite") -> tuple[int, ...]:
    """The channels of a key head that RoPE leaves alone (all ``d_k`` without RoPE)."""
    rotated = {c for plane in site.rope.planes(site.d_k) for c in plane}
    return tuple(c for c in range(site.d_k) if c not in rotated)


SINKS_KEY = ("its softmax has a learned sink logit per head (attention sinks), which a shift of the key scores does "
             "not move")
SINKS_VALUE = ("its attention weights sum to 1 − p_sink < 1 (attention sinks), a share that depends on the query, so "
               "no output bias can take a value shift back")


def _reason(kind: str, *, k_bias: bool, v_bias: bool, o_bias: bool, qk_norm: bool, free: int, rope: str,
            sinks: bool = False) -> str | None:
    """Why a layer with these features has no ``kind`` sector (``None``: it has one)."""
    if kind == "key_bias":
        if not k_bias:
            return "its key projection has no bias"
        if qk_norm:
            return "it normalises the keys after the bias (QK-norm), so a shift is not the same for every key"
        if not free:
            return (f"RoPE rotates every channel of its key heads ({rope}); a shift on a rotated channel depends on "
                    "the key's position and changes the function")
        if sinks:
            return SINKS_KEY
        return None
    if kind == "value_bias":
        if not v_bias:
            return "its value projection has no bias"
        if not o_bias:
            return "its output projection has no bias to absorb W_O·δ"
        if sinks:
            return SINKS_VALUE
        return None
    raise GaugeError(f"bias sector kind={kind!r} is not one of {BIAS_SECTORS}")


def missing_reason(site: "AttentionSite", kind: str) -> str | None:
    """Why ``site`` has no ``kind`` sector, or ``None`` when it has one."""
    return _reason(kind, k_bias=site.k.bias is not None, v_bias=site.v.bias is not None, o_bias=site.o.bias is not None,
                   qk_norm=site.qk_norm is not None, free=len(free_key_channels(site)),
                   rope=f"{site.rope.kind}, rotary_dim={site.rope.rotary_dim}", sinks=site.sinks is not None)


def sector_dims(*, h_kv: int, d_k: int, d_v: int, rotary_dim: int, k_bias: bool, v_bias: bool, o_bias: bool,
                qk_norm: bool, sinks: bool = False) -> dict[str, int]:
    """``{kind: dimension}`` of the bias sectors of a layer with these features (no weights needed):
    ``key_bias`` ``h_kv·(d_k − r)``, ``value_bias`` ``h_kv·d_v``, where the layer has them.

    Example:
        >>> sector_dims(h_kv=12, d_k=64, d_v=64, rotary_dim=0, k_bias=True, v_bias=True, o_bias=True, qk_norm=False)
        {'key_bias': 768, 'value_bias': 768}
    """
    flags = dict(k_bias=k_bias, v_bias=v_bias, o_bias=o_bias, qk_norm=qk_norm, free=d_k - rotary_dim, rope="", sinks=sinks)
    dims = {"key_bias": h_kv * (d_k - rotary_dim), "value_bias": h_kv * d_v}
    return {k: n for k, n in dims.items() if _reason(k, **flags) is None}


def bias_kinds(site: "AttentionSite") -> tuple[str, ...]:
    """The bias sectors ``site`` has (see the module docstring for the conditions)."""
    return tuple(k for k in BIAS_SECTORS if missing_reason(site, k) is None)


@dataclass(frozen=True)
class BiasSector:
    """The ``key_bias`` or ``value_bias`` sector of one attention site.

    Attributes:
        kind: ``"key_bias"`` or ``"value_bias"``.
        site: the :class:`~gaugeopt.AttentionSite`.
        proj: the projection whose bias shifts (``"k"`` or ``"v"``).
        channels: the shifted channels of each of its heads (the non-rotary ones for ``key_bias``,
            all ``d_v`` for ``value_bias``).
        absorber: the projection whose bias takes the shift back through its weight (``"o"`` for
            ``value_bias``; ``None`` for ``key_bias``: softmax absorbs it).
    """

    kind: str
    site: "AttentionSite"
    proj: str
    channels: tuple[int, ...]
    absorber: str | None

    @property
    def bias(self) -> "TensorRef":
        """The shifted bias, canonical ``(h_kv, width)`` (the base bias ``b̄`` under LRM)."""
        return getattr(self.site, self.proj).bias

    @property
    def mult(self) -> "TensorRef | None":
        """The LRM row multiplier of the shifted bias (``r_K`` or ``r_V``), or ``None``."""
        return getattr(self.site, self.proj).row_mult

    @property
    def groups(self) -> int:
        return self.site.h_kv

    @property
    def dim(self) -> int:
        """Dimension of the sector: ``h_kv · len(channels)``."""
        return self.site.h_kv * len(self.channels)

    @staticmethod
    def of(site: "AttentionSite", kind: str) -> "BiasSector":
        """The sector ``kind`` of ``site`` (prefer :meth:`gaugeopt.AttentionSite.bias_sector`)."""
        why = missing_reason(site, kind)
        if why is not None:
            raise GaugeError(f"{site.name} has no {kind!r} sector: {why}")
        if kind == "key_bias":
            return BiasSector(kind, site, "k", free_key_channels(site), None)
        return BiasSector(kind, site, "v", tuple(range(site.d_v)), "o")

    # ------------------------------------------------------------------ the action on effective tensors
    def _check(self, delta: torch.Tensor) -> None:
        want = (self.site.h_kv, len(self.channels))
        if tuple(delta.shape) != want:
            raise GaugeError(f"{self.site.name}: the {self.kind} shift has shape {tuple(delta.shape)}, expected {want}")

    def shifted(self, bias: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``bias`` (effective, ``(h_kv, width)``) with ``δ (h_kv, len(channels))`` added on :attr:`channels`."""
        self._check(delta)
        out = bias.clone()
        idx = list(self.channels)
        out[:, idx] = out[:, idx] + delta.to(out)
        return out

    def absorbed(self, out_bias: torch.Tensor, out_weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``value_bias``: the output bias after the trade, ``b_O − Σ_i W_O[:, i] δ[g(i)]``
        (effective ``out_weight`` in canonical layout ``(d, h, d_v)``)."""
        if self.absorber is None:
            raise GaugeError(f"{self.site.name}: the {self.kind} sector moves no output bias")
        self._check(delta)
        per_query = self.site.per_query(delta.to(out_weight))  # (h, d_v)
        return out_bias - torch.einsum("dhv,hv->d", out_weight, per_query).to(out_bias)
