"""The one gate: every gauge operation acts only through records proved for the model as it is now.

A record says where a layer's Q, K, V and O live and which transformations leave it unchanged. Every
operation that edits parameters through records (:func:`gaugeopt.gauge_fix`, the projector and
:class:`gaugeopt.GaugeOptimizer`, the training callbacks, random gauge transforms, canonical forms,
merging) or reads the model through them (equivalence, counting) passes this gate first:

1. **records** — :func:`gaugeopt.find_attention` (or the records given);
2. **static checks** (:mod:`gaugeopt.trust.static_checks`): hooks, parametrizations, shared
   tensors, code that is not the stock code, meta tensors — a :class:`~gaugeopt.GaugeError` before
   anything is written;
3. **proof** (:mod:`gaugeopt.trust.proof`): each record must carry a stamp proving it on
   the module as it is now (:mod:`gaugeopt.trust.stamps`). A missing proof is run now —
   from a forward recorded earlier, or from an input gaugeopt makes up for the models it knows
   (:mod:`gaugeopt.trust.examples`) — or the gate refuses, saying
   ``gaugeopt.certify(model, example_batch)``. Built-in adapters are proved like any other: an adapter
   is right for the stock class, the proof says it is right for *this* model.

The proof runs once per model structure: its stamps live on the modules. Long-lived users of the
gate (a fixer, a projector, a training callback) hold a :class:`Gate`, whose :meth:`Gate.ensure`
re-checks a :class:`Snapshot` of everything the records rely on — the module at every record's
path, its submodules, classes, hooks, parameters, the code bindings the static checks looked at —
in a few dictionary lookups per layer, and only runs the whole gate again when one changed (model
surgery, a tied weight, a new hook, a patched helper). A change of records is reported to the
caller, which plans again; a change it cannot follow is a :class:`~gaugeopt.GaugeError`.

**Opting out.** :func:`assume_certified` stamps the current records as assumed, without a proof
(``static_checks=False`` skips the static checks too): gauge operations then trust them until the
structure changes, and a warning says so once.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.trust.gate import Gate
    >>> model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8))
    >>> gate = Gate(model, "example")                    # proves both layers on a made-up input
    >>> gate.ensure()                                    # nothing changed since
    False
    >>> model.transformer.h[1].attn = GPT(model.config).transformer.h[1].attn   # model surgery
    >>> gate.ensure()                                    # found again, proved again, caller re-plans
    True
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Sequence

import torch.nn as nn
import torch.nn.modules.module as _torch_module

from gaugeopt.errors import GaugeError
from gaugeopt.trust.capture import arm_capture, release_capture, take_capture
from gaugeopt.trust.proof import certify_calls, certify_with
from gaugeopt.trust.stamps import fingerprint, how_certified, stamp, unproved
from gaugeopt.trust.examples import example_forward
from gaugeopt.adapters.find import find_attention
from gaugeopt.sectors.registry import generation
from gaugeopt.records.site import AttentionSite
from gaugeopt.trust.static_checks import check_static, site_bindings, site_modules

__all__ = ["Gate", "Snapshot", "assume_certified", "require_certified", "trusted_sites", "unproved", "arm_capture",
           "release_capture"]

_MISSING = object()
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")
_ASSUMED_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class Snapshot:
    """Everything the records of one gate pass rely on, re-checked in a few lookups per layer.

    :meth:`holds` is false as soon as any of these changed: the module at each record's path from the
    root, the submodules of each attention module (and their classes, instance ``forward``, forward
    hooks and pre-hooks), the parameter objects the records name and whether they are trainable, the
    code bindings of the static checks, the global module hooks, and the sector registry (a sector
    registered or removed: :func:`gaugeopt.sectors.generation`).
    """

    def __init__(self, root: nn.Module | None, sites: Sequence[AttentionSite]) -> None:
        same: list[tuple[Any, Any, Any]] = []        # (dict, key, object) compared by identity
        keys: list[tuple[dict, tuple]] = []          # (hook dict, its keys)
        self._bindings = list(dict.fromkeys(b for s in sites for b in site_bindings(s)))
        self._trainable = [(ref.param, ref.param.requires_grad) for s in sites for _, ref in s.refs()]
        for site in sites:
            if root is not None:
                parent = root
                for part in site.name.split(".") if site.name else ():
                    child = parent._modules.get(part)
                    same.append((parent._modules, part, child))
                    if child is None:
                        break
                    parent = child
            for _, m in site_modules(site):
                same.append((m.__dict__, "forward", m.__dict__.get("forward", _MISSING)))
                for name, child in m._modules.items():
                    same.append((m._modules, name, child))
                for attr in ("_forward_pre_hooks", "_forward_hooks"):
                    d = getattr(m, attr)
                    keys.append((d, tuple(d)))
            for _, ref in site.refs():
                store = ref.owner._parameters if ref.attr in ref.owner._parameters else vars(ref.owner)
                same.append((store, ref.attr, store.get(ref.attr, _MISSING)))
        for attr in _GLOBAL_HOOKS:
            d = getattr(_torch_module, attr, None)
            if d is not None:
                keys.append((d, tuple(d)))
        self._classes = [(m, type(m)) for s in sites for _, m in site_modules(s)]
        self._same = same
        self._keys = keys
        self._generation = generation()

    def holds(self) -> bool:
        if generation() != self._generation:
            return False
        for d, key, obj in self._same:
            if d.get(key, _MISSING) is not obj:
                return False
        for d, expected in self._keys:
            if len(d) != len(expected) or tuple(d) != expected:
                return False
        for m, cls in self._classes:
            if type(m) is not cls:
                return False
        for p, trainable in self._trainable:
            if p.requires_grad is not trainable:
                return False
        return all(b.holds() for b in self._bindings)


def _root_of(model: nn.Module | None, sites: Sequence[AttentionSite] | None) -> nn.Module | None:
    if model is not None:
        return model
    for s in sites or ():
        r = s.root_model
        if r is not None:
            return r
    return None


def _prove(root: nn.Module | None, sites: Sequence[AttentionSite], operation: str, *, automatic: bool):
    """Prove ``sites`` (all unproved) from a recorded forward or a made-up input and return the
    :class:`~gaugeopt.CertificateReport`; else refuse."""
    calls = take_capture(root, sites)
    if calls is not None:
        return certify_calls(sites, calls)
    example = example_forward(root, sites) if (automatic and root is not None) else None
    if example is not None:
        what, run = example
        try:
            return certify_with(root, lambda _model: run(), sites=sites)
        except GaugeError:
            raise
        except Exception as exc:  # the made-up input did not suit the model: say so, and how to give one
            raise GaugeError(
                f"{operation}: proving the attention records needs one forward, and the example gaugeopt made up "
                f"({what}) failed: {type(exc).__name__}: {exc}. Certify with a real batch: "
                "gaugeopt.certify(model, example_batch) (docs/trust.md)"
            ) from exc
    names = ", ".join(f"{s.name or '<root>'} ({type(s.module).__qualname__})" for s in sites[:4])
    more = f" and {len(sites) - 4} more" if len(sites) > 4 else ""
    why = ("certify=False asks for a proof made beforehand" if not automatic else
           "gaugeopt knows no example input for this model" if root is not None else
           "the records were built by hand, without the model they belong to")
    raise GaugeError(
        f"{operation}: {len(sites)} attention layer(s) — {names}{more} — have no proof for the model as it is now, "
        f"and none can be run here ({why}). A wrong record (head count, fused row order, RoPE convention, a hook or "
        "a patched helper) would change the model silently. Prove them once on an example input: "
        "gaugeopt.certify(model, example_batch) — or gaugeopt.assume_certified(model) to skip the proof at your own "
        "risk (docs/trust.md)"
    )


def _warn_assumed(sites: Sequence[AttentionSite], operation: str) -> None:
    for s in sites:
        if how_certified(s) == "assumed" and s.module not in _ASSUMED_WARNED:
            _ASSUMED_WARNED.add(s.module)
            warnings.warn(
                f"{operation}: {s.name or '<root>'} acts through a record assumed, not proved "
                "(gaugeopt.assume_certified); gaugeopt cannot vouch that it keeps the model's function",
                RuntimeWarning, stacklevel=4,
            )


def _assumed_without_checks(sites: Sequence[AttentionSite]) -> bool:
    return bool(sites) and all(vars(s.module).get("_gaugeopt_skip_static") for s in sites)


def trusted_sites(model: nn.Module | None, operation: str, *, sites: Sequence[AttentionSite] | None = None,
                  automatic: bool = True) -> list[AttentionSite]:
    """One pass of the gate: the records of ``model`` (or ``sites``), checked and proved, or a
    :class:`~gaugeopt.GaugeError` naming what is wrong and what to do.

    Args:
        model: the model (``None`` when ``sites`` are given: their model is used if they know it).
        operation: the caller's name, for messages.
        sites: records to use instead of ``find_attention(model)``.
        automatic: prove missing records now where possible; ``False`` requires an existing proof.
    """
    root = _root_of(model, sites)
    if sites is None:
        if model is None:
            raise GaugeError(f"{operation}: pass a model or sites=gaugeopt.find_attention(model)")
        sites = find_attention(model)
    sites = list(sites)
    if not _assumed_without_checks(sites):
        check_static(root, sites, operation)
    todo = unproved(sites)
    if todo:
        _prove(root, todo, operation, automatic=automatic)
    _warn_assumed(sites, operation)
    return sites


def require_certified(sites: Sequence[AttentionSite], operation: str) -> None:
    """The gate (:func:`trusted_sites`) for code that holds records only: static checks, then a proof —
    run now where gaugeopt can find an example input for the model the records came from — or a
    :class:`GaugeError` saying how to give one."""
    sites = list(sites)
    if not sites:
        raise GaugeError(f"{operation}: no attention records to act on")
    trusted_sites(None, operation, sites=sites)


def _same(a: Sequence[AttentionSite], b: Sequence[AttentionSite]) -> bool:
    return len(a) == len(b) and all(x.module is y.module and fingerprint(x) == fingerprint(y) for x, y in zip(a, b))


class Gate:
    """A long-lived pass through the gate: records found, checked and proved once, then kept honest.

    Args:
        model: the model (``None`` with ``sites``).
        operation: the caller's name, for messages.
        sites: records to use instead of finding them (they are not found again after surgery: a
            record whose module left the model is an error).
        automatic: prove missing records at construction from a made-up input where gaugeopt knows
            one, else from the next forward (:func:`arm_capture`) at the first :meth:`ensure`;
            ``False`` requires proofs made beforehand (``gaugeopt.certify``).
    """

    def __init__(self, model: nn.Module | None, operation: str, *, sites: Sequence[AttentionSite] | None = None,
                 automatic: bool = True) -> None:
        self.operation = operation
        self.automatic = automatic
        self._given = None if sites is None else list(sites)
        if model is None and not self._given:
            raise GaugeError(f"{operation}: pass a model or sites=gaugeopt.find_attention(model)")
        self.root = _root_of(model, self._given)
        self.sites: list[AttentionSite] = self._find()
        self.snapshot: Snapshot | None = None
        self.certificate = None  # the CertificateReport of the latest proof this gate ran
        if not _assumed_without_checks(self.sites):
            check_static(self.root, self.sites, operation)
        todo = unproved(self.sites)
        if todo and automatic:
            if self.root is not None and example_forward(self.root, todo) is not None:
                self.certificate = _prove(self.root, todo, operation, automatic=True)
            else:
                arm_capture(self.root, todo)
        elif todo:
            _prove(self.root, todo, operation, automatic=False)
        if not unproved(self.sites):
            _warn_assumed(self.sites, operation)
            self.snapshot = Snapshot(self.root, self.sites)

    def _find(self) -> list[AttentionSite]:
        if self._given is None:
            return find_attention(self.root)
        if self.root is not None:
            for s in self._given:
                try:
                    here = self.root.get_submodule(s.name) if s.name else self.root
                except AttributeError:
                    here = None
                if here is not s.module:
                    raise GaugeError(
                        f"{self.operation}: the record {s.name!r} points at a module that is no longer in the model "
                        "(replaced or removed since the records were found); find them again "
                        "(gaugeopt.find_attention(model)) and build a new one"
                    )
        return list(self._given)

    @property
    def proved(self) -> bool:
        """Whether every record is proved (or assumed) and nothing changed since."""
        return self.snapshot is not None and self.snapshot.holds()

    def ensure(self) -> bool:
        """Before each use: ``False`` when nothing changed; otherwise run the gate again (records found
        again unless given, checked, proved) and return whether the records changed — the caller
        must plan again — or raise :class:`~gaugeopt.GaugeError`."""
        if self.snapshot is not None and self.snapshot.holds():
            return False
        old = self.sites
        self.sites = self._find()
        if not _assumed_without_checks(self.sites):
            check_static(self.root, self.sites, self.operation)
        todo = unproved(self.sites)
        if todo:
            self.certificate = _prove(self.root, todo, self.operation, automatic=self.automatic)
        _warn_assumed(self.sites, self.operation)
        release_capture(self.root, self.sites)  # proved: a recording still armed is not needed
        self.snapshot = Snapshot(self.root, self.sites)
        return not _same(old, self.sites)

    def record_next_forward(self) -> None:
        """Record the next forward's calls of the records still unproved (a training batch, with its
        real masks and positions), for the proof at the next :meth:`ensure`."""
        if self.snapshot is None:
            arm_capture(self.root, unproved(self.sites))


def assume_certified(model: nn.Module, *, static_checks: bool = True,
                     sites: Sequence[AttentionSite] | None = None) -> list[AttentionSite]:
    """Skip the proof: stamp ``model``'s current attention records as assumed correct.

    For users who accept the risk — a model gaugeopt cannot run on a made-up input and no batch at
    hand, or a proof too slow for a quick experiment. Gauge operations then use the records without
    proving them (and warn once per layer), until the structure changes (a new hook, surgery,
    ``apply_lrm``). ``static_checks=False`` also skips the static checks (hooks, sharing, patched
    code): nothing then stands between a wrong record and your model.

    Returns:
        The records stamped.

    Example:
        >>> import torch, gaugeopt
        >>> from gaugeopt.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
        >>> [s.name for s in gaugeopt.assume_certified(model)]
        ['transformer.h.0.attn']
    """
    if not isinstance(model, nn.Module):
        raise GaugeError(f"assume_certified: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(static_checks, bool):
        raise GaugeError(f"assume_certified: static_checks={static_checks!r} must be True or False")
    sites = list(find_attention(model) if sites is None else sites)
    if static_checks:
        check_static(model, sites, "assume_certified")
    for s in sites:
        vars(s.module)["_gaugeopt_skip_static"] = not static_checks
        stamp(s, "assumed")
    return sites
