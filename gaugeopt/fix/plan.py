"""The plan of a gauge fix: which tensors form each side, and which channels share one scale.

A :class:`PairPlan` is built once from an :class:`~gaugeopt.AttentionSite`'s
:class:`~gaugeopt.records.pair.GaugePair` and the options; no tensor is read. The fix
(:mod:`gaugeopt.fix.gaugefix`), its drift metrics (:mod:`gaugeopt.fix.drift`) and both fix
backends consume plans.

**Mode** — what a side's scale is measured on and what the factor rescales:

* ``"lrm"``: the learnable multiplier on the side's channel axis (``r_Q``, ``r_K``, ``r_V``, ``c_O``);
* ``"plain"``: the stored rows and the bias that travels with them (``[W | b]`` is one augmented
  matrix; the O side is the columns ``W_O[:, i]``). The per-head scalar gauge ``A = g·I`` is a
  subgroup of ``GL(d_k)``, so this is a section of the full gauge for any attention;
* ``"auto"``: multipliers where the site has them; on a QK-norm site (``site.qk_norm``) the norm's
  **gains** ``g_q`` vs ``g_k`` (the ``"qk_gain"`` pair; docs/qk_norm.md). There the rows of
  ``W_Q``/``W_K`` and the multipliers ``r_Q``/``r_K`` are not a symmetry (the norm undoes a
  rescale only up to its epsilon, and only when uniform over a head), so ``"lrm"`` and ``"plain"``
  are refused on such a site's Q/K pair; its V/O pair follows the rules above. A plan of a
  gain pair reports mode ``"gain"``.

**Multi-head latent attention** (docs/mla.md): the Q/K gauge is two pairs, each balanced on its own
— the part without RoPE per head (``W_qb[i][:n]`` against ``W_kvb[i][:n]``; no RoPE, so ``"auto"`` is
per head and ``"channel"`` is allowed), and the RoPE part per plane across all heads against the one
key they share (``"auto"``: per plane; ``"channel"`` is refused there). Multipliers are not supported
on these layers, so the mode is ``"plain"``. The latent spaces' gains are left alone (docs/mla.md says why).

**Granularity** — which channels of a head share one scale (a *slot*):

* ``"head"``    — one slot per KV group (paper 002);
* ``"channel"`` — one slot per channel; refused under RoPE, where scaling the two coordinates of a
  rotation plane differently does not commute with the rotation;
* ``"plane"``   — one slot per RoPE plane, and one per non-rotary channel
  (:func:`gaugeopt.records.rope.plane_index`); without RoPE it equals ``"channel"``;
* ``"auto"``    — ``"plane"`` under RoPE, ``"head"`` otherwise; for QK-norm gains the finest slots
  the gain gauge allows: ``"plane"`` when the norm acts before RoPE, ``"channel"`` otherwise.

Example:
    >>> import gaugeopt
    >>> from gaugeopt.fix.plan import plan_pairs
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_kv_head=2,
    ...                                          n_embd=32, rope="split_half")))
    >>> plan = plan_pairs(gaugeopt.find_attention(model))[0]
    >>> plan.mode, plan.granularity, plan.n_slots, [m.role for m in plan.members_a]
    ('lrm', 'plane', 4, ['q.row_mult'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.fix.options import (
    GRANULARITIES, FIX_MODES, VO_GRANULARITIES, FixOptions, check_choice, resolve_options,
)
from gaugeopt.records.pair import GaugePair, Member, PairSide
from gaugeopt.records.rope import plane_index
from gaugeopt.records.site import AttentionSite

__all__ = [
    "GRANULARITIES",
    "VO_GRANULARITIES",
    "FIX_MODES",
    "PairPlan",
    "plan_pairs",
    "check_choice",
    "check_fix_options",
    "plan_parameters",
]

FIX_KINDS = ("qk", "vo")  # "qk": the site's Q/K gauge, on its gains under QK-norm (AttentionSite.qk_kind)
PLAN_FIELDS = ("granularity", "vo_granularity", "mode")  # the options a plan reads


def check_fix_options(**options) -> None:
    """Validate fix options given as keyword arguments (:class:`~gaugeopt.fix.options.FixOptions`
    does it; this spelling stays for callers that validate without keeping the object)."""
    resolve_options(None, options, "check_fix_options")


@dataclass(frozen=True)
class PairPlan:
    """What the fix of one gauge pair (Q/K or V/O) of one attention site touches.

    Side ``a`` (Q or V) is divided by the gauge factor ``g``, side ``b`` (K or O) multiplied.
    ``slot[c]`` is the scale slot of channel ``c`` (``(width,)`` long, values ``< n_slots``).

    Attributes:
        pair: the site's :class:`~gaugeopt.records.pair.GaugePair`.
        mode: ``"lrm"``, ``"plain"`` or ``"gain"`` (resolved; ``"gain"`` for a QK-norm site's gains).
        granularity: ``"head"``, ``"channel"`` or ``"plane"`` (resolved).
        members_a, members_b: the tensors each side's factor rescales.
    """

    pair: GaugePair
    mode: str
    granularity: str
    members_a: tuple[Member, ...]
    members_b: tuple[Member, ...]
    slot: torch.Tensor
    n_slots: int

    @property
    def site(self) -> AttentionSite:
        return self.pair.site

    @property
    def kind(self) -> str:
        return self.pair.kind

    @property
    def a(self) -> PairSide:
        return self.pair.a

    @property
    def b(self) -> PairSide:
        return self.pair.b

    @property
    def groups(self) -> int:
        """Independent factors per slot (``h_kv``; ``1`` for a gain vector shared by every head)."""
        return self.pair.groups

    @property
    def width(self) -> int:
        return int(self.slot.numel())

    def sides(self) -> tuple[tuple[PairSide, tuple[Member, ...]], tuple[PairSide, tuple[Member, ...]]]:
        """``((a, members_a), (b, members_b))``."""
        return (self.pair.a, self.members_a), (self.pair.b, self.members_b)

    @property
    def heads_per_group(self) -> int:
        """Query heads one group's factor acts on (what ``heads_fixed`` counts per changed group)."""
        return self.pair.query_heads_per_group

    def batch_key(self) -> tuple:
        """Plans with equal keys are stacked along a layer axis and balanced in one call."""
        return (self.kind, self.groups, self.a.repeat, self.b.repeat, tuple(self.slot.tolist()), self.n_slots)


def _resolve_mode(pair: GaugePair, mode: str) -> str:
    if pair.kind == "qk_gain":
        if mode != "auto":
            raise GaugeError(
                f"mode={mode!r} on {pair.site.name}, which normalises queries and keys (QK-norm): rescaling "
                f"{'the multipliers r_Q/r_K' if mode == 'lrm' else 'the rows of W_Q/W_K'} is not a symmetry there (the "
                "norm undoes a rescale only up to its epsilon, and only when uniform over a head). Its Q/K gauge acts "
                "on the norm's gains: use mode='auto', which balances g_q against g_k (docs/qk_norm.md)"
            )
        return "gain"
    have = pair.has_multipliers
    if mode == "lrm" and not have:
        a, b = pair.a, pair.b
        need = f"{a.proj}.{'col' if a.columns else 'row'}_mult and {b.proj}.{'col' if b.columns else 'row'}_mult"
        raise GaugeError(
            f"mode='lrm' but {pair.site.name} has no learnable multipliers ({need}); convert the model with "
            "gaugeopt.apply_lrm, or use mode='plain' (rescale the W rows and biases) or mode='auto'"
        )
    if mode == "auto":
        return "lrm" if have else "plain"
    return mode


def _slots(pair: GaugePair, granularity: str) -> tuple[str, torch.Tensor, int]:
    width, rope = pair.width, pair.rope
    if granularity == "auto":
        granularity = "plane" if rope.active else ("channel" if pair.kind == "qk_gain" else "head")
    if granularity == "head":
        return "head", torch.zeros(width, dtype=torch.long), 1
    if granularity == "channel":
        if rope.active:
            raise GaugeError(
                f"granularity='channel' on {pair.site.name}, which uses RoPE ({rope.kind}, rotary_dim="
                f"{rope.rotary_dim}): scaling the two coordinates of a rotation plane differently does not commute "
                "with the position-dependent rotation, so q·k (and the model) would change. Use granularity='plane' "
                "(one scale per RoPE plane, the finest valid diagonal gauge), 'head', or 'auto' (plane under RoPE)"
            )
        return "channel", torch.arange(width), width
    if granularity == "plane":
        if pair.kind == "vo":
            raise GaugeError("vo_granularity='plane': V/O has no rotation planes; use 'head' or 'channel'")
        idx = plane_index(rope, width)
        return "plane", idx, int(idx.max()) + 1
    raise GaugeError(f"granularity={granularity!r} is not one of {GRANULARITIES}")


def plan_pairs(
    sites: Sequence[AttentionSite],
    options: FixOptions | None = None,
    *,
    kinds: Sequence[str] | None = None,
    **fields,
) -> list[PairPlan]:
    """Build the fix/metric plan for ``sites`` (no tensor is read).

    Args:
        options: the fix's :class:`~gaugeopt.fix.options.FixOptions` (``None``: the defaults);
            a plan reads its ``granularity``, ``vo_granularity`` and ``mode``, which may also be
            given as keyword arguments (replacing those of ``options``):
            ``granularity`` — the Q/K slots (``"auto"``: per RoPE plane where the site uses RoPE,
            per head otherwise; per channel for gains without RoPE); ``vo_granularity`` — the V/O
            slots; ``mode`` — ``"lrm"`` (multipliers; refuses a site without them), ``"plain"``
            (stored rows and biases) or ``"auto"`` (multipliers where present).
        kinds: ``"qk"`` and/or ``"vo"`` (default: ``options.kinds``, ``("qk",)`` without options).
            ``"qk"`` is each site's Q/K gauge: the ``"qk_gain"`` pair on a
            QK-norm site, the ``"qk"`` pair elsewhere (:attr:`~gaugeopt.AttentionSite.qk_kind`), and on
            multi-head latent attention also the ``"qk_rope"`` pair of its RoPE part — one plan each
            (:attr:`~gaugeopt.AttentionSite.qk_kinds`; docs/mla.md).
    """
    opts = resolve_options(options, fields, "plan_pairs", accepted=PLAN_FIELDS)
    kinds = opts.kinds if kinds is None else tuple(kinds)
    for k in kinds:
        check_choice("kind", k, FIX_KINDS)
    granularity, vo_granularity, mode = opts.granularity, opts.vo_granularity, opts.mode
    plans = []
    for site in sites:
        for kind in kinds:
            if kind == "qk" and site.qk_orthogonal:
                continue  # the norm fixes each head's scale: no Q/K scale is a gauge there
            for pair_kind in (site.qk_kinds if kind == "qk" else (kind,)):
                pair = site.pair(pair_kind)
                m = _resolve_mode(pair, mode)
                gran, slot, n_slots = _slots(pair, granularity if kind == "qk" else vo_granularity)
                plans.append(PairPlan(pair, m, gran, pair.a.members(m), pair.b.members(m), slot, n_slots))
    return plans


def plan_parameters(plans: Sequence[PairPlan]) -> dict[int, tuple[str, torch.Tensor]]:
    """``id → (name, parameter)`` of every tensor the plans rescale, each once, in plan order."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for plan in plans:
        for _, members in plan.sides():
            for m in members:
                out.setdefault(id(m.ref.param), (m.ref.name, m.ref.param))
    return out
