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
own: :mod:`gaugeopt.trust.static_checks`). Every record — verified or not — is proved on the
model by the certificate before a gauge operation uses it (:mod:`gaugeopt.trust.gate`). A
module whose class subclasses a supported class is refused, never skipped. An attention class absent
from the table whose ``forward`` and everything it reaches are a renamed copy of a verified class's
(:mod:`gaugeopt.adapters.recognise`) is handled by that class's adapter, unverified.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.adapters import builtin as _builtin  # noqa: F401  (registers the built-in adapters)
from gaugeopt.adapters.table import (  # noqa: F401  (_ADAPTERS...: the tables, for tests that patch them)
    _ADAPTERS,
    _NAMED_ADAPTERS,
    _RECOGNISERS,
    _VERIFIED,
    _WRAPPERS,
    Adapter,
    is_verified,
    register_adapter,
    register_builtin,
    register_builtin_recogniser,
    register_named_adapter,
    register_wrapper,
    recognisers,
    registered,
    wrappers,
)
from gaugeopt.adapters.recognise import recognised_adapter
from gaugeopt.records.site import AttentionSite

__all__ = ["Adapter", "effective_class", "find_attention", "register_adapter", "register_named_adapter", "registered_adapters"]

# Class-name fragments that mark a module as attention; a module whose class matches one of
# these and that no adapter claims makes find_attention refuse the model (no partial results).
_ATTENTION_HINTS = ("attention", "selfattn", "attn")


def registered_adapters() -> dict[type | str, Adapter]:
    """The adapter table: classes, and import paths of classes from optional libraries (the built-in
    adapters included: importing this module registers them)."""
    return registered()


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
        found = next((a for pred, a in recognisers() if pred(module)), None)
    return found


def _supported_ancestor(module: nn.Module, table: dict) -> str | None:
    """The import path of a strict ancestor class of ``module``'s class that has an adapter."""
    for base in effective_class(module).__mro__[1:]:
        if base in table or _class_path(base) in table:
            return _class_path(base)
    return None


def _looks_like_attention(module: nn.Module) -> bool:
    if _class_path(type(module)) in wrappers():
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
