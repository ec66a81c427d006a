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

**QK-norm.** When queries and keys are normalised before they meet (``site.qk_norm``), ``GL(d_k)``
on ``W_Q``/``W_K`` is no longer a symmetry and the Q/K gauge moves the norm's *gains* instead
(docs/qk_norm.md): the pair ``"qk_gain"`` has side ``a`` = the query gains ``g_q`` (with the LayerNorm
bias ``β_q``, which travels with them), side ``b`` = the key gains ``g_k`` (and ``β_k``), acted on by
``g_q ← g_q ⊙ d``, ``g_k ← g_k ⊘ d`` — a diagonal action, constant on each RoPE plane when the norm
acts before RoPE. One gain vector shared by every head gives ``groups = 1`` (one factor per slot for
the whole layer); per-head gains give ``groups = h_kv`` (a factor tied across the query heads of a KV
group, which share the key gain). A gain stored with an offset (Gemma: the gain is ``1 + w``) is
scaled as ``w ← (1 + w)·d − 1``; :attr:`Member.offset` carries the ``1``.

**Multi-head latent attention** (:mod:`gaugeopt.records.latent`, docs/mla.md). Its part without RoPE is
the ``"qk"`` pair above; its RoPE part is the pair ``"qk_rope"``: side ``a`` the RoPE query rows of
every head (``W_qb[i][n:]``, with their bias), side ``b`` the one key all heads share (the last ``r``
rows of the key–value down-projection and their bias) — a multi-query pair, ``groups = 1``, side ``a``
repeating ``h`` times, acted on by the RoPE commutant of the shared key.

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
from gaugeopt.records.rope import NO_ROPE, RopeSpec

if TYPE_CHECKING:  # pragma: no cover
    from gaugeopt.records.site import AttentionSite, TensorRef

__all__ = ["PAIRS", "Member", "PairSide", "GaugePair", "query_rows"]

PAIRS = ("qk", "vo", "qk_gain", "qk_rope")
SIDE_KINDS = ("rows", "gain")


@dataclass(frozen=True)
class Member:
    """One stored tensor of a side, in the side's channel layout.

    ``role`` is ``"<proj>.<weight|bias|row_mult|col_mult|gain|norm_bias>"``; ``columns`` says that the
    channels are the second and third axes of the canonical view (the O weight ``(d, h, d_v)``) rather
    than the first two (``(heads, width, ...)``). A per-channel factor is constant along the
    remaining axis (:attr:`broadcast_axis`, ``None`` for 1-D biases, multipliers and gains).

    ``offset``: the value a factor scales is ``stored + offset`` (Gemma's gain ``1 + w``: offset 1), so
    a rescale by ``s`` writes ``(stored + offset)·s − offset``; its derivative is still ``s``, so the
    optimizer state transports as for ``offset = 0``. ``measured``: the tensor enters the side's scale
    (a LayerNorm bias is rescaled with its gain but does not define the gain's scale).
    """

    role: str
    ref: "TensorRef"
    columns: bool = False
    offset: float = 0.0
    measured: bool = True

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
            On a gain side (``kind="gain"``): the norm's gain, canonical ``(heads, width)``.
        bias: the bias that travels with the rows (``None`` for O and for bias-free layers); on a
            gain side the LayerNorm bias.
        mult: the LRM multiplier on the channel axis (``r`` for Q/K/V, ``c_O`` for O), or ``None``.
        heads: rows of this side's tensors (``h`` for Q and O, ``h_kv`` for K and V; a gain vector
            shared by every head is one row).
        repeat: rows of this side per group of the pair.
        columns: the channel axis is the weight's input axis (the O side).
        kind: ``"rows"`` (projection rows or columns) or ``"gain"`` (a QK-norm gain).
        offset: the gain's stored offset (the gain is ``offset + stored``; Gemma: 1).
    """

    proj: str
    weight: "TensorRef"
    bias: "TensorRef | None"
    mult: "TensorRef | None"
    heads: int
    repeat: int
    columns: bool
    kind: str = "rows"
    offset: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SIDE_KINDS:
            raise GaugeError(f"PairSide.kind={self.kind!r} is not one of {SIDE_KINDS}")
        if self.offset and self.kind != "gain":
            raise GaugeError(f"PairSide: an offset ({self.offset}) belongs to a QK-norm gain, not to projection rows")

    def members(self, mode: str) -> tuple[Member, ...]:
        """The tensors a diagonal gauge of this side rescales: ``"lrm"`` — the multiplier;
        ``"plain"`` — the weight and the bias that travels with it; ``"gain"`` (a gain side) — the
        gain, then the LayerNorm bias that travels with it (rescaled, not measured)."""
        if self.kind == "gain" or mode == "gain":
            if self.kind != "gain" or mode != "gain":
                what = "a QK-norm gain" if self.kind == "gain" else f"the {self.proj.upper()} projection"
                raise GaugeError(
                    f"{self.weight.name}: mode={mode!r} does not apply to {what}; QK-norm gains take mode 'gain', "
                    "projection rows 'plain' or 'lrm'"
                )
            out = (Member(f"{self.proj}.gain", self.weight, offset=self.offset),)
            if self.bias is not None:
                out += (Member(f"{self.proj}.norm_bias", self.bias, measured=False),)
            return out
        if mode == "lrm":
            if self.mult is None:
                raise GaugeError(f"{self.weight.name}: no learnable multiplier on the {self.proj.upper()} side")
            role = "col_mult" if self.columns else "row_mult"
            return (Member(f"{self.proj}.{role}", self.mult),)
        if mode != "plain":
            raise GaugeError(f"mode={mode!r} is not 'lrm', 'plain' or 'gain'")
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


def query_rows(site: "AttentionSite") -> PairSide:
    """The rows ``[W_Q[i] | b_Q[i]]`` of the query heads, grouped by KV group: side ``a`` of the ``"qk"``
    pair, and how tools that read the query projection (Gram matrices, canonical metrics) group it
    whether or not the site normalises queries (a QK-norm site has no ``"qk"`` pair)."""
    q = site.q
    return PairSide("q", q.weight, q.bias, q.row_mult, site.h, site.n_rep, False)


@dataclass(frozen=True)
class GaugePair:
    """The ``qk``, ``vo``, ``qk_gain`` or ``qk_rope`` pair of one attention site (see the module docstring).

    Attributes:
        kind: ``"qk"``, ``"vo"``, ``"qk_gain"`` or ``"qk_rope"``.
        site: the :class:`~gaugeopt.AttentionSite`.
        a, b: the sides (Q and K, V and O, or the query and key gains).
        width: channels per head (``d_k`` or ``d_v``).
        rope: the rotation the group must commute with (the site's RoPE for ``qk``, none for ``vo``;
            for ``qk_gain`` the site's RoPE when the norm acts before it, none when after).
        groups: independent group elements (``h_kv``: one per KV group; ``1`` for a gain vector
            shared by every head); side ``a`` holds ``groups · a.repeat`` rows, side ``b``
            ``groups · b.repeat``.
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

    @property
    def query_heads_per_group(self) -> int:
        """Query heads one group element acts on (all ``h`` for a gain vector shared by every head)."""
        return self.site.h // self.groups if self.kind != "vo" else 1

    def sides(self) -> tuple[PairSide, PairSide]:
        return self.a, self.b

    @staticmethod
    def of(site: "AttentionSite", kind: str, *, orthogonal_ok: bool = False) -> "GaugePair":
        """The pair ``kind`` of ``site`` (prefer :meth:`gaugeopt.AttentionSite.pair`).

        ``orthogonal_ok``: return the ``"qk"`` pair of a site that keeps only the orthogonal part of
        its Q/K gauge (``site.qk_orthogonal``) — for code that restricts itself to that part (the
        projection's RoPE-plane rotations); everything else gets the refusal."""
        if kind == "qk" and site.qk_norm is not None:
            raise GaugeError(
                f"{site.name} normalises queries and keys per head (QK-norm, {site.qk_norm.kind}): GL(d_k) on W_Q/W_K "
                "is not a symmetry of it; its Q/K gauge acts on the norm's gains (the 'qk_gain' pair, docs/qk_norm.md)"
            )
        if kind == "qk" and site.qk_orthogonal and not orthogonal_ok:
            raise GaugeError(
                f"{site.name}: only the orthogonal part of GL(d_k) is a Q/K symmetry here ({site.qk_orthogonal}); the "
                "'qk' pair rescales queries against keys, which the norm undoes, so it has no Q/K pair to balance"
            )
        if kind == "qk_gain":
            return GaugePair._gain_pair(site)
        if kind == "qk_rope":
            lat = site.latent
            if lat is None:
                raise GaugeError(
                    f"{site.name} is not multi-head latent attention, so it has no 'qk_rope' pair (a RoPE key shared "
                    "by all heads); its Q/K gauge is the pair site.qk_kind names"
                )
            return GaugePair(
                "qk_rope", site,
                PairSide("q", lat.q_rope, lat.q_rope_bias, None, site.h, site.h, False),
                PairSide("k", lat.k_rope, lat.k_rope_bias, None, 1, 1, False),
                lat.r, lat.rope, 1,
            )
        if kind == "qk":
            k = site.k
            return GaugePair(
                "qk", site,
                query_rows(site),
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

    @staticmethod
    def _gain_pair(site: "AttentionSite") -> "GaugePair":
        n = site.qk_norm
        if n is None:
            raise GaugeError(
                f"{site.name} has no QK-norm, so it has no 'qk_gain' pair: its Q/K gauge acts on W_Q/W_K (the 'qk' "
                "pair; site.qk_kind names the right one)"
            )
        if n.q_gain is None or n.k_gain is None:
            raise GaugeError(
                f"{site.name}: the QK-norm has no learnable gain on the {'query' if n.q_gain is None else 'key'} side, "
                "so no continuous Q/K gauge is left (only V/O); gaugeopt needs both gains to build the 'qk_gain' pair"
            )
        if n.q_gain.param is n.k_gain.param:
            raise GaugeError(
                f"{site.name}: queries and keys share one norm gain ({n.q_gain.name}); g_q ⊙ d, g_k ⊘ d cannot act on "
                "one tensor, so no continuous Q/K gauge is left"
            )
        rq, rk = n.q_gain.shape[0], n.k_gain.shape[0]
        if rq == 1 and rk == 1:
            groups, rep_q, rows_q, rows_k = 1, 1, 1, 1
        elif rq == site.h and rk == site.h_kv:
            groups, rep_q, rows_q, rows_k = site.h_kv, site.n_rep, site.h, site.h_kv
        else:
            raise GaugeError(
                f"{site.name}: the query gains have {rq} rows and the key gains {rk}; gaugeopt handles one gain vector "
                f"shared by all heads on both sides, or one per head on both sides ({site.h} and {site.h_kv})"
            )
        return GaugePair(
            "qk_gain", site,
            PairSide("q", n.q_gain, n.q_bias, None, rows_q, rep_q, False, "gain", n.gain_offset),
            PairSide("k", n.k_gain, n.k_bias, None, rows_k, 1, False, "gain", n.gain_offset),
            site.d_k, site.rope if n.before_rope else NO_ROPE, groups,
        )
