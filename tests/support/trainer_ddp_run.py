"""GaugeFixCallback under DDP through the Hugging Face Trainer and Accelerate (2 CPU processes, gloo).

Run by tests/integrations/test_transformers_trainer.py::test_ddp_two_processes_via_accelerate as
``python -m torch.distributed.run --nproc_per_node=2 trainer_ddp_run.py OUT``; each rank writes
``OUT/rank{r}.pt`` with its parameters, counters and logged fix steps.
"""

import sys

import torch

import gaugeopt
from gaugeopt.integrations.transformers import GaugeFixCallback
from trainer_helpers import arguments, tiny_llama, trainer

if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    model = tiny_llama()
    fix = GaugeFixCallback(every=4)
    t = trainer(model, arguments(out, steps=12, logging_steps=100), callbacks=[fix], n=192)
    t.train()
    rank = t.args.process_index
    torch.save({
        "world": t.args.world_size,
        "ddp": isinstance(t.model_wrapped, torch.nn.parallel.DistributedDataParallel),
        "steps": fix.optimizer_steps,
        "fixes": fix.fixes,
        "drift": gaugeopt.qk_drift(model),
        "logged": [r["step"] for r in t.state.log_history if "gauge/fixes" in r],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }, f"{out}/rank{rank}.pt")
