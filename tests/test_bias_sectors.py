"""The bias sectors (gaugeopt.structure.bias): generators built from the definition, exactly flat along
a finite step; the key-bias shift refused under RoPE, where it is measured not to be a symmetry."""

from __future__ import annotations

import pytest
import torch

import gaugeopt
import zoo
from gaugeopt import GaugeError
from gaugeopt.structure.symmetries import attention_families
from gaugeopt.tools.attribution import generator_matrix

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
