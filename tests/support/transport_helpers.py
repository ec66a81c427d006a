"""The independent reference for optimizer-state transport (tests/fix/test_transport.py,
tests/fix/test_optimizer_rules.py).

A run trains a few steps, gauge-fixes and takes one more step. The reference runs the same
optimizer(s) from scratch on a copy held, before every past step ``t``, at ``s ⊙ p_t`` (``s`` the
diagonal action the fix was observed to apply): autograd then supplies the gradients in the new
coordinates (``g_t / s``) and the optimizer builds its statistics from them. State that is a *point*
of parameter space (schedule-free's ``z``) is not built from gradients alone; such keys
(``forced``) are held at ``s ⊙ z_t`` too, as the parameters are. Then one step from the fixed
parameters: the two runs must agree.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import gaugeopt
import zoo
from gaugefix_helpers import add_drift, load_params, snapshot_params
from gaugeopt.fix import gauge_fix

STEPS = 3


def batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, zoo.VOCAB, (zoo.B, zoo.T), generator=g),
             torch.randint(0, zoo.VOCAB, (zoo.B, zoo.T), generator=g)) for _ in range(n)]


def loss(name, model, batch):
    logits = zoo.forward_fn(name)(model, batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def as_list(opt):
    return list(opt) if isinstance(opt, (list, tuple)) else [opt]


def step(name, model, opt, batch):
    """One backward, then every optimizer of ``opt`` (one or a list) steps."""
    for o in as_list(opt):
        o.zero_grad(set_to_none=True)
    loss(name, model, batch).backward()
    for o in as_list(opt):
        o.step()


def _state_by_name(model, opt, keys):
    named = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for o in as_list(opt):
        for p, st in o.state.items():
            for k in keys:
                if k in st:
                    out[(named[id(p)], k)] = st[k].detach().clone()
    return out


def fixed_then_step(name, lrm, make_opt, *, forced=(), before_fix=None, after_fix=None, **fix_kwargs):
    """Train STEPS steps, gauge-fix (Q/K and V/O), take one more step.

    Returns ``(initial, batches, snapshots, scale, fixed, result, report, opt, model)``:
    ``snapshots[t] = (params, forced state)`` before step ``t``; ``scale`` the observed action.
    """
    case = zoo.build(name, lrm=lrm)
    add_drift(case.model, lrm, vo=True)
    model = case.model  # eval mode: no dropout, so both runs see the same function
    initial = copy.deepcopy(model)
    data = batches(STEPS + 1)
    opt = make_opt(model)
    snapshots = []
    for t in range(STEPS):
        snapshots.append((snapshot_params(model), _state_by_name(model, opt, forced)))
        step(name, model, opt, data[t])
    unfixed = snapshot_params(model)
    if before_fix is not None:
        before_fix(model, opt)
    fix_kwargs.setdefault("vo", True)
    report = gauge_fix(model, opt if len(as_list(opt)) > 1 else as_list(opt)[0], **fix_kwargs)
    fixed = snapshot_params(model)
    if after_fix is not None:
        after_fix(model, opt)
    scale = {n: fixed[n] / unfixed[n] for n in fixed}  # the observed diagonal action s (1 where untouched)
    assert sum(int((s != 1).any()) for s in scale.values()) >= 2
    fixed_forced = _state_by_name(model, opt, forced)
    step(name, model, opt, data[STEPS])
    return initial, data, snapshots + [(fixed, fixed_forced)], scale, fixed, snapshot_params(model), report, opt, model


def oracle(name, initial, make_opt, data, snapshots, scale, fixed, forced=()):
    """The same optimizer(s) run from scratch in the transported coordinates (module docstring)."""
    ref = copy.deepcopy(initial)
    opt = make_opt(ref)
    named = dict(ref.named_parameters())
    for t in range(STEPS + 1):
        params, state = snapshots[t]
        load_params(ref, {n: scale[n] * params[n] for n in scale})
        for o in as_list(opt):
            for p, st in o.state.items():
                n = next(k for k, q in named.items() if q is p)
                for k in forced:
                    if (n, k) in state:
                        st[k].copy_(scale[n] * state[(n, k)] if t < STEPS else state[(n, k)])
        if t == STEPS:
            load_params(ref, fixed)
        step(name, ref, opt, data[t])
    return snapshot_params(ref)


def max_rel(a, b, skip=None):
    """Largest relative difference over all parameters; ``skip`` masks out entries (True = skip)."""
    worst = 0.0
    for n in a:
        keep = ~skip[n] if skip and n in skip else slice(None)
        worst = max(worst, gaugeopt.relative_change(a[n][keep], b[n][keep]))
    return worst


def key_bias_mask(model):
    """The K biases: ∂L/∂b_K ≡ 0 (softmax ignores a shift shared by all keys), so their gradient is
    pure rounding noise that Adam normalises into O(lr) steps; two runs agree there only to the
    noise level (~1e-10 relative), whatever the transport."""
    masks = {}
    for site in gaugeopt.find_attention(model):
        ref = site.k.bias
        if ref is not None:
            m = masks.setdefault(ref.name, torch.zeros_like(ref.param, dtype=torch.bool))
            ref.view(m).fill_(True)
    return masks


def matrices_and_rest(model):
    """``(2-D hidden matrices, everything else)``: Muon's usual split (embeddings and the output
    head, biases, norms and multipliers to AdamW)."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None:
        emb.add(id(out.weight))
    mats = [p for p in model.parameters() if p.dim() == 2 and id(p) not in emb]
    rest = [p for p in model.parameters() if p.dim() != 2 or id(p) in emb]
    return mats, rest


class Sign(torch.optim.Optimizer):
    """A toy optimizer with a momentum the library does not know (signSGD with momentum)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                buf = st.setdefault("buf", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf.sign(), alpha=-group["lr"])
