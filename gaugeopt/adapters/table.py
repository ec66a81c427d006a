"""The adapter tables: which attention classes have an adapter, and which adapters are built in.

An adapter ``(root_model, qualified_name, module) -> AttentionSite`` is registered for an exact
module class (:func:`register_adapter`), or for the import path of a class from an optional library
(:func:`register_named_adapter`) so that gaugeopt never imports it. The built-in adapters
(:mod:`gaugeopt.adapters.builtin`) register themselves here with :func:`register_builtin`, which
marks them *verified*. The tables only hold entries; :func:`gaugeopt.find_attention`
(:mod:`gaugeopt.adapters.find`, which loads the built-in adapters) reads them. Keeping the two
apart lets the adapters, :class:`gaugeopt.AttentionSpec` and the registry import downwards only.

Example:
    >>> import torch.nn as nn
    >>> from gaugeopt.adapters.table import is_verified, register_adapter, registered
    >>> class Attn(nn.Module):
    ...     pass
    >>> adapter = lambda root, name, module: None
    >>> register_adapter(Attn, adapter)
    >>> registered()[Attn] is adapter, is_verified(adapter)
    (True, False)
    >>> from gaugeopt.adapters.table import _ADAPTERS
    >>> del _ADAPTERS[Attn]
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.records.site import AttentionSite

__all__ = ["Adapter", "is_verified", "register_adapter", "register_builtin", "register_builtin_recogniser",
           "register_named_adapter", "register_wrapper", "registered", "recognisers", "wrappers"]

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

def register_adapter(cls: type, adapter: Adapter) -> None:
    """Teach :func:`find_attention` a new attention class.

    ``adapter(root, name, module)`` returns the :class:`AttentionSite` for ``module`` (a
    ``cls`` instance at qualified name ``name`` in ``root``) or raises :class:`GaugeError`
    naming a feature it does not handle. Matching is by exact class: a subclass must be
    registered on its own, because it may change ``forward``. :class:`gaugeopt.AttentionSpec`
    writes the adapter for you (``spec.register(cls)``). Records from a registered adapter are proved
    on the model before a gauge operation uses them, like every record (:mod:`gaugeopt.trust.gate`).

    Example:
        >>> import torch.nn as nn, gaugeopt
        >>> from gaugeopt import register_adapter, site_from_linears
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


def is_verified(adapter: Adapter) -> bool:
    """Whether ``adapter`` is a built-in whose records the test suite verifies."""
    return id(adapter) in _VERIFIED


def registered() -> dict[type | str, Adapter]:
    """The adapter table as it is now: import paths, then classes (a class entry wins)."""
    return {**_NAMED_ADAPTERS, **_ADAPTERS}


def recognisers() -> list[tuple[Callable[[nn.Module], bool], Adapter]]:
    """The built-in adapters matched by structure rather than class, in registration order."""
    return list(_RECOGNISERS)


def wrappers() -> set[str]:
    """Import paths of classes that only wrap an attention module."""
    return set(_WRAPPERS)
