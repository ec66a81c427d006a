"""The certificate: prove numerically that each attention record matches its module's computation.

An adapter — a built-in one or yours — *claims* where a layer's Q, K, V and O live, how many
heads it has and how RoPE pairs its coordinates. :func:`certify` checks the claim on your model:

1. run the model once on your example input, and record the real call of every attention
   module (forward pre-hooks with keyword arguments: hidden states, masks, position
   embeddings, encoder states; key/value caches are dropped);
2. per layer, alone: copy the module, cast it and the recorded floating arguments to float64,
   give the copy generic random parameters (:func:`~gaugeopt.trust.invariance.randomize_parameters`:
   a freshly initialised model's near-uniform attention would hide a wrong Q/K record, and a
   record that is right is right for every value of the weights) and compute its output ``y``;
3. for every sector the record claims — ``qk`` (``GL(d_k)`` per KV group, in the RoPE
   commutant; with a QK-norm ``qk_gain``, the gain gauge of the norm), ``vo`` (``GL(d_v)``),
   ``perm`` (head permutations), the bias sectors ``key_bias`` and ``value_bias`` where the
   record has the biases (:mod:`gaugeopt.records.bias_sector`), with learnable
   multipliers ``lrm_qk``, ``lrm_vo``, ``lrm_internal``, and on multi-head latent attention
   ``qk_rope``, ``latent_rotation``, ``latent_gain`` (docs/mla.md) — apply a random valid element to a
   fresh copy and require ``‖y' − y‖ / ‖y‖ ≤ 1e-10``;
4. per sector, apply a *negative control* (an invalid element: a general ``GL(d_k)`` under RoPE
   or an asymmetric Q/K pair, the plain Q/K gauge under a QK-norm, a mismatched V/O pair, query
   heads permuted alone — under latent attention every head but its RoPE query rows —, a one-sided
   multiplier scale, a key shift on RoPE-rotated channels or one that varies with the key, a value
   bias moved without the output bias, a general ``GL`` on the shared RoPE key or on a latent, a
   latent gain moved alone) and require a change ``≥ 1e-3``, so that the check has power.

A layer whose module computes part of the attention in float32 even in float64 (recorded in
:attr:`~gaugeopt.AttentionSite.float32_steps`, e.g. torchtitan's RoPE, GPT-J's eager scores)
gets ``1e-6`` instead of ``1e-10`` in the sectors that change queries, keys, scores or values
through the softmax (``qk``, ``qk_gain``, ``lrm_qk``, ``perm``, ``key_bias``, ``value_bias``; on multi-head
latent attention also ``qk_rope``, ``latent_rotation``, ``latent_gain``, which its implementations' float32
latent norms and rotations see); the controls still need ``1e-3``. One layer is copied at a
time, so the cost is one float64 attention layer, whatever the model's size.

A wrong record fails: a wrong head count or GQA map, a forgotten partial rotary or a missing
RoPE (the ``qk`` element leaves the true commutant), a Q/K-normalised module registered as plain
attention, a fused layout read in the wrong row order. The error names the layer, the sector
and the measured change. Passing records are stamped on their modules
(:mod:`gaugeopt.trust.stamps`), which lets the gauge operations use them.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, rope="split_half"))
    >>> report = gaugeopt.certify(model, torch.randint(0, 64, (2, 16)))
    >>> [sorted(layer.sectors) for layer in report.layers][0]
    ['perm', 'qk', 'value_bias', 'vo']
    >>> report.worst_valid < 1e-10 < 1e-3 < report.weakest_control
    True
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.trust.capture import Call, CallRecorder, _first_tensor, _to_float64, release_capture
from gaugeopt.trust.stamps import stamp
from gaugeopt.sectors.group_actions import relative_change
from gaugeopt.trust.invariance import randomize_parameters
from gaugeopt.adapters.find import find_attention
from gaugeopt import sectors
from gaugeopt.records.site import AttentionSite, ProjectionRefs, QKNorm, TensorRef
from gaugeopt.trust.static_checks import check_static, is_infrastructure_hook

__all__ = [
    "VALID_TOL", "FLOAT32_TOL", "CONTROL_MIN", "SectorCheck", "LayerCertificate", "CertificateReport",
    "CallRecorder", "certify", "certify_calls", "claimed_sectors",
]

VALID_TOL = 1e-10
FLOAT32_TOL = 1e-6
CONTROL_MIN = 1e-3
# How closely a float64 rerun must reproduce the module's output in the model's own forward, by dtype.
_RERUN_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


@dataclass
class SectorCheck:
    """One sector of one layer: the largest relative change under valid elements, the change under
    the negative control, and the tolerance applied."""

    sector: str
    valid: float
    control: float
    control_kind: str
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.valid <= self.tolerance and self.control >= CONTROL_MIN


@dataclass
class LayerCertificate:
    """The checks of one attention layer (:attr:`sectors` by name)."""

    name: str
    kind: str
    sectors: dict[str, SectorCheck] = field(default_factory=dict)
    float32_steps: str = ""
    rerun_change: float | None = None

    @property
    def worst_valid(self) -> float:
        return max((c.valid for c in self.sectors.values()), default=0.0)

    @property
    def weakest_control(self) -> float:
        return min((c.control for c in self.sectors.values()), default=float("inf"))


@dataclass
class CertificateReport:
    """What :func:`certify` measured, per layer; ``str(report)`` is a table."""

    layers: list[LayerCertificate] = field(default_factory=list)

    @property
    def worst_valid(self) -> float:
        """Largest relative change of any layer's output under a valid element."""
        return max((layer.worst_valid for layer in self.layers), default=0.0)

    @property
    def weakest_control(self) -> float:
        """Smallest relative change under a negative control (must be ≥ 1e-3)."""
        return min((layer.weakest_control for layer in self.layers), default=float("inf"))

    def as_dict(self) -> dict[str, float]:
        out = {"certificate/worst_valid": self.worst_valid, "certificate/weakest_control": self.weakest_control}
        return out

    def __str__(self) -> str:
        rows = [f"{'layer':<40} {'kind':<14} sector        valid     control ({'kind'})"]
        for layer in self.layers:
            for c in layer.sectors.values():
                rows.append(f"{layer.name:<40} {layer.kind:<14} {c.sector:<12} {c.valid:9.1e} {c.control:9.1e} ({c.control_kind})")
        rows.append(f"worst valid change {self.worst_valid:.1e}, weakest control {self.weakest_control:.1e}")
        return "\n".join(rows)


# ---------------------------------------------------------------------- one layer
def _rebind(site: AttentionSite, module: nn.Module) -> AttentionSite:
    """The record ``site`` pointing into ``module``, a copy of ``site.module``."""
    paths = {id(m): p for p, m in site.module.named_modules(remove_duplicate=False)}

    def ref_on(ref: TensorRef | None) -> TensorRef | None:
        if ref is None:
            return None
        path = paths.get(id(ref.owner))
        if path is None:
            raise GaugeError(
                f"certify: {site.name}: {ref.name} is not held by the attention module {site.name or '<root>'} "
                f"({type(site.module).__qualname__}); the certificate reruns that module alone, so its record must name "
                "the module that computes all four projections (register the spec on the parent, e.g. BertAttention "
                "for BERT's output.dense; docs/adapters.md)"
            )
        return dataclasses.replace(ref, owner=module.get_submodule(path) if path else module)

    def proj_on(p: ProjectionRefs) -> ProjectionRefs:
        return ProjectionRefs(ref_on(p.weight), ref_on(p.bias), ref_on(p.row_mult), ref_on(p.col_mult))

    norm: QKNorm | None = site.qk_norm
    if norm is not None:
        norm = dataclasses.replace(norm, q_gain=ref_on(norm.q_gain), k_gain=ref_on(norm.k_gain),
                                   q_bias=ref_on(norm.q_bias), k_bias=ref_on(norm.k_bias))
    lat = site.latent
    if lat is not None:
        def latent_on(x):
            return None if x is None else dataclasses.replace(
                x, down=ref_on(x.down), down_bias=ref_on(x.down_bias), gain=ref_on(x.gain), up=ref_on(x.up))

        lat = dataclasses.replace(lat, q_rope=ref_on(lat.q_rope), q_rope_bias=ref_on(lat.q_rope_bias),
                                  k_rope=ref_on(lat.k_rope), k_rope_bias=ref_on(lat.k_rope_bias),
                                  kv_latent=latent_on(lat.kv_latent), q_latent=latent_on(lat.q_latent))
    return dataclasses.replace(site, module=module, q=proj_on(site.q), k=proj_on(site.k), v=proj_on(site.v),
                               o=proj_on(site.o), qk_norm=norm, sinks=ref_on(site.sinks), latent=lat)


def claimed_sectors(site: AttentionSite) -> list[str]:
    """The sectors a record claims, in the order they are checked: every registered sector that is a
    symmetry of the record's kind of attention and that it holds (:func:`gaugeopt.sectors.claimed`)
    — ``qk`` (or ``qk_gain`` with a QK-norm), ``vo``, on multi-head latent attention ``qk_rope``,
    ``latent_rotation``, ``latent_gain``, ``perm`` (two heads or more, no per-head score term), the bias
    sectors its biases give it, the multiplier sectors its learnable multipliers give it."""
    return sectors.claimed(site)


@torch.no_grad()
def _valid(site: AttentionSite, sector: str, g: torch.Generator) -> None:
    """Apply the valid element the certificate uses for ``sector`` (never the identity)."""
    sectors.sector(sector).prove(site, g)


@torch.no_grad()
def _control(site: AttentionSite, sector: str, g: torch.Generator) -> str:
    """Apply the sector's negative control; returns its name."""
    return sectors.sector(sector).control(site, g)


def _float64_copy(module: nn.Module) -> nn.Module:
    """A float64 copy of ``module`` in eval mode to rerun alone: sharded (DTensor) parameters become
    full-shape local tensors — their values are replaced by random ones anyway, so no collective is
    needed —, and hooks that only move shards or record calls (FSDP2's, gaugeopt's own) are dropped;
    a user's hooks stay, so the proof covers them."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        if type(p).__name__ == "DTensor":
            memo[id(p)] = nn.Parameter(torch.zeros(tuple(p.shape), dtype=torch.float64), requires_grad=p.requires_grad)
    out = copy.deepcopy(module, memo)
    for m in out.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            d = getattr(m, attr)
            for key in [k for k, h in d.items() if getattr(h, "_gaugeopt_recorder", False) or is_infrastructure_hook(h)]:
                del d[key]
                getattr(m, attr + "_with_kwargs", {}).pop(key, None)
                getattr(m, "_forward_hooks_always_called", {}).pop(key, None)
    return out.double().eval()


def _run(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    out = _first_tensor(module(*args, **kwargs))
    if out is None:
        raise GaugeError(f"certify: {type(module).__qualname__} returned no tensor")
    return out


def _floats(obj: Any):
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _floats(x)
    elif isinstance(obj, Mapping):
        for x in obj.values():
            yield from _floats(x)


def _require_finite(site: AttentionSite, call: Call) -> None:
    """A recorded call with a NaN or an infinity (an additive mask's -inf aside) proves nothing."""
    bad = [t for t in _floats((call.args, call.kwargs)) if torch.isnan(t).any() or torch.isposinf(t).any()]
    if call.output is not None and not torch.isfinite(call.output).all():
        bad.append(call.output)
    if bad:
        raise GaugeError(
            f"certify: layer {site.name}: the model's own forward fed it, or got from it, NaN or infinite values (a "
            "non-finite weight or input upstream), so nothing can be proved on that call. Prove the records while the "
            "model is finite (gaugeopt.certify(model, example_batch) before training, or any gauge operation then: the "
            "proof is kept) or repair the values first (docs/trust.md)"
        )


def certify_site(site: AttentionSite, call: Call, *, seed: int = 0) -> LayerCertificate:
    """Certify one record on one recorded call (see the module docstring); raises :class:`GaugeError`."""
    _require_finite(site, call)
    sharded = any(type(p).__name__ == "DTensor" for p in site.module.parameters())
    g = torch.Generator().manual_seed(seed)
    base = _float64_copy(site.module)
    args, kwargs = _to_float64(call.args), _to_float64(call.kwargs)
    cert = LayerCertificate(site.name, site.kind, float32_steps=site.float32_steps)
    if call.output is not None and not call.training and not sharded:  # the rerun must be the call it claims to be
        cert.rerun_change = relative_change(_run(base, args, kwargs), call.output.double())
        limit = _RERUN_TOL.get(call.autocast or call.output.dtype, 5e-2)  # bf16/fp16 autocast: its own rounding
        if not cert.rerun_change <= limit:
            raise GaugeError(
                f"certify: layer {site.name} ({site.kind}): rerunning the module alone on its recorded inputs changes its "
                f"output by {cert.rerun_change:.1e} relative to the model's own forward ({call.autocast or call.output.dtype}, limit "
                f"{limit:.0e}): the module depends on something the recording cannot replay (a cache, a hook, global "
                "state), so gaugeopt cannot certify it"
            )
    randomize_parameters(base, g)
    y = _run(base, args, kwargs)
    for sector in claimed_sectors(site):
        tol = FLOAT32_TOL if site.float32_steps and sectors.sector(sector).through_scores else VALID_TOL
        moved = copy.deepcopy(base)
        _valid(_rebind(site, moved), sector, g)
        valid = relative_change(y, _run(moved, args, kwargs))
        moved = copy.deepcopy(base)
        kind = _control(_rebind(site, moved), sector, g)
        control = relative_change(y, _run(moved, args, kwargs))
        check = SectorCheck(sector, valid, control, kind, tol)
        cert.sectors[sector] = check
        if valid > tol:
            raise GaugeError(
                f"certify: layer {site.name} ({site.kind}), sector {sector}: a valid gauge transformation changed the "
                f"module's output by {valid:.1e} (> {tol:.0e}), so the record does not describe this module's "
                "computation — check the head counts and GQA grouping, the fused row order, the RoPE convention and "
                "rotary width (partial rotary?), a per-head Q/K normalisation, extra learned keys or values"
                + (f"; the module computes {site.float32_steps}" if site.float32_steps else "")
            )
        if control < CONTROL_MIN:
            raise GaugeError(
                f"certify: layer {site.name} ({site.kind}), sector {sector}: the negative control ({kind}) changed the "
                f"module's output by only {control:.1e} (< {CONTROL_MIN:.0e}), so the check has no power: the record's "
                "tensors may not be the ones the module computes with, or the example input does not exercise them"
            )
    return cert


def certify_calls(sites: Sequence[AttentionSite], calls: Mapping[str, Call], *, seed: int = 0) -> CertificateReport:
    """Certify every site on its recorded call and stamp the ones that pass."""
    report = CertificateReport()
    missing = [s.name for s in sites if s.name not in calls]
    if missing:
        raise GaugeError(
            f"certify: the example forward never called {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; "
            "pass inputs that exercise every attention layer (an encoder-decoder needs decoder inputs too)"
        )
    for i, site in enumerate(sites):
        report.layers.append(certify_site(site, calls[site.name], seed=seed + i))
    for site in sites:
        stamp(site)
    return report


def certify(model: nn.Module, *example_args: Any, **example_kwargs: Any) -> CertificateReport:
    """Prove that every attention record of ``model`` matches its module, on an example input.

    Runs ``model(*example_args, **example_kwargs)`` once (no gradients; every module in eval
    mode for the call, restored afterwards), then certifies each attention layer alone in
    float64 (see the module docstring). Records that pass are stamped on their modules, which
    lets :func:`gaugeopt.gauge_fix`, :class:`gaugeopt.GaugeOptimizer` and the other gauge
    operations use records that no built-in adapter vouches for.

    Returns:
        :class:`CertificateReport`: per layer and sector, the largest valid change and the
        negative control's change.

    Raises:
        GaugeError: naming the layer, the sector and the measured change, when a valid element
            changes a layer's output by more than ``1e-10`` (``1e-6`` for float32 steps) or a
            negative control by less than ``1e-3``; or when the forward skips a layer.
    """
    if not isinstance(model, nn.Module):
        raise GaugeError(f"certify: model must be an nn.Module, got {type(model).__name__}")
    sites = find_attention(model)
    check_static(model, sites, "certify")
    report = certify_with(model, lambda m: m(*example_args, **example_kwargs), sites=sites)
    release_capture(model, sites)  # a recording armed by a fixer or a callback is not needed any more
    return report


def certify_with(model: nn.Module, forward: Callable[[nn.Module], Any], *, sites: Sequence[AttentionSite] | None = None,
                 seed: int = 0) -> CertificateReport:
    """:func:`certify` with a ``forward(model)`` callable and optional precomputed ``sites``."""
    sites = list(find_attention(model) if sites is None else sites)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with CallRecorder(sites) as rec, torch.no_grad():
            forward(model)
        calls = rec.calls
    finally:
        for m, training in modes:
            m.training = training
    return certify_calls(sites, calls, seed=seed)
