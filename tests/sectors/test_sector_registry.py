"""The sector registry: a sector added in one module (tests/support/toy_sector.py) reaches every reader — the random
transforms, the certificate, the projector, the flat-direction families, the counts — with nothing else in
gaugeopt changed; a wrong one is refused by the certificate, and proofs made before it was registered are not
reused. The projection of the toy sector is checked in float64 against least squares on generators built by
finite differences of its action (an independent construction)."""

from __future__ import annotations

import copy

import pytest
import torch

import gaugeopt
import toy_sector
from gaugeopt import GaugeError
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.projection import joint, projector
from gaugeopt import sectors, transforms as actions
from gaugeopt.trust.invariance import randomize_parameters
from gaugeopt.flat.symmetries import symmetry_families

CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, rope="split_half")


@pytest.fixture
def toy():
    sec = toy_sector.register_toy()
    yield sec
    sectors.unregister(sec.name)


@pytest.fixture
def wrong():
    sec = toy_sector.register_toy(sign=+1, name="qk_scalar_wrong")
    yield sec
    sectors.unregister(sec.name)


def _model(seed: int = 0) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG)).double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    return model, torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_builtin_lists_are_derived_and_unchanged():
    """The lists modules held as literals before the registry, derived from it now, are the same (so a seed, a
    projection and a count give what they gave)."""
    assert tuple(s.name for s in sectors.sectors()) == (
        "qk", "vo", "perm", "lrm_qk", "lrm_vo", "lrm_internal", "qk_gain", "key_bias", "value_bias", "qk_rope",
        "latent_rotation", "latent_gain")
    assert projector.SECTORS == gaugeopt.projection.SECTORS == (
        "qk", "vo", "lrm_qk", "lrm_vo", "lrm_internal", "qk_gain", "key_bias", "value_bias", "qk_rope")
    assert projector.OPT_IN == ("value_bias",)
    assert joint.FAMILIES == (("qk", "vo", "lrm_qk", "lrm_vo", "qk_gain", "qk_rope"), ("key_bias", "value_bias"),
                              ("lrm_internal",))
    assert joint.OVERLAPPING == ("lrm_internal",) and joint.REDUNDANT == {"lrm_qk": "qk", "lrm_vo": "vo"}
    assert joint.components(("qk", "vo", "key_bias")) == [[["vo"]], [["qk"], ["key_bias"]]]
    assert joint.components(("qk_gain", "lrm_internal")) == [[["qk_gain"]], [["lrm_internal"]]]  # gains: no LRM tensor


def test_every_reader_sees_a_registered_sector_and_forgets_it_after(toy):
    model, _ = _model()
    assert "qk_scalar" in actions.VALID_KINDS
    assert "qk_scalar" in projector.SECTORS and "qk_scalar" in gaugeopt.projection.SECTORS
    assert "qk_scalar" not in projector.OPT_IN
    assert any("qk_scalar" in fam for fam in joint.FAMILIES)
    # it moves q/k weights and biases: projected jointly with qk and key_bias, never with vo
    assert joint.components(("qk_scalar", "vo")) == [[["qk_scalar"]], [["vo"]]]
    assert joint.components(("qk_scalar", "qk", "key_bias")) == [[["qk"], ["key_bias"], ["qk_scalar"]]]
    assert joint.FAMILIES[-2:] == (("qk_scalar",), ("lrm_internal",))  # its own family, before the overlapping one
    fams, _ = symmetry_families(model)
    assert [f.unit for f in fams if f.name == "qk_scalar"] == [s.name for s in gaugeopt.find_attention(model)]
    counts = gaugeopt.gauge_dimension(model, "complete", per_symmetry=True)
    assert counts["qk_scalar"] == CFG["n_layer"] * CFG["n_kv_head"]
    sectors.unregister("qk_scalar")
    try:
        assert "qk_scalar" not in actions.VALID_KINDS and "qk_scalar" not in projector.SECTORS
        assert not any("qk_scalar" in fam for fam in joint.FAMILIES)
        assert "qk_scalar" not in gaugeopt.gauge_dimension(model, "complete", per_symmetry=True)
        assert not [f for f in symmetry_families(model)[0] if f.name == "qk_scalar"]
    finally:
        sectors.register(toy)


def test_random_transform_of_the_toy_kind_keeps_the_function_and_moves_the_weights(toy):
    model, x = _model()
    moved = copy.deepcopy(model)
    gaugeopt.random_gauge_transform(moved, kinds=("qk_scalar",), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _rel(moved(x)[0], model(x)[0]) <= 1e-12
    w0, w1 = model.transformer.h[0].attn.c_attn.weight, moved.transformer.h[0].attn.c_attn.weight
    assert _rel(w1, w0) > 1e-2  # it did act (the queries' and keys' rows were rescaled)
    with pytest.raises(GaugeError, match="qk_scalar"):  # a record that lacks it says so
        gaugeopt.random_gauge_transform(gaugeopt.apply_lrm(copy.deepcopy(model)), kinds=("qk_scalar",))


def test_the_certificate_claims_and_checks_the_toy_sector(toy):
    model, x = _model()
    report = gaugeopt.certify(model, x)
    for layer in report.layers:
        check = layer.sectors["qk_scalar"]
        assert check.valid <= 1e-12 and check.control >= 1e-3


def test_a_wrong_sector_is_refused_by_the_certificate(wrong):
    model, x = _model()
    with pytest.raises(GaugeError, match="qk_scalar_wrong"):
        gaugeopt.certify(model, x)


def test_a_proof_made_before_a_sector_was_registered_is_not_reused():
    model, x = _model()
    gaugeopt.certify(model, x)
    fixer = gaugeopt.GaugeFixer(model)  # a long-lived gate, built and proved before the registration
    fixer()
    gaugeopt.gauge_fix(model)
    bad = toy_sector.register_toy(sign=+1, name="qk_scalar_wrong")
    try:
        with pytest.raises(GaugeError, match="qk_scalar_wrong"):
            gaugeopt.gauge_fix(model)  # the stamp is of the old registry: proved again, and the new sector fails
        with pytest.raises(GaugeError, match="qk_scalar_wrong"):
            fixer()  # its snapshot sees the registry change and re-proves before writing
    finally:
        sectors.unregister(bad.name)
    gaugeopt.gauge_fix(model)  # control: with the registry as it was, the model passes again
    fixer()


def _generators(model: GPT, eps: float = 1e-6) -> torch.Tensor:
    """Columns: the tangent of each KV group's scalar in each layer, by central differences of the action
    (``a_j = e^{±ε}``) over every parameter entry — built without the solver."""
    cols = []
    for li in range(CFG["n_layer"]):
        for j in range(CFG["n_kv_head"]):
            ends = []
            for e in (eps, -eps):
                m = copy.deepcopy(model)
                site = gaugeopt.find_attention(m)[li]
                a = torch.ones(site.h_kv, dtype=torch.float64)
                a[j] = torch.exp(torch.tensor(e, dtype=torch.float64))
                toy_sector._scale(site, a, -1)
                ends.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
            cols.append((ends[0] - ends[1]) / (2 * eps))
    return torch.stack(cols, 1)


def test_the_projector_removes_the_toy_sector_exactly(toy):
    model, _ = _model()
    proj = gaugeopt.GaugeProjector(model, sectors=("qk_scalar",))
    assert proj.sectors == ("qk_scalar",)
    g = torch.Generator().manual_seed(3)
    names = [n for n, _ in model.named_parameters()]
    u = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters()}
    hor = proj.project(u)
    flat_u = torch.cat([u[n].flatten() for n in names])
    flat_h = torch.cat([hor[n].flatten() for n in names])
    G = _generators(model)
    coef = torch.linalg.lstsq(G, flat_u[:, None]).solution
    expected = flat_u - (G @ coef)[:, 0]
    assert _rel(flat_h, expected) <= 1e-8
    assert float((G.T @ flat_h).abs().max() / (G.norm(dim=0).max() * flat_h.norm())) <= 1e-8  # orthogonal to the span
    again = proj.project(hor)
    assert _rel(torch.cat([again[n].flatten() for n in names]), flat_h) <= 1e-12  # idempotent
    # negative control: the generators of the wrong variant (queries and keys both scaled) span another space
    Gw = G.clone()
    wrong_sign = torch.zeros(G.shape[0], dtype=torch.bool)
    offset = 0
    for n, p in model.named_parameters():
        if "c_attn" in n:
            rows = torch.arange(p.numel()).reshape(p.shape)[CFG["n_embd"]: CFG["n_embd"] + CFG["n_kv_head"] * 4].flatten()
            wrong_sign[offset + rows] = True
        offset += p.numel()
    Gw[wrong_sign] *= -1
    coef_w = torch.linalg.lstsq(Gw, flat_u[:, None]).solution
    assert _rel(flat_h, flat_u - (Gw @ coef_w)[:, 0]) > 1e-3
