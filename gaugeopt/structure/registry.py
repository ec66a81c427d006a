"""The adapter registry and :func:`find_attention`: which module classes are attention, and how.

An adapter ``(root_model, qualified_name, module) -> AttentionSite`` is registered for an exact
module class, never a name pattern over parameters. Classes from optional libraries are
registered by import path (``"package.module.Class"``) so that gaugeopt never imports them.
A class that users copy into their own code (nanoGPT's ``CausalSelfAttention``) is recognised
by its structure and the source of its ``forward`` instead. A module that looks like attention
(by class name) and that no adapter claims makes :func:`find_attention` refuse the model: a
silent partial result would leave that layer's gauge unfixed.

Built-in adapters are *verified*: the test suite checks every gauge action on their classes, and
:func:`find_attention` marks their records ``verified=True`` (their code must then be the library's
own: :mod:`gaugeopt.structure.static_checks`). Every record — verified or not — is proved on the
model by the certificate before a gauge operation uses it (:mod:`gaugeopt.structure.gate`). A
module whose class subclasses a supported class is refused, never skipped. An attention class absent
from the table whose ``forward`` and everything it reaches are a renamed copy of a verified class's
(:mod:`gaugeopt.structure.recognise`) is handled by that class's adapter, unverified.
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.structure.recognise import recognised_adapter
from gaugeopt.structure.site import AttentionSite

__all__ = ["Adapter", "effective_class", "find_attention", "register_adapter", "register_named_adapter", "registered_adapters"]

# An adapter: (root_model, qualified_name, module) -> AttentionSite.
Adapter = Callable[[nn.Module, str, nn.Module], AttentionSite]
_ADAPTERS: dict[type, Adapter] = {}
_NAMED_ADAPTERS: dict[str, Adapter] = {}
# (predicate, adapter) for classes matched by structure rather than by class (copied code).
_RECOGNISERS: list[tuple[Callable[[nn.Module], bool], Adapter]] = []
# ids of the built-in adapters (their records are verified by the test suite).
_VERIFIED: set[int] = set()
# Import paths of classes that are named like attention but only wrap it (T5LayerSelfAttention).
_WRAPPERS: set[str] = set()
_BUILTINS_LOADED = False

# Class-name fragments that mark a module as attention; a module whose class matches one of
# these and that no adapter claims makes find_attention refuse the model (no partial results).
_ATTENTION_HINTS = ("attention", "selfattn", "attn")


def register_adapter(cls: type, adapter: Adapter) -> None:
    """Teach :func:`find_attention` a new attention class.

    ``adapter(root, name, module)`` returns the :class:`AttentionSite` for ``module`` (a
    ``cls`` instance at qualified name ``name`` in ``root``) or raises :class:`GaugeError`
    naming a feature it does not handle. Matching is by exact class: a subclass must be
    registered on its own, because it may change ``forward``. :class:`gaugeopt.AttentionSpec`
    writes the adapter for you (``spec.register(cls)``). Records from a registered adapter are proved
    on the model before a gauge operation uses them, like every record (:mod:`gaugeopt.structure.gate`).

    Example:
        >>> import torch.nn as nn, gaugeopt
        >>> from gaugeopt.structure import register_adapter, site_from_linears
        >>> class MyAttn(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.wq, self.wk, self.wv, self.wo = (nn.Linear(8, 8) for _ in range(4))
        >>> register_adapter(MyAttn, lambda root, name, m: site_from_linears(
        ...     m, name, q="wq", k="wk", v="wv", o="wo", num_heads=2))
        >>> [(s.h, s.verified) for s in gaugeopt.find_attention(nn.Sequential(MyAttn()))]
        [(2, False)]
    """
    if not isinstance(cls, type):
        raise GaugeError(f"register_adapter expects a class, got {cls!r}; for an import path use register_named_adapter")
    _ADAPTERS[cls] = adapter


def register_named_adapter(path: str, adapter: Adapter) -> None:
    """Register an adapter for the class at import path ``path`` without importing it."""
    if not isinstance(path, str) or "." not in path:
        raise GaugeError(f"register_named_adapter expects an import path 'package.module.Class', got {path!r}")
    _NAMED_ADAPTERS[path] = adapter


def register_builtin(key: type | str, adapter: Adapter) -> None:
    """Register a built-in adapter: its records are marked verified (the suite checks its class)."""
    if isinstance(key, str):
        register_named_adapter(key, adapter)
    else:
        register_adapter(key, adapter)
    _VERIFIED.add(id(adapter))


def register_builtin_recogniser(predicate: Callable[[nn.Module], bool], adapter: Adapter) -> None:
    """A built-in adapter for modules matched by ``predicate`` (structure, not class)."""
    _RECOGNISERS.append((predicate, adapter))
    _VERIFIED.add(id(adapter))


def register_wrapper(path: str) -> None:
    """Mark the class at ``path`` as a wrapper around an attention module, not attention itself."""
    _WRAPPERS.add(path)


def _load_builtin_adapters() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from gaugeopt.structure import adapters  # noqa: F401  (registers the built-in adapters)


def registered_adapters() -> dict[type | str, Adapter]:
    """The adapter table: classes, and import paths of classes from optional libraries."""
    _load_builtin_adapters()
    return {**_NAMED_ADAPTERS, **_ADAPTERS}


def is_verified(adapter: Adapter) -> bool:
    """Whether ``adapter`` is a built-in whose records the test suite verifies."""
    return id(adapter) in _VERIFIED


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def effective_class(module: nn.Module) -> type:
    """The class a module was built as: FSDP2's ``fully_shard`` swaps it for a generated subclass
    ``FSDP<Class>(FSDPModule, Class)`` that adds sharding around the same ``forward``."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


def _adapter_for(module: nn.Module, table: dict) -> Adapter | None:
    cls = effective_class(module)
    found = table.get(cls)
    if found is None:
        found = table.get(_class_path(cls))
    if found is None:
        found = next((a for pred, a in _RECOGNISERS if pred(module)), None)
    return found


def _supported_ancestor(module: nn.Module, table: dict) -> str | None:
    """The import path of a strict ancestor class of ``module``'s class that has an adapter."""
    for base in effective_class(module).__mro__[1:]:
        if base in table or _class_path(base) in table:
            return _class_path(base)
    return None


def _looks_like_attention(module: nn.Module) -> bool:
    if _class_path(type(module)) in _WRAPPERS:
        return False
    name = type(module).__name__.lower().replace("_", "")
    return any(hint in name for hint in _ATTENTION_HINTS)


def _linear_children(module: nn.Module) -> list[str]:
    out = []
    for name, child in module.named_modules():
        w = getattr(child, "weight", None)
        if name and (isinstance(child, nn.Linear) or (type(child).__name__ == "Conv1D" and w is not None)):
            out.append(f"{name} ({w.shape[-1]}→{w.shape[0]})" if isinstance(child, nn.Linear) else f"{name} (Conv1D)")
    return out


def unclaimed_hint(module: nn.Module) -> str:
    """How to describe an unclaimed attention class: a runnable :class:`gaugeopt.AttentionSpec` example."""
    cls = type(module).__name__
    linears = _linear_children(module)
    return (
        f"Describe {cls} with gaugeopt.AttentionSpec, register it and certify it on your model, e.g.\n"
        f"    spec = gaugeopt.AttentionSpec(q=\"q_proj\", k=\"k_proj\", v=\"v_proj\", o=\"o_proj\", num_heads=\"num_heads\")\n"
        f"    spec.register({cls})        # or spec.register(\"{_class_path(type(module))}\")\n"
        f"    gaugeopt.certify(model, example_batch)\n"
        f"(its linear children: {', '.join(linears) if linears else 'none'}; a fused projection is "
        "qkv=\"...\", fused=\"concat\" | \"grouped\" | \"per_head\"; RoPE: rope=gaugeopt.RopeSpec(\"split_half\", rotary_dim); "
        "see docs/adapters.md)"
    )


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
        The sites in module order, with ``layer_index`` set and ``verified`` true for the
        records of built-in adapters.

    Raises:
        GaugeError: no attention found (the message lists the classes searched for); an
            attention-like module that no adapter claims (a silent partial result would leave
            that layer's gauge unfixed; the message shows how to describe it with
            :class:`gaugeopt.AttentionSpec`); or an adapter refusing a feature it cannot handle.
    """
    if not isinstance(model, nn.Module):
        raise GaugeError(f"find_attention: model must be a torch.nn.Module, got {type(model).__name__} ({model!r:.60})")
    table = {**registered_adapters(), **(adapters or {})}
    root_ref = weakref.ref(model)
    subclasses: list[str] = []
    first_subclass: nn.Module | None = None
    sites: list[AttentionSite] = []
    claimed: list[str] = []
    unclaimed: list[str] = []
    first_unclaimed: nn.Module | None = None
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed):
            continue
        adapter = _adapter_for(module, table)
        if adapter is None and _looks_like_attention(module):
            adapter = recognised_adapter(module, table, is_verified)  # a renamed copy of a verified class
        if adapter is not None:
            site = adapter(model, name, module)
            site.layer_index = len(sites)
            site.verified = is_verified(adapter)
            site.root = root_ref
            sites.append(site)
            claimed.append(name)
        elif not _is_container(module):
            parent = _supported_ancestor(module, table)
            if parent is not None:  # never skipped, whatever its name and allow_unclaimed say
                subclasses.append(f"{name or '<root>'} ({type(module).__qualname__}, a subclass of {parent})")
                first_subclass = first_subclass or module
            elif name in allow_unclaimed:
                continue
            elif _looks_like_attention(module):
                unclaimed.append(f"{name or '<root>'} ({type(module).__qualname__})")
            else:
                continue
            first_unclaimed = first_unclaimed or module
    if subclasses:
        raise GaugeError(
            "find_attention: these modules subclass a supported attention class, so they may compute something else "
            "(a subclass can override forward or any helper it calls): " + ", ".join(subclasses[:8])
            + (" ..." if len(subclasses) > 8 else "") + ". gaugeopt refuses them rather than skip them. "
            + unclaimed_hint(first_subclass)
        )
    if unclaimed:
        raise GaugeError(
            "find_attention: these modules look like attention but no adapter understands them: "
            + ", ".join(unclaimed[:8])
            + (" ..." if len(unclaimed) > 8 else "")
            + ". " + unclaimed_hint(first_unclaimed)
            + ". Or pass allow_unclaimed=[names] if they are not attention layers."
        )
    if not sites:
        known = sorted(c if isinstance(c, str) else _class_path(c) for c in table)
        raise GaugeError(
            f"find_attention: no attention layer found in {type(model).__qualname__}. "
            f"Searched for modules of these classes: {', '.join(known)}, and nanoGPT's CausalSelfAttention. "
            "For another architecture describe its attention class with gaugeopt.AttentionSpec(...).register(cls) "
            "(or gaugeopt.register_adapter(cls, fn)) and certify it with gaugeopt.certify(model, example_batch); "
            "see docs/adapters.md."
        )
    return sites


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
