"""QK-Clip under DDP (2 CPU ranks, gloo): ranks that see different batches measure different maxima,
MAX-reduce them and clip identically — parameters and Adam state stay bit-identical, through the
function and through the step core's hooks in a training loop; without the reduction they diverge
(the comparison has power)."""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gaugeopt
from gaugeopt.integrations.clip import ClipSteps
from gaugeopt.integrations.steps import FixSteps
from gaugeopt.models import GPT, GPTConfig
from distributed_helpers import WORLD, bits as _bits, init as _init, spawn as _spawn

pytestmark = pytest.mark.slow


def _model(lrm: bool) -> GPT:
    torch.manual_seed(0)  # the same initial replica on both ranks
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, rope="split_half"))
    return gaugeopt.apply_lrm(model) if lrm else model


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return out


def _state_bits(model, opt) -> torch.Tensor:
    return _bits([*model.parameters(), *(v for st in opt.state.values() for v in st.values() if v.dim())])


def _worker(rank: int, port: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(rank, port)
    try:
        for lrm in (False, True):
            model = _model(lrm)
            ddp = DDP(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
            x = torch.randint(0, 64, (2, 17), generator=g)
            F.cross_entropy(ddp(x[:, :-1])[0].reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
            opt.step()
            local = gaugeopt.max_attention_logits(ddp, x[:, :-1])
            flat = torch.cat([local[s.name] for s in gaugeopt.find_attention(ddp)])
            mine, other = _gather(flat)[rank], _gather(flat)[1 - rank]
            assert not torch.equal(mine, other)  # the ranks saw different batches
            tau = float(torch.maximum(mine, other).median())
            before = _state_bits(model, opt)
            report = gaugeopt.qk_clip(ddp, opt, local, tau=tau)
            assert report.reduced and report.heads_over > 0
            reduced = torch.tensor([m for lc in report.layers for m in lc.max_before])
            assert torch.equal(reduced, torch.maximum(mine, other).double())
            both = _gather(_state_bits(model, opt))
            assert torch.equal(both[0], both[1]) and not torch.equal(both[rank], before)
            # control: each rank clipping on its own maxima leaves the replicas apart
            gaugeopt.qk_clip(ddp, opt, local, tau=0.5 * tau, reduce=False)
            both = _gather(_state_bits(model, opt))
            assert not torch.equal(both[0], both[1])
            del ddp, opt, model
            gc.collect()

        # the step core in a DDP training loop: clip then balance after every step, replicas stay identical
        model = _model(True)
        ddp = DDP(model)
        opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "B", lr=1e-2))
        clip = ClipSteps(tau=0.1).watch(ddp, opt)
        fix = FixSteps(every=1).watch(ddp, opt)
        g = torch.Generator().manual_seed(200 + rank)
        for _ in range(4):
            x = torch.randint(0, 64, (2, 17), generator=g)
            F.cross_entropy(ddp(x[:, :-1])[0].reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            both = _gather(_state_bits(model, opt))
            assert torch.equal(both[0], both[1])
        assert clip.clips == 4 and clip.last_report.reduced and clip.last_report.heads_over > 0 and fix.fixes == 4
        clip.detach()
        fix.detach()
        del ddp, opt, model  # DDP's reducer holds the process group (see test_gaugefix_distributed)
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_clip_identically():
    _spawn(_worker)
