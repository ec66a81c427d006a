"""Independent references for the GaugeFix tests.

Scales are recomputed here from the canonical views with plain Python loops over KV groups
and slots (planes listed from ``RopeSpec.planes``), not through gaugeopt.fix.plan's batched
one-hot reductions, so that a layout or grouping bug in the library cannot hide in both.
"""

from __future__ import annotations

import math

import torch

import gaugeopt
from gaugeopt.records.site import AttentionSite


def side_rows(site: AttentionSite, proj: str, mode: str) -> torch.Tensor:
    """``(heads, width, L)``: the entries whose RMS is a channel's scale.

    lrm: the multiplier itself (``L = 1``); plain: the augmented row ``[W[c, :] | b[c]]`` of
    Q/K/V, or the column ``W_O[:, i, c]`` of O.
    """
    p = getattr(site, proj)
    with torch.no_grad():
        if mode == "lrm":
            m = p.col_mult if proj == "o" else p.row_mult
            return m.get().detach().double()[..., None].clone()
        if proj == "o":
            return p.weight.get().detach().double().permute(1, 2, 0).clone()  # (d, h, d_v) -> (h, d_v, d)
        w = p.weight.get().detach().double()
        if p.bias is not None:
            w = torch.cat([w, p.bias.get().detach().double()[..., None]], dim=-1)
        return w.clone()


def slots(site: AttentionSite, kind: str, granularity: str) -> list[list[int]]:
    width = site.d_k if kind == "qk" else site.d_v
    if granularity == "head":
        return [list(range(width))]
    if granularity == "channel":
        return [[c] for c in range(width)]
    assert granularity == "plane"
    planes = [list(pq) for pq in site.rope.planes(width)]
    return planes + [[c] for c in range(site.rope.rotary_dim, width)]


def reference_scales(site: AttentionSite, kind: str, granularity: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s_a, s_b)``, each ``(h_kv, n_slots)``: RMS over the group's heads and the slot's channels."""
    a, b = ("q", "k") if kind == "qk" else ("v", "o")
    out = []
    for proj in (a, b):
        rows = side_rows(site, proj, mode)
        heads = rows.shape[0]
        per_group = heads // site.h_kv
        s = torch.zeros(site.h_kv, len(slots(site, kind, granularity)), dtype=torch.float64)
        for j in range(site.h_kv):
            for n, chans in enumerate(slots(site, kind, granularity)):
                block = rows[j * per_group:(j + 1) * per_group][:, chans, :]
                s[j, n] = math.sqrt(float((block**2).mean()))
        out.append(s)
    return out[0], out[1]


def reference_drift(model, kind: str = "qk", granularity: str = "head", mode: str | None = None) -> float:
    """max |log(s_a/s_b)| over layers, groups and slots, from :func:`reference_scales`."""
    worst = 0.0
    for site in gaugeopt.find_attention(model):
        m = mode or ("lrm" if _has_mults(site, kind) else "plain")
        sa, sb = reference_scales(site, kind, granularity, m)
        worst = max(worst, float((sa / sb).log().abs().max()))
    return worst


def _has_mults(site: AttentionSite, kind: str) -> bool:
    if kind == "qk":
        return site.has_multipliers
    return site.v.row_mult is not None and site.o.col_mult is not None


def add_drift(model, lrm: bool, seed: int = 1, log_scale: float = 1.5, vo: bool = False):
    """Push the Q/K (and V/O) scales far from balance with a valid gauge transform."""
    g = torch.Generator().manual_seed(seed)
    kinds = (("lrm_qk",) + (("lrm_vo",) if vo else ())) if lrm else (("qk",) + (("vo",) if vo else ()))
    gaugeopt.random_gauge_transform(model, kinds, generator=g, log_scale=log_scale)
    return model


def touched_names(model, kinds=("qk",), mode: str | None = None) -> set[str]:
    """Names of the parameters a fix may rewrite."""
    names = set()
    for site in gaugeopt.find_attention(model):
        for kind in kinds:
            m = mode or ("lrm" if _has_mults(site, kind) else "plain")
            for proj in (("q", "k") if kind == "qk" else ("v", "o")):
                p = getattr(site, proj)
                if m == "lrm":
                    names.add((p.col_mult if proj == "o" else p.row_mult).name)
                else:
                    names.add(p.weight.name)
                    if proj != "o" and p.bias is not None:
                        names.add(p.bias.name)
    return names


def snapshot_params(model) -> dict[str, torch.Tensor]:
    """Copies of every parameter, by name (a point of a training run, for the transport references)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def load_params(model, values: dict[str, torch.Tensor]) -> None:
    """Write ``values`` (from :func:`snapshot_params`, possibly transformed) into the model in place."""
    for n, p in model.named_parameters():
        p.copy_(values[n])
