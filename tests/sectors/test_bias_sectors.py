"""The bias sectors (gaugeopt.records.bias_sector): generators built from the definition, exactly flat along
a finite step; the key-bias shift refused under RoPE, where it is measured not to be a symmetry."""

from __future__ import annotations

import pytest
import torch

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.flat.symmetries import attention_families
from gaugeopt.flat.attribution import generator_matrix

CASES = [("gpt", False), ("gpt_rope_partial_split_half", False), ("hf_gpt2", False), ("hf_llama", False), ("gpt", True)]
IDS = [n + ("+lrm" if lrm else "") for n, lrm in CASES]


def _reference_generators(model, kind: str) -> torch.Tensor:
    """The sector's generators written from its definition, in stored coordinates: ``key_bias`` moves one
    entry ``b_K[j, c]`` of a non-rotary channel (``1/r`` under LRM, whose effective bias is ``r ⊙ b̄``);
    ``value_bias`` moves ``b_V[j, c]`` and ``b_O`` by ``−Σ_{i∈j} W_O[:, i, c]`` (effective weights,
    ``/r_O`` on the stored output bias)."""
    params = dict(model.named_parameters())
    cols = []
    for site in gaugeopt.find_attention(model):
        proj = site.k if kind == "key_bias" else site.v
        rotated = {c for p in site.rope.planes(site.d_k) for c in p} if kind == "key_bias" else set()
        width = site.d_k if kind == "key_bias" else site.d_v
        r = None if proj.row_mult is None else proj.row_mult.get().detach()
        wo, _ = site.effective("o")
        r_o = None if site.o.row_mult is None else site.o.row_mult.get().detach()
        for j in range(site.h_kv):
            for c in range(width):
                if c in rotated:
                    continue
                img = {n: torch.zeros_like(p) for n, p in params.items()}
                proj.bias.view(img[proj.bias.name])[j, c] = 1.0 if r is None else 1.0 / r[j, c]
                if kind == "value_bias":
                    heads = [i for i in range(site.h) if i // site.n_rep == j]
                    col = -sum(wo[:, i, c] for i in heads)
                    site.o.bias.view(img[site.o.bias.name]).add_(col if r_o is None else col / r_o)
                cols.append(torch.cat([t.reshape(-1) for t in img.values()]))
    return torch.stack(cols, 1)


@pytest.mark.parametrize("name, lrm", CASES, ids=IDS)
def test_generators_match_the_definition_and_are_exactly_flat(name, lrm):
    case = zoo.build(name, 1, lrm=lrm)
    kinds = sorted({k for s in gaugeopt.find_attention(case.model) for k in s.bias_kinds})
    assert kinds == (["value_bias"] if name == "hf_llama" else ["key_bias", "value_bias"])  # full RoPE: no key bias
    cplx = case.copy().to(torch.complex128)
    fams = [f for s in gaugeopt.find_attention(cplx) for f in attention_families(s)]
    params = dict(case.model.named_parameters())
    ref = case.logits()
    for kind in kinds:
        A = generator_matrix(cplx, [f for f in fams if f.name == kind], dict(cplx.named_parameters()))
        B = _reference_generators(case.model, kind)
        assert A.shape == B.shape and float((A - B).abs().max()) <= 1e-12 * float(B.abs().max())
        worst = 0.0
        for col in (0, A.shape[1] // 2, A.shape[1] - 1):  # a finite step along single generators ...
            worst = max(worst, _step_change(case, params, A[:, col], 0.7, ref))
        combo = A @ torch.randn(A.shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        worst = max(worst, _step_change(case, params, combo, 0.5, ref))  # ... and along a random combination
        print(f"{case.name} {kind}: {A.shape[1]} generators, largest relative logit change along a finite step {worst:.1e}")
        assert worst <= 1e-12


def _step_change(case, params, direction: torch.Tensor, size: float, ref: torch.Tensor) -> float:
    moved = case.copy()
    mp = dict(moved.named_parameters())
    scale = size / float(direction.abs().max())
    off = 0
    with torch.no_grad():
        for n, p in params.items():
            k = p.numel()
            mp[n].add_(scale * direction[off:off + k].view_as(p))
            off += k
    # the attention outputs too: HF Llama rounds its residual stream through float32 in its RMSNorm
    attn = max(gaugeopt.relative_change(a[2], b[2]) for a, b in zip(zoo.attention_io(case, case.model),
                                                                    zoo.attention_io(case, moved)))
    return max(gaugeopt.relative_change(ref, case.logits(moved)), attn)


@pytest.mark.parametrize("name", ["gpt_rope_interleaved", "gpt_rope_partial_split_half"])
def test_key_bias_under_rope_is_refused_and_is_not_a_symmetry(name):
    """Full RoPE: no key-bias sector at all (refused with the reason). Partial RoPE: the sector is the
    non-rotary channels only. On the rotated channels the same shift changes the logits: measured."""
    case = zoo.build(name, 1)
    site = gaugeopt.find_attention(case.model)[0]
    if site.rope.rotary_dim == site.d_k:
        assert "key_bias" not in site.bias_kinds
        with pytest.raises(GaugeError, match="RoPE rotates every channel"):
            site.bias_sector("key_bias")
        with pytest.raises(GaugeError, match="kind 'key_bias' does not apply.*RoPE rotates"):
            gaugeopt.random_gauge_transform(case.copy(), ("key_bias",))
    else:
        assert site.bias_sector("key_bias").channels == tuple(range(site.rope.rotary_dim, site.d_k))
        exact = gaugeopt.random_gauge_transform(case.copy(), ("key_bias",), generator=torch.Generator().manual_seed(0))
        assert gaugeopt.relative_change(case.logits(), case.logits(exact)) <= 1e-12
    changes = [gaugeopt.relative_change(case.logits(), case.logits(
        gaugeopt.invalid_gauge_transform(case.copy(), "key_bias_rope", generator=torch.Generator().manual_seed(s))))
        for s in range(3)]
    print(f"{name}: the key-bias shift on RoPE-rotated channels changes the logits by {min(changes):.3f}–{max(changes):.3f}")
    assert min(changes) > 1e-3


def _as_field(model, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    for n, p in model.named_parameters():
        out[n] = flat[off:off + p.numel()].view_as(p).clone()
        off += p.numel()
    return out


@pytest.mark.parametrize("name, lrm", CASES, ids=IDS)
def test_projector_removes_the_bias_sectors(name, lrm):
    """GaugeProjector("all") has the bias sectors ("auto" has the key-bias shift, not the value-bias trade):
    each generator (complex step of the finite action) is
    vertical to 1e-9, alone and jointly with the overlapping head gauges; the joint projection equals least
    squares against every generator stacked; a direction off the sector (b_K on a rotated channel) is not."""
    import numpy as np
    import projection_helpers as H
    from gaugeopt.projection.projector import GaugeProjector

    case = zoo.build(name, 2, lrm=lrm)
    model = case.model
    proj = GaugeProjector(model, "all", joint_tol=1e-14)
    kinds = sorted({k for s in gaugeopt.find_attention(model) for k in s.bias_kinds})
    assert set(kinds) <= set(proj.sectors)
    auto = GaugeProjector(model).sectors
    assert "value_bias" not in auto and ("key_bias" in auto) == ("key_bias" in kinds)
    worst = 1.0
    for kind in kinds:
        imgs = [img for _, img in H.generator_images(model, kind)]
        mine = [img for _, img in proj.basis(sectors=(kind,))]  # the projector's own generators, same order
        A, B = (np.stack([H.flatten(model, i) for i in x], 1) for x in (imgs, mine))
        assert A.shape == B.shape and np.abs(A - B).max() <= 1e-12 * np.abs(A).max()
        for img in imgs[:: max(1, len(imgs) // 4)]:
            alone = gaugeopt.vertical_fraction(model, img, sectors=(kind,))
            joint = gaugeopt.vertical_fraction(model, img, projector=proj)
            worst = min(worst, alone, joint)
    print(f"{case.name}: {', '.join(kinds)}: smallest vertical fraction of a generator {worst:.15f}")
    assert worst >= 1 - 1e-9
    site = gaugeopt.find_attention(model)[0]
    u = H.random_field(model, seed=4)
    dec = proj.decompose(u)
    assert dec.info["joint_iterations"] >= 1 and dec.info["joint_residual"] <= 1e-14
    if not lrm:  # layers are independent without LRM: least squares over layer 0's generators, on its entries
        names = site.parameter_names()  # (the LRM model's joint projection: tests/projection/test_projection.py)
        A = np.stack([H.flatten(model, img, names) for s in proj.sectors
                      for _, img in H.generator_images(model, s, prefix=site.name)], 1)
        ref, _ = H.ls_vertical(A, H.flatten(model, u, names))
        mine = H.flatten(model, dec.vertical, names)
        assert np.linalg.norm(mine - ref) <= 1e-9 * np.linalg.norm(ref)
        fast = H.flatten(model, proj.vertical(u), names)  # {qk, key_bias} in closed form (no coefficients asked)
        assert np.linalg.norm(fast - ref) <= 1e-9 * np.linalg.norm(ref)
    rotated = sorted(c for p in site.rope.planes(site.d_k) for c in p)
    if rotated and site.k.bias is not None:  # the key-bias shift on a rotated channel is not a gauge direction
        w = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        site.k.bias.view(w[site.k.bias.name])[0, rotated[0]] = 1.0
        off = gaugeopt.vertical_fraction(model, w, projector=proj)
        print(f"  b_K on rotated channel {rotated[0]}: vertical fraction {off:.3f}")
        assert off < 0.5


def test_key_bias_sector_is_refused_under_full_rope():
    from gaugeopt.projection.projector import GaugeProjector

    case = zoo.build("gpt_rope_interleaved", 1)
    assert "key_bias" not in GaugeProjector(case.model).sectors
    with pytest.raises(GaugeError, match="'key_bias'.*not present.*key bias on channels RoPE does not rotate"):
        GaugeProjector(case.model, sectors=("key_bias",))


def test_gauge_projected_steps_have_no_bias_sector_part():
    """The update GaugeOptimizer(sectors="all") applies has no vertical part in the bias sectors (an
    unprojected AdamW step has some); the function-changing part of the step is what remains. The share
    of the step in them is what "auto" gives up by leaving the value-bias trade out."""
    case = zoo.build("gpt", 3)
    model = case.model
    x = case.inputs

    def update(wrap: bool) -> dict[str, torch.Tensor]:
        m = case.copy()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        if wrap:
            opt = gaugeopt.GaugeOptimizer(opt, m, sectors="all")
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        _, loss = m(x, x)
        loss.backward()
        opt.step()
        return {n: p.detach() - before[n] for n, p in m.named_parameters()}

    for wrap, test in ((False, lambda f: f > 1e-3), (True, lambda f: f <= 1e-10)):
        step = update(wrap)
        fracs = {k: gaugeopt.vertical_fraction(model, step, sectors=(k,)) for k in ("key_bias", "value_bias")}
        print(f"GaugeOptimizer={wrap}: bias-sector vertical fractions of the step {fracs}")
        assert all(test(f) for f in fracs.values()), fracs
