"""The Triton kernels compile for a Hopper GPU (sm_90) — checked on CPU, no GPU needed.

The interpreter cases check the arithmetic; this checks that the same source also lowers
through Triton's GPU compiler (constexpr branches, pointer casts from the descriptor tables,
dtype combinations), so a GPU machine does not find the first compile error. It compiles to
PTX and a cubin with Triton's bundled ptxas and asserts that nothing spills to local memory.
"""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton", reason="the kernels need triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the kernels are decorated for the interpreter in this process", allow_module_level=True)

import triton.language as tl  # noqa: E402

from gaugeopt.kernels.gaugefix import fused as gft  # noqa: E402
from gaugeopt.kernels.projection import fused as pjt  # noqa: E402


def _compile(fn, sig: dict, consts: dict, **options):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **{k: "constexpr" for k in consts}}
    try:
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options=options)
    except RuntimeError as err:  # no CUDA backend / ptxas in this triton build
        if "ptxas" in str(err) or "backend" in str(err).lower():
            pytest.skip(f"triton cannot compile for CUDA here: {err}")
        raise


def _check(compiled) -> None:
    ptx = compiled.asm["ptx"]
    assert ".entry" in ptx and "cubin" in compiled.asm
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"


GF_SIG = {"unit_tab": "*i64", "plan_tab": "*i64", "desc_tab": "*i64", "slot_tab": "*i32", "scal": "*fp32",
          "out": "*fp32", "unit_changed": "*i32", "n_out": "i32"}


@pytest.mark.slow
@pytest.mark.parametrize("param,state,layout,has_max,block_c,block_x", [
    (tl.float32, tl.float32, 1, True, 128, 32),  # LLaMA plain rows (d_k 128), magnitude cap
    (tl.bfloat16, tl.float32, 2, False, 64, 64),  # bf16 parameters, fp32 moments, Conv1D layout
    (tl.float64, tl.float64, 0, False, 16, 1),  # float64 multipliers, generic strides
])
def test_gaugefix_kernel_compiles_for_sm90(param, state, layout, has_max, block_c, block_x):
    acc = tl.float64 if param == tl.float64 else tl.float32
    sig = dict(GF_SIG, scal="*fp64" if acc == tl.float64 else "*fp32", out="*fp64" if acc == tl.float64 else "*fp32")
    c = _compile(gft._gaugefix_kernel, sig, dict(PARAM_T=param, STATE_T=state, ACC_T=acc, IEEE32=acc == tl.float32,
                                                 LAYOUT=layout, HAS_MAX=has_max, BLOCK_C=block_c, BLOCK_X=block_x),
                 num_warps=8 if block_c * block_x > 2048 else 4)
    _check(c)


@pytest.mark.slow
def test_projection_kernels_compile_for_sm90():
    _check(_compile(pjt._diag_kernel, {"site_tab": "*i64", "desc_tab": "*i64", "slot_tab": "*i32", "rtol_ptr": "*fp32"},
                    dict(P_T=tl.bfloat16, U_T=tl.float32, ACC_T=tl.float32, SUBTRACT=True, BLOCK_K=8, BLOCK_C=128)))
    _check(_compile(pjt._plane_kernel, {"unit_tab": "*i64", "site_tab": "*i64", "desc_tab": "*i64", "twist_tab": "*i64",
                                        "plane_tab": "*i32", "rtol_ptr": "*fp32", "zero_flag": "*i32"},
                    dict(P_T=tl.float32, U_T=tl.bfloat16, ACC_T=tl.float32, SUBTRACT=False, HAS_TWIST=True,
                         BLOCK_P=16, BLOCK_X=256)))
