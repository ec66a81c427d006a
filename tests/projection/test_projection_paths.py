"""The batched projection paths against the straightforward implementation they replaced, and the
approximate mode's promise.

``tests/support/legacy_projection`` holds the sectors as they were (per-site gathers, concatenated bias
columns, a dense eigendecomposition of every ``lrm_internal`` Schur complement); every new path
must give its vertical part to 1e-10 in float64. The approximate mode must never leave more
vertical part than the field had (measured with the exact projector), on directions from
initialisation and from a trained model, while paper 000's Algorithm 2 (``mode="paper000"``)
can add vertical part.
"""

from __future__ import annotations

import pytest
import torch

import gaugeopt
import legacy_projection
import projection_helpers as H
import zoo
from errata_helpers import adamw_update
from gaugeopt import GaugeError
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.projection import dense
from gaugeopt.projection.projector import GaugeProjector
from gaugeopt.trust.invariance import randomize_parameters

SECTOR_SETS = [("qk",), ("vo",), ("qk", "vo")]
LRM_SETS = [("lrm_qk",), ("lrm_vo",), ("lrm_internal",), ("qk", "vo", "lrm_qk", "lrm_vo")]


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[n] - b[n]).double().square().sum()) for n in b) ** 0.5
    den = sum(float(a[n].double().square().sum()) for n in b) ** 0.5
    return num / den if den else num


@pytest.mark.parametrize("stack", [False, True], ids=["per-site", "stacked"])
@pytest.mark.parametrize("name, lrm", zoo.CASES, ids=[f"{n}{'+lrm' if lrm else ''}" for n, lrm in zoo.CASES])
def test_every_sector_matches_the_reference_implementation(name, lrm, stack, monkeypatch):
    """qk, vo (Sylvester; RoPE planes by the closed 2×2 form; LRM + GQA by CG) and the multiplier
    sectors (lrm_internal by CG on the Schur complement) against the old implementation, with the
    sites handled one view at a time (CPU) and stacked along the head axis (CUDA's layout)."""
    monkeypatch.setattr(dense, "STACK_SITES", stack)
    model = zoo.build(name, lrm=lrm).model
    u = H.random_field(model, seed=1)
    for sectors in SECTOR_SETS + (LRM_SETS if lrm else []):
        ref = legacy_projection.vertical(model, u, sectors)
        mine = GaugeProjector(model, sectors=sectors).vertical(u)
        assert set(mine) == set(ref)
        assert _rel(ref, mine) <= 1e-10, (sectors, _rel(ref, mine))
        assert sum(float(t.square().sum()) for t in ref.values()) > 0


@pytest.mark.parametrize("name, lrm", [("gpt_gqa", False), ("hf_llama", True), ("gpt_rope_partial_split_half", False)])
def test_project_and_decompose_agree_with_vertical(name, lrm):
    """project() subtracts in one pass, decompose() also returns coefficients and norms: the same
    vertical part as vertical(), and project(inplace=True) writes it into the given tensors."""
    model = zoo.build(name, lrm=lrm).model
    u = H.random_field(model, seed=2)
    proj = GaugeProjector(model, sectors=("qk", "vo"))
    v = proj.vertical(u)
    dec = proj.decompose(u, norms=True)
    hor = proj.project(u)
    for n in v:
        assert torch.allclose(dec.vertical[n], v[n], rtol=0, atol=1e-14)
        assert torch.allclose(hor[n], u[n] - v[n], rtol=0, atol=1e-14)
    for (sector, unit), (vsq, usq) in dec.norms.items():
        site = next(s for s in gaugeopt.find_attention(model) if s.name == unit)
        pair = site.pair(sector)
        refs = [r for side in pair.sides() for r in (side.weight, side.bias) if r is not None]
        want = sum(float(r.view(dec.vertical[r.name]).square().sum()) for r in refs)
        assert vsq == pytest.approx(want, rel=1e-12)
    w = {n: t.clone() for n, t in u.items()}
    proj.project(w, inplace=True)
    for n in v:
        assert torch.allclose(w[n], hor[n], rtol=0, atol=1e-14)


@torch.no_grad()
def test_lrm_internal_converges_when_the_rows_dominate_the_multipliers():
    """The Schur complement is worst conditioned when ``W̄`` carries the rows' norm and the
    multipliers are small; CG still matches the dense eigendecomposition and least squares."""
    torch.manual_seed(0)
    model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))).double()
    randomize_parameters(model, torch.Generator().manual_seed(3))
    for m in model.modules():
        if isinstance(m, gaugeopt.LRMLinear):
            m.weight.mul_(4.0)
            for r in (*m.row_mults, *m.col_mults):
                r.mul_(0.05)
    u = H.random_field(model, seed=4)
    proj = GaugeProjector(model, sectors=("lrm_internal",))
    mine = proj.vertical(u)
    assert proj.last_info["cg_residual"] <= 1e3 * torch.finfo(torch.float64).eps
    assert _rel(legacy_projection.vertical(model, u, ("lrm_internal",)), mine) <= 1e-10
    for ug in H.unit_generators(H.generator_images(model, "lrm_internal"), model, "lrm_internal"):
        shapes = {n: p.shape for n, p in model.named_parameters()}
        ref, _ = H.ls_vertical(ug.A, H.flatten(model, u, ug.names, shapes)[ug.rows])
        got = H.flatten(model, mine, ug.names, shapes)[ug.rows]
        assert float(((got - ref) ** 2).sum() ** 0.5) <= 1e-9 * float((ref**2).sum() ** 0.5)


def test_joint_projection_splits_off_the_layers_outside_attention():
    """The MLP's LRM layers touch nothing the dense sectors touch, so their generators are
    orthogonal to all others: the joint projection's MLP part is their own projection of the
    field's MLP part (the joint result as a whole is checked against least squares over all
    generators stacked in test_projection.py)."""
    torch.manual_seed(0)
    model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))).double()
    randomize_parameters(model, torch.Generator().manual_seed(0))
    u = H.random_field(model, seed=5)
    proj = GaugeProjector(model, joint_tol=1e-14)
    v = proj.vertical(u)
    mlp = [n for n in v if ".mlp." in n]
    assert mlp
    alone = GaugeProjector(model, sectors=("lrm_internal",)).vertical({n: u[n] for n in mlp})
    assert _rel({n: alone[n] for n in mlp}, {n: v[n] for n in mlp}) <= 1e-12
    assert proj.last_info["joint_residual"] <= 1e-14


# ---------------------------------------------------------------------- approximate mode
def _exact_fraction(model, field, at=None) -> float:
    v = GaugeProjector(model, sectors=("qk", "vo")).vertical(field, at=at)
    return H.norm(v) / H.norm({n: field[n] for n in v})


def _trained(seed: int = 0, steps: int = 150):
    """A small GPT trained on a repeating pattern until its attention is far from initialisation."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=17, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(16) % 5
    for _ in range(steps):
        x = (base[None, :] + torch.randint(0, 12, (8, 1), generator=g)) % 17
        opt.zero_grad()
        model(x, x.roll(-1, 1))[1].backward()
        opt.step()
    return model


def _directions():
    torch.manual_seed(0)
    init = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=64)).double()
    upd, at = adamw_update(init)
    yield "init: AdamW update", init, upd, at
    yield "init: random", init, H.random_field(init, seed=1), None
    trained = _trained()
    upd, at = adamw_update(trained)
    yield "trained: AdamW update", trained, upd, at
    yield "trained: random", trained, H.random_field(trained, seed=2), None


@pytest.mark.parametrize("case", list(range(4)), ids=["init-update", "init-random", "trained-update", "trained-random"])
def test_approx_never_increases_the_vertical_part(case):
    """Each extra CG step leaves at most as much vertical part as the one before, starting below
    the field's own; the reported estimate follows the measured remainder."""
    label, model, field, at = list(_directions())[case]
    before = _exact_fraction(model, field, at)
    assert before > 0.05, label
    left = []
    for k in (1, 2, 4, 8):
        proj = GaugeProjector(model, sectors=("qk", "vo"), mode="approx", approx_iters=k)
        out = proj.project(field, at=at)
        left.append(_exact_fraction(model, out, at) * H.norm({n: out[n] for n in proj.param_names()}) /
                    H.norm({n: field[n] for n in proj.param_names()}))
        est = float(proj.last_info["approx_left_estimate"])
        assert proj.last_info["approx_iterations"] == k
        assert left[-1] < 1e-9 or 0.5 * left[-1] <= est <= 2.0 * left[-1], (label, k, est, left[-1])
    assert left[0] < before, label
    assert all(b <= a * (1 + 1e-9) + 1e-15 for a, b in zip(left, left[1:])), (label, left)
    assert left[-1] < 1e-2 * before, (label, left)


def test_paper000_can_add_vertical_part():
    """Paper 000's Algorithm 2 on an early AdamW update at GPT initialisation leaves *more*
    vertical part than the update had (the failure its docstring quotes); approx removes it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=4, n_embd=64)).double()
    upd, at = adamw_update(model)
    before = _exact_fraction(model, upd, at)
    paper = GaugeProjector(model, sectors=("qk", "vo"), mode="paper000").project(upd, at=at)
    approx = GaugeProjector(model, sectors=("qk", "vo"), mode="approx").project(upd, at=at)
    names = GaugeProjector(model, sectors=("qk", "vo")).param_names()
    scale = H.norm({n: upd[n] for n in names})
    left_paper = _exact_fraction(model, paper, at) * H.norm({n: paper[n] for n in names}) / scale
    left_approx = _exact_fraction(model, approx, at) * H.norm({n: approx[n] for n in names}) / scale
    assert left_paper > 1.1 * before
    assert left_approx < 1e-2 * before


def test_approx_warm_start_is_safe_and_helps():
    """The warm start is the best multiple of the previous coefficients: after a call on an
    unrelated (here: negated-and-shuffled) field the result is still never worse than the field,
    and a repeated field is projected better the second time."""
    label, model, field, at = list(_directions())[2]
    proj = GaugeProjector(model, sectors=("qk", "vo"), mode="approx", approx_iters=1)
    names = proj.param_names()
    scale = H.norm({n: field[n] for n in names})
    before = _exact_fraction(model, field, at)

    def left(out):
        return _exact_fraction(model, out, at) * H.norm({n: out[n] for n in names}) / scale

    cold = left(GaugeProjector(model, sectors=("qk", "vo"), mode="approx", approx_iters=1).project(field, at=at))
    first = left(proj.project(field, at=at))
    second = left(proj.project(field, at=at))
    assert first == pytest.approx(cold, rel=1e-9)
    assert second < 0.7 * first  # the start is the best multiple of the last result: never worse, here much better
    other = H.random_field(model, seed=9)
    proj.project({n: -t for n, t in other.items()}, at=at)  # an unrelated previous call
    after = left(proj.project(field, at=at))
    assert after <= before


def test_mode_names_are_checked_in_one_place():
    from gaugeopt.projection.projector import PROJECTION_MODES, check_mode

    assert PROJECTION_MODES == ("exact", "approx", "paper000")
    model = zoo.build("gpt").model
    for bad in ("fast", "Approx", "algorithm2"):
        with pytest.raises(GaugeError, match="mode"):
            check_mode(bad)
        with pytest.raises(GaugeError, match="mode"):
            GaugeProjector(model, mode=bad)
        with pytest.raises(GaugeError, match="mode"):
            gaugeopt.GaugeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, mode=bad)
    with pytest.raises(GaugeError, match="approx_iters"):
        GaugeProjector(model, mode="approx", approx_iters=0)
