"""Declarative adapters: describe an attention class once, get its :class:`AttentionSite` records.

An :class:`AttentionSpec` says where an attention module keeps its projections and how its heads
are laid out; :meth:`AttentionSpec.register` teaches :func:`gaugeopt.find_attention` the class.
It is what the built-in adapters for nanoGPT, litgpt, timm, torchtitan and most Hugging Face
families are written with, and what you write for your own model (``docs/adapters.md``):

==================  ==========================================================================
field               meaning
==================  ==========================================================================
``q, k, v``         attribute paths of separate Q/K/V linears (``"q_proj"``, ``"self.query"``)
``qkv, fused``      or one fused linear and its row layout: ``"concat"`` (``[Q|K|V]``), ``"grouped"``
                    (``[q_(g,·), k_g, v_g]`` per KV group), ``"per_head"`` (``[q_i, k_i, v_i]``)
``o``               attribute path of the output linear
``num_heads``, ...  head counts and widths: an int, an attribute path (``"config.n_head"``) or
                    a callable ``module -> int``; widths default to rows / heads
``rope``            a :class:`~gaugeopt.records.rope.RopeSpec` or ``module -> RopeSpec``
``qk_norm``         a :class:`QKNormSpec` (or ``module -> QKNormSpec | None``) when the module
                    normalises queries and keys per head; the record then carries a
                    :class:`~gaugeopt.records.site.QKNorm`
``refuse``          ``module -> reason | None``: features the gauge cannot survive (checked first)
``linear_types``    ``nn.Linear`` subclasses (classes or import paths) whose forward is ``x Wᵀ + b``
``float32_steps``   what the module computes in float32 even in float64 (loosens the certificate's
                    Q/K sectors to ``1e-6``)
``fixed_head_order``  why heads may not be permuted (a per-head score term such as ALiBi)
``qk_orthogonal``   why only the orthogonal part of the Q/K gauge survives (a weight-free norm of
                    each head, Llama 4): ``""`` or a reason, or ``module -> str``
``sinks``           attribute path of per-head attention-sink logits (a learned extra softmax column
                    per head, gpt-oss): no bias sectors then, and permutations move the sinks
==================  ==========================================================================

All paths start at the attention module. The module registered must contain all four
projections: when the output projection lives in a sibling (BERT's ``BertSelfOutput.dense``),
register the spec on the parent that calls both (``BertAttention``, with ``o="output.dense"``),
so that the module's output includes the output projection — that output is what
:func:`gaugeopt.certify` compares.

A spec vouches for nothing by itself: a record it builds for your class is used only once the
certificate has rerun the module under random gauge transformations on your model — automatically
at the first gauge operation where gaugeopt can run the model, or by :func:`gaugeopt.certify`
(:mod:`gaugeopt.trust.gate`).

Example:
    >>> import torch, torch.nn as nn, gaugeopt
    >>> class Attn(nn.Module):                        # fused [Q|K|V], 2 heads of width 4
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.n_head, self.qkv, self.proj = 2, nn.Linear(8, 24), nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
    ...         y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ...         return self.proj(y.transpose(1, 2).flatten(2))
    >>> spec = gaugeopt.AttentionSpec(qkv="qkv", o="proj", num_heads="n_head")
    >>> site = spec.build(Attn(), "attn")
    >>> (site.h, site.d_k, site.q.weight.name, site.verified)
    (2, 4, 'attn.qkv.weight', False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.adapters.table import register_adapter, register_named_adapter
from gaugeopt.records.linears import FUSED_LAYOUTS, fused_qkv_refs, linear_like, projection_refs
from gaugeopt.records.rope import NO_ROPE, RopeSpec
from gaugeopt.records.site import QK_NORM_KINDS, QK_NORM_SCOPES, AttentionSite, QKNorm, TensorRef

__all__ = ["AttentionSpec", "QKNormSpec", "Value", "refuse_qk_norm", "require_stock_forward", "resolve",
           "site_from_linears"]

# An int (or float), an attribute path from the module ("config.n_head"), or a callable module -> value.
Value = Union[int, float, str, Callable[[nn.Module], Any]]


def resolve(module: nn.Module, value: Value, what: str, name: str = "") -> Any:
    """The value of a spec field for ``module``: ``value(module)`` for a callable, the attribute at
    the dotted path for a string, the value itself otherwise."""
    if callable(value) and not isinstance(value, type):
        return value(module)
    if isinstance(value, str):
        obj: Any = module
        for part in value.split("."):
            if isinstance(obj, (nn.ModuleList, nn.Sequential)) and part.isdigit():
                obj = obj[int(part)]
                continue
            if not hasattr(obj, part):
                raise GaugeError(
                    f"{name or type(module).__qualname__}: {what}={value!r}: no attribute {part!r} on "
                    f"{type(obj).__qualname__}"
                )
            obj = getattr(obj, part)
        return obj
    return value


def require_stock_forward(name: str, module: nn.Module) -> None:
    """Refuse a module whose ``forward`` is not the one its class's source defines.

    An adapter is written against one ``forward``; an instance-level override or a patched
    class method may compute something else (extra scaling, per-head norms, adapters), and
    the gauge would then silently change the function. Decided on the code object
    (:func:`gaugeopt.adapters.stock.forward_problems`: ``functools.wraps`` keeps a name, not a code
    object); a replacement marked with :func:`gaugeopt.accept_patch` passes (the certificate proves it).
    """
    from gaugeopt.adapters.stock import forward_problems

    if "forward" in vars(module):
        raise GaugeError(f"{name}: forward was overridden on the instance; gaugeopt cannot vouch for its gauge group")
    problems = forward_problems(type(module))
    if problems:
        raise GaugeError(
            f"{name}: {problems[0]}, not the implementation the adapter was written for (patched by another "
            "library?); describe it with gaugeopt.AttentionSpec and certify it (docs/adapters.md), or mark a patch you "
            "vouch for with gaugeopt.accept_patch"
        )


def refuse_qk_norm(site: AttentionSite, where: str = "") -> AttentionSite:
    """Refuse a record with per-head Q/K normalisation (an :attr:`AttentionSpec.on_qk_norm` choice).

    Normalising each head's queries and keys removes ``GL(d_k)`` from the Q/K gauge: what remains
    acts on the norm's gains (``docs/gauge_group.md``), which the operations here do not move yet.
    """
    n = site.qk_norm
    assert n is not None
    if n.q_gain is None:
        layout = "gains not one tensor (a norm module per head)"
    else:
        layout = "a gain per head" if n.q_gain.shape[0] > 1 else "one gain shared by all heads"
    scope = "over all heads' channels at once" if n.scope == "full" else "over each head's d_k channels"
    raise GaugeError(
        f"{site.name}: per-head Q/K normalisation (QK-norm{': ' + where if where else ''}; "
        f"{'LayerNorm' if n.kind == 'layer' else 'RMSNorm'} {scope}, {layout}) changes the attention gauge "
        "group: GL(d_k) on W_Q/W_K is no longer a symmetry, and what remains acts on the norm's gains. "
        "gaugeopt does not support Q/K-normalised attention for this model yet; V/O is unaffected, but the "
        "layer is refused as a whole"
    )


@dataclass(frozen=True)
class QKNormSpec:
    """Where an attention module keeps its per-head Q/K normalisation.

    Attributes:
        kind: ``"rms"`` or ``"layer"`` (LayerNorm: centred, optionally with a bias).
        q, k: attribute paths of the query and key norm modules (their ``weight`` is the gain,
            their ``bias`` the LayerNorm bias); ``None`` when the gains are not one tensor (a
            separate norm module per head): the record then has no gain refs.
        eps: the norm's epsilon: a number, an attribute path from the attention module
            (``"q_norm.variance_epsilon"``) or a callable of it.
        gain_offset: the gain is ``gain_offset + weight`` (Gemma: 1).
        scope: ``"head"`` (over each head's ``d_k`` channels) or ``"full"`` (over all heads at once).
        before_rope: the norm acts before RoPE.
    """

    kind: str
    q: str | None
    k: str | None
    eps: Value = 1e-6
    gain_offset: float = 0.0
    scope: str = "head"
    before_rope: bool = True

    def __post_init__(self) -> None:
        if self.kind not in QK_NORM_KINDS:
            raise GaugeError(f"QKNormSpec.kind={self.kind!r} is not one of {QK_NORM_KINDS}")
        if self.scope not in QK_NORM_SCOPES:
            raise GaugeError(f"QKNormSpec.scope={self.scope!r} is not one of {QK_NORM_SCOPES}")

    def record(self, module: nn.Module, name: str, h: int, h_kv: int, d_k: int) -> QKNorm:
        """The :class:`~gaugeopt.records.site.QKNorm` of ``module`` (gains in ``(groups, d_k)`` layout)."""
        refs: dict[str, TensorRef | None] = {}
        eps = resolve(module, self.eps, "qk_norm.eps", name)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
            raise GaugeError(f"{name}: qk_norm.eps resolved to {eps!r}, expected a number >= 0")
        for side, path, heads in (("q", self.q, h), ("k", self.k, h_kv)):
            refs[f"{side}_gain"] = refs[f"{side}_bias"] = None
            if path is None:
                continue
            norm = resolve(module, path, f"qk_norm.{side}", name)
            for role, attr in (("gain", "weight"), ("bias", "bias")):
                p = getattr(norm, attr, None)
                if p is None:
                    continue
                if p.numel() == d_k:
                    shape = (1, d_k)
                elif p.numel() == heads * d_k:  # a gain vector per head (OLMo 2's full width, Cohere's per head)
                    shape = (heads, d_k)
                else:
                    raise GaugeError(
                        f"{name}.{path}.{attr} has {p.numel()} entries; a {self.scope}-scope Q/K norm over "
                        f"{heads} heads of width {d_k} has {d_k} (shared) or {heads * d_k} (one vector per head)"
                    )
                refs[f"{side}_{role}"] = TensorRef(norm, attr, ".".join(x for x in (name, path, attr) if x), shape)
        if self.kind == "rms":
            refs["q_bias"] = refs["k_bias"] = None
        return QKNorm(self.kind, eps=float(eps), gain_offset=self.gain_offset,
                      scope=self.scope, before_rope=self.before_rope, **refs)


@dataclass(frozen=True)
class AttentionSpec:
    """How one attention class lays out its projections (see the module docstring).

    Give either ``q``, ``k``, ``v`` (separate linears) or ``qkv`` with ``fused``, and ``o``.
    Head counts, widths, the RoPE convention and the QK-norm may be values, attribute paths
    from the attention module or callables of it. :meth:`build` returns the record for one
    module, :meth:`adapter` the function :func:`gaugeopt.register_adapter` takes, and
    :meth:`register` registers it for a class (or a class's import path, for optional
    libraries that gaugeopt must not import).

    Attributes:
        stock_forward: refuse an instance whose ``forward`` was overridden or patched.
        kind: the records' :attr:`~gaugeopt.AttentionSite.kind`.
        on_qk_norm: what to do with a record that has a QK-norm: return it (the default: its Q/K gauge
            is then the norm's gain gauge, which :func:`gaugeopt.certify` checks), or refuse it
            (:func:`refuse_qk_norm`, what built-in families without a verified gain gauge do).
    """

    o: str
    num_heads: Value
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    fused: str = "concat"
    num_kv_heads: Value | None = None
    head_dim: Value | None = None
    v_head_dim: Value | None = None
    rope: RopeSpec | Callable[[nn.Module], RopeSpec] = NO_ROPE
    qk_norm: QKNormSpec | Callable[[nn.Module], QKNormSpec | None] | None = None
    refuse: Callable[[nn.Module], str | None] | None = None
    linear_types: tuple[type | str, ...] = ()
    float32_steps: str | Callable[[nn.Module], str] = ""
    fixed_head_order: str | Callable[[nn.Module], str] = ""
    kind: str = "spec"
    stock_forward: bool = True
    on_qk_norm: Callable[[AttentionSite], AttentionSite] | None = None
    sinks: str | None = None
    qk_orthogonal: str | Callable[[nn.Module], str] = ""

    def __post_init__(self) -> None:
        separate = (self.q, self.k, self.v)
        if self.qkv is not None and any(p is not None for p in separate):
            raise GaugeError("AttentionSpec: give either qkv= (a fused projection) or q=, k=, v= (separate ones), not both")
        if self.qkv is None and any(p is None for p in separate):
            raise GaugeError("AttentionSpec: give q=, k= and v= (attribute paths of separate linears) or qkv= (a fused one)")
        if self.fused not in FUSED_LAYOUTS:
            raise GaugeError(f"AttentionSpec: fused={self.fused!r} is not one of {FUSED_LAYOUTS}")
        if not isinstance(self.linear_types, tuple):
            raise GaugeError(f"AttentionSpec: linear_types must be a tuple of classes or import paths, got {self.linear_types!r}")

    # ------------------------------------------------------------------ building
    def _int(self, module: nn.Module, value: Value | None, what: str, name: str) -> int | None:
        if value is None:
            return None
        got = resolve(module, value, what, name)
        if isinstance(got, bool) or not isinstance(got, int) or got <= 0:
            raise GaugeError(f"{name}: {what} resolved to {got!r}, expected a positive integer")
        return got

    def _linear(self, module: nn.Module, path: str, name: str) -> tuple[nn.Module, str, int, int]:
        mod = resolve(module, path, "projection path", name)
        if not isinstance(mod, nn.Module):
            raise GaugeError(f"{name}: {path!r} is a {type(mod).__qualname__}, not a linear module")
        _, out, inp = linear_like(mod, self.linear_types)
        return mod, ".".join(x for x in (name, path) if x), out, inp

    def build(self, module: nn.Module, name: str = "", root: nn.Module | None = None) -> AttentionSite:
        """The :class:`~gaugeopt.AttentionSite` of ``module`` (qualified name ``name`` in ``root``)."""
        if self.stock_forward:
            require_stock_forward(name or type(module).__qualname__, module)
        if self.refuse is not None:
            reason = self.refuse(module)
            if reason:
                raise GaugeError(f"{name or type(module).__qualname__}: {reason}")
        h = self._int(module, self.num_heads, "num_heads", name)
        h_kv = self._int(module, self.num_kv_heads, "num_kv_heads", name) or h
        d_k = self._int(module, self.head_dim, "head_dim", name)
        d_v = self._int(module, self.v_head_dim, "v_head_dim", name)
        if h % h_kv:
            raise GaugeError(f"{name}: num_heads={h} is not a multiple of num_kv_heads={h_kv}")
        if self.qkv is not None:
            mod, qname, out, d_model = self._linear(module, self.qkv, name)
            if d_k is None:
                width, rem = divmod(out, h + 2 * h_kv) if d_v is None else divmod(out - h_kv * d_v, h + h_kv)
                if rem:
                    raise GaugeError(f"{qname}: {out} output rows do not split into {h} query and {h_kv}+{h_kv} key/value heads")
                d_k = width
            if d_v is None:
                d_v, rem = divmod(out - (h + h_kv) * d_k, h_kv)
                if rem or d_v <= 0:
                    raise GaugeError(f"{qname}: {out} output rows do not hold {h}+{h_kv} heads of width {d_k} and {h_kv} value heads")
            q, k, v = fused_qkv_refs(mod, qname, layout=self.fused, h=h, h_kv=h_kv, d_k=d_k, d_v=d_v, d_model=d_model,
                                     accept=self.linear_types)
        else:
            projs = {}
            for role, path in (("q", self.q), ("k", self.k), ("v", self.v)):
                projs[role] = self._linear(module, path, name)
            _, _, q_out, d_model = projs["q"]
            d_k = d_k or _divide(q_out, h, f"{projs['q'][1]}: {q_out} output rows", "num_heads", name)
            d_v = d_v or _divide(projs["v"][2], h_kv, f"{projs['v'][1]}: {projs['v'][2]} output rows", "num_kv_heads", name)
            refs = {}
            for role, heads, width in (("q", h, d_k), ("k", h_kv, d_k), ("v", h_kv, d_v)):
                mod, qname, out, inp = projs[role]
                if out != heads * width:
                    raise GaugeError(f"{qname}: {out} output rows, expected {heads} heads × {width}")
                refs[role] = projection_refs(mod, qname, rows=None, split=0, canon="in", heads=heads, width=width,
                                             d_model=inp, accept=self.linear_types)
            q, k, v = refs["q"], refs["k"], refs["v"]
        omod, oname, d_out, o_in = self._linear(module, self.o, name)
        if o_in != h * d_v:
            raise GaugeError(f"{oname}: {o_in} input columns, expected {h} heads × {d_v}")
        o = projection_refs(omod, oname, rows=None, split=0, canon="out", heads=h, width=d_v, d_model=d_out,
                            accept=self.linear_types)
        rope = self.rope(module) if callable(self.rope) else self.rope
        if not isinstance(rope, RopeSpec):
            raise GaugeError(f"{name}: rope resolved to {rope!r}, expected a gaugeopt.RopeSpec")
        norm_spec = self.qk_norm(module) if callable(self.qk_norm) else self.qk_norm
        qk_norm = None if norm_spec is None else norm_spec.record(module, name, h, h_kv, d_k)
        sinks = None if self.sinks is None else _sinks_ref(module, self.sinks, name, h)
        f32 = self.float32_steps(module) if callable(self.float32_steps) else self.float32_steps
        fixed = self.fixed_head_order(module) if callable(self.fixed_head_order) else self.fixed_head_order
        orth = self.qk_orthogonal(module) if callable(self.qk_orthogonal) else self.qk_orthogonal
        features = (("fused_qkv", f"fused_{self.fused}") if self.qkv is not None else ()) + \
            (("gqa",) if h_kv != h else ()) + ((f"rope_{rope.kind}",) if rope.active else ()) + \
            (("qk_norm",) if qk_norm is not None else ()) + (("sinks",) if sinks is not None else ())
        site = AttentionSite(
            name=name, module=module, h=h, h_kv=h_kv, d_k=d_k, d_v=d_v, d_model=d_model, q=q, k=k, v=v, o=o,
            rope=rope, kind=self.kind, features=features, qk_norm=qk_norm, float32_steps=f32 or "",
            fixed_head_order=fixed or "", sinks=sinks, qk_orthogonal=orth or "",
        )
        if qk_norm is not None:
            site = self.on_qk_norm(site) if self.on_qk_norm is not None else site
        return site

    def adapter(self) -> Callable[[nn.Module, str, nn.Module], AttentionSite]:
        """``(root, name, module) -> AttentionSite``: the function :func:`gaugeopt.register_adapter` takes."""
        def adapt(root: nn.Module, name: str, module: nn.Module) -> AttentionSite:
            return self.build(module, name, root)

        adapt.spec = self  # type: ignore[attr-defined]
        return adapt

    def register(self, cls: type | str) -> None:
        """Register this spec for ``cls`` (a class, or its import path ``"package.module.Class"``)."""
        if isinstance(cls, str):
            register_named_adapter(cls, self.adapter())
        else:
            register_adapter(cls, self.adapter())


def _sinks_ref(module: nn.Module, path: str, name: str, h: int) -> TensorRef:
    """The per-head sink logits at attribute path ``path`` (one entry per query head)."""
    owner_path, _, attr = path.rpartition(".")
    owner = resolve(module, owner_path, "sinks", name) if owner_path else module
    p = getattr(owner, attr, None)
    if not isinstance(p, nn.Parameter) or p.numel() != h:
        got = "missing" if p is None else f"{type(p).__name__} with {getattr(p, 'numel', lambda: '?')()} entries"
        raise GaugeError(f"{name}: sinks={path!r} must name a parameter with one logit per query head ({h}); got {got}")
    return TensorRef(owner, attr, ".".join(x for x in (name, path) if x), (h,))


def _divide(total: int, parts: int, what: str, by: str, name: str) -> int:
    width, rem = divmod(total, parts)
    if rem or width <= 0:
        raise GaugeError(f"{what} do not split into {by}={parts} heads; give head_dim= explicitly")
    return width


def site_from_linears(
    module: nn.Module,
    name: str,
    *,
    q: str,
    k: str,
    v: str,
    o: str,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    v_head_dim: int | None = None,
    rope: RopeSpec = NO_ROPE,
    kind: str = "manual",
) -> AttentionSite:
    """Build an :class:`AttentionSite` from four separate linear-like children of ``module``.

    A shorthand for :class:`gaugeopt.AttentionSpec` with separate projections (which also
    describes fused layouts, head counts read from attributes, QK-norm and refusals). *You*
    vouch that the module's forward is standard scaled-dot-product attention over these
    projections; :func:`gaugeopt.certify` proves it numerically on your model, and gauge
    operations refuse the record until it has.

    Args:
        module: the attention module; ``name`` its qualified name in the root model.
        q, k, v, o: attribute paths of the projections on ``module``.
        num_heads, num_kv_heads: query heads and key/value heads (GQA when fewer).
        head_dim, v_head_dim: widths (default: Q rows / num_heads, V rows / num_kv_heads).
        rope: the RoPE convention (:class:`~gaugeopt.records.rope.RopeSpec`).
    """
    if len({q, k, v}) < 3:
        raise GaugeError(
            f"{name}: q={q!r}, k={k!r}, v={v!r} name the same layer: that is a fused QKV projection, and "
            "site_from_linears takes separate Q, K and V linears. Describe the fused layout (its row order) "
            "with gaugeopt.AttentionSpec(qkv=..., fused='concat'|'grouped'|'per_head') instead; see docs/adapters.md"
        )
    spec = AttentionSpec(
        q=q, k=k, v=v, o=o, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        v_head_dim=v_head_dim, rope=rope, kind=kind, stock_forward=False,
    )
    return spec.build(module, name)
