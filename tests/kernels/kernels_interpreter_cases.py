"""Kernel cases run under the Triton interpreter (CPU), each against its torch reference.

Not collected on its own (the file name does not start with ``test_``):
``tests/kernels/test_kernels_interpreter.py`` runs it in a fresh process with ``TRITON_INTERPRET=1``,
because the variable must be set before any kernel is decorated, and another test module of
the same pytest process may already have imported the kernel modules for the GPU.
Run it by hand with ``TRITON_INTERPRET=1 python -m pytest tests/kernels/kernels_interpreter_cases.py``.
"""

from __future__ import annotations

import doctest
import os

if os.environ.get("TRITON_INTERPRET") != "1":  # never run these on compiled kernels by accident
    raise RuntimeError("tests/kernels/kernels_interpreter_cases.py needs TRITON_INTERPRET=1 set before it is imported")

import pytest
import torch

import gaugeopt
import zoo
from gaugeopt.fix import GaugeFixer
from gaugeopt.kernels import dispatch
from gaugeopt.kernels.gaugefix import fused as gft
from gaugeopt.kernels.projection import fused as pjt
from kernel_helpers import (
    TOL, assert_same_fields, assert_same_fix, fix_reference, odd_gpt, project_with, random_field, train_steps, twin,
    vertical_with,
)

DTYPES = [torch.float32, torch.float64]
F32, F64 = torch.float32, torch.float64
ZOO = [  # (model, lrm, dtype): each layout once; the dtype alternates (the interpreter is slow)
    ("gpt_gqa", False, F32),  # plain rows + biases, GQA n_rep = 2, nn.Linear (columns contiguous)
    ("gpt_gqa", False, F64),
    ("gpt_rope_partial_split_half", False, F32),  # plane slots, partial rotary, GQA
    ("hf_gpt2", False, F64),  # Conv1D in×out storage, fused c_attn (channels contiguous)
    ("hf_qwen2", False, F32),  # q/k/v biases, GQA
    ("torch_mha_kdim", False, F64),  # separate K input width (K rows shorter than Q rows), d_k = 6
    ("gpt", True, F32),  # LRM multipliers, per head
    ("gpt_rope_split_half_gqa", True, F64),  # multipliers, RoPE planes, GQA
    ("hf_gpt2", True, F32),
    ("hf_llama", True, F64),
    ("hf_gpt_neox", False, F32),  # fused [q_i, k_i, v_i] per head: strided head views, partial RoPE
    ("gpt_qknorm", False, F32),  # QK-norm gains: one vector shared by all heads, RoPE plane slots
]


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)


def _setup(model, opt_cls=torch.optim.AdamW, **opt_kw):
    opt = opt_cls(model.parameters(), lr=1e-2, **opt_kw)
    train_steps(model, opt)
    return opt


def _both(model, opt, **kw):
    """(reference model, opt, report), (Triton model, opt, report) from the same starting point."""
    m2, o2 = twin(model, opt)
    r1 = fix_reference(model, opt, **kw)
    r2 = gaugeopt.gauge_fix(m2, o2, backend="triton", **kw)
    assert dispatch.last_decision("gauge_fix").backend == "triton"
    return (model, opt, r1), (m2, o2, r2)


@pytest.mark.parametrize("name,lrm,dtype", ZOO, ids=[n + ("+lrm" if l else "") + f"-{str(d)[6:]}" for n, l, d in ZOO])
def test_fused_gauge_fix_matches_the_torch_core(name, lrm, dtype):
    model = zoo.build(name, seed=1, lrm=lrm, dtype=dtype).model
    opt = _setup(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (m1, o1, r1), (m2, o2, r2) = _both(model, opt)
    assert_same_fix(m1, o1, r1, m2, o2, r2, dtype)
    # not vacuous: the fix moved the Q/K tensors and balanced them
    assert r2.max_drift_before > 1e-2 and r2.heads_fixed == r1.heads_fixed > 0
    assert any(not torch.equal(before[n], p) for n, p in m2.named_parameters())
    assert gaugeopt.qk_drift(m2, granularity="auto") < (1e-5 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("name", ["hf_deepseek_v3", "litgpt_mla"])
def test_fused_gauge_fix_of_latent_attention_matches_the_torch_core(name):
    """Multi-head latent attention (docs/mla.md): the part without RoPE per head (rows inside each head's
    block of the up-projections: strided views) and the RoPE part, one group of every head against the
    shared key, with V/O."""
    import mla_helpers

    model = mla_helpers.build(name).model
    opt = _setup(model)
    (m1, o1, r1), (m2, o2, r2) = _both(model, opt, vo=True)
    assert_same_fix(m1, o1, r1, m2, o2, r2, F64)
    assert {p.kind for p in r2.pairs} == {"qk", "qk_rope", "vo"} and r2.max_drift_before > 1e-2
    assert gaugeopt.qk_drift(m2) < 1e-10


@pytest.mark.parametrize("name,lrm", [("gpt_rope_split_half_gqa", True), ("hf_qwen2", False)])
def test_second_fix_reports_the_same_heads_on_both_backends(name, lrm):
    """Right after a float32 fix every factor is 1 up to rounding: a second fix changes no group,
    and both backends say so with the same rule (the report's integer fields once disagreed)."""
    model = zoo.build(name, seed=1, lrm=lrm, dtype=F32).model
    opt = _setup(model)
    (m1, o1, r1), (m2, o2, r2) = _both(model, opt, vo=True)
    assert r1.heads_fixed == r2.heads_fixed > 0
    again_torch = fix_reference(m1, o1, vo=True)
    again_triton = gaugeopt.gauge_fix(m2, o2, vo=True, backend="triton")
    assert again_torch.heads_fixed == again_triton.heads_fixed == 0
    assert_same_fix(m1, o1, again_torch, m2, o2, again_triton, F32)


ODD = [  # (lrm, rope, granularity, dtype): the masks do not depend on the dtype, the rounding does
    (False, "split_half", "plane", torch.float64), (False, "none", "channel", torch.float32),
    *[(True, r, g, dt) for r, g in (("split_half", "plane"), ("split_half", "head"), ("none", "channel")) for dt in DTYPES],
]


@pytest.mark.parametrize("lrm,rope,granularity,dtype", ODD, ids=lambda v: str(v).replace("torch.", ""))
def test_odd_shapes_exercise_every_mask(monkeypatch, lrm, rope, granularity, dtype):
    """d_k = 10 in 16-channel tiles, 37 (+1 bias) columns in 16-column tiles, n_rep = 3, V/O too."""
    monkeypatch.setattr(gft, "_TILE_ELEMS", 256)  # BLOCK_C = 16 -> BLOCK_X = 16: three column tiles, the last partial
    model = odd_gpt(lrm=lrm, dtype=dtype, rope=rope)
    opt = _setup(model, torch.optim.Adam, amsgrad=True)  # exp_avg, exp_avg_sq and max_exp_avg_sq
    (m1, o1, r1), (m2, o2, r2) = _both(model, opt, granularity=granularity, vo=True, vo_granularity="channel")
    assert_same_fix(m1, o1, r1, m2, o2, r2, dtype)
    assert r2.max_drift_before > 1e-2


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.SGD, dict(momentum=0.9)), (torch.optim.Adagrad, {}),
                                        (torch.optim.NAdam, {})], ids=["sgd", "adagrad", "nadam"])
def test_state_rules_of_other_optimizers(opt_cls, kw):
    model = odd_gpt(lrm=False)
    opt = _setup(model, opt_cls, **kw)
    (m1, o1, r1), (m2, o2, r2) = _both(model, opt, vo=True)
    assert_same_fix(m1, o1, r1, m2, o2, r2, torch.float64)
    assert r2.transported


class _Unknown(torch.optim.SGD):
    """An SGD subclass keeping an extra per-coordinate buffer no rule covers."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["trace"] = torch.ones_like(p)


def test_unknown_state_policies():
    gaugeopt.fix.transport.register_state_rule(_Unknown, {"momentum_buffer": 1})  # rule lacks "trace"
    model = odd_gpt(lrm=True)
    opt = _setup(model, _Unknown, momentum=0.9)
    m2, o2 = twin(model, opt)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(gaugeopt.GaugeError, match="trace"):
        gaugeopt.gauge_fix(m2, o2, backend="triton")
    assert all(torch.equal(a, p) for a, p in zip(before, m2.parameters())), "wrote before refusing"
    for policy in ("reset", "leave"):
        (m1, o1, r1), (m2, o2, r2) = _both(*twin(model, opt), unknown_state=policy)
        assert_same_fix(m1, o1, r1, m2, o2, r2, torch.float64)
        assert (r2.reset if policy == "reset" else r2.left)


@pytest.mark.parametrize("opts", [dict(product_decay=0.1), dict(product_max=0.05), dict(product_decay=0.2, product_max=0.5),
                                  dict(transport_state=False), dict(mode="plain"), dict(eps=1e-3)],
                         ids=["decay", "max", "decay+max", "no-transport", "plain-on-lrm", "eps"])
def test_magnitude_control_and_options(opts):
    model = odd_gpt(lrm=True, dtype=torch.float32)
    opt = _setup(model)
    (m1, o1, r1), (m2, o2, r2) = _both(model, opt, vo=True, **opts)
    assert_same_fix(m1, o1, r1, m2, o2, r2, torch.float32)


def test_generic_layout_matches(monkeypatch):
    """The stride-generic tile (no contiguous axis assumed) gives the same results (Conv1D strides)."""
    monkeypatch.setattr(gft, "_layout_of", lambda tensors: gft._GENERIC)
    model = zoo.build("hf_gpt2", seed=2, dtype=torch.float64).model
    opt = _setup(model)
    (m1, o1, r1), (m2, o2, r2) = _both(model, opt, vo=True)
    assert_same_fix(m1, o1, r1, m2, o2, r2, torch.float64)


def test_one_launch_per_dtype_group(monkeypatch):
    """Two layers in different dtypes: two launches, each over its own layers, still exact."""
    launches = []
    real = gft._run
    monkeypatch.setattr(gft, "_run", lambda pk: launches.append(len(pk.members)) or real(pk))
    model = odd_gpt(lrm=True, dtype=torch.float64)
    opt = _setup(model)
    (m1, o1, r1), (m2, o2, r2) = _both(model, opt, vo=True)
    assert_same_fix(m1, o1, r1, m2, o2, r2, torch.float64)
    assert launches == [4]  # 2 layers x (Q/K, V/O) in one launch
    launches.clear()
    mixed = odd_gpt(lrm=True, dtype=torch.float64)
    gaugeopt.certify(mixed, torch.randint(0, 29, (1, 8)))  # proved before the cast: a mixed model cannot run
    mixed.transformer.h[1].to(torch.float32)
    opt = _setup(mixed)
    (m1, o1, r1), (m2, o2, r2) = _both(mixed, opt)
    assert launches == [1, 1]
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(b, a, **TOL[a.dtype], msg=lambda m: f"{n}: {m}")


def test_environment_variable_forces_triton(monkeypatch):
    model = odd_gpt(lrm=True)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    gaugeopt.gauge_fix(model)
    d = dispatch.last_decision("gauge_fix")
    assert (d.backend, d.source) == ("triton", "environment") and "interpreter" in d.reason
    monkeypatch.delenv(dispatch.ENV_VAR)
    gaugeopt.gauge_fix(model)
    assert dispatch.last_decision("gauge_fix").backend == "torch"  # auto on CPU: the reference


@pytest.mark.parametrize("mod", [gft, pjt], ids=["gaugefix.fused", "projection.fused"])
def test_docstring_examples_run(mod):
    result = doctest.testmod(mod, verbose=False)
    assert result.failed == 0


# ---------------------------------------------------------------------- closed-form projections

PROJ = [  # (model, sectors, dtype, small tiles): tiles are dtype-independent, rounding is not
    ("odd_full_rope", ("qk",), torch.float64, True),  # 5 planes per head, 37 (+1 bias) columns, n_rep = 3
    ("odd_full_rope+lrm", ("qk", "lrm_qk", "lrm_vo"), torch.float32, True),  # per-head twists r_Q in the plane solve
    ("odd_full_rope+lrm", ("qk",), torch.float64, False),
    ("odd_partial+lrm", ("lrm_qk", "lrm_vo"), torch.float64, False),  # lrm_qk slots: 3 planes + 4 single channels
    ("hf_llama+lrm", ("qk", "lrm_qk"), torch.float32, False),  # GQA, biases, split-half, Llama layout
    ("hf_mistral", ("qk",), torch.float64, False),
]


def _proj_model(name: str, dtype):
    if name.startswith("odd"):
        return odd_gpt(lrm=name.endswith("+lrm"), dtype=dtype, rope="interleaved" if "full" in name else "split_half",
                       rotary_dim=None if "full" in name else 6, seed=3)
    base, _, lrm = name.partition("+")
    return zoo.build(base, seed=3, lrm=bool(lrm), dtype=dtype).model


@pytest.mark.parametrize("name,sectors,dtype,small", PROJ,
                         ids=[f"{n}-{str(d)[6:]}{'-small-tiles' if t else ''}" for n, _, d, t in PROJ])
def test_fused_projection_matches_the_projector(monkeypatch, name, sectors, dtype, small):
    if small:
        monkeypatch.setattr(pjt, "_BLOCK_P", 4)  # 5 planes -> 2 plane blocks, the second one partial
        monkeypatch.setattr(pjt, "_TILE_ELEMS", 128)  # 32 columns per tile: 37 -> two tiles, the second partial
    model = _proj_model(name, dtype)
    u = random_field(model)
    for sector in sectors:
        ref = vertical_with(model, u, sector)
        got = vertical_with(model, u, sector, backend="triton")
        assert dispatch.last_decision(f"project_{sector}").backend == "triton"
        assert_same_fields(ref, got, dtype, f"vertical {sector}")
        assert min(float(v.norm()) for v in got.values()) > 1e-3  # not vacuous: every tensor has a vertical part
    if small:
        return  # the subtracting variant is checked on the default tiles (interpreter time)
    sector = sectors[0]
    hor = project_with(model, u, sector, backend="triton")
    assert_same_fields(project_with(model, u, sector), hor, dtype, f"project {sector}")
    left = vertical_with(model, hor, sector)  # the projected field has no vertical part left
    assert max(float(v.abs().max()) for v in left.values()) < (1e-4 if dtype == torch.float32 else 1e-11)


def test_fused_projection_in_place_and_missing_entries():
    model = _proj_model("odd_full_rope+lrm", torch.float64)
    u = random_field(model, seed=5)
    del u["transformer.h.1.attn.c_attn.weight"]  # a missing entry counts as zero
    expect = project_with(model, dict(u), "qk")
    given = {n: t.clone() for n, t in u.items()}
    same = given["transformer.h.0.attn.c_attn.weight"]
    out = project_with(model, given, "qk", backend="triton", inplace=True)
    assert out["transformer.h.0.attn.c_attn.weight"] is same  # written in place
    assert_same_fields(expect, out, torch.float64, "in place")


def test_zero_multiplier_is_refused_like_the_core():
    model = _proj_model("odd_full_rope+lrm", torch.float64)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.row_mults[1][3] = 0.0  # one r_K entry
    u = random_field(model)
    with pytest.raises(gaugeopt.GaugeError, match="exact zero"):
        vertical_with(model, u, "qk")
    with pytest.raises(gaugeopt.GaugeError, match="exact zero"):
        vertical_with(model, u, "qk", backend="triton")


def test_dense_sectors_are_refused_when_forced_and_fall_back_under_auto():
    model = _proj_model("odd_partial+lrm", torch.float64)  # partial rotary: the dense block needs Sylvester
    u = random_field(model)
    with pytest.raises(gaugeopt.GaugeError, match="Sylvester"):
        vertical_with(model, u, "qk", backend="triton")
    got = vertical_with(model, u, "qk", backend="auto")  # auto on CPU: the torch projector
    assert dispatch.last_decision("project_qk").backend == "torch"
    assert_same_fields(vertical_with(model, u, "qk"), got, torch.float64)
    # V/O has no closed form: it always runs the Sylvester solve in torch, whatever the backend
    assert_same_fields(vertical_with(model, u, "vo"), vertical_with(model, u, "vo", backend="triton"), torch.float64)


def test_fused_gauge_fix_object_reuses_its_tables_across_steps(monkeypatch):
    """GaugeFixer packs once while storage stays put, re-packs when the state is reallocated."""
    packs = []
    real = gft._pack
    monkeypatch.setattr(gft, "_pack", lambda *a: packs.append(1) or real(*a))
    model = odd_gpt(lrm=True)
    opt = _setup(model)
    m2, o2 = twin(model, opt)
    fix = GaugeFixer(m2, o2, vo=True, backend="triton")
    for step in range(3):
        r1, r2 = fix_reference(model, opt, vo=True), fix()
        assert fix.decision.backend == "triton" and r2.backend == "triton"
        assert_same_fix(model, opt, r1, m2, o2, r2, torch.float64)
        train_steps(model, opt, 1, seed=10 + step)
        train_steps(m2, o2, 1, seed=10 + step)
    assert len(packs) == 1
    opt.state.clear()
    o2.state.clear()
    train_steps(model, opt, 1, seed=20)
    train_steps(m2, o2, 1, seed=20)
    r1, r2 = fix_reference(model, opt, vo=True), fix()
    assert_same_fix(model, opt, r1, m2, o2, r2, torch.float64)
    assert len(packs) == 2


# ---------------------------------------------------------------------- each kernel against its naive reference
# The kernels on synthetic tensors (odd widths, strided views, several tensors per side) against the plain-torch
# references beside them (gaugeopt.kernels.*.naive); tests/kernels/test_kernel_references.py checks the references
# against the model-level torch paths.
from gaugeopt.kernels import gaugefix as kfix  # noqa: E402
from gaugeopt.kernels import projection as kproj  # noqa: E402


def _store(dtype, seed: int) -> dict[str, torch.Tensor]:
    """Storage for three pairs: a fused Q/K weight in nn.Linear layout (80 rows + 5 other rows, 37 columns),
    its biases, V rows, an O weight (columns = 6 heads × 10), multipliers, and two moments of each."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, positive=False):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (x.abs() + 0.1 if positive else x * 0.5 + 1.0).to(dtype)

    shapes = {"w": (85, 37), "b": (80,), "v": (20, 37), "o": (37, 60), "r_q": (6, 10), "r_k": (2, 10)}
    out = {}
    for k, shape in shapes.items():
        out[k] = rnd(*shape)
        out[k + ".m1"] = rnd(*shape)
        out[k + ".m2"] = rnd(*shape, positive=True)
    return out


def _pairs(st: dict) -> list:
    """Plain Q/K rows + biases in RoPE-plane slots (3 planes + 4 single channels), V rows against O columns
    per channel, multipliers per head; parameters then moments of power 1 and 2."""
    T = kfix.FixTensor

    def with_state(key, view_of, side, columns=False):
        return [T(view_of(st[key]), side, 0, columns)], [T(view_of(st[key + m]), side, k, columns)
                                                          for m, k in ((".m1", 1), (".m2", 2))]

    qk = [with_state("w", lambda t: t[:60].view(6, 10, 37), 0), with_state("b", lambda t: t[:60].view(6, 10), 0),
          with_state("w", lambda t: t[60:80].view(2, 10, 37), 1), with_state("b", lambda t: t[60:80].view(2, 10), 1)]
    vo = [with_state("v", lambda t: t.view(2, 10, 37), 0), with_state("o", lambda t: t.view(37, 6, 10), 1, True)]
    lrm = [with_state("r_q", lambda t: t, 0), with_state("r_k", lambda t: t, 1)]

    def pair(parts, slot, repeat_a, repeat_b):
        params = [t for p, _ in parts for t in p]
        states = [t for _, s in parts for t in s]
        return kfix.FixPair(params + states, 2, 10, slot, max(slot) + 1, repeat_a, repeat_b)

    planes = [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    return [pair(qk, planes, 3, 1), pair(vo, list(range(10)), 1, 3), pair(lrm, [0] * 10, 3, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("opts", [{}, dict(product_decay=0.2, product_max=0.5)], ids=["plain", "magnitude"])
def test_gaugefix_kernel_matches_its_naive_reference(monkeypatch, dtype, opts):
    monkeypatch.setattr(gft, "_TILE_ELEMS", 256)  # BLOCK_C = 16 -> BLOCK_X = 16: 37 columns in three tiles
    ref, got = _store(dtype, 7), _store(dtype, 7)
    before = {k: t.clone() for k, t in got.items()}
    expect = kfix.fix_naive(_pairs(ref), **opts)
    numbers = kfix.prepare(_pairs(got), **opts).run()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for want, have in zip(expect, numbers):
        for x, y in zip(want, have):
            if x.dtype == torch.bool:
                assert torch.equal(x, y), (x, y)
            else:
                assert y.dtype == acc
                torch.testing.assert_close(y, x, **TOL[acc])
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **TOL[dtype], msg=lambda m: f"{k}: {m}")
    # not vacuous: every pair changed its groups, and every tensor (the 5 rows outside the pairs aside) moved
    assert all(bool(n[4].all()) for n in numbers)
    assert all(not torch.equal(before[k], got[k]) for k in got)
    assert torch.equal(before["w"][80:], got["w"][80:]) and torch.equal(before["w.m2"][80:], got["w.m2"][80:])


def _proj_store(dtype, seed: int, layout: str) -> dict[str, torch.Tensor]:
    """A fused Q/K weight (``"linear"``: rows × columns, ``"conv1d"``: stored transposed), its biases and
    multipliers; the field in the same layouts; the outputs zero."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5 + 1.0).to(dtype)

    w = rnd(80, 37) if layout == "linear" else rnd(37, 80).T
    du = rnd(80, 37) if layout == "linear" else rnd(37, 80).T
    return {"w": w, "u": du, "out": torch.zeros_like(du), "b": rnd(80), "ub": rnd(80), "outb": torch.zeros(80, dtype=dtype),
            "r_q": rnd(6, 10), "r_k": rnd(2, 10), "u_q": rnd(6, 10), "u_k": rnd(2, 10),
            "o_q": torch.zeros(6, 10, dtype=dtype), "o_k": torch.zeros(2, 10, dtype=dtype)}


def _plane_site(st: dict, twist: bool):
    def rows(key, lo, hi, heads):
        return st[key][lo:hi].view(heads, 10, 37) if st[key].is_contiguous() else st[key][lo:hi].unflatten(0, (heads, 10))

    def bias(key, lo, hi, heads):
        return st[key][lo:hi].view(heads, 10)

    side_a = [kproj.PlaneMember(rows("w", 0, 60, 6), rows("u", 0, 60, 6), rows("out", 0, 60, 6)),
              kproj.PlaneMember(bias("b", 0, 60, 6), bias("ub", 0, 60, 6), bias("outb", 0, 60, 6))]
    side_b = [kproj.PlaneMember(rows("w", 60, 80, 2), rows("u", 60, 80, 2), rows("out", 60, 80, 2)),
              kproj.PlaneMember(bias("b", 60, 80, 2), bias("ub", 60, 80, 2), bias("outb", 60, 80, 2))]
    planes = [(2 * m, 2 * m + 1) for m in range(5)]  # interleaved: 5 planes of a 10-channel head
    return kproj.PlaneSite(side_a, side_b, planes, groups=2, repeat_a=3, repeat_b=1,
                           twist_a=st["r_q"] if twist else None, twist_b=st["r_k"] if twist else None)


def _diag_sites(st: dict):
    qk = kproj.DiagonalSite(st["r_q"], st["r_k"], st["u_q"], st["u_k"], st["o_q"], st["o_k"], groups=2, repeat_a=3,
                            repeat_b=1, slot=[0, 1, 2, 0, 1, 2, 3, 4, 5, 6], n_slots=7)
    vo = kproj.DiagonalSite(st["r_k"], st["r_q"], st["u_k"], st["u_q"], st["o_k"], st["o_q"], groups=2, repeat_a=1,
                            repeat_b=3, slot=list(range(10)), n_slots=10)
    return [qk], [vo]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("layout,twist,subtract", [("linear", True, False), ("conv1d", True, True), ("linear", False, True)])
def test_plane_kernel_matches_its_naive_reference(monkeypatch, dtype, layout, twist, subtract):
    monkeypatch.setattr(pjt, "_BLOCK_P", 4)  # 5 planes -> 2 plane blocks, the second one partial
    monkeypatch.setattr(pjt, "_TILE_ELEMS", 128)  # 32 columns per tile: 37 -> two tiles, the second partial
    ref, got = _proj_store(dtype, 5, layout), _proj_store(dtype, 5, layout)
    rtol = 1000 * torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    kproj.project_planes_naive([_plane_site(ref, twist)], rtol=rtol, subtract=subtract)
    kproj.project_planes([_plane_site(got, twist)], rtol=rtol, subtract=subtract)
    for k in ("out", "outb"):
        assert_same_fields({k: ref[k]}, {k: got[k]}, dtype, k)
        moved = got[k] - (got["u" if k == "out" else "ub"] if subtract else 0)
        assert float(moved.abs().min()) > 0  # not vacuous: every entry of every plane has a vertical part


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("subtract", [False, True], ids=["vertical", "horizontal"])
def test_diagonal_kernel_matches_its_naive_reference(dtype, subtract):
    ref, got = _proj_store(dtype, 6, "linear"), _proj_store(dtype, 6, "linear")
    rtol = 1000 * torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    for k in range(2):  # a Q/K-like layer (GQA, plane slots), then a V/O-like one (repeat on side b)
        kproj.project_diagonal_naive(_diag_sites(ref)[k], rtol=rtol, subtract=subtract)
        kproj.project_diagonal(_diag_sites(got)[k], rtol=rtol, subtract=subtract)
        for key in ("o_q", "o_k"):
            assert_same_fields({key: ref[key]}, {key: got[key]}, dtype, f"layer {k} {key}")
            assert float(got[key].abs().min()) > 0


def test_plane_kernel_refuses_a_zero_twist_like_its_reference():
    ref, got = _proj_store(F64, 5, "linear"), _proj_store(F64, 5, "linear")
    ref["r_k"][1, 3] = got["r_k"][1, 3] = 0.0
    with pytest.raises(gaugeopt.GaugeError, match="exact zero"):
        kproj.project_planes_naive([_plane_site(ref, True)], rtol=1e-12)
    with pytest.raises(gaugeopt.GaugeError, match="exact zero"):
        kproj.project_planes([_plane_site(got, True)], rtol=1e-12)
