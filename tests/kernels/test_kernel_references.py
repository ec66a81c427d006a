"""The kernels' plain-torch references (``gaugeopt.kernels.*.naive``) against the model-level torch paths.

Each kernel op keeps a naive reference beside it, which ``tests/kernels/kernels_interpreter_cases.py``
compares the kernel with. Here, on CPU and without Triton, the references themselves are checked
against independent model-level implementations: the fix's reference against the torch backend
(:class:`gaugeopt.fix.torch_backend.TorchFix`, through the same pairs the Triton host builds), the
projection references against :class:`gaugeopt.GaugeProjector`'s torch sectors (through the same
site descriptions the Triton host builds). Negative controls show that each comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

import gaugeopt
import zoo
from gaugeopt.errors import GaugeError
from gaugeopt.fix import gaugefix as gaugefix_module
from gaugeopt.fix.torch_backend import PairNumbers
from gaugeopt.fix.triton_backend import _fix_pair
from gaugeopt.kernels import gaugefix as kfix
from gaugeopt.kernels import projection as kproj
from gaugeopt.projection.sylvester import default_rtol
from gaugeopt.projection.triton_backend import describe
from kernel_helpers import assert_same_fields, assert_same_fix, fix_reference, odd_gpt, random_field, train_steps, twin


class NaiveFix:
    """The fix's backend contract run by the kernel op's plain-torch reference on the pairs the Triton
    host builds (:func:`gaugeopt.fix.triton_backend._fix_pair`)."""

    name = "naive"
    power_of = None  # negative control: map a state power to another

    def __init__(self, plans, state, *, special=None, **numbers) -> None:
        assert not special
        self.pairs = [_fix_pair(p, state) for p in plans]
        if NaiveFix.power_of is not None:
            for pair in self.pairs:
                for t in pair.states:
                    t.power = NaiveFix.power_of(t.power)
        self.numbers = numbers

    def run(self) -> list[PairNumbers]:
        return [PairNumbers(*r) for r in kfix.fix_naive(self.pairs, **self.numbers)]


def _naive_fix(monkeypatch, model, opt, **kw):
    monkeypatch.setattr(gaugefix_module, "TorchFix", NaiveFix)
    report = gaugeopt.gauge_fix(model, opt, backend="torch", **kw)
    monkeypatch.undo()
    assert report.backend == "naive"
    return report


FIX_CASES = [  # (model, lrm, dtype, options)
    ("gpt_gqa", False, torch.float64, dict(vo=True)),  # plain rows + biases, GQA
    ("gpt_rope_split_half_gqa", True, torch.float64, dict(vo=True)),  # multipliers, RoPE plane slots
    ("hf_gpt2", False, torch.float32, dict(vo=True)),  # Conv1D in×out storage, fused c_attn
    ("hf_llama", True, torch.float32, dict(vo=True, product_decay=0.1, product_max=0.05)),
    ("gpt_qknorm", False, torch.float64, {}),  # QK-norm gains
    ("torch_mha_kdim", False, torch.float64, dict(vo=True)),
]


@pytest.mark.parametrize("name,lrm,dtype,kw", FIX_CASES, ids=[f"{c[0]}{'+lrm' if c[1] else ''}" for c in FIX_CASES])
def test_naive_gauge_fix_matches_the_torch_backend(monkeypatch, name, lrm, dtype, kw):
    model = zoo.build(name, seed=1, lrm=lrm, dtype=dtype).model
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)  # exp_avg, exp_avg_sq, max_exp_avg_sq
    train_steps(model, opt)
    m2, o2 = twin(model, opt)
    r1 = fix_reference(model, opt, **kw)
    r2 = _naive_fix(monkeypatch, m2, o2, **kw)
    assert_same_fix(model, opt, r1, m2, o2, r2, dtype)
    assert r1.max_drift_before > 1e-2 and r2.heads_fixed == r1.heads_fixed > 0  # not vacuous


def test_naive_gauge_fix_comparison_has_power(monkeypatch):
    """Negative control: the reference with the second moment moved like the first (power 1) fails."""
    model = odd_gpt(lrm=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, opt)
    m2, o2 = twin(model, opt)
    r1 = fix_reference(model, opt, vo=True)
    monkeypatch.setattr(NaiveFix, "power_of", lambda k: 1)
    r2 = _naive_fix(monkeypatch, m2, o2, vo=True)
    with pytest.raises(AssertionError, match="exp_avg_sq"):
        assert_same_fix(model, opt, r1, m2, o2, r2, torch.float64)


def test_the_changed_rule_is_the_cores():
    assert kfix.CHANGED_ULPS == gaugeopt.fix.balance.CHANGED_ULPS


# ---------------------------------------------------------------------- closed-form projections
def _naive_vertical(model, u, sector: str, *, subtract: bool = False, drop_twists: bool = False):
    sites = gaugeopt.find_attention(model)
    found, out, acc = describe(sites, sector, u, subtract=subtract)
    if drop_twists:  # negative control: the multipliers' twists of the plane generators left out
        for s in found:
            s.twist_a = s.twist_b = None
    run = kproj.project_diagonal_naive if sector.startswith("lrm") else kproj.project_planes_naive
    run(found, rtol=default_rtol(acc), subtract=subtract)
    return out


PROJ_CASES = [  # (model, lrm, dtype, sectors)
    ("gpt_rope_split_half_gqa", True, torch.float64, ("qk", "lrm_qk", "lrm_vo")),  # GQA, twists, plane slots
    ("gpt_rope_interleaved", False, torch.float64, ("qk",)),  # interleaved planes, biases
    ("hf_llama", True, torch.float32, ("qk", "lrm_qk", "lrm_vo")),
    ("gpt_rope_partial_split_half", True, torch.float64, ("lrm_qk", "lrm_vo")),  # planes + single channels
    ("gpt_gqa", True, torch.float64, ("lrm_qk", "lrm_vo")),  # no RoPE: one slot per channel
]


@pytest.mark.parametrize("name,lrm,dtype,sectors", PROJ_CASES, ids=[f"{c[0]}{'+lrm' if c[1] else ''}" for c in PROJ_CASES])
def test_naive_projections_match_the_projector(name, lrm, dtype, sectors):
    model = zoo.build(name, seed=3, lrm=lrm, dtype=dtype).model
    u = random_field(model, seed=4)
    for sector in sectors:
        proj = gaugeopt.GaugeProjector(model, sectors=(sector,), backend="torch")
        ref = proj.vertical(u)
        got = _naive_vertical(model, u, sector)
        assert_same_fields(ref, got, dtype, f"vertical {sector}")
        assert min(float(v.norm()) for v in got.values()) > 1e-3  # not vacuous: every tensor has a vertical part
        hor = _naive_vertical(model, u, sector, subtract=True)
        assert_same_fields({n: proj.project(u)[n] for n in hor}, hor, dtype, f"project {sector}")


def test_naive_plane_comparison_has_power():
    """Negative control: without the multipliers' twists the plane generators are wrong, and it shows."""
    model = zoo.build("gpt_rope_split_half_gqa", seed=3, lrm=True).model
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "mult" in n:
                p.mul_(1.0 + 0.5 * torch.rand(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
    u = random_field(model, seed=4)
    ref = gaugeopt.GaugeProjector(model, sectors=("qk",), backend="torch").vertical(u)
    assert_same_fields(ref, _naive_vertical(model, u, "qk"), torch.float64)
    with pytest.raises(AssertionError):
        assert_same_fields(ref, _naive_vertical(model, u, "qk", drop_twists=True), torch.float64)


def test_zero_multiplier_is_refused_by_the_reference():
    model = zoo.build("gpt_rope_split_half_gqa", seed=3, lrm=True).model
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.row_mults[1][3] = 0.0  # one r_K entry
    with pytest.raises(GaugeError, match="exact zero"):
        _naive_vertical(model, random_field(model), "qk")


def test_the_ops_check_their_inputs():
    a, b = torch.ones(4, 6), torch.ones(2, 6)
    u = lambda t: torch.zeros_like(t)  # noqa: E731

    def site(**kw):
        args = dict(a=a, b=b, u_a=u(a), u_b=u(b), out_a=u(a), out_b=u(b), groups=2, repeat_a=2, repeat_b=1,
                    slot=[0, 1, 2, 0, 1, 2], n_slots=3)
        return kproj.DiagonalSite(**{**args, **kw})

    kproj.check_diagonal([site()])
    with pytest.raises(GaugeError, match="strides"):
        kproj.check_diagonal([site(u_a=torch.zeros(6, 4).T)])
    with pytest.raises(GaugeError, match=r"side b has shape \(2, 6\); expected \(2·2, 6\)"):
        kproj.check_diagonal([site(repeat_b=2)])
    with pytest.raises(GaugeError, match="one field dtype"):
        kproj.check_diagonal([site(u_b=u(b).double(), out_b=u(b).double())])
    with pytest.raises(GaugeError, match="empty"):
        kproj.project_diagonal_naive([], rtol=1e-6)
    pair = kfix.FixPair([kfix.FixTensor(a, 0), kfix.FixTensor(b, 1)], groups=2, width=6, slot=[0] * 6, n_slots=1,
                        repeat_a=2, repeat_b=1)
    kfix.check_pairs([pair])
    with pytest.raises(GaugeError, match="each side"):
        kfix.check_pairs([kfix.FixPair(pair.tensors[:1], 2, 6, [0] * 6, 1, 2, 1)])
    with pytest.raises(GaugeError, match="every slot used"):
        kfix.check_pairs([kfix.FixPair(pair.tensors, 2, 6, [0] * 6, 2, 2, 1)])
    with pytest.raises(GaugeError, match="powers"):
        kfix.check_pairs([kfix.FixPair(pair.tensors + [kfix.FixTensor(b, 1, 3)], 2, 6, [0] * 6, 1, 2, 1)])
