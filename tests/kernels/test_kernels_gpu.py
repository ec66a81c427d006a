"""The Triton kernels on a CUDA device: float32 against the torch core, bfloat16/float16 against
the float32 core on the upcast values (one storage rounding apart), auto dispatch.

Skipped without CUDA (the interpreter gives NaN in bfloat16, see docs/kernels.md); run by
``benchmarks/gpu_check.sh`` on a GPU machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gaugeopt

import zoo
from gaugeopt.fix import GaugeFixer
from gaugeopt.kernels import dispatch
from kernel_helpers import (
    TOL, assert_same_fields, assert_same_fix, fix_reference, odd_gpt, project_with, random_field, train_steps, twin,
    vertical_with,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16 kernel tests are GPU-only: "
                       "the Triton interpreter gives NaN in bfloat16)"),
]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


def _on_cuda(model, dtype):
    return model.to(device=CUDA, dtype=dtype)


@pytest.mark.parametrize("name,lrm", [("hf_gpt2", False), ("gpt_rope_split_half_gqa", True), ("hf_llama", False),
                                      ("torch_mha_kdim", False)])
def test_cuda_float32_matches_the_core_and_auto_picks_triton(name, lrm):
    model = _on_cuda(zoo.build(name, seed=4, lrm=lrm, dtype=torch.float64).model, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt)
    m2, o2 = twin(model, opt)
    r1 = fix_reference(model, opt, vo=True)
    r2 = gaugeopt.gauge_fix(m2, o2, vo=True)  # auto on CUDA
    assert dispatch.last_decision("gauge_fix").backend == "triton", dispatch.explain()
    assert_same_fix(model, opt, r1, m2, o2, r2, torch.float32)
    assert r2.heads_fixed == r1.heads_fixed > 0


@pytest.mark.parametrize("state_dtype", ["same", "float32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lrm", [True, False], ids=["lrm", "plain"])
def test_low_precision_within_one_storage_rounding(lrm, dtype, state_dtype):
    """bf16/fp16 parameters: statistics in float32; each stored value is the float32 result
    rounded once, so it lies within one ulp of the float32 core run on the upcast values."""
    model = _on_cuda(odd_gpt(lrm=lrm, dtype=torch.float64, rope="split_half"), dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    train_steps(model, opt)
    if state_dtype == "float32":  # mixed precision: fp32 moments of low-precision parameters
        for st in opt.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    st[k] = v.float()
    ref_model = copy.deepcopy(model).float()
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2, amsgrad=True)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # casts the moments to float32
    r_ref = fix_reference(ref_model, ref_opt, vo=True)
    r = gaugeopt.gauge_fix(model, opt, vo=True, backend="triton")
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.float(), q, **TOL[dtype], msg=lambda m: f"{n}: {m}")
        for key, v in opt.state[p].items():
            if torch.is_tensor(v) and v.dim() > 0:
                w = ref_opt.state[q][key]
                torch.testing.assert_close(v.float(), w, rtol=TOL[dtype]["rtol"], atol=1e-6 * float(w.abs().max()),
                                           msg=lambda m: f"{key} of {n}: {m}")
    for a, b in zip(r_ref.pairs, r.pairs):
        torch.testing.assert_close(b.drift_before, a.drift_before, **TOL[torch.float32])
        assert b.drift_before.dtype == torch.float32
    assert r.max_drift_before > 1e-2 and r.max_drift_after < 2e-2


def test_fused_gauge_fix_object_on_cuda():
    model = _on_cuda(odd_gpt(lrm=True), torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt)
    m2, o2 = twin(model, opt)
    fix = GaugeFixer(m2, o2)
    for step in range(2):
        assert_same_fix(model, opt, fix_reference(model, opt), m2, o2, fix(), torch.float32)
        assert fix.decision.backend == "triton"
        train_steps(model, opt, 1, seed=step)
        train_steps(m2, o2, 1, seed=step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name,sectors", [("hf_llama+lrm", ("qk", "lrm_qk", "lrm_vo")), ("odd_full", ("qk",))])
def test_projection_on_cuda(name, sectors, dtype):
    if name == "odd_full":
        model = odd_gpt(lrm=False, rope="interleaved", rotary_dim=None, seed=5)
    else:
        model = zoo.build("hf_llama", seed=5, lrm=True, dtype=torch.float64).model
    model = _on_cuda(model, dtype)
    u = {n: t.to(CUDA) for n, t in random_field(model).items()}
    for sector in sectors:
        ref = vertical_with(model, u, sector)
        got = vertical_with(model, u, sector, backend="auto")  # auto on CUDA
        assert dispatch.last_decision(f"project_{sector}").backend == "triton", dispatch.explain()
        assert_same_fields(ref, got, dtype, f"vertical {sector}")
        assert_same_fields(project_with(model, u, sector), project_with(model, u, sector, backend="auto"), dtype,
                           f"project {sector}")


@pytest.mark.parametrize("mode", ["exact", "approx"])
@pytest.mark.parametrize("name,lrm", [("gpt_gqa", False), ("hf_llama", True), ("gpt_rope_partial_split_half", False)])
def test_dense_projection_on_cuda_matches_float64_on_cpu(name, lrm, mode):
    """The CUDA layout of the dense sectors (sites stacked along the head axis, the Gram
    eigenpairs from the SVD of their factors for d_k > 32, batched Cholesky for approx) against
    the float64 CPU projection, all sectors of the model including the joint LRM solve."""
    from gaugeopt.projection.projector import GaugeProjector

    case = zoo.build(name, seed=5, lrm=lrm, dtype=torch.float64)
    cpu = case.model
    u = random_field(cpu, seed=6)
    ref = GaugeProjector(cpu, mode="exact").vertical(u)
    gpu = copy.deepcopy(cpu).to(device=CUDA, dtype=torch.float32)
    v = GaugeProjector(gpu, mode=mode).vertical({n: t.to(CUDA, torch.float32) for n, t in u.items()})
    num = sum(float((v[n].double().cpu() - ref[n]).square().sum()) for n in ref) ** 0.5
    den = sum(float(ref[n].square().sum()) for n in ref) ** 0.5
    assert num <= (2e-3 if mode == "exact" else 5e-2) * den, num / den
