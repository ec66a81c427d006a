"""Diagnostics: vertical fractions (paper 004 Alg. 1/3, paper 000 Prop. 38), Fisher–Rao split, holonomy."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import gaugeopt
import projection_helpers as H
import zoo
from gaugeopt import GaugeError
from gaugeopt.projection.diagnostics import fisher_rao_split, holonomy, vertical_fraction, vertical_report
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.projection.projector import GaugeProjector
from gaugeopt.records.rope import RopeSpec
from gaugeopt.records.site import ProjectionRefs
from gaugeopt.trust.invariance import randomize_parameters


def _invariant_grad(case) -> dict[str, torch.Tensor]:
    """Gradient of a gauge-invariant loss (any function of the logits)."""
    model = case.model
    model.zero_grad()
    out = case.forward(model)
    (out.sin().sum() + out.square().mean()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _gauge_part_fraction(proj: GaugeProjector, grads) -> float:
    """‖u_vert‖ / ‖u restricted to the gauge parameters‖ (stricter than the fraction of all of u)."""
    dec = proj.decompose(grads)
    return H.norm(dec.vertical) / H.norm({n: grads[n] for n in proj.param_names() if n in grads})


@pytest.mark.parametrize("name, lrm", zoo.CASES, ids=zoo.CASE_IDS)
def test_gradient_of_invariant_loss_is_horizontal(name, lrm):
    """Paper 000 Prop. 38 on every adapter kind, all sectors jointly (float64)."""
    case = zoo.build(name, lrm=lrm)
    grads = _invariant_grad(case)
    assert vertical_fraction(case.model, grads) <= 1e-10
    proj = GaugeProjector(case.model)
    assert _gauge_part_fraction(proj, grads) <= 1e-10
    # the same field plus a generator is not horizontal (the fraction sees vertical parts)
    gen = next(proj.basis(sectors=("qk",)))[1]
    bumped = {n: grads[n] + (1e-2 * H.norm(grads) / H.norm(gen)) * gen[n] if n in gen else grads[n] for n in grads}
    assert vertical_fraction(case.model, bumped, projector=proj) > 1e-3


def _swap_rope(site):
    other = "split_half" if site.rope.kind == "interleaved" else "interleaved"
    return dataclasses.replace(site, rope=RopeSpec(other, site.rope.rotary_dim))


def _drop_biases(site):
    strip = lambda p: ProjectionRefs(p.weight, None, p.row_mult, p.col_mult)  # noqa: E731
    return dataclasses.replace(site, q=strip(site.q), k=strip(site.k), v=strip(site.v))


def _drop_multipliers(site):
    strip = lambda p: ProjectionRefs(p.weight, p.bias, None, None)  # noqa: E731
    return dataclasses.replace(site, q=strip(site.q), k=strip(site.k), v=strip(site.v), o=strip(site.o))


@pytest.mark.parametrize(
    "name, lrm, wrong, sector",
    [
        ("gpt_rope_interleaved", False, _swap_rope, "qk"),
        ("gpt_rope_partial_split_half", False, _swap_rope, "qk"),
        ("hf_llama", False, _swap_rope, "qk"),
        ("gpt", False, _drop_biases, "qk"),
        ("hf_qwen2", False, _drop_biases, "vo"),
        ("gpt", True, _drop_multipliers, "qk"),
        ("hf_llama", True, _drop_multipliers, "vo"),
    ],
    ids=["rope-interleaved", "rope-partial-split", "llama-rope", "gpt-biases", "qwen2-v-bias", "lrm-twist-qk", "lrm-twist-vo"],
)
def test_wrong_generator_sets_see_a_vertical_gradient(name, lrm, wrong, sector):
    """Negative controls for Prop. 38: the wrong RoPE pairing, generators that forget the biases, or
    effective-weight generators applied to W̄ (ignoring the multipliers) are not symmetries, and
    the gradient has a large component along them."""
    case = zoo.build(name, lrm=lrm)
    grads = _invariant_grad(case)
    sites = gaugeopt.find_attention(case.model)
    right = GaugeProjector(case.model, sectors=(sector,), sites=sites)
    wrong_sites = [wrong(s) for s in sites]
    with pytest.raises(gaugeopt.GaugeError, match="certify"):  # the gate proves records: these fail
        GaugeProjector(case.model, sectors=(sector,), sites=wrong_sites)
    gaugeopt.assume_certified(case.model, sites=wrong_sites)  # past the gate, on purpose
    with pytest.warns(RuntimeWarning, match="assumed, not proved"):
        bad = GaugeProjector(case.model, sectors=(sector,), sites=wrong_sites)
    assert _gauge_part_fraction(right, grads) <= 1e-10
    assert _gauge_part_fraction(bad, grads) > 1e-3


def test_vertical_report_is_consistent():
    case = zoo.build("gpt_gqa")
    model = case.model
    site = gaugeopt.find_attention(model)[0]
    u = H.random_field(model, seed=2)
    heads = ("qk", "vo")  # disjoint supports (the bias sectors overlap them: tested apart below)
    rep = vertical_report(model, u, sectors=heads)
    dec = GaugeProjector(model, sectors=heads).decompose(u)
    assert rep.total == pytest.approx(H.norm(dec.vertical) / H.norm(u), rel=1e-12)
    assert rep.total**2 + rep.horizontal**2 == pytest.approx(1.0, rel=1e-12)
    assert rep.sectors["qk"] ** 2 + rep.sectors["vo"] ** 2 == pytest.approx(rep.total**2, rel=1e-10)
    full = vertical_report(model, u, sectors="all")  # with the bias sectors: more vertical part, still exact
    assert set(full.sectors) == {"qk", "vo", "key_bias", "value_bias"} and full.total > rep.total
    assert full.total**2 + full.horizontal**2 == pytest.approx(1.0, rel=1e-12) and full.defect <= 1e-13
    assert rep.defect <= 1e-13
    names = site.parameter_names()
    assert rep.layers[site.name] == pytest.approx(
        H.norm({n: dec.vertical[n] for n in names if n in dec.vertical}) / H.norm({n: u[n] for n in names}), rel=1e-12
    )
    # a field living on layer 0's Q/K entries only: the unit fraction is the sector fraction
    w = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for ref in (site.q.weight, site.q.bias, site.k.weight, site.k.bias):
        view = ref.view(w[ref.name])
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(3), dtype=view.dtype))
    r2 = vertical_report(model, w, sectors=heads)
    assert r2.units[("qk", site.name)] == pytest.approx(r2.sectors["qk"], rel=1e-12)
    assert r2.sectors["vo"] == 0.0 and r2.units[("qk", gaugeopt.find_attention(model)[1].name)] == 0.0
    # paper000 mode: what Algorithm 2 leaves behind is the defect
    ra = vertical_report(model, u, mode="paper000", sectors=heads)
    assert ra.defect > 1e-2 and abs(ra.total - rep.total) > 1e-3
    # approx mode (truncated CG): it leaves less than it found, and less than Algorithm 2
    rc = vertical_report(model, u, mode="approx", sectors=heads)
    assert rc.defect < 1e-2 * rep.total and rc.defect < ra.defect
    with pytest.raises(GaugeError, match="zero"):
        vertical_report(model, {n: torch.zeros_like(t) for n, t in u.items()})


def _tiny(lrm=False, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    model = GPT(GPTConfig(**{**cfg, **kw}))
    if lrm:
        gaugeopt.apply_lrm(model)
    model = model.double()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    return model


def test_fisher_rao_split_with_identity_metric_is_the_euclidean_projection():
    model = _tiny(lrm=True)
    u = H.random_field(model, seed=4)
    fr = fisher_rao_split(model, u, lambda v: v)
    dec = GaugeProjector(model, joint_tol=1e-15).decompose(u)
    diff = {n: fr.vertical[n] - dec.vertical.get(n, torch.zeros_like(fr.vertical[n])) for n in fr.vertical}
    assert H.norm(diff) <= 1e-9 * H.norm(dec.vertical)
    assert fr.fraction == pytest.approx(vertical_fraction(model, u, joint_tol=1e-15), rel=1e-9)
    assert fr.residual <= 1e-10


def test_fisher_rao_split_with_an_spd_metric_matches_weighted_least_squares():
    """Against generators built independently (complex step through gaugeopt.transforms)."""
    model = _tiny(rope="interleaved", n_kv_head=1, n_head=2)
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: p.shape for n, p in model.named_parameters()}
    D = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(5)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    M = Q @ torch.diag(torch.exp(torch.randn(D, generator=g, dtype=torch.float64))) @ Q.mT
    u = H.random_field(model, seed=6)
    fr = fisher_rao_split(model, u, lambda v: M @ v, sectors="all")
    sectors = GaugeProjector(model, "all").sectors  # the head gauges and the value-bias trade
    assert "value_bias" in sectors
    A = np.stack([H.flatten(model, img, names, shapes) for s in sectors for _, img in H.generator_images(model, s)], 1)
    L = np.linalg.cholesky(M.numpy())
    uf = H.flatten(model, u, names, shapes)
    c = np.linalg.lstsq(L.T @ A, L.T @ uf, rcond=None)[0]
    ref = A @ c
    mine = H.flatten(model, fr.vertical, names, shapes)
    assert np.linalg.norm(mine - ref) <= 1e-8 * np.linalg.norm(ref)
    assert np.abs(A.T @ M.numpy() @ (uf - mine)).max() <= 1e-9 * np.linalg.norm(uf) * np.abs(M.numpy() @ A).max()
    assert fr.fraction == pytest.approx(math.sqrt(ref @ M.numpy() @ ref / (uf @ M.numpy() @ uf)), rel=1e-8)


def test_true_fisher_is_degenerate_on_gauge_directions():
    """The caveat of the docstring, checked: F = JᵀJ (J = ∂logits/∂θ) annihilates every generator."""
    model = _tiny()
    x = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(0))
    params = dict(model.named_parameters())
    names = list(params)

    def logits(*flat):
        out = torch.func.functional_call(model, dict(zip(names, flat)), (x,))
        return out[0].reshape(-1)

    J = torch.cat([j.reshape(j.shape[0], -1) for j in torch.autograd.functional.jacobian(logits, tuple(params.values()))], 1)
    proj = GaugeProjector(model)
    for _, img in list(proj.basis())[:: 7]:
        v = torch.cat([img.get(n, torch.zeros_like(p)).reshape(-1) for n, p in params.items()])
        assert float((J @ v).norm()) <= 1e-12 * float(J.norm() * v.norm())


def test_fisher_rao_split_refuses_large_bases():
    model = _tiny()
    with pytest.raises(GaugeError, match="max_generators"):
        fisher_rao_split(model, H.random_field(model), lambda v: v, max_generators=10)


def _fd_curvature(model, u, v, h=1e-4) -> float:
    """‖vertical part of [X_u, X_v]‖ in Lie-algebra coordinates, by central differences of the
    projector at nearby points (independent of the loop integrator)."""
    proj = GaugeProjector(model)
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}

    def X(w, at):
        hor = proj.decompose(w, at=at).horizontal
        return {n: hor.get(n, w[n]) for n in w}

    def unit(d):
        s = H.norm(d)
        return {n: t / s for n, t in d.items()}

    full = lambda d: {n: d.get(n, torch.zeros_like(t)) for n, t in theta.items()}  # noqa: E731
    hu = unit(X(full(u), theta))
    hv = X(full(v), theta)
    c = sum(float((hv[n] * hu[n]).sum()) for n in hu)
    hv = unit({n: hv[n] - c * hu[n] for n in hv})
    shift = lambda d, s: {n: theta[n] + s * d[n] for n in theta}  # noqa: E731
    dv_u = {n: (a - b) / (2 * h) for (n, a), b in zip(X(hv, shift(hu, h)).items(), X(hv, shift(hu, -h)).values())}
    du_v = {n: (a - b) / (2 * h) for (n, a), b in zip(X(hu, shift(hv, h)).items(), X(hu, shift(hv, -h)).values())}
    bracket = {n: dv_u[n] - du_v[n] for n in dv_u}
    coeffs = proj.decompose(bracket, at=theta).coefficients
    return math.sqrt(sum(float(t.square().sum()) for t in coeffs.values()))


def test_holonomy_small_loop_scaling_and_curvature():
    """Algorithm 4: ‖Δ(δ)‖ scales as δ², the Richardson estimate matches the curvature of the
    connection computed locally by finite differences, and the symmetric loop converges faster."""
    model = _tiny(n_head=2)
    g = torch.Generator().manual_seed(1)
    u = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters() if ".attn." in n}
    v = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters() if ".attn." in n}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    est = holonomy(model, u, v, eps=0.1)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # not modified
    assert est.delta_eps / est.delta_half == pytest.approx(4.0, rel=2e-3)
    curv = _fd_curvature(model, u, v)
    assert curv > 1e-3  # attention directions: the connection is curved (paper 004 Theorem 10)
    assert est.estimate == pytest.approx(curv, rel=1e-5)
    assert est.error <= 1e-3 * est.estimate
    single = holonomy(model, u, v, eps=0.1, symmetric=False)
    assert abs(single.estimate - curv) > abs(est.estimate - curv)
    assert single.estimate == pytest.approx(curv, rel=1e-2)


def test_holonomy_vanishes_in_flat_directions():
    """FFN directions are horizontal everywhere and untouched by the projector: the loop closes."""
    model = _tiny()
    g = torch.Generator().manual_seed(2)
    u = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters() if ".mlp." in n}
    v = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters() if ".mlp." in n}
    est = holonomy(model, u, v, eps=0.1)
    assert est.delta_eps <= 1e-14 and est.estimate <= 1e-10
    with pytest.raises(GaugeError, match="no horizontal part"):
        gen = next(GaugeProjector(model).basis(sectors=("vo",)))[1]
        holonomy(model, gen, v)
