"""Proof stamps: which attention records the certificate has proved on the module as it is now.

:func:`gaugeopt.certify` (or the gate, :mod:`gaugeopt.trust.gate`, on its own) reruns each
attention module in float64 under random gauge transformations; a record that passes is stamped on
its module under its :func:`proof_key`:

* the record's structure (:func:`fingerprint`: head counts, widths, RoPE, QK-norm and every tensor
  reference, relative to the module, so a wrapper's prefix does not matter), and
* what the module runs (:func:`behaviour_key`): the class of every module inside it, the code
  of every ``forward``, method, helper and kernel the static checks looked at
  (:mod:`gaugeopt.trust.static_checks`), and the read-only hooks the proof ran with;
* the sector registry as it was (:func:`gaugeopt.sectors.generation`): a new sector is
  proved before anything uses it.

The stamp travels with the module (``copy.deepcopy``, ``torch.compile``, DDP wrappers and FSDP2's
sharding keep it; pickling keeps it but a new process computes other keys, so it proves again)
and stops matching as soon as either part changes: ``apply_lrm`` adds multipliers, a helper is
patched, a hook is added. A module replaced by a new one carries no stamp. Records assumed without
a proof (:func:`gaugeopt.assume_certified`) are stamped as ``"assumed"``.

Example:
    >>> import torch.nn as nn, gaugeopt
    >>> from gaugeopt.trust.stamps import is_certified
    >>> class Attn(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
    >>> site = gaugeopt.AttentionSpec(q="q", k="k", v="v", o="o", num_heads=2, stock_forward=False).build(Attn(), "a")
    >>> is_certified(site)
    False
"""

from __future__ import annotations

from typing import Iterable

from gaugeopt.sectors.registry import generation
from gaugeopt.records.site import AttentionSite, TensorRef
from gaugeopt.trust.static_checks import is_allowed_hook, site_bindings

__all__ = ["fingerprint", "behaviour_key", "proof_key", "is_certified", "how_certified", "stamp", "unproved"]

_STAMP = "_gaugeopt_certificates"


def _index_key(index) -> object:
    if isinstance(index, slice):
        return ("slice", index.start, index.stop, index.step)
    return index


def _relative(site: AttentionSite, ref: TensorRef) -> str:
    prefix = f"{site.name}." if site.name else ""
    return ref.name[len(prefix):] if prefix and ref.name.startswith(prefix) else ref.name


def fingerprint(site: AttentionSite) -> tuple:
    """The record's structure and tensor references (names relative to the module)."""
    refs = tuple(
        (role, _relative(site, ref), ref.attr, tuple(ref.shape), ref.transpose, _index_key(ref.index), ref.groups)
        for role, ref in site.refs()
    )
    n = site.qk_norm
    norm = None if n is None else (n.kind, n.scope, n.gain_offset, n.before_rope, float(n.eps))
    key = (site.h, site.h_kv, site.d_k, site.d_v, site.d_model, site.rope.kind, site.rope.rotary_dim, norm,
           site.float32_steps, site.fixed_head_order, site.qk_orthogonal, site.kind, refs)
    lat = site.latent
    if lat is not None:  # multi-head latent attention: its RoPE layout and latent norms (the refs are above)
        key += ((lat.rope.kind, lat.rope.rotary_dim, tuple((x.name, float(x.eps), x.gain_offset) for x in lat.latents())),)
    return key


def behaviour_key(site: AttentionSite) -> tuple:
    """What the module runs: the classes inside it, the code of every binding the static checks looked at
    (:func:`~gaugeopt.trust.static_checks.site_bindings`) and the read-only hooks it carries."""
    classes, hooks = [], []
    for rel, m in site.module.named_modules():
        cls = type(m)
        classes.append((rel, cls.__module__, cls.__qualname__))
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            for h in getattr(m, attr, {}).values():
                if is_allowed_hook(h) and not getattr(h, "_gaugeopt_recorder", False):
                    fn = getattr(h, "__func__", h)
                    code = getattr(fn, "__code__", None)
                    hooks.append((rel, attr, getattr(fn, "__qualname__", type(fn).__qualname__),
                                  None if code is None else (code.co_filename, code.co_firstlineno, hash(code.co_code))))
    return tuple(classes), tuple(sorted({b.code_key() for b in site_bindings(site)}, key=repr)), tuple(hooks)


def proof_key(site: AttentionSite) -> tuple:
    """The key a proof of ``site`` is stamped under: ``(fingerprint, behaviour_key, registry generation)``.

    The last part is :func:`gaugeopt.sectors.generation`: a proof covers the sectors registered when
    it ran, so registering or removing a sector (or a named control) makes every record prove again."""
    return fingerprint(site), behaviour_key(site), generation()


def stamp(site: AttentionSite, how: str = "proved") -> None:
    """Record on the module that ``site`` passed the certificate (``how="proved"``) or was assumed."""
    stamps = vars(site.module).get(_STAMP)
    if not isinstance(stamps, dict):  # a stamp set written by an earlier release: start over
        stamps = vars(site.module)[_STAMP] = {}
    stamps[proof_key(site)] = how


def how_certified(site: AttentionSite) -> str | None:
    """``"proved"``, ``"assumed"`` or ``None`` for the record as it is now."""
    stamps = vars(site.module).get(_STAMP)
    if not isinstance(stamps, dict):
        return None
    return stamps.get(proof_key(site))


def is_certified(site: AttentionSite) -> bool:
    """Whether the module carries a proof (or an assumption) of this record as it is now."""
    return how_certified(site) is not None


def unproved(sites: Iterable[AttentionSite]) -> list[AttentionSite]:
    """The records without a proof (or an assumption) for the module as it is now."""
    return [s for s in sites if how_certified(s) is None]
