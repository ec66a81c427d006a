"""The integrations' one every-N counter (gaugeopt.integrations.schedule.Schedule): rounds of real optimizer
steps with several owners, the actions after rounds ``every, 2·every, ...``, clear refusals; the hosts (the
step core under the callbacks, ClipSteps, GaugeOptimizer) count with it and act only when it says so; their
checkpoints keep the format they had."""

from __future__ import annotations

import pickle

import pytest
import torch

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.integrations.clip import ClipSteps
from gaugeopt.integrations.optim import _STATE_KEY
from gaugeopt.integrations.schedule import Schedule, check_every
from gaugeopt.integrations.steps import FixSteps, StepCounter
from gaugeopt.models import GPT, GPTConfig


def _lrm_model():
    torch.manual_seed(0)
    return gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16)))


def _train(model, opts, steps: int, skip_second: set[int] = frozenset()):
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    for i in range(steps):
        model(x, x)[1].backward()
        for k, o in enumerate(opts):
            if not (k == 1 and i in skip_second):  # a GradScaler that found inf skips this optimizer's step
                o.step()
            o.zero_grad()


def test_rounds_with_several_owners_and_a_skipped_step():
    s = Schedule(every=2, members=2)
    assert [s.stepped(w) for w in ("muon", "adamw")] == [False, True] and s.steps == 1 and not s.due()
    assert s.opening
    assert s.stepped("muon") is False and not s.opening
    assert s.stepped("muon") is False  # adamw's step was skipped: the round stays open, muon is not counted twice
    assert s.stepped("adamw") is True and s.steps == 2 and s.due()
    assert [s.due(k) for k in range(1, 7)] == [False, True, False, True, False, True]
    s.expect(1)
    assert s.stepped() is True and s.steps == 3


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "10", None])
def test_bad_every_is_refused_naming_it(bad):
    with pytest.raises(GaugeError, match=r"FixSteps: every=.* must be a positive integer number of optimizer steps"):
        Schedule(bad, who="FixSteps")
    if bad is None:
        assert Schedule(None, optional=True).due(5) is False  # optional: never
    with pytest.raises(GaugeError, match="fix_every"):
        check_every(bad if bad is not None else 0, "fix_every", optional=True)


def test_every_host_counts_with_a_schedule():
    model = _lrm_model()
    opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2))
    hosts = [FixSteps(every=3).watch(model, opt), ClipSteps(tau=1e6, every=2).watch(model, opt)]
    other = _lrm_model()
    wrapper = gaugeopt.GaugeOptimizer(torch.optim.AdamW(other.parameters()), other, fix_every=4)
    for h in hosts:
        assert isinstance(h.schedule, Schedule) and h.schedule.every == h.every
    assert isinstance(wrapper._schedule, Schedule) and wrapper.fix_every == 4


def test_hosts_act_only_when_the_schedule_says_so(monkeypatch):
    """Fails if a host keeps a counter of its own: with the schedule saying "never" nothing is fixed."""
    def run(model):
        opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2))
        fixer = FixSteps(every=1).watch(model, opt)
        wrapped = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, project=None, fix_every=1)
        _train(model, [opt], 3)
        _train(model, [wrapped], 3)
        return fixer.fixes, wrapped._fixes, fixer.optimizer_steps, wrapped._schedule.steps

    assert run(_lrm_model()) == (3, 3, 3, 3)
    monkeypatch.setattr(Schedule, "due", lambda self, step=None: False)
    assert run(_lrm_model()) == (0, 0, 3, 3)


def test_two_owners_fix_once_per_round_and_not_on_a_skipped_step():
    model = _lrm_model()
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n]
    ids = {id(p) for p in mats}
    opts = [torch.optim.SGD(mats, lr=1e-2, momentum=0.9),
            torch.optim.AdamW([p for p in model.parameters() if id(p) not in ids], lr=1e-2)]
    fixer = FixSteps(every=2).watch(model, opts)
    _train(model, opts, 5, skip_second={1})  # rounds complete after iterations 0, 2, 3, 4 (1 is left open)
    assert fixer.optimizer_steps == 4 and fixer.fixes == 2


def test_checkpoints_keep_their_format():
    model = _lrm_model()
    opt = torch.optim.AdamW(model.parameters())
    fixer = FixSteps(every=3).watch(model, opt)
    _train(model, [opt], 2)
    assert fixer.state_dict() == {"optimizer_steps": 2, "fixes": 0}
    again = FixSteps(every=3)
    again.load_state_dict({"optimizer_steps": 2, "fixes": 0})  # as earlier versions wrote it
    assert again.schedule.steps == 2 and again.runs_next()  # the fix comes after the third step, as before
    assert StepCounter(every=5).state_dict() == {"optimizer_steps": 0}

    wrapped = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters()), model, project=None, fix_every=2)
    _train(model, [wrapped], 3)
    own = wrapped.state_dict()[_STATE_KEY]
    assert set(own) == {"version", "step", "fixes", "nonfinite_steps", "project", "mode", "fix_every", "sectors"}
    assert (own["version"], own["step"], own["fixes"], own["fix_every"]) == (1, 3, 1, 2)
    fresh = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters()), model, project=None, fix_every=2)
    fresh.load_state_dict(wrapped.state_dict())
    assert fresh._schedule.steps == 3 and fresh._fixes == 1
    clone = pickle.loads(pickle.dumps(wrapped))  # the pickled form carries the schedule
    assert clone._schedule.steps == 3 and clone.fix_every == 2
