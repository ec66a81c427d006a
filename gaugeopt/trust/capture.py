"""Recording the calls of attention modules, for a proof made later.

The certificate (:mod:`gaugeopt.trust.proof`) reruns each attention module alone on the
arguments the model's own forward gave it. :class:`CallRecorder` records the first call of each
record's module — positional and keyword arguments (hidden states, masks, position embeddings,
encoder states) as detached snapshots, key/value caches dropped, the output, the mode and the
autocast dtype. The gate (:mod:`gaugeopt.trust.gate`) keeps one recording per model armed
(:func:`arm_capture`) while records wait for a proof, so that the next training forward — with its
real masks and positions — proves them; :func:`take_capture` hands the calls over once every
module has been called, :func:`release_capture` drops a recording no longer needed.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.trust.capture import CallRecorder
    >>> model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8))
    >>> sites = gaugeopt.find_attention(model)
    >>> with CallRecorder(sites) as rec:
    ...     _ = model(torch.randint(0, 32, (1, 8)))
    >>> sorted(rec.calls), tuple(rec.calls["transformer.h.0.attn"].args[0].shape)
    (['transformer.h.0.attn', 'transformer.h.1.attn'], (1, 8, 8))
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn

from gaugeopt.trust.stamps import unproved
from gaugeopt.records.site import AttentionSite

__all__ = ["Call", "CallRecorder", "arm_capture", "release_capture", "take_capture"]

# root model (or first attention module, for records without one) -> a CallRecorder waiting for a forward
_CAPTURES: "weakref.WeakKeyDictionary[nn.Module, CallRecorder]" = weakref.WeakKeyDictionary()


@dataclass
class Call:
    """One recorded call of an attention module: its arguments (snapshots), output, mode, and the
    autocast dtype it ran under (``None`` without autocast)."""

    args: tuple
    kwargs: dict
    output: torch.Tensor | None
    training: bool
    autocast: torch.dtype | None = None


def _autocast_dtype(args: Any) -> torch.dtype | None:
    """The autocast dtype active for the device of the first tensor in ``args`` (``None`` if off)."""
    t = _first_tensor(args)
    device = t.device.type if t is not None else "cpu"
    try:
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    except (RuntimeError, TypeError):  # a device type without autocast
        return None


def _is_cache(obj: Any) -> bool:
    return type(obj).__name__.endswith("Cache")


def _snapshot(obj: Any, memo: dict) -> Any:
    """Detached copies of the tensors in ``obj`` (each tensor once, shared across calls), key/value
    caches replaced by ``None`` (a rerun must not read or grow them), anything else by reference."""
    if isinstance(obj, torch.Tensor):
        got = memo.get(id(obj))
        if got is None:  # keep the original alive with its copy: a freed tensor's id may be reused
            got = memo[id(obj)] = (obj, obj.detach().clone())
        return got[1]
    if _is_cache(obj):
        return None
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_snapshot(x, memo) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_snapshot(x, memo) for x in obj)
    if isinstance(obj, dict):
        return {k: _snapshot(v, memo) for k, v in obj.items()}
    return obj


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for x in out:
            t = _first_tensor(x)
            if t is not None:
                return t
    if isinstance(out, Mapping):
        for x in out.values():
            t = _first_tensor(x)
            if t is not None:
                return t
    return None


def _mark(hook):
    """The recorder's hooks only read: the static checks let them pass, proofs do not count them."""
    hook._gaugeopt_read_only = True
    hook._gaugeopt_recorder = True
    return hook


class CallRecorder:
    """Records the first call of each site's module (a context manager, or :meth:`close`); see the
    module docstring for an example."""

    def __init__(self, sites: Sequence[AttentionSite]) -> None:
        self.calls: dict[str, Call] = {}
        self.names = frozenset(s.name for s in sites)
        self._memo: dict = {}
        self._handles = []
        for site in sites:
            self._handles.append(site.module.register_forward_pre_hook(self._pre(site), with_kwargs=True))
            self._handles.append(site.module.register_forward_hook(self._post(site), with_kwargs=True))

    def _pre(self, site: AttentionSite):
        name, owner = site.name, site.module

        def hook(module, args, kwargs):
            if module is owner and name not in self.calls:  # not a copy of the module made meanwhile
                self.calls[name] = Call(_snapshot(args, self._memo), _snapshot(kwargs, self._memo), None, module.training,
                                        _autocast_dtype(args))
        return _mark(hook)

    def _post(self, site: AttentionSite):
        name, owner = site.name, site.module

        def hook(module, args, kwargs, output):
            call = self.calls.get(name)
            if module is owner and call is not None and call.output is None:
                out = _first_tensor(output)
                call.output = None if out is None else out.detach().clone()
        return _mark(hook)

    @property
    def complete(self) -> bool:
        return all(c.output is not None for c in self.calls.values())

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._memo = {}

    def __enter__(self) -> "CallRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _to_float64(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_float64(x) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_float64(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_float64(v) for k, v in obj.items()}
    return obj


# ---------------------------------------------------------------------- recordings armed for the gate
def _capture_key(root: nn.Module | None, sites: Sequence[AttentionSite]) -> nn.Module | None:
    return root if root is not None else (sites[0].module if sites else None)


def arm_capture(root: nn.Module | None, sites: Sequence[AttentionSite]) -> None:
    """Record the next forward's calls of the unproved ``sites``, for a proof at the next gate pass."""
    todo = unproved(sites)
    key = _capture_key(root, sites)
    if not todo or key is None:
        return
    rec = _CAPTURES.get(key)
    if rec is not None and {s.name for s in todo} <= rec.names:
        return
    if rec is not None:
        rec.close()
    _CAPTURES[key] = CallRecorder(todo)


def release_capture(root: nn.Module | None, sites: Sequence[AttentionSite] = ()) -> None:
    """Drop a recording armed for ``root`` (or for ``sites`` without one): their records are proved."""
    key = _capture_key(root, list(sites))
    rec = _CAPTURES.pop(key, None) if key is not None else None
    if rec is not None:
        rec.close()


def take_capture(root: nn.Module | None, sites: Sequence[AttentionSite]):
    key = _capture_key(root, sites)
    rec = _CAPTURES.get(key) if key is not None else None
    if rec is None or not all(s.name in rec.calls and rec.calls[s.name].output is not None for s in sites):
        return None
    del _CAPTURES[key]
    rec.close()
    return rec.calls
