"""torchtitan's seam: FixSteps watching an OptimizersContainer, in the shape of Trainer.train_step,
with its counters checkpointed by torch.distributed.checkpoint next to the container, as torchtitan's
CheckpointManager does with the ``states`` it is given.

The model is the project's GPT (GQA, multipliers): torchtitan's own Llama3 attention (FusedQKVLinear
over torchtitan's Linear, flex attention) has no gaugeopt adapter, and a full torchtitan Trainer
needs a tokenizer and a dataset; the container, its hooks and the checkpoint protocol are what the
documented lines (docs/integrations.md) rely on, and they are torchtitan's own here.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gaugeopt
from gaugeopt.integrations.steps import FixSteps
from gaugeopt.models import GPT, GPTConfig

optimizer_mod = pytest.importorskip("torchtitan.components.optimizer")
lr_mod = pytest.importorskip("torchtitan.components.optimizer.lr_scheduler")
dcp = pytest.importorskip("torch.distributed.checkpoint")

VOCAB, T = 32, 12


def _model():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_kv_head=2, n_embd=16)
    return gaugeopt.apply_lrm(GPT(cfg))


def _containers(model, steps=10):
    """Adam for the token embedding, AdamW (no decay on the multipliers) for the rest: two
    optimizers in one container, as torchtitan builds them from regex param groups."""
    PG = optimizer_mod.ParamGroupConfig
    cfg = optimizer_mod.OptimizersContainer.Config(implementation="for-loop", param_groups=[
        PG(pattern=r"\.wte\.", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2}),
        PG(pattern=r"mults", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.0}),
        PG(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1}),
    ])
    optimizers = cfg.build(model_parts=[model])
    schedulers = lr_mod.LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    return optimizers, schedulers


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, T), generator=g) for _ in range(n)]


def _train_step(model, optimizers, schedulers, micro):
    """torchtitan.trainer.Trainer.train_step in miniature: zero_grad, accumulate, clip, step."""
    optimizers.zero_grad()
    for x in micro:
        (model(x, x.roll(-1, 1))[1] / len(micro)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    optimizers.step()
    schedulers.step()


def test_fix_steps_watch_the_optimizers_container_and_checkpoint_with_dcp(tmp_path):
    """10 steps x 2 micro-batches, fix every 4: the container's AdamW is hooked (the attention is
    there), the fixes match gauge_fix(model, that AdamW) after steps 4 and 8 of a bare run, and a run
    restored from a DCP checkpoint of step 6 (model, container, schedulers, FixSteps) ends
    bit-identical (every=4 puts the second fix at 8, after the restore)."""
    batches = _batches(20, seed=3)
    micro = [batches[2 * k:2 * k + 2] for k in range(10)]

    model = _model()
    optimizers, schedulers = _containers(model)
    assert len(optimizers.optimizers) == 2  # Adam + AdamW
    fix = FixSteps(every=4).watch([model], optimizers)
    adamw = next(o for o in optimizers.optimizers if isinstance(o, torch.optim.AdamW))
    assert fix._optimizer is adamw
    reference = copy.deepcopy(model)
    ref_opts, ref_scheds = _containers(reference)
    ref_adamw = next(o for o in ref_opts.optimizers if isinstance(o, torch.optim.AdamW))
    for k, m in enumerate(micro, 1):
        _train_step(model, optimizers, schedulers, m)
        _train_step(reference, ref_opts, ref_scheds, m)
        if k % 4 == 0:
            gaugeopt.gauge_fix(reference, ref_adamw)
        if k == 6:
            dcp.save({"model": model.state_dict(), "optimizer": optimizers, "lr_scheduler": schedulers,
                      "gauge_fix": fix}, checkpoint_id=str(tmp_path / "step-6"))
    assert fix.state_dict() == {"optimizer_steps": 10, "fixes": 2}
    assert fix.last_report.max_drift_before > 1e-4
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), n

    resumed = _model()
    r_opts, r_scheds = _containers(resumed)
    r_fix = FixSteps(every=4).watch([resumed], r_opts)
    state = {"model": resumed.state_dict(), "optimizer": r_opts, "lr_scheduler": r_scheds, "gauge_fix": r_fix}
    dcp.load(state, checkpoint_id=str(tmp_path / "step-6"))
    resumed.load_state_dict(state["model"])
    assert r_fix.state_dict() == {"optimizer_steps": 6, "fixes": 1}
    for m in micro[6:]:
        _train_step(resumed, r_opts, r_scheds, m)
    assert r_fix.state_dict() == fix.state_dict()
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
