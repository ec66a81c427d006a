"""Helpers for the kernel tests: odd-shaped models, a trained optimizer state, and the
comparison of two GaugeFix runs (parameters, every optimizer state entry, the report).

Tolerances (relative, per dtype), with their reasons:

* float64: 1e-12 — both paths do the same float64 arithmetic in a different summation order
  (tile sums vs torch reductions); measured differences are ~4e-16.
* float32: 2e-6 — the same in float32 (measured ≤ 3e-7); division and square root are
  IEEE-rounded on both sides, ``log`` differs by an ulp.
* bfloat16 / float16 (GPU only): one storage ulp (2**-7 / 2**-10 relative) — the kernel rounds
  ``p·f`` once, the torch core rounds ``f`` to the parameter dtype before the product.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

import gaugeopt
from gaugeopt.models import GPT, GPTConfig

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=2e-6, atol=1e-6),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-3),
    torch.float16: dict(rtol=2**-10, atol=1e-4),
}


def odd_gpt(*, lrm: bool, dtype: torch.dtype = torch.float64, seed: int = 0, rope: str = "split_half",
            rotary_dim: int | None = 6, bias: bool = True) -> torch.nn.Module:
    """6 query heads in 2 KV groups (n_rep = 3), d_k = 10 (not a power of two), d = 37 (odd),
    by default partial split-half RoPE over 6 of the 10 channels (3 planes + 4 single-channel
    slots); ``rotary_dim=None`` rotates all 10 (5 planes)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=29, block_size=16, n_layer=2, n_head=6, n_kv_head=2, head_dim=10, n_embd=37,
                    rope=rope, rotary_dim=rotary_dim if rope != "none" else None, bias=bias)
    model = GPT(cfg)
    if lrm:
        gaugeopt.apply_lrm(model)
    model = model.to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # generic values, multipliers away from 1 so that every head drifts
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return model


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2, seed: int = 0) -> None:
    """A few optimizer steps on a synthetic loss, so every parameter has state."""
    g = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    for _ in range(steps):
        loss = sum((p * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p)).sum() ** 2 for p in params)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def twin(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """A deep copy of ``model`` and an optimizer of the same class holding the same state."""
    m2 = copy.deepcopy(model)
    o2 = type(optimizer)(m2.parameters(), lr=optimizer.defaults["lr"])
    # deep copy: load_state_dict keeps the very same state tensors when dtype and device match
    o2.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for p1, p2 in zip(model.parameters(), m2.parameters()):
        for key, v in o2.state.get(p2, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                assert v.data_ptr() != optimizer.state[p1][key].data_ptr(), "twin shares optimizer state"
    return m2, o2


def assert_same_fix(m1, o1, r1, m2, o2, r2, dtype: torch.dtype) -> None:
    """Parameters, every tensor state entry and the report of two fixes agree within :data:`TOL`."""
    tol = TOL[dtype]
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert n1 == n2
        torch.testing.assert_close(p2, p1, **tol, msg=lambda m: f"parameter {n1}: {m}")
        if o1 is not None:
            s1, s2 = o1.state.get(p1, {}), o2.state.get(p2, {})
            assert sorted(s1) == sorted(s2), n1
            for key in s1:
                if torch.is_tensor(s1[key]) and s1[key].dim() > 0:
                    torch.testing.assert_close(s2[key], s1[key], **tol, msg=lambda m: f"state {key} of {n1}: {m}")
                else:  # step counters and the like: untouched by both
                    assert float(s2[key]) == float(s1[key]), (n1, key)
    assert_same_report(r1, r2, dtype)


def assert_same_report(r1, r2, dtype: torch.dtype) -> None:
    """Every field of two reports agrees: lists and integers exactly, tensors within :data:`TOL`
    (the ``backend`` field names which implementation ran and may differ)."""
    for f in dataclasses.fields(r1):
        if f.name not in ("pairs", "backend"):
            assert getattr(r1, f.name) == getattr(r2, f.name), f.name
    assert r1.heads_fixed == r2.heads_fixed
    assert len(r1.pairs) == len(r2.pairs)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for a, b in zip(r1.pairs, r2.pairs):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if torch.is_tensor(x) and x.dtype == torch.bool:  # which groups changed: exactly the same
                assert torch.equal(x.cpu(), y.cpu()), (a.name, a.kind, f.name, x, y)
            elif torch.is_tensor(x):
                assert x.shape == y.shape and y.dtype == acc, (f.name, x.shape, y.shape, y.dtype)
                torch.testing.assert_close(y.cpu(), x.cpu(), **TOL[acc], msg=lambda m: f"{a.name} {a.kind} {f.name}: {m}")
            else:
                assert x == y, (a.name, a.kind, f.name, x, y)


def fix_reference(model, optimizer=None, **kw):
    """The torch backend of :func:`gaugeopt.gauge_fix` (what the kernel must reproduce)."""
    return gaugeopt.gauge_fix(model, optimizer, backend="torch", **kw)


def vertical_with(model, u, sector: str, backend: str = "torch"):
    """``GaugeProjector(model, sectors=(sector,), backend=backend).vertical(u)``."""
    return gaugeopt.GaugeProjector(model, sectors=(sector,), backend=backend).vertical(u)


def project_with(model, u, sector: str, backend: str = "torch", inplace: bool = False):
    """``GaugeProjector(model, sectors=(sector,), backend=backend).project(u, inplace=inplace)``."""
    return gaugeopt.GaugeProjector(model, sectors=(sector,), backend=backend).project(u, inplace=inplace)


def random_field(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """``{name: u}`` with standard normal entries in each parameter's dtype."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) for n, p in model.named_parameters()}


def assert_same_fields(ref: dict, got: dict, dtype: torch.dtype, what: str = "") -> None:
    """Same keys, dtypes and values within :data:`TOL` relative to each tensor's largest entry."""
    assert sorted(ref) == sorted(got), (sorted(ref), sorted(got))
    for n in ref:
        assert got[n].dtype == ref[n].dtype, (n, got[n].dtype, ref[n].dtype)
        scale = float(ref[n].abs().max())
        tol = TOL[dtype]
        torch.testing.assert_close(got[n], ref[n], rtol=tol["rtol"], atol=tol["rtol"] * scale + tol["atol"] * 1e-3,
                                   msg=lambda m: f"{what} {n}: {m}")
