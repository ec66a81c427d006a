"""Where a model's attention lives: one :class:`AttentionSite` per attention layer.

Every gauge computation in gaugeopt reads and writes weights through these records, so the
layout conventions are pinned here once (DESIGN.md §1). For ``h`` query heads, ``h_kv``
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

With learnable multipliers (:mod:`gaugeopt.structure.lrm`) the *effective* weight of a projection is
``diag(r)·W̄·diag(c)`` and its effective bias ``r ⊙ b̄``; :meth:`AttentionSite.effective`
and :meth:`AttentionSite.set_effective` read and write in those terms.

Adapters (``gaugeopt.structure.adapters``) build the records for known model classes, matching the
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

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.structure.rope import NO_ROPE, RopeSpec

__all__ = [
    "TensorRef",
    "Projection",
    "AttentionSite",
    "find_attention",
    "register_adapter",
    "register_named_adapter",
    "registered_adapters",
    "site_from_linears",
]

@dataclass(frozen=True)
class TensorRef:
    """A view recipe into one stored parameter.

    The parameter is resolved lazily as ``getattr(owner, attr)`` so that a record stays valid
    when a wrapper (FSDP2's ``fully_shard``, ``torch.compile``) swaps the parameter object.

    ``view(t)`` maps a tensor ``t`` shaped like the stored parameter to the canonical view:
    transpose (for ``in×out`` storage), then ``t[index]`` along dim 0, then ``.view(shape)``.
    The result always aliases ``t`` (no copy), so in-place edits reach the parameter.

    Attributes:
        owner: module that holds the parameter.
        attr: attribute name on ``owner``.
        name: qualified name as in ``model.named_parameters()``.
        shape: canonical view shape.
        transpose: the storage is ``in×out`` (HF ``Conv1D``).
        index: row selection in the (transposed) storage, e.g. the Q rows of a fused QKV.
    """

    owner: nn.Module
    attr: str
    name: str
    shape: tuple[int, ...]
    transpose: bool = False
    index: int | slice | None = None

    @property
    def param(self) -> torch.Tensor:
        """The stored parameter (resolved now)."""
        return getattr(self.owner, self.attr)

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """Canonical view of ``t`` (same shape as the stored parameter), aliasing ``t``."""
        x = t.t() if self.transpose else t
        if self.index is not None:
            x = x[self.index]
        return x.view(self.shape)

    def get(self) -> torch.Tensor:
        """Canonical view of the parameter itself (aliases it: edit under ``torch.no_grad()``)."""
        return self.view(self.param)

    def grad(self) -> torch.Tensor | None:
        g = self.param.grad
        return None if g is None else self.view(g)


@dataclass(frozen=True)
class Projection:
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
    """

    name: str
    module: nn.Module
    h: int
    h_kv: int
    d_k: int
    d_v: int
    d_model: int
    q: Projection
    k: Projection
    v: Projection
    o: Projection
    rope: RopeSpec = NO_ROPE
    kind: str = "manual"
    layer_index: int = 0
    features: tuple[str, ...] = field(default_factory=tuple)

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

    # ------------------------------------------------------------------ structure
    @property
    def n_rep(self) -> int:
        """Query heads per KV head (``h // h_kv``)."""
        return self.h // self.h_kv

    def group_of(self, i: int) -> int:
        """KV head read by query head ``i``."""
        return i // self.n_rep

    @property
    def has_multipliers(self) -> bool:
        """True when Q and K carry LRM row multipliers (the GaugeFix-LRM setting)."""
        return self.q.row_mult is not None and self.k.row_mult is not None

    def projections(self) -> Iterator[tuple[str, Projection]]:
        for p in "qkvo":
            yield p, getattr(self, p)

    def refs(self) -> Iterator[tuple[str, TensorRef]]:
        """All ``(\"q.weight\", ref)``-style entries of this site."""
        for p, proj in self.projections():
            for role, ref in proj.refs():
                yield f"{p}.{role}", ref

    def parameter_names(self) -> list[str]:
        """Qualified names of the parameters this site reads (each once)."""
        seen: dict[str, None] = {}
        for _, ref in self.refs():
            seen.setdefault(ref.name, None)
        return list(seen)

    # ------------------------------------------------------------------ effective tensors
    def _mult_factors(self, p: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Row and column factors broadcastable against the canonical weight view of ``p``."""
        proj: Projection = getattr(self, p)
        r = proj.row_mult.get().detach() if proj.row_mult is not None else None
        c = proj.col_mult.get().detach() if proj.col_mult is not None else None
        if p == "o":  # weight (d, h, d_v): rows = d, cols = (h, d_v)
            return (None if r is None else r[:, None, None]), c
        return (None if r is None else r[..., None]), c

    def effective(self, p: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Effective ``(weight, bias)`` of projection ``p`` in canonical layout (new tensors).

        ``weight = r ⊙ W̄ ⊙ c`` and ``bias = r ⊙ b̄`` under LRM; a detached copy otherwise.
        """
        proj: Projection = getattr(self, p)
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
    def set_effective(self, p: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Write an effective ``(weight, bias)`` back, dividing out the LRM multipliers."""
        proj: Projection = getattr(self, p)
        r, c = self._mult_factors(p)
        w = weight
        if r is not None:
            w = w / r
        if c is not None:
            w = w / c
        proj.weight.get().copy_(w)
        if bias is not None:
            if proj.bias is None:
                raise GaugeError(f"{self.name}: projection {p!r} has no bias to write")
            b = bias
            if proj.row_mult is not None:
                b = b / proj.row_mult.get()
            proj.bias.get().copy_(b)

    def __repr__(self) -> str:  # compact: the dataclass default would print whole modules
        extra = f", rope={self.rope.kind}:{self.rope.rotary_dim}" if self.rope.active else ""
        lrm = ", lrm" if self.has_multipliers else ""
        return (
            f"AttentionSite({self.name!r}, kind={self.kind}, h={self.h}, h_kv={self.h_kv}, "
            f"d_k={self.d_k}, d_v={self.d_v}, d_model={self.d_model}{extra}{lrm})"
        )


# ---------------------------------------------------------------------- adapter registry
# An adapter: (root_model, qualified_name, module) -> AttentionSite, registered for an exact
# module class (never a name pattern over parameters). Classes from optional libraries are
# registered by import path ("package.module.Class") so that gaugeopt never imports them.
Adapter = Callable[[nn.Module, str, nn.Module], AttentionSite]
_ADAPTERS: dict[type, Adapter] = {}
_NAMED_ADAPTERS: dict[str, Adapter] = {}
_BUILTINS_LOADED = False

# Class-name fragments that mark a module as attention; a module whose class matches one of
# these and that no adapter claims makes find_attention refuse the model (no partial results).
_ATTENTION_HINTS = ("attention", "selfattn", "attn")


def register_adapter(cls: type, adapter: Adapter) -> None:
    """Teach :func:`find_attention` a new attention class.

    ``adapter(root, name, module)`` returns the :class:`AttentionSite` for ``module`` (a
    ``cls`` instance at qualified name ``name`` in ``root``) or raises :class:`GaugeError`
    naming a feature it does not handle. Matching is by exact class: a subclass must be
    registered on its own, because it may change ``forward``.

    Example:
        >>> import torch.nn as nn, gaugeopt
        >>> from gaugeopt.structure.site import register_adapter, site_from_linears
        >>> class MyAttn(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.wq, self.wk, self.wv, self.wo = (nn.Linear(8, 8) for _ in range(4))
        >>> register_adapter(MyAttn, lambda root, name, m: site_from_linears(
        ...     m, name, q="wq", k="wk", v="wv", o="wo", num_heads=2))
        >>> [s.h for s in gaugeopt.find_attention(nn.Sequential(MyAttn()))]
        [2]
    """
    if not isinstance(cls, type):
        raise GaugeError(f"register_adapter expects a class, got {cls!r}")
    _ADAPTERS[cls] = adapter


def register_named_adapter(path: str, adapter: Adapter) -> None:
    """Register an adapter for the class at import path ``path`` without importing it."""
    _NAMED_ADAPTERS[path] = adapter


def _load_builtin_adapters() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from gaugeopt.structure import adapters  # noqa: F401  (registers the built-in adapters)


def registered_adapters() -> dict[type | str, Adapter]:
    """The adapter table: classes, and import paths of classes from optional libraries."""
    _load_builtin_adapters()
    return {**_NAMED_ADAPTERS, **_ADAPTERS}


def _adapter_for(cls: type, table: dict) -> Adapter | None:
    found = table.get(cls)
    if found is None:
        found = table.get(f"{cls.__module__}.{cls.__qualname__}")
    return found


def _looks_like_attention(module: nn.Module) -> bool:
    name = type(module).__name__.lower().replace("_", "")
    return any(hint in name for hint in _ATTENTION_HINTS)


def find_attention(
    model: nn.Module,
    *,
    adapters: dict[type, Adapter] | None = None,
    allow_unclaimed: Sequence[str] = (),
) -> list[AttentionSite]:
    """Find every attention layer of ``model`` and describe where its weights live.

    Walks ``model.named_modules()`` and hands each module whose exact class has an adapter to
    that adapter. The children of a claimed module are not searched again.

    Args:
        model: any ``nn.Module`` (a DDP/``torch.compile`` wrapper is fine).
        adapters: extra ``{class: adapter}`` entries, tried before the built-ins.
        allow_unclaimed: qualified module names of attention-like modules (by class name)
            that are *not* attention and should be ignored.

    Returns:
        The sites in module order, with ``layer_index`` set.

    Raises:
        GaugeError: no attention found (the message lists the classes searched for); an
            attention-like module that no adapter claims (a silent partial result would leave
            that layer's gauge unfixed); or an adapter refusing a feature it cannot handle.
    """
    table = {**registered_adapters(), **(adapters or {})}
    sites: list[AttentionSite] = []
    claimed: list[str] = []
    unclaimed: list[str] = []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        adapter = _adapter_for(type(module), table)
        if adapter is not None:
            site = adapter(model, name, module)
            site.layer_index = len(sites)
            sites.append(site)
            claimed.append(name)
        elif name not in allow_unclaimed and not _is_container(module):
            parent = next((c for c in table if isinstance(c, type) and isinstance(module, c)), None)
            if parent is not None:
                unclaimed.append(
                    f"{name or '<root>'} ({type(module).__qualname__}, a subclass of {parent.__qualname__} that may "
                    "compute something else)"
                )
            elif _looks_like_attention(module):
                unclaimed.append(f"{name or '<root>'} ({type(module).__qualname__})")
    if unclaimed:
        raise GaugeError(
            "find_attention: these modules look like attention but no adapter understands them: "
            + ", ".join(unclaimed[:8])
            + (" ..." if len(unclaimed) > 8 else "")
            + ". Register one with gaugeopt.register_adapter(cls, fn) (see site_from_linears), "
            "or pass allow_unclaimed=[names] if they are not attention layers."
        )
    if not sites:
        known = sorted(c if isinstance(c, str) else f"{c.__module__}.{c.__qualname__}" for c in table)
        raise GaugeError(
            f"find_attention: no attention layer found in {type(model).__qualname__}. "
            f"Searched for modules of these classes: {', '.join(known)}. "
            "For another architecture register an adapter with gaugeopt.register_adapter(cls, fn); "
            "gaugeopt.site_from_linears builds a site from separate Q/K/V/O linears."
        )
    return sites


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential))


# ---------------------------------------------------------------------- building blocks
def _qualify(prefix: str, *parts: str) -> str:
    return ".".join(p for p in (prefix, *parts) if p)


def linear_like(module: nn.Module) -> tuple[bool, int, int]:
    """``(transposed, out_features, in_features)`` of an ``nn.Linear``, HF ``Conv1D`` or
    :class:`~gaugeopt.structure.lrm.LRMLinear`; raises :class:`GaugeError` for anything else."""
    from gaugeopt.structure.lrm import LRMLinear

    if type(module) is nn.Linear or type(module) is LRMLinear:
        return False, module.out_features, module.in_features
    if type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers"):
        return True, module.nf, module.weight.shape[0]
    raise GaugeError(
        f"expected nn.Linear, transformers Conv1D or gaugeopt LRMLinear, got {type(module).__qualname__}; "
        "a wrapped projection (LoRA, quantised, ...) changes the function the gauge acts on"
    )


def projection_refs(
    module: nn.Module,
    module_name: str,
    *,
    rows: slice | None,
    split: int,
    canon: str,
    heads: int,
    width: int,
    d_model: int,
) -> Projection:
    """Refs for the rows ``rows`` (split number ``split`` of a fused layer) of a linear-like
    ``module``. ``canon="in"`` gives the Q/K/V layout ``(heads, width, d_model)``;
    ``canon="out"`` the O layout ``(d_model, heads, width)``."""
    from gaugeopt.structure.lrm import LRMLinear

    transposed, _, _ = linear_like(module)
    if canon == "in":
        wshape = (heads, width, d_model)
        weight = TensorRef(module, "weight", _qualify(module_name, "weight"), wshape, transposed, rows)
    else:
        weight = TensorRef(module, "weight", _qualify(module_name, "weight"), (d_model, heads, width), transposed, rows)
    bias = None
    if getattr(module, "bias", None) is not None:
        bshape = (heads, width) if canon == "in" else (d_model,)
        bias = TensorRef(module, "bias", _qualify(module_name, "bias"), bshape, False, rows)
    row_mult = col_mult = None
    if type(module) is LRMLinear:
        rm, cm = module.row_mults, module.col_mults
        if canon == "in":
            row_mult = TensorRef(rm, str(split), _qualify(module_name, "row_mults", str(split)), (heads, width))
            col_mult = TensorRef(cm, str(split), _qualify(module_name, "col_mults", str(split)), (d_model,))
        else:
            row_mult = TensorRef(rm, str(split), _qualify(module_name, "row_mults", str(split)), (d_model,))
            col_mult = TensorRef(cm, str(split), _qualify(module_name, "col_mults", str(split)), (heads, width))
    return Projection(weight, bias, row_mult, col_mult)


def fused_rows(module: nn.Module, sizes: Sequence[int]) -> list[slice]:
    """Row slices of a fused projection whose output is the concatenation of ``sizes``.

    For an :class:`~gaugeopt.structure.lrm.LRMLinear` the module's own split sizes must agree (the
    multipliers are per split)."""
    from gaugeopt.structure.lrm import LRMLinear

    _, out, _ = linear_like(module)
    if sum(sizes) != out:
        raise GaugeError(f"fused projection has {out} output rows, expected {' + '.join(map(str, sizes))}")
    if type(module) is LRMLinear and tuple(module.split_sizes) not in (tuple(sizes),):
        raise GaugeError(
            f"LRMLinear split sizes {tuple(module.split_sizes)} do not match the fused layout {tuple(sizes)}; "
            "convert with gaugeopt.apply_lrm so that Q, K and V get their own multipliers"
        )
    out_slices, start = [], 0
    for s in sizes:
        out_slices.append(slice(start, start + s))
        start += s
    return out_slices


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

    The manual spec API for an architecture without a built-in adapter: name the Q, K, V
    and O children (``nn.Linear``, HF ``Conv1D`` or ``LRMLinear``), the head counts and the
    RoPE convention. *You* vouch that the module's forward is standard scaled-dot-product
    attention over these projections (no per-head normalisation, no extra learned keys);
    :func:`gaugeopt.structure.actions.check_invariance` verifies it numerically on your model.

    Args:
        module: the attention module; ``name`` its qualified name in the root model.
        q, k, v, o: attribute names of the projections on ``module``.
        num_heads, num_kv_heads: query heads and key/value heads (GQA when fewer).
        head_dim, v_head_dim: widths (default: Q rows / num_heads).
        rope: the RoPE convention (:class:`~gaugeopt.structure.rope.RopeSpec`).
    """
    mods = {}
    for role, attr in (("q", q), ("k", k), ("v", v), ("o", o)):
        if not hasattr(module, attr):
            raise GaugeError(f"{name}: no attribute {attr!r} for the {role.upper()} projection")
        mods[role] = getattr(module, attr)
    h = num_heads
    h_kv = num_kv_heads or h
    _, q_out, d_model = linear_like(mods["q"])
    d_k = head_dim or q_out // h
    _, v_out, _ = linear_like(mods["v"])
    d_v = v_head_dim or v_out // h_kv
    attrs = {"q": q, "k": k, "v": v, "o": o}
    refs = {}
    for role, heads, width in (("q", h, d_k), ("k", h_kv, d_k), ("v", h_kv, d_v)):
        _, out, _ = linear_like(mods[role])
        if out != heads * width:
            raise GaugeError(f"{name}.{attrs[role]}: {out} output rows, expected {heads}×{width}")
        refs[role] = projection_refs(
            mods[role], _qualify(name, attrs[role]), rows=None, split=0,
            canon="in", heads=heads, width=width, d_model=d_model,
        )
    _, d_out, o_in = linear_like(mods["o"])
    if o_in != h * d_v:
        raise GaugeError(f"{name}.{o}: {o_in} input columns, expected {h}×{d_v}")
    refs["o"] = projection_refs(
        mods["o"], _qualify(name, o), rows=None, split=0, canon="out", heads=h, width=d_v, d_model=d_out
    )
    return AttentionSite(
        name=name, module=module, h=h, h_kv=h_kv, d_k=d_k, d_v=d_v, d_model=d_model,
        q=refs["q"], k=refs["k"], v=refs["v"], o=refs["o"], rope=rope, kind=kind,
    )

