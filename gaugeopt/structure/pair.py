"""The two sides of a gauge sector: which tensors a group element moves, and how.

Every head gauge of attention pairs two projections of one KV group ``j``. An element of the
group acts on side ``a`` by ``Mᵀ`` and on side ``b`` by ``M⁻¹`` (a finite action; its generator
``X`` moves ``a`` by ``Xᵀa`` and ``b`` by ``−Xb``), so that the pairing between them — the scores
``q·k`` or the output ``W_O v`` — is unchanged:

======  =============================================  ==============================================
pair    side ``a`` (acted on by ``Mᵀ``)                   side ``b`` (acted on by ``M⁻¹``)
======  =============================================  ==============================================
``qk``  rows ``[W_Q[i] | b_Q[i]]`` of the query heads  rows ``[W_K[j] | b_K[j]]`` of the KV head
        ``i`` of group ``j``; multipliers ``r_Q[i]``      ``j``; multipliers ``r_K[j]``
``vo``  rows ``[W_V[j] | b_V[j]]``; multipliers ``r_V[j]``  columns ``W_O[:, i]`` of the query heads ``i``
                                                      of group ``j``; multipliers ``c_O[i]``
======  =============================================  ==============================================

(``M = A`` for Q/K, ``M = C`` for V/O.) The O bias is added after the heads are summed and never
moves; biases of Q, K and V travel with their rows. Each side holds ``repeat`` heads per KV group
(``h / h_kv`` for Q and O, one for K and V), and its *channel axis* — the one a diagonal gauge
scales — is the rows of a Q/K/V weight but the *columns* of the O weight: :attr:`PairSide.columns`.

This module is the one place that says which tensor is on which side. GaugeFix and its drift
metrics, optimizer-state transport, every projection sector, the kernels and canonical forms read
it through :meth:`gaugeopt.AttentionSite.pair`.

Under learnable multipliers (``W = diag(r)·W̄·diag(c)``) the multiplier on a side's channel axis
(``r`` for Q, K, V; ``c`` for O) is the side's :attr:`~PairSide.mult`: a GaugeFix moves it
instead of the rows, and a generator of ``W`` expressed in ``W̄`` coordinates is *twisted* by it
(``δW̄ = diag(r)⁻¹ Xᵀ diag(r) W̄``).

Example:
    >>> import gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> site = gaugeopt.find_attention(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4,
    ...                                              n_kv_head=2, n_embd=32)))[0]
    >>> vo = site.pair("vo")
    >>> (vo.a.proj, vo.a.repeat, vo.a.columns), (vo.b.proj, vo.b.repeat, vo.b.columns)
    (('v', 1, False), ('o', 2, True))
    >>> [m.role for m in vo.b.members("plain")], [m.role for m in site.pair("qk").a.members("plain")]
    (['o.weight'], ['q.weight', 'q.bias'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.structure.rope import NO_ROPE, RopeSpec

if TYPE_CHECKING:  # pragma: no cover
    from gaugeopt.structure.site import AttentionSite, TensorRef

__all__ = ["PAIRS", "Member", "PairSide", "GaugePair"]

PAIRS = ("qk", "vo")


@dataclass(frozen=True)
class Member:
    """One stored tensor of a side, in the side's channel layout.

    ``role`` is ``"<proj>.<weight|bias|row_mult|col_mult>"``; ``columns`` says that the channels
    are the second and third axes of the canonical view (the O weight ``(d, h, d_v)``) rather
    than the first two (``(heads, width, ...)``). A per-channel factor is constant along the
    remaining axis (:attr:`broadcast_axis`, ``None`` for 1-D biases and multipliers).
    """

    role: str
    ref: "TensorRef"
    columns: bool = False

    @property
    def broadcast_axis(self) -> int | None:
        """Axis of the canonical view along which a per-channel factor is constant."""
        if len(self.ref.shape) == 2:
            return None
        return 0 if self.columns else len(self.ref.shape) - 1


@dataclass(frozen=True)
class PairSide:
    """One side of a :class:`GaugePair`.

    Attributes:
        proj: ``"q"``, ``"k"``, ``"v"`` or ``"o"``.
        weight: the (base) weight; canonical ``(heads, width, m)``, or ``(m, heads, width)`` for O.
        bias: the bias that travels with the rows (``None`` for O and for bias-free layers).
        mult: the LRM multiplier on the channel axis (``r`` for Q/K/V, ``c_O`` for O), or ``None``.
        heads: heads on this side (``h`` for Q and O, ``h_kv`` for K and V).
        repeat: heads of this side per KV group.
        columns: the channel axis is the weight's input axis (the O side).
    """

    proj: str
    weight: "TensorRef"
    bias: "TensorRef | None"
    mult: "TensorRef | None"
    heads: int
    repeat: int
    columns: bool

    def members(self, mode: str) -> tuple[Member, ...]:
        """The tensors a diagonal gauge of this side rescales: ``"lrm"`` — the multiplier;
        ``"plain"`` — the weight and the bias that travels with it."""
        if mode == "lrm":
            if self.mult is None:
                raise GaugeError(f"{self.weight.name}: no learnable multiplier on the {self.proj.upper()} side")
            role = "col_mult" if self.columns else "row_mult"
            return (Member(f"{self.proj}.{role}", self.mult),)
        if mode != "plain":
            raise GaugeError(f"mode={mode!r} is not 'lrm' or 'plain'")
        out = (Member(f"{self.proj}.weight", self.weight, self.columns),)
        if self.bias is not None:
            out += (Member(f"{self.proj}.bias", self.bias),)
        return out

    def rows(self, w: torch.Tensor) -> torch.Tensor:
        """A canonical weight view as rows ``(heads, width, m)`` (the O columns transposed; a view)."""
        return w.permute(1, 2, 0) if self.columns else w

    def unrows(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rows`: ``(heads, width, m)`` back to the canonical weight layout."""
        return rows.permute(2, 0, 1) if self.columns else rows

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``(heads, ...)`` → ``(h_kv, repeat, ...)``: this side's heads per KV group."""
        return x.reshape(self.heads // self.repeat, self.repeat, *x.shape[1:])

    def stack(self, rows: torch.Tensor) -> torch.Tensor:
        """``(heads, width, m)`` → ``(groups, width, repeat·m)``: the rows of each group's heads side
        by side, so that ``S Sᵀ = Σ_i rows_i rows_iᵀ`` over the group (a Gram matrix per group)."""
        g = self.grouped(rows)  # (groups, repeat, width, m)
        return g.permute(0, 2, 1, 3).reshape(g.shape[0], g.shape[2], -1)

    def expand(self, per_group: torch.Tensor) -> torch.Tensor:
        """``(h_kv, ...)`` → ``(heads, ...)``: a per-KV-group value for every head of this side."""
        return per_group.repeat_interleave(self.repeat, dim=0) if self.repeat > 1 else per_group


@dataclass(frozen=True)
class GaugePair:
    """The ``qk`` or ``vo`` pair of one attention site (see the module docstring).

    Attributes:
        kind: ``"qk"`` or ``"vo"``.
        site: the :class:`~gaugeopt.AttentionSite`.
        a, b: the sides (Q and K, or V and O).
        width: channels per head (``d_k`` or ``d_v``).
        rope: the rotation the group must commute with (the site's RoPE for ``qk``, none for ``vo``).
        groups: independent group elements (``h_kv``: one per KV group); side ``a`` holds
            ``groups · a.repeat`` heads, side ``b`` ``groups · b.repeat``.
    """

    kind: str
    site: "AttentionSite"
    a: PairSide
    b: PairSide
    width: int
    rope: RopeSpec
    groups: int

    @property
    def has_multipliers(self) -> bool:
        """Both sides carry a learnable multiplier on their channel axis."""
        return self.a.mult is not None and self.b.mult is not None

    def sides(self) -> tuple[PairSide, PairSide]:
        return self.a, self.b

    @staticmethod
    def of(site: "AttentionSite", kind: str) -> "GaugePair":
        """The pair ``kind`` of ``site`` (prefer :meth:`gaugeopt.AttentionSite.pair`)."""
        if kind == "qk" and site.qk_norm is not None:
            raise GaugeError(
                f"{site.name} normalises queries and keys per head (QK-norm, {site.qk_norm.kind}): GL(d_k) on W_Q/W_K "
                "is not a symmetry of it; its Q/K gauge acts on the norm's gains (the 'qk_gain' pair, docs/qk_norm.md)"
            )
        if kind == "qk":
            q, k = site.q, site.k
            return GaugePair(
                "qk", site,
                PairSide("q", q.weight, q.bias, q.row_mult, site.h, site.n_rep, False),
                PairSide("k", k.weight, k.bias, k.row_mult, site.h_kv, 1, False),
                site.d_k, site.rope, site.h_kv,
            )
        if kind == "vo":
            v, o = site.v, site.o
            return GaugePair(
                "vo", site,
                PairSide("v", v.weight, v.bias, v.row_mult, site.h_kv, 1, False),
                PairSide("o", o.weight, None, o.col_mult, site.h, site.n_rep, True),
                site.d_v, NO_ROPE, site.h_kv,
            )
        raise GaugeError(f"pair kind={kind!r} is not one of {PAIRS}")
