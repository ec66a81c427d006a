"""GaugeFix under Lightning's ModelParallelStrategy (FSDP2 over gloo, 2 CPU processes).

Run by tests/integrations/test_callbacks.py::test_fsdp2_model_parallel_strategy as ``python fsdp_lightning_run.py OUT``;
Lightning starts the second rank by re-running this command. Rank 0 writes ``OUT/fsdp.pt``.
"""

import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

import gaugeopt
from gaugeopt.callbacks import GaugeFix
from lightning_helpers import TinyLit, token_loader, trainer


class FSDPLit(TinyLit):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class Record(GaugeFix):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.before, self.after = [], []

    def _act(self, optimizer):
        out = super()._act(optimizer)
        self.before.append(self.last_report.max_drift_before)
        self.after.append(self.last_report.max_drift_after)
        return out


class Save(pl.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module):
        fix = next(c for c in trainer.callbacks if isinstance(c, Record))
        site = gaugeopt.find_attention(pl_module)[0]
        sharded = type(site.q.row_mult.param).__name__ == "DTensor"
        drift_full = gaugeopt.qk_drift(pl_module)  # reads DTensors through the core's gathers
        if trainer.global_rank == 0:
            torch.save({"fixes": fix.fixes, "before": fix.before, "after": fix.after,
                        "sharded": sharded, "drift_full": drift_full}, f"{self.out_dir}/fsdp.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    t = trainer(out, max_steps=9, devices=2, strategy=strategy, callbacks=[Record(every=3), Save(out)])
    t.fit(FSDPLit(lr=1e-2), token_loader(18))
