"""The sharp edges a new user cuts themselves on: each one is a clear error or a fix, tested here."""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.projection.diagnostics import fisher_rao_split
from gaugeopt.trust.invariance import randomize_parameters
from gaugeopt.tools.equivalence import compare, spectral_fingerprint


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)).double()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    return model


def test_gauge_fix_refuses_an_optimizer_that_owns_none_of_the_parameters():
    case = zoo.build("gpt_gqa", lrm=True)
    other = zoo.build("gpt_gqa", lrm=True, seed=3).model
    foreign = torch.optim.AdamW(other.parameters())
    before = [p.detach().clone() for p in case.model.parameters()]
    with pytest.raises(GaugeError, match="steps none of the parameters the fix rescales"):
        gaugeopt.gauge_fix(case.model, foreign)
    assert all(torch.equal(a, p) for a, p in zip(before, case.model.parameters())), "nothing may be written"
    partial = torch.optim.AdamW([p for n, p in case.model.named_parameters() if "row_mults.1" not in n])
    with pytest.raises(GaugeError, match=r"steps \d+ of the \d+ parameters"):
        gaugeopt.gauge_fix(case.model, partial)
    gaugeopt.gauge_fix(case.model, partial, transport_state=False)  # parameters alone: allowed, explicitly


def test_find_attention_refuses_what_is_not_a_module():
    with pytest.raises(GaugeError, match="must be a torch.nn.Module, got str"):
        gaugeopt.find_attention("str")
    with pytest.raises(GaugeError, match="must be an nn.Module"):
        gaugeopt.gauge_fix("model")


def test_random_gauge_transform_takes_an_integer_seed():
    case = zoo.build("gpt_rope_split_half_gqa")
    a = gaugeopt.random_gauge_transform(case.copy(), generator=0)
    b = gaugeopt.random_gauge_transform(case.copy(), generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert gaugeopt.relative_change(case.logits(), case.logits(a)) <= 1e-12
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), case.model.parameters()))
    with pytest.raises(GaugeError, match="generator must be a torch.Generator, an integer seed or None, got str"):
        gaugeopt.random_gauge_transform(case.copy(), generator="0")
    with pytest.raises(GaugeError, match="integer seed"):
        gaugeopt.invalid_gauge_transform(case.copy(), "asymmetric_qk", generator=1.5)


def test_vertical_fraction_checks_shapes_of_a_zero_field_too():
    model = _tiny()
    name = "transformer.h.0.attn.c_attn.weight"
    wrong = (3, 3)
    with pytest.raises(GaugeError, match=r"has shape \(3, 3\)"):
        gaugeopt.vertical_fraction(model, {name: torch.randn(wrong, dtype=torch.float64)})
    with pytest.raises(GaugeError, match=r"has shape \(3, 3\)"):
        gaugeopt.vertical_fraction(model, {name: torch.zeros(wrong, dtype=torch.float64)})
    assert gaugeopt.vertical_fraction(model, {name: torch.zeros(24, 8, dtype=torch.float64)}) == 0.0


def test_site_from_linears_says_a_fused_layer_is_fused():
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)

    with pytest.raises(GaugeError, match="fused QKV projection") as err:
        gaugeopt.site_from_linears(Fused(), "attn", q="qkv", k="qkv", v="qkv", o="proj", num_heads=4)
    assert "input columns" not in str(err.value)


def test_gauge_projected_builds_itself_with_the_public_optimizer_constructor(monkeypatch):
    """Whatever a torch release adds to Optimizer.__init__ reaches the wrapper (it used to copy internals)."""
    real = torch.optim.Optimizer.__init__
    seen = []

    def spy(self, params, defaults):
        seen.append(type(self).__name__)
        real(self, params, defaults)
        self._added_by_a_future_torch = True

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", spy)
    model = _tiny()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = gaugeopt.GaugeOptimizer(inner, model)
    assert "GaugeOptimizer" in seen and wrapped._added_by_a_future_torch
    assert wrapped.param_groups is inner.param_groups and wrapped.state is inner.state  # the placeholder is gone
    assert [p for g in wrapped.param_groups for p in g["params"]] == list(model.parameters())


def _true_fisher(model, x):
    params = dict(model.named_parameters())
    names = list(params)

    def logits(*flat):
        return torch.func.functional_call(model, dict(zip(names, flat)), (x,))[0].reshape(-1)

    J = torch.cat([j.reshape(j.shape[0], -1) for j in torch.autograd.functional.jacobian(logits, tuple(params.values()))], 1)
    return lambda v: J.mT @ (J @ v)


def test_fisher_rao_split_refuses_the_degenerate_true_fisher():
    model = _tiny()
    x = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(0))
    F = _true_fisher(model, x)
    u = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    with pytest.raises(GaugeError, match="degenerate along the gauge orbits"):
        fisher_rao_split(model, u, F, sectors=("qk",))
    damped = fisher_rao_split(model, u, lambda v: F(v) + 1e-3 * v, sectors=("qk",))  # what the message suggests
    assert 0 < damped.fraction <= 1 and 0 < damped.euclidean_fraction <= 1


def test_equal_spectral_digests_do_not_mean_the_same_function():
    """The digest is a necessary condition only: an orthogonal map on the O side of one head keeps
    its circuit's singular values and changes the function; compare() gives the verdict. (Without
    biases: with a value bias the folded output bias b_O + W_O b_V would see the map.)"""
    case = zoo.build("gpt_nobias")
    moved = case.copy()
    site = gaugeopt.find_attention(moved)[0]
    q, _ = torch.linalg.qr(torch.randn(site.d_model, site.d_model, generator=torch.Generator().manual_seed(2),
                                       dtype=torch.float64))
    with torch.no_grad():
        wo = site.o.weight.get()
        wo[:, 0] = q @ wo[:, 0]  # W_O[:, 0] ← U W_O[:, 0]
    assert gaugeopt.relative_change(case.logits(), case.logits(moved)) > 1e-3
    assert spectral_fingerprint(moved).digest() == spectral_fingerprint(case.model).digest()
    assert not compare(case.model, moved, tol=1e-8).equivalent
    assert not hasattr(gaugeopt, "fingerprint")  # renamed so that the name says what it is
    assert "necessary" in (gaugeopt.spectral_fingerprint.__doc__ + type(spectral_fingerprint(moved)).digest.__doc__)


def test_demo_checks_its_optional_dependencies_before_any_work(tmp_path, monkeypatch, capsys):
    import importlib.util

    from recipes import demo

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    started = []
    monkeypatch.setattr("recipes.train.train", lambda *a, **k: started.append(1))
    out = tmp_path / "demo"
    assert demo.main(["--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "--no-plot" in err and "pip install" in err
    assert not started and not out.exists()
    assert demo.missing_dependencies(plot=False) == []  # --no-plot needs no matplotlib
