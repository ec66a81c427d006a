"""Checks that need no inputs: what makes an attention record unsafe whatever the numbers say.

A gauge action edits the stored tensors a record names and relies on the module computing with
exactly those tensors, through exactly the code its adapter was written for. Users change models
in ways no adapter can anticipate; these checks catch the common ones before any tensor is written
(each a :class:`~gaugeopt.GaugeError` naming the module and what to do):

* **hooks** — a forward hook or pre-hook on the attention module or any module inside it (its
  projections, norms), or a global module hook (``torch.nn.modules.module.register_module_forward_hook``),
  may rewrite what the module computes (a per-head key normalisation, a steering vector, an edited
  ``position_embeddings``). Refused unless marked read-only with :func:`read_only_hook` — the
  certificate then proves the module with the hook in place. The legacy hook-based
  ``torch.nn.utils.weight_norm`` / ``spectral_norm`` recompute ``weight`` before every forward:
  refused with their own message. FSDP2's own hooks (all-gather / reshard) are recognised.
* **parametrizations** (``torch.nn.utils.parametrize``): the forward reads a computed tensor, not
  the stored one a gauge action would edit.
* **sharing** — a parameter the record names that is also reachable under another name outside
  the module (one ``q_proj`` used by two layers, ``W_Q`` tied to an MLP weight), or twice inside it
  (``o_proj.weight = v_proj.weight``, ``k_proj = q_proj``): a gauge action on one use would be a
  change of the other. A whole attention module registered at several places (one module called
  by several layers) is fine: the action is applied once and holds at every call.
* **code** — an instance-level ``forward``, and, for records from built-in adapters, a ``forward``,
  method or module-level helper that is not its library's own code, or an HF attention kernel
  registered in place of the stock one (:mod:`gaugeopt.adapters.stock`).
* **materialisation** — parameters on the meta device.

Every binding looked at (helpers, kernels: :func:`site_bindings`) is re-checked by
:class:`gaugeopt.trust.gate.Snapshot`, which notices a patch made after the checks ran, and is
part of the key a proof is stamped under (:func:`gaugeopt.trust.stamps.behaviour_key`).

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.trust.static_checks import static_problems
    >>> model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    >>> static_problems(model, gaugeopt.find_attention(model))
    []
    >>> handle = model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, i, o: o * 2)
    >>> print(static_problems(model, gaugeopt.find_attention(model))[0].split(";")[0])
    transformer.h.0.attn.c_attn: forward hook <lambda> may change what the module computes
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.modules.module as _torch_module

from gaugeopt.errors import GaugeError
from gaugeopt.records.site import AttentionSite
from gaugeopt.adapters.stock import Binding, code_bindings

__all__ = [
    "READ_ONLY_ATTR", "read_only_hook", "is_allowed_hook", "is_infrastructure_hook", "site_modules", "hook_problems", "global_hook_problems",
    "static_problems", "check_static", "class_code", "site_bindings",
]

READ_ONLY_ATTR = "_gaugeopt_read_only"
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks")
_HOOK_DICTS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"))
# Hooks from these packages only move parameters between shards around a forward (FSDP2's
# all-gather / reshard): they do not change what the module computes.
_INFRASTRUCTURE = ("torch.distributed.fsdp", "torch.distributed._composable")


def read_only_hook(fn: Callable) -> Callable:
    """Mark a hook function as read-only (it observes, never changes, a module's inputs or outputs).

    gaugeopt refuses models with hooks on their attention, because a hook may rewrite what the
    module computes. A hook that only reads — activation statistics, logging — can be marked
    with this decorator before it is registered; the certificate then proves the module with the
    hook in place, as it runs. Returns ``fn`` itself.

    Example:
        >>> import torch.nn as nn, gaugeopt
        >>> seen = []
        >>> @gaugeopt.read_only_hook
        ... def log_norm(module, args, output):
        ...     seen.append(float(output.norm()))
        >>> _ = nn.Linear(4, 4).register_forward_hook(log_norm)
    """
    try:
        setattr(fn, READ_ONLY_ATTR, True)
    except AttributeError as exc:  # a builtin or a bound method
        raise GaugeError(
            f"read_only_hook: cannot mark {fn!r}; wrap it in a plain function (def hook(module, args, output): ...)"
        ) from exc
    return fn


def _hook_function(hook: Any) -> Any:
    while hasattr(hook, "func") and not hasattr(hook, "__code__"):  # functools.partial
        hook = hook.func
    return getattr(hook, "__func__", hook)  # a bound method's function


def is_infrastructure_hook(hook: Any) -> bool:
    """A hook of FSDP2's shard movement (all-gather before the forward, reshard after)."""
    fn = _hook_function(hook)
    module = getattr(fn, "__module__", None) or getattr(type(fn), "__module__", "")
    return module.startswith(_INFRASTRUCTURE)


def is_allowed_hook(hook: Any) -> bool:
    """A hook marked :func:`read_only_hook` (gaugeopt's own recorders are), or FSDP2's shard movement."""
    fn = _hook_function(hook)
    if getattr(fn, READ_ONLY_ATTR, False) or getattr(hook, READ_ONLY_ATTR, False):
        return True
    return is_infrastructure_hook(hook)


def _hook_name(hook: Any) -> str:
    fn = _hook_function(hook)
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def site_modules(site: AttentionSite) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` for the attention module, every module inside it, and any module
    holding a tensor of the record outside it."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    for rel, m in site.module.named_modules():
        if id(m) not in seen:
            seen.add(id(m))
            out.append((".".join(x for x in (site.name, rel) if x), m))
    for _, ref in site.refs():
        if id(ref.owner) not in seen:
            seen.add(id(ref.owner))
            out.append((ref.name.rsplit(".", 1)[0], ref.owner))
    return out


def _legacy_norm(hook: Any) -> str | None:
    kind = type(hook).__qualname__
    if kind == "WeightNorm":
        return "legacy torch.nn.utils.weight_norm"
    if kind == "SpectralNorm":
        return "legacy torch.nn.utils.spectral_norm"
    return None


def hook_problems(name: str, module: nn.Module) -> list[str]:
    """Forward hooks and pre-hooks on ``module`` that gaugeopt cannot vouch for."""
    problems = []
    for attr, what in _HOOK_DICTS:
        for hook in getattr(module, attr, {}).values():
            if is_allowed_hook(hook):
                continue
            legacy = _legacy_norm(hook)
            if legacy is not None:
                problems.append(
                    f"{name}: {legacy} recomputes {getattr(hook, 'name', 'weight')} from its factors before every forward, so "
                    "a gauge action on the stored tensor would be overwritten or would change the function; remove it "
                    f"(torch.nn.utils.remove_{'weight' if 'weight' in legacy else 'spectral'}_norm) before using gaugeopt"
                )
                continue
            problems.append(
                f"{name}: {what} {_hook_name(hook)} may change what the module computes; gaugeopt cannot prove a gauge "
                "action exact through it. Remove it (handle.remove()) while gauge operations run, or, if it only reads "
                "(logging, statistics), mark it with gaugeopt.read_only_hook before registering it: the certificate "
                "then proves the module with the hook in place"
            )
    return problems


def global_hook_problems() -> list[str]:
    """Global module hooks (``register_module_forward_hook`` / ``_pre_hook``) run on every module."""
    problems = []
    for attr in _GLOBAL_HOOK_DICTS:
        for hook in getattr(_torch_module, attr, {}).values():
            if not is_allowed_hook(hook):
                problems.append(
                    f"a global module {'pre-hook' if 'pre' in attr else 'hook'} ({_hook_name(hook)}, registered with "
                    f"torch.nn.modules.module.register_module_forward{'_pre' if 'pre' in attr else ''}_hook) runs on every "
                    "attention module and may change what it computes; remove it while gauge operations run, or mark it "
                    "with gaugeopt.read_only_hook if it only reads"
                )
    return problems


# (class, check) -> (problems, bindings); valid while every binding holds
_CODE_CACHE: dict[tuple[type, bool], tuple[list[str], list[Binding]]] = {}


def class_code(cls: type, *, check: bool) -> tuple[list[str], list[Binding]]:
    """:func:`gaugeopt.adapters.stock.code_bindings` of ``cls``, cached while its bindings hold."""
    key = (cls, check)
    hit = _CODE_CACHE.get(key)
    if hit is not None and all(b.holds() for b in hit[1]):
        return hit
    problems, bindings = code_bindings(cls, check=check)
    _CODE_CACHE[key] = (problems, bindings)
    return problems, bindings


def site_bindings(site: AttentionSite) -> list[Binding]:
    """Every binding the record relies on: the adapter's own (:attr:`AttentionSite.adapter_bindings`)
    and the code of each module inside the attention module (:func:`class_code`)."""
    out = list(site.adapter_bindings)
    for cls in dict.fromkeys(type(m) for _, m in site_modules(site)):
        out += class_code(cls, check=site.verified)[1]
    return list(dict.fromkeys(out))


def _code_problems(site: AttentionSite, modules: Sequence[tuple[str, nn.Module]]) -> list[str]:
    problems: list[str] = []
    for name, m in modules:
        if "forward" in vars(m):
            problems.append(
                f"{name}: forward was replaced on the instance ({type(m).__qualname__}); gaugeopt cannot vouch for what it "
                "computes. Restore the class's forward (del module.forward) or describe the module with gaugeopt.AttentionSpec"
            )
            continue
        found = class_code(type(m), check=site.verified)[0]
        problems += [
            f"{name}: {p}; the built-in adapter was written for the stock code. Undo the patch, or register your own "
            "gaugeopt.AttentionSpec for the class and certify it (docs/adapters.md)" for p in found
        ]
    for b in site.adapter_bindings:
        if not b.holds():
            problems.append(f"{site.name}: {b.name} changed while the record was being checked; find the records again")
    return problems


def _sharing_problems(maps: "_Maps | None", site: AttentionSite) -> list[str]:
    problems: list[str] = []
    inside: dict[int, list[str]] = {}
    for rel, p in site.module.named_parameters(remove_duplicate=False):
        inside.setdefault(id(p), []).append(rel)
    paths = maps.modules.get(id(site.module), [site.name]) if maps is not None else [site.name]
    for _, ref in site.refs():
        p = ref.param
        uses = inside.get(id(p), [])
        if len(uses) > 1:
            problems.append(
                f"{site.name}: {ref.name} is one tensor used under several names inside the attention module "
                f"({', '.join(uses)}): a gauge action on one use would change the other. Untie them (give each projection "
                "its own parameter) before using gaugeopt"
            )
        if maps is not None:
            own = {f"{q}.{u}" if q else u for q in paths for u in uses}
            outside = [n for n in maps.params.get(id(p), []) if n not in own]
            if outside:
                problems.append(
                    f"{site.name}: {ref.name} is also used as {', '.join(outside[:3])}: a gauge action on this layer would "
                    "change that use too. Give each layer its own projection (copy.deepcopy the shared module) before "
                    "using gaugeopt"
                )
    return list(dict.fromkeys(problems))


class _Maps:
    """Every name of every parameter and module of a model (``remove_duplicate=False``), by ``id``."""

    def __init__(self, root: nn.Module) -> None:
        self.params: dict[int, list[str]] = {}
        for n, p in root.named_parameters(remove_duplicate=False):
            self.params.setdefault(id(p), []).append(n)
        self.modules: dict[int, list[str]] = {}
        for n, m in root.named_modules(remove_duplicate=False):
            self.modules.setdefault(id(m), []).append(n)


def _meta_problems(site: AttentionSite) -> list[str]:
    metas = sorted({ref.name for _, ref in site.refs() if ref.param.device.type == "meta"})
    if not metas:
        return []
    return [
        f"{site.name}: {', '.join(metas[:3])}{' ...' if len(metas) > 3 else ''} are on the meta device (shapes without "
        "values); materialise the model first (model.to_empty(device=...) and load or initialise its weights) — to "
        "count a model too large to materialise, pass its config: gaugeopt.gauge_dimension(config)"
    ]


def _parametrization_problems(modules: Iterable[tuple[str, nn.Module]]) -> list[str]:
    problems = []
    for name, m in modules:
        parametrized = getattr(m, "parametrizations", None)
        if isinstance(parametrized, nn.ModuleDict) and len(parametrized):
            problems.append(
                f"{name}: {', '.join(parametrized.keys())} {'is' if len(parametrized) == 1 else 'are'} parametrized "
                "(torch.nn.utils.parametrize): the forward computes the tensor from its parametrization, so a gauge action "
                "cannot edit it; remove the parametrization (parametrize.remove_parametrizations(module, name)) first"
            )
    return problems


def static_problems(model: nn.Module | None, sites: Sequence[AttentionSite]) -> list[str]:
    """Everything :func:`check_static` would refuse, one message each (``[]``: nothing found).

    """
    problems = global_hook_problems()
    maps = _Maps(model) if model is not None else None
    for site in sites:
        modules = site_modules(site)
        problems += _meta_problems(site)
        for name, m in modules:
            problems += hook_problems(name, m)
        problems += _parametrization_problems(modules)
        problems += _code_problems(site, modules)
        problems += _sharing_problems(maps, site)
    return list(dict.fromkeys(problems))


def check_static(model: nn.Module | None, sites: Sequence[AttentionSite], operation: str) -> None:
    """Raise :class:`~gaugeopt.GaugeError` listing every :func:`static_problems` finding."""
    problems = static_problems(model, sites)
    if problems:
        more = f"\n  ... and {len(problems) - 6} more" if len(problems) > 6 else ""
        raise GaugeError(
            f"{operation}: refused, because the model's attention is not what its records describe:\n  - "
            + "\n  - ".join(problems[:6]) + more
            + "\n(to take the risk anyway: gaugeopt.assume_certified(model, static_checks=False); docs/trust.md)"
        )
