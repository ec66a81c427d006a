"""torchmetrics metrics: values against independent computations, and DDP reduction."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gaugeopt
import zoo
from gaugeopt.metrics import QKDriftMetric, ScaleProductMetric, VerticalFractionMetric


def test_drift_and_scale_product_from_a_model():
    case = zoo.build("gpt_gqa", lrm=True)
    m, p = QKDriftMetric(), ScaleProductMetric()
    m.update(case.model)
    p.update(case.model)
    # independent: per KV group the RMS of r_Q over its query heads against the RMS of r_K
    drifts, products = [], []
    for site in gaugeopt.find_attention(case.model):
        rq = site.q.row_mult.get().detach().view(site.h_kv, site.n_rep * site.d_k)
        rk = site.k.row_mult.get().detach()
        s_q, s_k = rq.square().mean(-1).sqrt(), rk.square().mean(-1).sqrt()
        drifts.append((s_q / s_k).log().abs())
        products.append(s_q * s_k)
    expected_drift = float(torch.cat(drifts).max())
    assert expected_drift > 1e-2  # the zoo's random multipliers: not a vacuous comparison of zeros
    assert float(m.compute()) == pytest.approx(expected_drift, rel=1e-12)
    assert float(p.compute()) == pytest.approx(float(torch.cat(products).mean()), rel=1e-12)


def test_vertical_fraction_is_of_the_concatenated_vectors():
    case = zoo.build("gpt", seed=1)
    g = torch.Generator().manual_seed(0)
    u1 = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in case.model.named_parameters()}
    u2 = {n: 3 * torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in case.model.named_parameters()}
    m = VerticalFractionMetric()
    m.update(case.model, u1)
    m.update(case.model, u2)
    proj = gaugeopt.GaugeProjector(case.model)
    v1, v2 = proj.vertical(u1), proj.vertical(u2)
    sq = lambda d: sum(float(t.square().sum()) for t in d.values())  # noqa: E731
    expected = math.sqrt((sq(v1) + sq(v2)) / (sq(u1) + sq(u2)))
    assert float(m.compute()) == pytest.approx(expected, rel=1e-10)
    assert 0 < expected < 1


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        drift, prod, vf = QKDriftMetric(), ScaleProductMetric(), VerticalFractionMetric()
        drift.update(torch.tensor([0.1, 0.7])[rank])  # rank 1 saw the larger drift
        prod.update(torch.full((1 + 2 * rank,), 1.0 + rank))  # rank 0: [1.0]; rank 1: [2.0, 2.0, 2.0]
        vf.update(vertical_sq=[1.0, 3.0][rank], total_sq=[4.0, 12.0][rank])
        torch.save({"drift": drift.compute(), "prod": prod.compute(), "vf": vf.compute()}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_reduction(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert float(r["drift"]) == pytest.approx(0.7)  # max over ranks
        # rank 0 saw [1.0], rank 1 saw [2.0, 2.0, 2.0]: mean over all 4 values
        assert float(r["prod"]) == pytest.approx((1.0 + 6.0) / 4)
        assert float(r["vf"]) == pytest.approx(math.sqrt(4.0 / 16.0))  # sums, not a mean of ratios
