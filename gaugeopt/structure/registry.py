"""The adapter registry and :func:`find_attention`: which module classes are attention, and how.

An adapter ``(root_model, qualified_name, module) -> AttentionSite`` is registered for an exact
module class, never a name pattern over parameters. Classes from optional libraries are
registered by import path (``"package.module.Class"``) so that gaugeopt never imports them.
A module that looks like attention (by class name) and that no adapter claims makes
:func:`find_attention` refuse the model: a silent partial result would leave that layer's gauge
unfixed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.structure.site import AttentionSite

__all__ = ["Adapter", "find_attention", "register_adapter", "register_named_adapter", "registered_adapters"]

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
        >>> from gaugeopt.structure import register_adapter, site_from_linears
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
    if not isinstance(model, nn.Module):
        raise GaugeError(f"find_attention: model must be a torch.nn.Module, got {type(model).__name__} ({model!r:.60})")
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
