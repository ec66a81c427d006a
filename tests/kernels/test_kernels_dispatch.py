"""The kernel dispatch: argument and environment overrides, auto rules, errors that say why.

These run in the main test process without launching a kernel (a CPU machine has no GPU, and
``TRITON_INTERPRET`` is not set here): the interpreter cases are in
``tests/kernels/kernels_interpreter_cases.py``.
"""

from __future__ import annotations

import sys
import subprocess

import pytest
import torch

import gaugeopt
from gaugeopt.kernels import dispatch
from kernel_helpers import assert_same_fix, odd_gpt, train_steps, twin

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_argument_and_environment_choose_the_backend(monkeypatch):
    assert dispatch.requested_backend() == ("auto", "default")
    assert dispatch.requested_backend("torch") == ("torch", "argument")
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert dispatch.requested_backend() == ("torch", "environment")
    assert dispatch.requested_backend("triton") == ("triton", "argument")  # the argument wins
    monkeypatch.setenv(dispatch.ENV_VAR, " Triton ")
    assert dispatch.requested_backend() == ("triton", "environment")


def test_bad_values_are_refused(monkeypatch):
    with pytest.raises(gaugeopt.GaugeError, match=r"backend='cuda' is not one of"):
        dispatch.choose("gauge_fix", CPU, backend="cuda")
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(gaugeopt.GaugeError, match="GAUGEOPT_BACKEND='fast'"):
        dispatch.choose("gauge_fix", CPU)


def test_auto_on_cpu_takes_torch_and_says_why():
    d = dispatch.choose("gauge_fix", CPU)
    assert (d.backend, d.requested, d.source) == ("torch", "auto", "default")
    assert "cpu" in d.reason
    assert "gauge_fix: torch" in dispatch.explain("gauge_fix") and dispatch.last_decision("gauge_fix") == d


def test_forcing_triton_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    pytest.importorskip("triton")
    model = odd_gpt(lrm=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(gaugeopt.GaugeError, match="backend='triton'.*TRITON_INTERPRET=1 is not set"):
        gaugeopt.gauge_fix(model, backend="triton")
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with pytest.raises(gaugeopt.GaugeError, match="GAUGEOPT_BACKEND=triton.*cpu"):
        gaugeopt.gauge_fix(model)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "nothing may be written"


def test_interpreter_set_after_import_is_an_error(monkeypatch):
    pytest.importorskip("triton")
    import gaugeopt.kernels.gaugefix.fused  # noqa: F401  (decorated for the GPU: the variable is unset)

    if dispatch.kernels_interpreted("gaugefix.fused"):
        pytest.skip("this process imported the kernels under the interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(gaugeopt.GaugeError, match="imported before TRITON_INTERPRET=1"):
        dispatch.choose("gauge_fix", CPU, backend="triton", module="gaugefix.fused")


def test_missing_triton_is_an_error_when_forced_and_a_reason_otherwise(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_version", lambda: None)
    with pytest.raises(gaugeopt.GaugeError, match="triton is not importable; install it"):
        dispatch.choose("gauge_fix", torch.device("cuda"), backend="triton")
    d = dispatch.choose("gauge_fix", torch.device("cuda"))
    assert d.backend == "torch" and "not importable" in d.reason


def test_unsupported_inputs_fall_back_under_auto_and_raise_when_forced(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_version", lambda: "3.x")
    why = lambda: "x is a DTensor"  # noqa: E731
    d = dispatch.choose("gauge_fix", torch.device("cuda"), unsupported=why)
    assert (d.backend, d.reason) == ("torch", "x is a DTensor")
    with pytest.raises(gaugeopt.GaugeError, match="DTensor"):
        dispatch.choose("gauge_fix", torch.device("cuda"), backend="triton", unsupported=why)
    d = dispatch.choose("gauge_fix", torch.device("cuda"))
    assert d.backend == "triton" and "CUDA tensors" in d.reason
    with pytest.raises(gaugeopt.GaugeError, match="written for CUDA"):
        dispatch.choose("gauge_fix", torch.device("meta"), backend="triton")


def test_a_reused_fixer_plans_once_and_matches_one_shot_fixes():
    """GaugeFixer keeps its backend across optimizer steps (same storage) and gives, bit for bit,
    what a fresh gauge_fix gives after each step; on CPU the decision is torch, with the reason."""
    model = odd_gpt(lrm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt)
    m2, o2 = twin(model, opt)
    fixer = gaugeopt.GaugeFixer(m2, o2, vo=True)
    runners = set()
    for step in range(3):
        r1 = gaugeopt.gauge_fix(model, opt, vo=True)
        r2 = fixer()
        runners.add(id(fixer._runner))
        assert_same_fix(model, opt, r1, m2, o2, r2, torch.float64)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters())), step
        assert r1.max_drift_before > 1e-3, "each step drifts again: the fixes do work"
        train_steps(model, opt, 1, seed=10 + step)
        train_steps(m2, o2, 1, seed=10 + step)
    assert len(runners) == 1
    assert (fixer.decision.backend, fixer.decision.requested) == ("torch", "auto")
    assert "cpu" in fixer.decision.reason


def test_importing_gaugeopt_and_kernels_does_not_import_triton():
    code = ("import sys, gaugeopt, gaugeopt.kernels; from gaugeopt.kernels import dispatch, gaugefix, projection; "
            "import gaugeopt.kernels.gaugefix.naive, gaugeopt.kernels.projection.naive; "
            "import gaugeopt.fix.triton_backend, gaugeopt.projection.triton_backend, gaugeopt.projection.routing; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_projectors_route_is_decided_once_per_kind_of_field(monkeypatch):
    """The projector asks the dispatch once per signature of the field (dtype, device and type of each
    tensor the kernel would read, and the requested backend), not per sector per call; a reused
    decision is recorded again, and a new kind of field or a new request is decided anew."""
    model = odd_gpt(lrm=True, rope="interleaved", rotary_dim=None)
    proj = gaugeopt.GaugeProjector(model, sectors=("qk", "lrm_qk", "lrm_vo"))
    asked = []
    real = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda op, *a, **kw: asked.append(op) or real(op, *a, **kw))
    u = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    first = proj.vertical(u)
    assert asked == ["project_qk", "project_lrm_qk", "project_lrm_vo"]
    dispatch._LAST.pop("project_qk")
    again = proj.vertical({n: torch.randn_like(p) for n, p in model.named_parameters()})
    assert len(asked) == 3 and dispatch.last_decision("project_qk").backend == "torch"  # reused, recorded again
    assert all(not torch.equal(first[n], again[n]) for n in first)  # the projection itself ran again
    proj.vertical({n: t.float() for n, t in u.items()})  # another dtype: decided again
    assert len(asked) == 6
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")  # another request: decided again
    proj.vertical(u)
    assert len(asked) == 9 and dispatch.last_decision("project_qk").source == "environment"
    proj.vertical(u, sectors=("qk", "lrm_internal"))  # a joint projection never goes to the kernel
    assert len(asked) == 9
