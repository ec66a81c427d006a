"""GaugeFix: function-preserving balancing of the Q/K (and V/O) gauge (paper 002; ``docs/gaugefix.md``).

After an optimizer step, every KV group ``j`` of every attention layer gets a gauge factor per
*slot* (a set of channels sharing one scale) and its two sides are rescaled in opposite
directions, which leaves every ``q·k`` (and ``W_O v``) unchanged::

    s_Q = RMS(side Q in the slot),  s_K = RMS(side K in the slot)          (GQA: over all query heads of j)
    g   = sqrt((s_Q + ε) / (s_K + ε))                                        (eq. 4, ε = 1e-12)
    Q   ← Q / g,   K ← K · g                                                 (eq. 5-6)

The sides are the learnable multipliers (``r_Q`` vs ``r_K``; ``r_V`` vs ``c_O`` with ``vo=True``) or,
for a model without them, the stored rows and biases; the slots are whole heads, channels or RoPE
planes (:mod:`gaugeopt.fix.plan`). Magnitude control and the changed-group rule are in
:mod:`gaugeopt.fix.balance`.

**Optimizer state** (``transport_state=True``, the default): the rescaled parameters' moments are
transported (:mod:`gaugeopt.fix.transport`: ``exp_avg/s``, ``exp_avg_sq/s²``, SGD momentum ``/s``), so
the next step is the one the optimizer would take in the new coordinates. ``transport_state=False``
leaves them stale, as paper 002 did. Unknown optimizers follow ``unknown_state``. The optimizer
must own every parameter the fix rescales, or its state of them could not be transported.

**One fix, two backends.** :class:`GaugeFixer` owns validation, planning, state classification
and the report, and decides once which backend computes the numbers: the torch backend
(:mod:`gaugeopt.fix.torch_backend`, anywhere) or the fused Triton kernel
(:mod:`gaugeopt.fix.triton_backend`, CUDA tensors). :func:`gauge_fix` is a one-shot
:class:`GaugeFixer`; the Lightning callback and :class:`gaugeopt.GaugeOptimizer` keep one and call
it after optimizer steps, so planning and the kernel's packed tables are reused.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> _ = torch.manual_seed(0)
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4,
    ...                                          n_kv_head=2, n_embd=32, rope="split_half")))
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    >>> x = torch.randint(0, 64, (2, 16))
    >>> for _ in range(3):
    ...     model(x, x)[1].backward(); opt.step(); opt.zero_grad()
    >>> report = gaugeopt.gauge_fix(model, opt)        # granularity "auto" = per RoPE plane here
    >>> report.max_drift_before > 1e-4, gaugeopt.qk_drift(model) < 1e-6
    (True, True)
    >>> sorted(report.as_dict())[:3]
    ['gaugefix/heads_fixed', 'gaugefix/nonfinite_groups', 'gaugefix/params_approximate']
"""

from __future__ import annotations

import warnings
import weakref
from typing import Sequence

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.fix.drift import log_ratio
from gaugeopt.fix.options import FixOptions, resolve_options
from gaugeopt.fix.plan import PairPlan, plan_pairs, plan_parameters
from gaugeopt.fix.report import GaugeFixReport, PairRecord
from gaugeopt.fix.torch_backend import SpecialMap, StateMap, TorchFix, measured_scales, plan_batches
from gaugeopt.fix.transport import param_owners, plan_state, storage_factor
from gaugeopt.kernels import dispatch
from gaugeopt.trust.gate import Gate, trusted_sites
from gaugeopt.records.site import AttentionSite

__all__ = ["GaugeFixer", "gauge_fix", "check_optimizer_owns", "factor_probe"]


def check_optimizer_owns(params: dict[int, tuple[str, torch.Tensor]], optimizer, what: str) -> None:
    """Refuse optimizers (one or several) that do not step every parameter a gauge operation
    rescales exactly once (:func:`~gaugeopt.fix.transport.param_owners`): the state of the others
    could not be transported and would silently go stale."""
    param_owners(optimizer, params, what)


def factor_probe(plans: Sequence[PairPlan], seed: int = 0) -> dict[int, torch.Tensor]:
    """``id(param) → a storage-layout factor with the structure of the fix's``: one random value per
    KV group and scale slot on each side, so that two coordinates get equal values exactly when the
    fix always gives them the same factor. State rules that cannot follow every factor (factored or
    per-block second moments) read the structure from it at set-up, before any factor exists."""
    g = torch.Generator().manual_seed(seed)
    out: dict[int, torch.Tensor] = {}
    for plan in plans:
        for side, members in plan.sides():
            per_slot = torch.rand(plan.groups, plan.n_slots, generator=g, dtype=torch.float64) + 0.5
            per_channel = side.expand(per_slot[:, plan.slot])  # (heads, width)
            for m in members:
                p = m.ref.param
                out[id(p)] = storage_factor(m, per_channel, out=out.get(id(p)))
    return out


def _rounding_floor(plan: PairPlan) -> float:
    """The relative precision of the stored tensors a plan rescales (``eps`` of the coarsest dtype): the
    drift a fix can leave in them is of this order, whatever the factors computed."""
    return max(torch.finfo(m.ref.param.dtype).eps for _, members in plan.sides() for m in members
               if m.ref.param.is_floating_point())


class GaugeFixer:
    """:func:`gauge_fix`, planned and validated once: call it after optimizer steps.

    Arguments as :func:`gauge_fix` (``optimizer`` may be several: ``[muon, adamw]``; each rescaled
    parameter's state is moved in the one optimizer that steps it); the options it runs with are
    :attr:`options` (a :class:`~gaugeopt.fix.options.FixOptions`). Construction finds the sites,
    builds the plans, validates every option, checks that every parameter it will rescale is
    stepped by exactly one of the optimizers and classifies the state they hold (an unknown key is
    refused here); an optimizer with no state yet is classified right after its first step
    (``check_first_step=True``: a step post-hook; hosts that hook the steps themselves pass
    ``False`` and call :meth:`check_state`). Each call
    classifies the optimizer state (raising before any write), runs the backend and returns a
    :class:`~gaugeopt.fix.report.GaugeFixReport`. The backend decision is taken on the first
    call and kept while the parameters' and state's storage stay put (``.decision`` says which
    and why); the Triton backend keeps its packed tables as long.

    Example:
        >>> import torch, gaugeopt
        >>> from gaugeopt.fix.gaugefix import GaugeFixer
        >>> from gaugeopt.models import GPT, GPTConfig
        >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)))
        >>> fix = GaugeFixer(model, torch.optim.AdamW(model.parameters()))
        >>> fix().max_drift_after < 1e-6, fix.decision.backend
        (True, 'torch')
    """

    def __init__(
        self,
        model: nn.Module | None,
        optimizer=None,
        granularity: str | None = None,
        *,
        sites: Sequence[AttentionSite] | None = None,
        options: FixOptions | None = None,
        check_first_step: bool = True,
        **fix_options,
    ) -> None:
        self.options = opts = resolve_options(options, fix_options, "GaugeFixer", granularity=granularity)
        dispatch.requested_backend(opts.backend)  # GAUGEOPT_BACKEND is checked now, too
        if model is None and sites is None:
            raise GaugeError("gauge_fix: pass a model or sites=find_attention(model)")
        if model is not None and not isinstance(model, nn.Module):
            raise GaugeError(f"gauge_fix: model must be an nn.Module, got {type(model).__name__}")
        self.optimizer = optimizer if opts.transport_state else None
        self._numbers = dict(eps=opts.eps, product_decay=opts.product_decay, product_max=opts.product_max)
        self._warned: set[str] = set()
        self.decision: dispatch.Decision | None = None
        self._gate = Gate(model, "gauge_fix", sites=sites)
        self._plan(self._gate.sites)
        if self.optimizers:
            self.check_state()  # an unknown key raises here, at set-up
            if check_first_step:
                self._check_at_first_step()

    def _plan(self, sites: Sequence[AttentionSite]) -> None:
        """Plan the pairs of ``sites`` (frozen ones left out unless ``rescale_frozen``) and find, for every
        parameter it rescales, the one optimizer that steps it."""
        self.sites = list(sites)
        plans = plan_pairs(self.sites, self.options)
        self.frozen: list[str] = []
        if not self.options.rescale_frozen:
            kept = []
            for plan in plans:
                frozen = [m.ref.name for _, members in plan.sides() for m in members if not m.ref.param.requires_grad]
                if frozen:
                    self.frozen.append(f"{plan.site.name} ({plan.kind}: {', '.join(dict.fromkeys(frozen))})")
                else:
                    kept.append(plan)
            plans = kept
        self.plans = plans
        self._params = plan_parameters(self.plans)
        self._batches = plan_batches(self.plans)
        # id(param) -> the optimizer stepping it (Muon for matrices beside AdamW for the rest: each its own)
        self._owners = (param_owners(self.optimizer, self._params, "gauge_fix")
                        if self.optimizer is not None and self._params else {})
        self.optimizers: list[torch.optim.Optimizer] = []
        for o in self._owners.values():
            if all(o is not q for q in self.optimizers):
                self.optimizers.append(o)
        first = next(iter(self._params.values()), None)
        self._device = first[1].device if first is not None else torch.device("cpu")
        self._runner = None
        self._key = None
        self._classified: dict[int, tuple] = {}
        self._probe: dict[int, torch.Tensor] | None = None

    # -- the optimizer state ------------------------------------------------------------------
    def _check_at_first_step(self) -> None:
        """An optimizer holding no state of the rescaled parameters yet is classified right after its
        first step (a step post-hook, inert after it fired: a hook cannot be removed while the
        optimizer runs its hooks). Hosts that hook the steps themselves call :meth:`check_state`."""
        weak = weakref.ref(self)
        for opt in self.optimizers:
            if any(self._owners.get(pid) is opt and not opt.state.get(p) for pid, (_, p) in self._params.items()):
                fired = []

                def first_step(optimizer, args, kwargs, _weak=weak, _fired=fired):
                    fixer = _weak()
                    if fixer is not None and not _fired:
                        _fired.append(True)
                        fixer.check_state()

                opt.register_step_post_hook(first_step)

    @property
    def probe(self) -> dict[int, torch.Tensor]:
        """:func:`factor_probe` of the plans (built on first use)."""
        if self._probe is None:
            self._probe = factor_probe(self.plans)
        return self._probe

    def check_state(self) -> dict[str, list[str]]:
        """Classify the optimizer state of every rescaled parameter now, writing nothing: the
        outcome lists (``transported``, ``approximate``, ``reset``, ``left``); an unknown state
        raises :class:`GaugeError` under ``unknown_state="error"``. Called at construction and after
        each optimizer's first step; every fix classifies again (cached while the state is unchanged)."""
        outcome, _, _ = self._plan_state(write=False)
        return outcome

    def _plan_state(self, write: bool = True) -> tuple[dict[str, list[str]], StateMap, SpecialMap]:
        """State outcome per parameter (raises before any write), the power moves for the backend,
        the other moves (factored, per-block) and, with ``write``, drops the state of ``"reset"``
        parameters. The parameters' pending gradients (``p.grad``, a covector: ``/s``) travel with the
        state, so a fix between a backward and the step that consumes it stays exact."""
        outcome: dict[str, list[str]] = {"transported": [], "approximate": [], "reset": [], "left": []}
        state: StateMap = {}
        special: SpecialMap = {}
        whats = []
        for pid, (name, p) in self._params.items():
            opt = self._owners.get(pid)
            st = opt.state.get(p) if opt is not None else None
            # a parameter's state dict keeps its keys and tensors between steps: classified once
            # (the cache holds the dict and its values, so an identity match cannot be a reused id)
            sig = (st, tuple(st.items())) if st else None
            hit = self._classified.get(pid)
            if hit is not None and sig is not None and hit[0][0] is st and len(hit[0][1]) == len(sig[1]) and all(
                    ka == kb and va is vb for (ka, va), (kb, vb) in zip(hit[0][1], sig[1])):
                whats.append((pid, name, p, opt, hit[1], hit[2]))
                continue
            if opt is None:
                what, moves = "no_state", []
            else:
                what, moves = plan_state(opt, p, unknown_state=self.options.unknown_state, name=name,
                                         factor=self.probe[pid])
            if sig is not None and what in ("transported", "approximate"):
                self._classified[pid] = (sig, what, moves)
            whats.append((pid, name, p, opt, what, moves))
        for pid, name, p, opt, what, moves in whats:
            if what in outcome:
                outcome[what].append(name)
            for m in moves:
                if m.approximate and f"{type(opt).__name__}:{m.key}" not in self._warned:
                    self._warned.add(f"{type(opt).__name__}:{m.key}")
                    warnings.warn(f"gauge_fix: {type(opt).__name__}'s {m.key!r} (e.g. of {name}) is transported "
                                  f"approximately: {m.approximate}. The report lists such parameters under "
                                  "'approximate' (docs/optimizers.md)", stacklevel=3)
            if not write:
                continue
            if what == "reset":
                opt.state.pop(p, None)
            powered = [(m.tensor, m.power) for m in moves if m.apply is None and m.power]
            if p.grad is not None:
                powered.append((p.grad, 1))
            if powered:
                state[pid] = powered
            applied = [m.apply for m in moves if m.apply is not None]
            if applied:
                special[pid] = applied
        return outcome, state, special

    def _classify(self) -> tuple[dict[str, list[str]], StateMap, SpecialMap]:
        return self._plan_state(write=True)

    def _backend_for(self, state: StateMap, special: SpecialMap):
        from gaugeopt.fix.triton_backend import storage_fingerprint

        key = (storage_fingerprint(self.plans, state), tuple((pid, id(f)) for pid, fs in special.items() for f in fs))
        if self._runner is None or key != self._key:
            def unsupported() -> str | None:
                from gaugeopt.fix.triton_backend import unsupported_reason

                if special:
                    pid = next(iter(special))
                    return (f"the optimizer state of {self._params[pid][0]} is factored or kept per block (Adafactor, "
                            "Adam-mini): moved by the torch backend")
                return unsupported_reason(self.plans, state)

            self.decision = dispatch.choose("gauge_fix", self._device, backend=self.options.backend,
                                            module="gaugefix.fused", unsupported=unsupported)
            if self.decision.backend == "triton":
                from gaugeopt.fix.triton_backend import TritonFix

                self._runner = TritonFix(self.plans, state, **self._numbers)
            else:
                self._runner = TorchFix(self.plans, state, special=special, **self._numbers)
            self._key = key
        return self._runner

    def __call__(self) -> GaugeFixReport:
        if self._gate.ensure():  # surgery, a new hook, a patched helper: found, checked, proved again
            self._plan(self._gate.sites)
        outcome, state, special = self._classify()
        report = GaugeFixReport(**outcome, frozen=list(self.frozen))
        if not self.plans:
            return report
        runner = self._backend_for(state, special)
        numbers = runner.run()
        report.backend = runner.name
        after = measured_scales(self.plans, self._batches)  # the stored values: what rounding to bf16 left, too
        for plan, n, (s_a, s_b) in zip(self.plans, numbers, after):  # tensors: no host sync until the report is read
            report.pairs.append(PairRecord(
                plan.site.name, plan.site.layer_index, plan.kind, plan.mode, plan.granularity,
                n.drift_before, log_ratio(s_a, s_b, self._numbers["eps"]), n.product_before, s_a * s_b, n.changed,
                plan.heads_per_group, skipped=n.skipped, floor=_rounding_floor(plan),
            ))
        report.warn_nonfinite()
        return report


def gauge_fix(
    model: nn.Module | None,
    optimizer=None,
    granularity: str | None = None,
    *,
    sites: Sequence[AttentionSite] | None = None,
    options: FixOptions | None = None,
    **fix_options,
) -> GaugeFixReport:
    """Balance the Q/K (and optionally V/O) gauge of every attention layer, in place.

    The function of the model is unchanged up to rounding (unless ``product_decay`` or
    ``product_max`` is set); see the module docstring for the formulas. To fix repeatedly,
    build a :class:`GaugeFixer` once and call it.

    Args:
        model: the model (a DDP / ``torch.compile`` / FSDP2 module is fine); ignored when
            ``sites`` is given.
        optimizer: the optimizer whose state is transported (``None``: parameters only) — one or
            several (``[muon, adamw]``), or a wrapper of them; together they must step every
            parameter the fix rescales, each exactly once.
        granularity: the one option that may be given by position (``gauge_fix(model, opt, "head")``).
        sites: precomputed :func:`gaugeopt.find_attention` records (saves the module walk).
        options: a :class:`~gaugeopt.fix.options.FixOptions`; keyword arguments replace its fields.
        **fix_options: any field of :class:`~gaugeopt.fix.options.FixOptions`, documented there:
            ``granularity`` (``"auto"``), ``transport_state`` (``True``), ``vo`` (``False``),
            ``vo_granularity`` (``"head"``), ``mode`` (``"auto"``), ``unknown_state``
            (``"error"``), ``product_decay``, ``product_max`` (``None``), ``eps`` (``1e-12``),
            ``backend`` (``"auto"``), ``rescale_frozen`` (``False``).

    Returns:
        :class:`~gaugeopt.fix.report.GaugeFixReport` (drift and scale product before/after per
        layer, heads fixed, state outcome); ``report.as_dict()`` for loggers.
    """
    if model is not None and not isinstance(model, nn.Module):
        raise GaugeError(f"gauge_fix: model must be an nn.Module, got {type(model).__name__}")
    options = resolve_options(options, fix_options, "gauge_fix", granularity=granularity)  # before any proof
    sites = trusted_sites(model, "gauge_fix", sites=sites)  # one shot: prove now or refuse (no recording armed)
    return GaugeFixer(model, optimizer, sites=sites, options=options, check_first_step=False)()
