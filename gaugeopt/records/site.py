"""Where a model's attention lives: one :class:`AttentionSite` per attention layer.

Every gauge computation in gaugeopt reads and writes weights through these records, so the
layout conventions are pinned here once (docs/gauge_group.md). For ``h`` query heads, ``h_kv``
key/value heads, head widths ``d_k``/``d_v`` and model width ``d``:

====================  ======================  ==========================================
tensor                canonical view shape    meaning
====================  ======================  ==========================================
``q.weight``          ``(h, d_k, d)``         ``W_Q[i]``, row block of the query weight
``q.bias``            ``(h, d_k)``            travels with its rows
``k.weight``          ``(h_kv, d_k, d)``      ``W_K[j]``
``v.weight``          ``(h_kv, d_v, d)``      ``W_V[j]``
``o.weight``          ``(d, h, d_v)``         ``W_O[:, i]``, column block of the output weight
``o.bias``            ``(d,)``                never touched by a head gauge
``q.row_mult``        ``(h, d_k)``            LRM row multipliers ``r_Q`` (likewise k, v)
``q.col_mult``        ``(d,)``                LRM column multipliers ``c_Q`` (input side)
``o.row_mult``        ``(d,)``                ``r_O``
``o.col_mult``        ``(h, d_v)``            ``c_O``
====================  ======================  ==========================================

Query head ``i`` reads KV head ``i // (h // h_kv)``. A :class:`TensorRef` maps *any* tensor
shaped like the stored parameter (the parameter itself, its gradient, an Adam moment, an
update) to that canonical view, without copying, whatever the storage: ``nn.Linear``
(``out×in``), Hugging Face ``Conv1D`` (``in×out``), fused QKV weights, LRM multipliers.

With learnable multipliers (:mod:`gaugeopt.models.lrm`) the *effective* weight of a projection is
``diag(r)·W̄·diag(c)`` and its effective bias ``r ⊙ b̄``; :meth:`AttentionSite.effective`
and :meth:`AttentionSite.set_effective` read and write in those terms.

Adapters (``gaugeopt.adapters``) build the records for known model classes, matching the
*class* of the attention module and checking that its ``forward`` is the one they were
written for; a model they cannot prove they understand is refused with a
:class:`~gaugeopt.errors.GaugeError` that names the feature.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    >>> sites = gaugeopt.find_attention(model)
    >>> s = sites[0]
    >>> (s.name, s.h, s.h_kv, s.d_k, s.d_v, s.rope.kind)
    ('transformer.h.0.attn', 4, 2, 8, 8, 'none')
    >>> tuple(s.q.weight.get().shape), tuple(s.o.weight.get().shape)
    ((4, 8, 32), (32, 4, 8))
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.records.bias_sector import BiasSector, bias_kinds
from gaugeopt.records.latent import LatentAttention, check_latent
from gaugeopt.records.pair import GaugePair
from gaugeopt.records.rope import NO_ROPE, RopeSpec

__all__ = ["TensorRef", "ProjectionRefs", "QKNorm", "AttentionSite"]

@dataclass(frozen=True)
class TensorRef:
    """A view recipe into one stored parameter.

    The parameter is resolved lazily as ``getattr(owner, attr)`` so that a record stays valid
    when a wrapper (FSDP2's ``fully_shard``, ``torch.compile``) swaps the parameter object.

    ``view(t)`` maps a tensor ``t`` shaped like the stored parameter to the canonical view:
    transpose (for ``in×out`` storage), then ``t[index]`` along dim 0, then ``.view(shape)``.
    With ``groups`` set, dim 0 is first split into ``groups`` equal blocks and ``index`` selects
    rows *inside every block* (``t.unflatten(0, (groups, -1))[:, index]``): the rows of one
    projection in a fused layer that interleaves heads, e.g. ``[q_i, k_i, v_i]`` per head
    (GPT-NeoX, Bloom). The result always aliases ``t`` (no copy), so in-place edits reach the
    parameter.

    Attributes:
        owner: module that holds the parameter.
        attr: attribute name on ``owner``.
        name: qualified name as in ``model.named_parameters()``.
        shape: canonical view shape.
        transpose: the storage is ``in×out`` (HF ``Conv1D``).
        index: row selection in the (transposed) storage, e.g. the Q rows of a fused QKV.
        groups: split the rows into this many equal blocks first; ``index`` then selects inside each.
    """

    owner: nn.Module
    attr: str
    name: str
    shape: tuple[int, ...]
    transpose: bool = False
    index: int | slice | None = None
    groups: int | None = None

    @property
    def param(self) -> torch.Tensor:
        """The stored parameter (resolved now)."""
        return getattr(self.owner, self.attr)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """Canonical view of ``t`` (same shape as the stored parameter), aliasing ``t``."""
        x = t.t() if self.transpose else t
        if self.groups is not None:
            x = x.unflatten(0, (self.groups, -1))
            if self.index is not None:
                x = x[:, self.index]
        elif self.index is not None:
            x = x[self.index]
        return x.view(self.shape)

    def get(self) -> torch.Tensor:
        """Canonical view of the parameter itself (aliases it: edit under ``torch.no_grad()``)."""
        return self.view(self.param)

    def grad(self) -> torch.Tensor | None:
        g = self.param.grad
        return None if g is None else self.view(g)


@dataclass(frozen=True)
class ProjectionRefs:
    """The tensors of one attention projection (Q, K, V or O); any may be ``None``.

    ``weight`` is the base matrix (``W̄`` under LRM), ``bias`` the base bias, ``row_mult`` and
    ``col_mult`` the LRM multipliers.
    """

    weight: TensorRef
    bias: TensorRef | None = None
    row_mult: TensorRef | None = None
    col_mult: TensorRef | None = None

    def refs(self) -> Iterator[tuple[str, TensorRef]]:
        for role in ("weight", "bias", "row_mult", "col_mult"):
            ref = getattr(self, role)
            if ref is not None:
                yield role, ref


QK_NORM_KINDS = ("rms", "layer")
QK_NORM_SCOPES = ("head", "full")


@dataclass(frozen=True)
class QKNorm:
    """Per-head normalisation of queries and keys (QK-norm), as the attention module applies it.

    The norm removes most of ``GL(d_k)`` from the Q/K gauge and leaves a gauge on its *gains*
    instead (``docs/qk_norm.md``); a site that records one exposes that gauge as the pair
    ``"qk_gain"`` and refuses the dense ``"qk"`` pair.

    Attributes:
        kind: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm: centred, with a bias).
        q_gain, k_gain: the gains in canonical layout ``(groups, d_k)``: ``(1, d_k)`` when one gain
            vector is shared by every head (Qwen3, Gemma 3, timm), ``(h, d_k)`` / ``(h_kv, d_k)``
            when every head has its own (OLMo 2's full-width norm).
        q_bias, k_bias: LayerNorm biases, laid out like the gains (``None`` for RMSNorm).
        eps: the norm's epsilon (> 0 in every model in use: a per-head scalar on ``W_Q`` is then
            not a symmetry).
        gain_offset: the gain is ``gain_offset + stored`` (Gemma stores ``w`` and scales by ``1 + w``).
        scope: ``"head"`` (normalised over the ``d_k`` channels of each head) or ``"full"`` (over all
            ``h·d_k`` query channels and all ``h_kv·d_k`` key channels at once, OLMo 2).
        before_rope: the norm acts before RoPE (every model in use), so a gain rescale must be
            constant on each RoPE plane; after RoPE it may vary per channel.
    """

    kind: str
    q_gain: TensorRef | None
    k_gain: TensorRef | None
    q_bias: TensorRef | None = None
    k_bias: TensorRef | None = None
    eps: float = 1e-6
    gain_offset: float = 0.0
    scope: str = "head"
    before_rope: bool = True

    def __post_init__(self) -> None:
        if self.kind not in QK_NORM_KINDS:
            raise GaugeError(f"QKNorm.kind={self.kind!r} is not one of {QK_NORM_KINDS}")
        if self.scope not in QK_NORM_SCOPES:
            raise GaugeError(f"QKNorm.scope={self.scope!r} is not one of {QK_NORM_SCOPES}")
        if self.eps < 0:
            raise GaugeError(f"QKNorm.eps={self.eps!r} must be >= 0")
        if self.kind == "rms" and (self.q_bias is not None or self.k_bias is not None):
            raise GaugeError("QKNorm(kind='rms') takes no biases; a norm with a bias is kind='layer'")

    def refs(self) -> Iterator[tuple[str, TensorRef]]:
        """``("q.gain", ref)``, ``("k.gain", ref)`` and the LayerNorm biases ``("q.norm_bias", ref)``, ...
        (those present)."""
        for role, ref in (("q.gain", self.q_gain), ("k.gain", self.k_gain),
                          ("q.norm_bias", self.q_bias), ("k.norm_bias", self.k_bias)):
            if ref is not None:
                yield role, ref

    @property
    def per_head(self) -> bool:
        """Every head has its own gain vector (OLMo 2), rather than one vector shared by all heads."""
        return self.q_gain is not None and self.q_gain.shape[0] > 1


@dataclass
class AttentionSite:
    """One attention layer: its projections, head structure and position encoding.

    Attributes:
        name: qualified name of the attention module.
        module: the attention module.
        h, h_kv, d_k, d_v, d_model: head counts and widths (``h % h_kv == 0``).
        q, k, v, o: the projections (see the module docstring for the view shapes).
        rope: the RoPE convention of the queries/keys.
        kind: which adapter built the record (``"gpt"``, ``"hf_gpt2"``, ``"hf_llama"``, ...).
        layer_index: position of this site in ``find_attention``'s list.
        features: what the adapter saw (``"gqa"``, ``"fused_qkv"``, ``"rope_split_half"``, ...).
        qk_norm: the per-head Q/K normalisation, or ``None``.
        float32_steps: what the module computes in float32 even in a float64 model (e.g. ``"q·kᵀ in
            float32"``), which bounds how exactly :func:`gaugeopt.certify` can observe a gauge action
            (``""``: nothing; the certificate then demands float64 exactness).
        qk_orthogonal: why only the orthogonal part of the Q/K gauge survives (``""``: all of it): a
            weight-free norm of each query and key head (Llama 4's L2 norm) keeps ``A`` only when it
            preserves lengths, so the ``qk`` sector is ``O(d_k)`` ∩ the RoPE commutant — a rotation per
            plane, ``SO`` of the non-rotary block — and the ``"qk"`` pair (scale balancing) and ``lrm_qk``
            are not symmetries there (the projection's ``qk`` sector keeps only the plane rotations).
        sinks: the per-head *sink* logits ``s_i`` (canonical ``(h,)``), or ``None``: a learned logit that
            joins each query head's softmax as an extra column with no value (gpt-oss), so a row's weights
            sum to ``1 − p_sink < 1``. The sinks leave ``qk``, ``vo`` and head permutations (which move
            them with their heads) exact but remove the bias sectors (:mod:`gaugeopt.records.bias_sector`).
        fixed_head_order: why the heads may not be permuted (``""``: they may): a term in the scores
            that differs per head (ALiBi slopes, T5's relative position bias) ties each head to its
            position, so the permutation symmetry is gone while the per-group ``GL`` gauges remain.
        verified: set by :func:`gaugeopt.find_attention`: the record comes from a built-in adapter that
            the test suite verifies for this class (whose code must then be the library's own,
            :mod:`gaugeopt.adapters.stock`). Every record — verified or not — is proved on the model
            by the certificate before a gauge operation uses it (:mod:`gaugeopt.trust.gate`).
        latent: multi-head latent attention (DeepSeek-V2/V3, :mod:`gaugeopt.records.latent`): the record's
            ``q``/``k``/``v``/``o`` and ``rope`` describe the part without RoPE (``d_k`` is its width), and
            this holds the RoPE part, whose key all heads share, and the latent spaces; ``None`` otherwise.
    """

    name: str
    module: nn.Module
    h: int
    h_kv: int
    d_k: int
    d_v: int
    d_model: int
    q: ProjectionRefs
    k: ProjectionRefs
    v: ProjectionRefs
    o: ProjectionRefs
    rope: RopeSpec = NO_ROPE
    kind: str = "manual"
    layer_index: int = 0
    features: tuple[str, ...] = field(default_factory=tuple)
    qk_norm: QKNorm | None = None
    float32_steps: str = ""
    fixed_head_order: str = ""
    sinks: TensorRef | None = None
    qk_orthogonal: str = ""
    verified: bool = False
    latent: "LatentAttention | None" = None
    # Set by find_attention: the model the record was found in (a weak reference). Set by adapters:
    # what their forward reads besides code and tensors (a kernel registry entry, a config value), as
    # gaugeopt.adapters.stock.Binding objects the gate re-checks (gaugeopt.trust.static_checks).
    root: Any = field(default=None, repr=False, compare=False)
    adapter_bindings: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.h <= 0 or self.h_kv <= 0 or self.h % self.h_kv:
            raise GaugeError(
                f"{self.name}: num_heads={self.h} must be a positive multiple of num_kv_heads={self.h_kv}"
            )
        self.rope.check_head_dim(self.d_k)
        expect = {
            "q.weight": (self.h, self.d_k, None),
            "k.weight": (self.h_kv, self.d_k, None),
            "v.weight": (self.h_kv, self.d_v, None),
            "o.weight": (None, self.h, self.d_v),
            "q.bias": (self.h, self.d_k),
            "k.bias": (self.h_kv, self.d_k),
            "v.bias": (self.h_kv, self.d_v),
            "q.row_mult": (self.h, self.d_k),
            "k.row_mult": (self.h_kv, self.d_k),
            "v.row_mult": (self.h_kv, self.d_v),
            "o.col_mult": (self.h, self.d_v),
        }
        for proj_name in "qkvo":
            for role, ref in getattr(self, proj_name).refs():
                want = expect.get(f"{proj_name}.{role}")
                if want is None:
                    continue
                ok = len(ref.shape) == len(want) and all(w is None or w == s for w, s in zip(want, ref.shape))
                if not ok:
                    raise GaugeError(
                        f"{self.name}: {proj_name}.{role} ({ref.name}) has canonical shape {ref.shape}, "
                        f"expected {tuple('*' if w is None else w for w in want)}"
                    )
        if self.qk_norm is not None:
            self._check_qk_norm(self.qk_norm)
        if self.sinks is not None and tuple(self.sinks.shape) != (self.h,):
            raise GaugeError(f"{self.name}: sinks ({self.sinks.name}) has canonical shape {self.sinks.shape}, "
                             f"expected ({self.h},): one sink logit per query head")
        if self.latent is not None:
            if self.qk_norm is not None:
                raise GaugeError(f"{self.name}: a record with both a QK-norm and latent attention is not supported")
            check_latent(self)

    def _check_qk_norm(self, n: QKNorm) -> None:
        """Gains and biases are ``(1, d_k)`` (shared by every head) or per head: ``(h, d_k)`` on the
        query side and ``(h_kv, d_k)`` on the key side."""
        for side, heads in (("q", self.h), ("k", self.h_kv)):
            rows = set()
            for what in ("gain", "bias"):
                ref = getattr(n, f"{side}_{what}")
                if ref is None:
                    continue
                if len(ref.shape) != 2 or ref.shape[1] != self.d_k or ref.shape[0] not in (1, heads):
                    raise GaugeError(
                        f"{self.name}: qk_norm.{side}_{what} ({ref.name}) has canonical shape {ref.shape}, expected "
                        f"(1, {self.d_k}) for one vector shared by all heads or ({heads}, {self.d_k}) for one per head"
                    )
                rows.add(ref.shape[0])
            if len(rows) > 1:
                raise GaugeError(f"{self.name}: the {side.upper()}-side norm gain and bias have different layouts")

    # ------------------------------------------------------------------ structure
    @property
    def n_rep(self) -> int:
        """Query heads per KV head (``h // h_kv``)."""
        return self.h // self.h_kv

    def group_of(self, i: int) -> int:
        """KV head read by query head ``i``."""
        return i // self.n_rep

    def pair(self, kind: str) -> "GaugePair":
        """The ``"qk"``, ``"vo"``, ``"qk_gain"`` or ``"qk_rope"`` :class:`~gaugeopt.records.pair.GaugePair` of
        this site: its two sides, their members, the GQA repeat and the multiplier on each side's channel
        axis. A QK-norm site has ``"qk_gain"`` and refuses ``"qk"``; :attr:`qk_kind` says which; a latent
        attention site has ``"qk_rope"`` too (:attr:`qk_kinds`)."""
        return GaugePair.of(self, kind)

    def bias_sector(self, kind: str) -> "BiasSector":
        """The ``"key_bias"`` or ``"value_bias"`` :class:`~gaugeopt.records.bias_sector.BiasSector` of this
        site (which bias shifts, on which channels, what absorbs it); :attr:`bias_kinds` says which
        this site has."""
        return BiasSector.of(self, kind)

    @property
    def bias_kinds(self) -> tuple[str, ...]:
        """The bias sectors of this site: ``"key_bias"`` (a key bias, non-rotary channels, no QK-norm)
        and ``"value_bias"`` (value and output biases); see :mod:`gaugeopt.records.bias_sector`."""
        return bias_kinds(self)

    @property
    def qk_kind(self) -> str:
        """The pair that carries this site's Q/K gauge: ``"qk_gain"`` under QK-norm, ``"qk"`` otherwise."""
        return "qk" if self.qk_norm is None else "qk_gain"

    @property
    def qk_kinds(self) -> tuple[str, ...]:
        """Every pair that carries part of this site's Q/K gauge: :attr:`qk_kind`, and ``"qk_rope"`` (the
        RoPE part, whose key all heads share) on a multi-head latent attention site."""
        return (self.qk_kind, "qk_rope") if self.latent is not None else (self.qk_kind,)

    @property
    def has_multipliers(self) -> bool:
        """True when Q and K carry LRM row multipliers (the GaugeFix-LRM setting)."""
        return self.q.row_mult is not None and self.k.row_mult is not None

    def projections(self) -> Iterator[tuple[str, ProjectionRefs]]:
        for p in "qkvo":
            yield p, getattr(self, p)

    def refs(self) -> Iterator[tuple[str, TensorRef]]:
        """All ``(\"q.weight\", ref)``-style entries of this site, then the QK-norm's gains and
        biases (``\"q.gain\"``, ``\"k.gain\"``, ``\"q.norm_bias\"``, ``\"k.norm_bias\"``), the attention
        sinks (``\"sinks\"``), then a latent attention's RoPE rows and latents (``\"q_rope.weight\"``,
        ``\"kv_latent.up\"``, ...; the up-projections are whole tensors that the ``q``/``k``/``v`` entries
        view in part)."""
        for p, proj in self.projections():
            for role, ref in proj.refs():
                yield f"{p}.{role}", ref
        if self.qk_norm is not None:
            yield from self.qk_norm.refs()
        if self.sinks is not None:
            yield "sinks", self.sinks
        if self.latent is not None:
            yield from self.latent.refs()

    def per_query(self, x: torch.Tensor) -> torch.Tensor:
        """Expand a per-KV-group tensor ``(h_kv, ...)`` to one entry per query head ``(h, ...)``."""
        return x.repeat_interleave(self.n_rep, dim=0) if self.n_rep > 1 else x

    def parameter_names(self) -> list[str]:
        """Qualified names of the parameters this site reads (each once)."""
        seen: dict[str, None] = {}
        for _, ref in self.refs():
            seen.setdefault(ref.name, None)
        return list(seen)

    # ------------------------------------------------------------------ effective tensors
    def _mult_factors(self, p: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Row and column factors broadcastable against the canonical weight view of ``p``."""
        proj: ProjectionRefs = getattr(self, p)
        r = proj.row_mult.get().detach() if proj.row_mult is not None else None
        c = proj.col_mult.get().detach() if proj.col_mult is not None else None
        if p == "o":  # weight (d, h, d_v): rows = d, cols = (h, d_v)
            return (None if r is None else r[:, None, None]), c
        return (None if r is None else r[..., None]), c

    def effective(self, p: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Effective ``(weight, bias)`` of projection ``p`` in canonical layout (new tensors).

        ``weight = r ⊙ W̄ ⊙ c`` and ``bias = r ⊙ b̄`` under LRM; a detached copy otherwise.
        """
        proj: ProjectionRefs = getattr(self, p)
        w = proj.weight.get().detach().clone()
        r, c = self._mult_factors(p)
        if r is not None:
            w = w * r
        if c is not None:
            w = w * c
        b = None
        if proj.bias is not None:
            b = proj.bias.get().detach().clone()
            if proj.row_mult is not None:
                b = b * proj.row_mult.get().detach()
        return w, b

    @torch.no_grad()
    def set_effective_bias(self, p: str, bias: torch.Tensor) -> None:
        """Write an effective bias of projection ``p`` back (``b̄ = b ⊘ r`` under LRM), leaving the weight."""
        proj: ProjectionRefs = getattr(self, p)
        if proj.bias is None:
            raise GaugeError(f"{self.name}: projection {p!r} has no bias to write")
        b = bias
        if proj.row_mult is not None:
            b = b / proj.row_mult.get()
        proj.bias.get().copy_(b)

    @torch.no_grad()
    def set_effective(self, p: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Write an effective ``(weight, bias)`` back, dividing out the LRM multipliers."""
        proj: ProjectionRefs = getattr(self, p)
        r, c = self._mult_factors(p)
        w = weight
        if r is not None:
            w = w / r
        if c is not None:
            w = w / c
        proj.weight.get().copy_(w)
        if bias is not None:
            self.set_effective_bias(p, bias)

    @property
    def root_model(self) -> nn.Module | None:
        """The model :func:`gaugeopt.find_attention` found this record in (``None`` if built by hand or gone)."""
        return self.root() if isinstance(self.root, weakref.ref) else None

    def __repr__(self) -> str:  # compact: the dataclass default would print whole modules
        extra = f", rope={self.rope.kind}:{self.rope.rotary_dim}" if self.rope.active else ""
        lrm = ", lrm" if self.has_multipliers else ""
        norm = "" if self.qk_norm is None else f", qk_norm={self.qk_norm.kind}:{self.qk_norm.scope}"
        norm += "" if self.sinks is None else ", sinks"
        norm += ", qk=orthogonal" if self.qk_orthogonal else ""
        lat = self.latent
        mla = "" if lat is None else (
            f", latent(rope={lat.rope.kind}:{lat.r}, " + ", ".join(f"L_{x.name}={x.width}" for x in lat.latents()) + ")")
        return (
            f"AttentionSite({self.name!r}, kind={self.kind}, h={self.h}, h_kv={self.h_kv}, "
            f"d_k={self.d_k}, d_v={self.d_v}, d_model={self.d_model}{extra}{lrm}{norm}{mla})"
        )
