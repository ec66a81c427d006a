"""One walk through optimizer wrappers (gaugeopt.fix.unwrap): what holds the state and what is hooked,
for every wrapper shape the integrations meet, nested; the fix, the step core and the conflict checks
all read it."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import gaugeopt
from gaugeopt import GaugeError
from gaugeopt.fix.unwrap import (
    owning_optimizers, param_owners, unwrap_optimizer, unwrap_optimizers, walk, wrapped_chain,
)
from gaugeopt.integrations.clip import ClipSteps
from gaugeopt.integrations.steps import FixSteps, ProjectSteps
from gaugeopt.models import GPT, GPTConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _model():
    torch.manual_seed(0)
    return gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)))


class LightningLike:
    """Not an Optimizer; wraps one in ``._optimizer`` (Lightning's LightningOptimizer)."""

    def __init__(self, optimizer):
        self._optimizer = optimizer


class SkipReporting(torch.optim.Optimizer):
    """An Optimizer sharing the inner one's state whose step runs for skipped steps too (Accelerate's)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.step_was_skipped = False

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups


class Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer: an Optimizer whose members in ``.optimizers`` hold the state."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        super().__init__([p for o in self.optimizers for g in o.param_groups for p in g["params"]], {})


def _split(model):
    """AdamW on the attention's tensors, Adam on the rest."""
    attn = {id(ref.param) for s in gaugeopt.find_attention(model) for _, ref in s.refs()}
    params = list(model.parameters())
    return (torch.optim.AdamW([p for p in params if id(p) in attn]),
            torch.optim.Adam([p for p in params if id(p) not in attn]))


def _cases():
    """``(name, build(model) -> (handed, holders, steppers))``: the expected answers written out per shape."""
    def plain(m):
        a = torch.optim.AdamW(m.parameters())
        return a, [a], [a]

    def lightning(m):
        a = torch.optim.AdamW(m.parameters())
        return LightningLike(a), [a], [a]

    def skip_reporting(m):
        a = torch.optim.AdamW(m.parameters())
        return SkipReporting(a), [a], [a]

    def wrapper_of_one(m):
        a = torch.optim.AdamW(m.parameters())
        w = gaugeopt.GaugeOptimizer(a, m)
        return w, [a], [w]

    def wrapper_of_two(m):
        a, b = _split(m)
        w = gaugeopt.GaugeOptimizer([a, b], m)
        return w, [a, b], [w]

    def container(m):
        a, b = _split(m)
        return Container([a, b]), [a, b], [a, b]

    def a_list(m):
        a, b = _split(m)
        return [LightningLike(a), b], [a, b], [a, b]

    def nested(m):  # Lightning's wrapper around a skip-reporting wrapper around the projected pair
        a, b = _split(m)
        w = gaugeopt.GaugeOptimizer([a, b], m)
        return LightningLike(SkipReporting(w)), [a, b], [w]

    def twice_in_a_list(m):
        a = torch.optim.AdamW(m.parameters())
        return [a, LightningLike(a)], [a], [a]

    return {f.__name__: f for f in (plain, lightning, skip_reporting, wrapper_of_one, wrapper_of_two, container,
                                    a_list, nested, twice_in_a_list)}


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_walk_finds_the_state_holders_and_the_objects_to_hook(case):
    model = _model()
    handed, holders, steppers = CASES[case](model)
    paths = walk(handed)
    assert [p.holder for p in paths] == holders
    assert unwrap_optimizers(handed) == holders
    starts = handed if isinstance(handed, list) else [handed]
    assert all(any(p.objects[0] is h for h in starts) for p in paths)  # each path from what was handed
    named = dict(model.named_parameters())
    attention = {id(ref.param) for s in gaugeopt.find_attention(model) for _, ref in s.refs()}
    # each attention tensor's holder steps it; the hooked objects are the expected ones that step any
    owners = param_owners(handed, {id(p): (n, p) for n, p in named.items() if id(p) in attention}, "x")
    assert set(owners) == attention
    for pid, holder in owners.items():
        assert any(id(p) == pid for g in holder.param_groups for p in g["params"])
    expected = [s for s in steppers if any(id(p) in attention for g in s.param_groups for p in g["params"])]
    assert owning_optimizers(handed, [p for p in named.values() if id(p) in attention], "x") == expected


def test_one_holder_is_unwrapped_and_several_are_named():
    model = _model()
    a, b = _split(model)
    assert unwrap_optimizer(LightningLike(SkipReporting(a))) is a
    with pytest.raises(GaugeError, match="holds 2 optimizers"):
        unwrap_optimizer(Container([a, b]))


def test_the_walk_refuses_what_wraps_no_optimizer_and_an_empty_list():
    with pytest.raises(GaugeError, match="is not a torch.optim.Optimizer and wraps none"):
        walk(LightningLike(object()))
    with pytest.raises(GaugeError, match="holds no optimizer"):
        walk([])
    assert wrapped_chain(None) == [None]  # the conflict scan never raises: the walk proper says what is wrong


def test_a_tensor_two_optimizers_step_is_refused_by_both_owner_maps():
    model = _model()
    a = torch.optim.AdamW(model.parameters())
    b = torch.optim.Adam(model.parameters())
    named = dict(model.named_parameters())
    for call in (lambda: param_owners([a, b], {id(p): (n, p) for n, p in named.items()}, "x"),
                 lambda: owning_optimizers([a, LightningLike(b)], list(named.values()), "x")):
        with pytest.raises(GaugeError, match="in two optimizers"):
            call()


@pytest.mark.parametrize("counter", [FixSteps, ProjectSteps, ClipSteps])
def test_the_conflict_checks_see_a_fixing_wrapper_however_deep(counter):
    """A GaugeOptimizer that fixes, inside Lightning's wrapper inside a container list, is refused by
    every step core; the same wrapper without fix_every (and not projecting) is not — the control."""
    model = _model()
    a, b = _split(model)
    fixing = gaugeopt.GaugeOptimizer([a, b], model, project=None, fix_every=5)
    with pytest.raises(GaugeError, match="fix_every=5"):
        counter().check_conflicts([LightningLike(SkipReporting(fixing))])
    model = _model()
    a, b = _split(model)
    plain = gaugeopt.GaugeOptimizer([a, b], model, project="update")
    if counter is ProjectSteps:
        with pytest.raises(GaugeError, match="projected twice"):
            counter().check_conflicts([LightningLike(plain)])
    else:
        counter().check_conflicts([LightningLike(plain)])


def test_only_the_walk_reads_the_wrapper_attributes():
    """One walk: no other module looks for .optimizer / ._optimizer / .optimizers / step_was_skipped on
    an object it was handed (getattr/hasattr with those names)."""
    names = {"optimizer", "_optimizer", "optimizers", "step_was_skipped"}
    found = []
    for path in sorted((ROOT / "gaugeopt").rglob("*.py")):
        if path.name == "unwrap.py" and path.parent.name == "fix":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
    # the check has power: the walk itself reads them
    walk_src = (ROOT / "gaugeopt" / "fix" / "unwrap.py").read_text()
    assert 'getattr(wrapper, "_optimizer"' in walk_src and 'hasattr(obj, "step_was_skipped")' in walk_src
