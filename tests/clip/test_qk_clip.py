"""``gaugeopt.qk_clip``: every head ends at or below τ (recomputed from the scores SDPA forms, not by
gaugeopt), the worst head of each clipped group lands on τ, heads of unclipped groups stay bit-identical,
the multipliers / QK-norm gains carry the rescale where they exist, Adam's state equals the state of Adam
run from scratch in the new coordinates (autograd through a reparameterised copy), and unusable maxima
(NaN, ±inf, ≤ 0) are skipped and reported."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize

import gaugeopt
import zoo
from gaugefix_helpers import snapshot_params
from gaugeopt import GaugeError
from gaugeopt.clip.qk_clip import clip_factors
from gaugeopt.trust.proof import CallRecorder
from logits_helpers import sdpa_maxima
from qk_norm_helpers import exact

CASES = [
    ("gpt", False), ("gpt_gqa", False), ("gpt_mqa", False), ("gpt_rope_split_half_gqa", False),
    ("gpt_rope_split_half_gqa", True), ("gpt_rope_interleaved", True), ("gpt_rope_partial_split_half", False),
    ("hf_llama", False), ("hf_llama", True), ("hf_gpt2", False),
    ("gpt_qknorm", False), ("gpt_qknorm_partial_interleaved", False), ("hf_olmo2", False), ("hf_gemma3", False),
]
IDS = [n + ("+lrm" if lrm else "") for n, lrm in CASES]


def _scores_max(case, model=None) -> torch.Tensor:
    """``(L, h)``: the maxima of the scores the model's own SDPA calls form (independent of gaugeopt)."""
    with exact(case.name), sdpa_maxima() as seen:
        case.logits(model)
    return torch.stack(seen)


def _record(case, sites) -> dict:
    with exact(case.name), CallRecorder(sites) as rec, torch.no_grad():
        case.logits()
    return rec.calls


def _replayed_max(case, sites, calls) -> torch.Tensor:
    """``(L, h)``: each attention module rerun on the inputs it had when the maxima were measured (a clip of
    layer 0 changes the inputs of layer 1: the cap holds for the batch as measured), through its own SDPA."""
    out = []
    with exact(case.name), torch.no_grad():
        for s in sites:
            with sdpa_maxima() as seen:
                s.module(*calls[s.name].args, **calls[s.name].kwargs)
            out.append(seen[0])
    return torch.stack(out)


def _maxima(case, sites, model=None) -> dict[str, torch.Tensor]:
    model = case.model if model is None else model
    with exact(case.name):
        if case.name.startswith("gpt"):
            return gaugeopt.max_attention_logits(model, case.inputs, sites=sites)
        return gaugeopt.max_attention_logits(model, input_ids=case.inputs, sites=sites)


def _tau(before: torch.Tensor, over: int | None = None) -> float:
    """Half-way between two neighbouring maxima, with ``over`` heads above (default: half of them), none at τ."""
    v = before.flatten().sort(descending=True).values
    n = len(v) // 2 if over is None else over
    return float(v[n - 1] + v[n]) / 2


def _groups(site, report_layer):
    """``(per query head: group id, set of clipped group ids)``; a shared QK-norm gain makes the layer one group."""
    shared = site.qk_norm is not None and not site.qk_norm.per_head
    group = [0 if shared else i // site.n_rep for i in range(site.h)]
    clipped = {group[i] for i, f in enumerate(report_layer.logit_factor) if f < 1.0}
    return group, clipped


@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0])
@pytest.mark.parametrize("name, lrm", CASES, ids=IDS)
def test_every_head_ends_at_or_below_tau(name, lrm, alpha):
    case = zoo.build(name, lrm=lrm)
    sites = gaugeopt.find_attention(case.model)
    calls = _record(case, sites)
    before = _replayed_max(case, sites, calls)
    assert torch.equal(before, _scores_max(case))
    tau = _tau(before)
    report = gaugeopt.qk_clip(case.model, None, _maxima(case, sites), tau=tau, alpha=alpha, sites=sites)
    after = _replayed_max(case, sites, calls)
    assert float(after.max()) <= tau * (1 + 1e-12)
    assert report.heads_over == int((before > tau).sum()) > 0
    for layer, site, lc in zip(range(len(sites)), sites, report.layers):
        group, clipped = _groups(site, lc)
        for g in clipped:  # the worst head of a clipped group lands on τ
            worst = max(float(after[layer, i]) for i in range(site.h) if group[i] == g)
            assert math.isclose(worst, tau, rel_tol=1e-12)
        for i in range(site.h):
            if group[i] not in clipped:  # nothing of an unclipped group moved
                assert float(after[layer, i]) == float(before[layer, i])
            else:
                assert float(after[layer, i]) <= float(before[layer, i])
        # the report predicts the maxima on the same batch
        assert torch.allclose(torch.tensor(lc.max_after, dtype=torch.float64), after[layer], rtol=1e-12, atol=0)


@pytest.mark.parametrize("name, lrm, target", [("gpt_rope_split_half_gqa", False, "rows"), ("hf_llama", False, "rows"),
                                               ("hf_llama", True, "multipliers"), ("gpt_rope_split_half_gqa", True, "multipliers"),
                                               ("gpt_qknorm", False, "gains"), ("hf_olmo2", False, "gains")])
def test_what_carries_the_rescale_and_bit_identity(name, lrm, target):
    """Rows with their biases, the multipliers r_Q/r_K, or the QK-norm gains carry the clip; everything else —
    and every row of an unclipped group, in every tensor, and its Adam state — is bit-identical."""
    case = zoo.build(name, lrm=lrm)
    sites = gaugeopt.find_attention(case.model)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    logits = case.forward(case.model)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), case.inputs.reshape(-1)).backward()
    opt.step()
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in case.model.named_parameters()}
    params = snapshot_params(case.model)
    maxima = _maxima(case, sites)
    report = gaugeopt.qk_clip(case.model, opt, maxima, tau=_tau(torch.stack(list(maxima.values())), over=1), sites=sites)
    assert {lc.target for lc in report.layers} == {target}
    changed = {n for n, p in case.model.named_parameters() if not torch.equal(p, params[n])}
    carriers = {ref.name for s in sites for role, ref in s.refs()
                if role in {"rows": ("q.weight", "q.bias", "k.weight", "k.bias"), "multipliers": ("q.row_mult", "k.row_mult"),
                            "gains": ("q.gain", "k.gain")}[target]}
    assert changed and changed <= carriers
    assert sorted(report.transported) == sorted(changed)
    mode = {"rows": "plain", "multipliers": "lrm", "gains": "gain"}[target]
    named = dict(case.model.named_parameters())
    checked = 0
    for site, lc in zip(sites, report.layers):
        group, clipped = _groups(site, lc)
        pair = site.pair(site.qk_kind)
        # row r of side a belongs to query head r's group (a shared gain: the layer's one group); row j of side b to group j
        for side, group_of in ((pair.a, lambda r: group[r] if pair.a.heads == site.h else 0), (pair.b, lambda j: j)):
            for member in side.members(mode):
                new, old = member.ref.view(named[member.ref.name].detach()), member.ref.view(params[member.ref.name])
                for r in range(side.heads):
                    if group_of(r) in clipped:
                        continue
                    assert torch.equal(new[r], old[r]), (member.role, r)
                    for key in ("exp_avg", "exp_avg_sq"):
                        now = member.ref.view(opt.state[member.ref.param][key])[r]
                        assert torch.equal(now, member.ref.view(state[member.ref.name][key])[r])
                    checked += 1
    assert checked  # not vacuous: some group was left alone


# ---------------------------------------------------------------------- the state, in the new coordinates
class _Divide(nn.Module):
    """The parametrisation ``p = p' / s``: the loss as a function of the clipped coordinates ``p' = s ⊙ p``."""

    def __init__(self, s: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("s", s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.s


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


STEPS = 3


@pytest.mark.parametrize("transport", [True, False])
@pytest.mark.parametrize("name, lrm", [("gpt_rope_split_half_gqa", False), ("gpt_rope_split_half_gqa", True),
                                       ("hf_gpt2", False), ("gpt_qknorm", False)], ids=["gpt", "gpt+lrm", "hf_gpt2", "gpt_qknorm"])
def test_adam_state_is_the_state_in_the_new_coordinates(name, lrm, transport):
    """AdamW run from scratch on a copy parameterised by ``p'`` with ``p = p'/s`` (autograd supplies the
    gradients ``g/s``), held at ``s ⊙ p_t`` at every past point, builds the moments qk_clip transports to
    (1e-12); with ``transport_state=False`` they are measurably different (the comparison has power)."""
    case = zoo.build(name, lrm=lrm)
    model, initial = case.model, copy.deepcopy(case.model)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, zoo.VOCAB, case.inputs.shape, generator=g) for _ in range(STEPS)]

    def step(m, opt, x):
        opt.zero_grad()
        logits = zoo.forward_fn(name)(m, x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.roll(-1, 1).reshape(-1)).backward()
        opt.step()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    snapshots = []
    for x in batches:
        snapshots.append(snapshot_params(model))
        step(model, opt, x)
    sites = gaugeopt.find_attention(model)
    maxima = _maxima(case, sites)
    unclipped = snapshot_params(model)
    gaugeopt.qk_clip(model, opt, maxima, tau=_tau(torch.stack(list(maxima.values()))), sites=sites,
                     transport_state=transport)
    clipped = snapshot_params(model)
    scale = {n: torch.where(unclipped[n] != 0, clipped[n] / unclipped[n], torch.ones_like(clipped[n])) for n in clipped}
    moved = [n for n, s in scale.items() if bool((s != 1).any())]
    assert moved

    ref = copy.deepcopy(initial)
    for n in moved:
        parametrize.register_parametrization(*_owner(ref, n), _Divide(scale[n]))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    originals = {n: _owner(ref, n)[0].parametrizations[_owner(ref, n)[1]].original for n in moved}
    for t, x in enumerate(batches):
        with torch.no_grad():  # the past iterate, in the new coordinates
            for n, p in ref.named_parameters():
                if ".parametrizations." not in n:
                    p.copy_(snapshots[t][n])
            for n in moved:
                originals[n].copy_(scale[n] * snapshots[t][n])
        step(ref, ref_opt, x)
    named = dict(model.named_parameters())
    worst = max(gaugeopt.relative_change(ref_opt.state[originals[n]][k], opt.state[named[n]][k])
                for n in moved for k in ("exp_avg", "exp_avg_sq"))
    if transport:
        assert worst <= 1e-12
    else:
        assert worst > 1e-3


# ---------------------------------------------------------------------- unusable maxima
def test_nonfinite_and_nonpositive_maxima_are_skipped():
    case = zoo.build("gpt_gqa")
    sites = gaugeopt.find_attention(case.model)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
    logits = case.forward(case.model)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), case.inputs.reshape(-1)).backward()
    opt.step()
    maxima = _maxima(case, sites)
    tau = 0.5 * float(maxima[sites[1].name].min())
    maxima[sites[0].name] = torch.tensor([float("nan"), -1.0, 0.0, float("inf")], dtype=torch.float64)
    before = snapshot_params(case.model)
    report = gaugeopt.qk_clip(case.model, opt, maxima, tau=tau, sites=sites)
    assert [(layer, i, why) for layer, i, _, why in report.skipped] == [
        (sites[0].name, 0, "not finite"), (sites[0].name, 1, "not positive"), (sites[0].name, 2, "not positive"),
        (sites[0].name, 3, "not finite")]
    assert report.layers[0].logit_factor == [1.0] * 4 and report.heads_over == 4
    for n, p in case.model.named_parameters():
        assert torch.isfinite(p).all() and all(torch.isfinite(v).all() for v in opt.state[p].values())
        if n.startswith("transformer.h.0."):
            assert torch.equal(p, before[n])
    assert "skipped" in str(report) and math.isfinite(report.as_dict()["qk_clip/max_logit_before"])


# ---------------------------------------------------------------------- the factors
def _reference_factors(m: list[float], h_kv: int, tau: float, alpha: float) -> tuple[list[float], list[float]]:
    """The rule written out with loops: keys take the group's worst head, queries what is still needed."""
    rep = len(m) // h_kv
    fk, fq = [], []
    for g in range(h_kv):
        heads = range(g * rep, (g + 1) * rep)
        etas = [tau / m[i] for i in heads if math.isfinite(m[i]) and m[i] > tau]
        fk.append(min(etas) ** (1 - alpha) if etas else 1.0)
        for i in heads:
            ok = math.isfinite(m[i]) and m[i] > tau
            fq.append(min(1.0, tau / (m[i] * fk[g])) if ok and m[i] * fk[g] > tau else 1.0)
    return fq, fk


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("h, h_kv", [(8, 8), (8, 2), (8, 1), (6, 3)])
def test_clip_factors_follow_the_rule(h, h_kv, alpha):
    g = torch.Generator().manual_seed(h * 10 + h_kv)
    for trial in range(20):
        m = torch.exp(torch.randn(h, generator=g, dtype=torch.float64) * 1.5) * 60
        if trial % 5 == 0:
            m[trial % h] = float("nan")
        tau = 100.0
        fq, fk, _ = clip_factors(m, h_kv, tau, alpha)
        rq, rk = _reference_factors(m.tolist(), h_kv, tau, alpha)
        assert torch.allclose(fq, torch.tensor(rq, dtype=torch.float64), rtol=1e-15)
        assert torch.allclose(fk, torch.tensor(rk, dtype=torch.float64), rtol=1e-15)
        after = m * fq * fk.repeat_interleave(h // h_kv)
        ok = torch.isfinite(m)
        assert (fq <= 1).all() and (fk <= 1).all() and (after[ok] <= tau * (1 + 1e-15)).all()
        if alpha == 1.0:
            assert (fk == 1).all()  # heads clipped alone
        if alpha == 0.0:
            assert (fq == 1).all()


def test_invalid_arguments():
    case = zoo.build("gpt")
    sites = gaugeopt.find_attention(case.model)
    maxima = gaugeopt.max_attention_logits(case.model, case.inputs)
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "100"):
        with pytest.raises(GaugeError, match="tau="):
            gaugeopt.qk_clip(case.model, None, maxima, tau=bad)
    for bad in (-0.1, 1.5, None):
        with pytest.raises(GaugeError, match="alpha="):
            gaugeopt.qk_clip(case.model, None, maxima, alpha=bad)
    with pytest.raises(GaugeError, match="missing"):
        gaugeopt.qk_clip(case.model, None, {sites[0].name: maxima[sites[0].name]})
    with pytest.raises(GaugeError, match=r"shape \(3,\)"):
        gaugeopt.qk_clip(case.model, None, {**maxima, sites[1].name: torch.ones(3)})
    with pytest.raises(GaugeError, match="max_attention_logits"):
        gaugeopt.qk_clip(case.model, None, [1.0, 2.0])


def test_uncertified_record_is_refused():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    site = gaugeopt.AttentionSpec(q="q", k="k", v="v", o="o", num_heads=2, stock_forward=False).build(Attn(), "a")
    with pytest.raises(GaugeError, match="certify"):
        gaugeopt.qk_clip(None, None, {"a": torch.ones(2)}, tau=0.5, sites=[site])


def test_optimizer_must_own_the_rescaled_tensors():
    case = zoo.build("gpt_gqa")
    maxima = gaugeopt.max_attention_logits(case.model, case.inputs)
    other = torch.optim.AdamW([nn.Parameter(torch.ones(3))])
    with pytest.raises(GaugeError, match="steps none of the"):
        gaugeopt.qk_clip(case.model, other, maxima, tau=1e-3)


class _Mystery(torch.optim.SGD):
    """An optimizer with a state key no rule knows (a user's own, say)."""

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["mystery"] = torch.ones_like(p)
        return out


def test_unknown_optimizer_state_refused_before_any_write():
    """An optimizer whose state has a key without a rule: the clip raises before touching a parameter;
    "reset" drops the rescaled tensors' state instead, "leave" keeps it."""
    case = zoo.build("gpt_gqa")
    opt = _Mystery(case.model.parameters(), lr=1e-3)
    logits = case.forward(case.model)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), case.inputs.reshape(-1)).backward()
    opt.step()
    maxima = gaugeopt.max_attention_logits(case.model, case.inputs)
    tau = _tau(torch.stack(list(maxima.values())))
    before = snapshot_params(case.model)
    with pytest.raises(GaugeError, match="mystery"):
        gaugeopt.qk_clip(case.model, opt, maxima, tau=tau)
    assert all(torch.equal(p, before[n]) for n, p in case.model.named_parameters())
    report = gaugeopt.qk_clip(case.model, opt, maxima, tau=tau, unknown_state="reset")
    assert report.reset and all(not opt.state.get(dict(case.model.named_parameters())[n]) for n in report.reset)
