"""Which attention records may be used to change parameters: verified or certified ones.

A record (:class:`~gaugeopt.AttentionSite`) is trusted when

* a built-in adapter made it (:attr:`~gaugeopt.AttentionSite.verified`: the test suite checks
  every gauge action on that class), or
* :func:`gaugeopt.certify` proved it on this model: the certificate stamps the attention module
  with the record's :func:`fingerprint` (head counts, widths, RoPE, QK-norm and every tensor
  reference, relative to the module). The stamp travels with the module (``copy.deepcopy``,
  ``torch.compile`` and DDP wrappers keep it) and stops matching as soon as the record changes
  (``apply_lrm`` adds multipliers: certify again).

Every operation that changes parameters through a record — :func:`gaugeopt.gauge_fix`,
:class:`gaugeopt.GaugeProjector` and :class:`gaugeopt.GaugeProjected`,
:func:`gaugeopt.random_gauge_transform`, :func:`gaugeopt.canonicalize`, :func:`gaugeopt.merge`
and the Lightning callbacks — calls :func:`require_certified` first.

Example:
    >>> import torch.nn as nn, gaugeopt
    >>> from gaugeopt.structure.certified import is_certified
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

from gaugeopt.errors import GaugeError
from gaugeopt.structure.site import AttentionSite, TensorRef

__all__ = ["fingerprint", "is_certified", "require_certified", "stamp"]

_STAMP = "_gaugeopt_certificates"


def _index_key(index) -> object:
    if isinstance(index, slice):
        return ("slice", index.start, index.stop, index.step)
    return index


def _relative(site: AttentionSite, ref: TensorRef) -> str:
    prefix = f"{site.name}." if site.name else ""
    return ref.name[len(prefix):] if prefix and ref.name.startswith(prefix) else ref.name


def fingerprint(site: AttentionSite) -> tuple:
    """What a certificate vouches for: the record's structure and tensor references (names
    relative to the module, so a wrapper's prefix does not matter)."""
    refs = tuple(
        (role, _relative(site, ref), ref.attr, tuple(ref.shape), ref.transpose, _index_key(ref.index), ref.groups)
        for role, ref in site.refs()
    )
    n = site.qk_norm
    norm = None if n is None else (n.kind, n.scope, n.gain_offset, n.before_rope, float(n.eps))
    key = (site.h, site.h_kv, site.d_k, site.d_v, site.d_model, site.rope.kind, site.rope.rotary_dim, norm,
           site.float32_steps, site.fixed_head_order, refs)
    lat = site.latent
    if lat is not None:  # multi-head latent attention: its RoPE layout and latent norms (the refs are above)
        key += ((lat.rope.kind, lat.rope.rotary_dim, tuple((x.name, float(x.eps), x.gain_offset) for x in lat.latents())),)
    return key


def stamp(site: AttentionSite) -> None:
    """Record on the module that ``site`` passed the certificate."""
    vars(site.module).setdefault(_STAMP, set()).add(fingerprint(site))


def is_certified(site: AttentionSite) -> bool:
    """A verified built-in record, or one whose fingerprint the module carries from :func:`gaugeopt.certify`."""
    if site.verified:
        return True
    return fingerprint(site) in vars(site.module).get(_STAMP, ())


def require_certified(sites: Iterable[AttentionSite], operation: str) -> None:
    """Refuse to change parameters through a record nobody has proved (see the module docstring)."""
    bad = [s for s in sites if not is_certified(s)]
    if not bad:
        return
    names = ", ".join(f"{s.name or '<root>'} ({type(s.module).__qualname__})" for s in bad[:4])
    more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
    raise GaugeError(
        f"{operation}: {len(bad)} attention layer(s) — {names}{more} — are described by an adapter the test suite has "
        "not verified, and no certificate on this model proves that the record matches the module's computation; "
        "a wrong record (head count, fused row order, RoPE convention or partial rotary width, a Q/K norm) would "
        "change the model silently. Certify it once on an example input: gaugeopt.certify(model, example_batch) "
        "(the Lightning callbacks do it on the first training batch; docs/adapters.md)"
    )
