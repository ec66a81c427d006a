"""Lightning pieces of the recipe: the GPT training module and the memmap data module.

:class:`GPTLitModule` trains :func:`recipes.model.build_model`'s GPT with AdamW on paper 002's
parameter groups (:func:`gaugeopt.lrm_param_groups`: condition A decays every multiplier by 2e-3,
B and C exempt the Q/K row multipliers) and nanoGPT's learning-rate schedule::

    lr(it) = lr · (it + 1) / (warmup + 1)                                   it < warmup
           = min_lr + ½ (1 + cos(π (it − warmup) / (decay − warmup))) (lr − min_lr)   warmup ≤ it ≤ decay
           = min_lr                                                          it > decay

(``it`` = optimizer steps taken).  Gradient clipping is the Trainer's (``gradient_clip_val``); the
module's ``configure_gradient_clipping`` clips with :func:`torch.nn.utils.clip_grad_norm_` and keeps
the pre-clip norm for logging.  Logged: ``train/loss`` (mean over the step's micro-batches on rank
0), ``train/lr``, ``train/grad_norm``, ``train/tokens``, ``val/loss``, ``val/best_loss``, and every
``log_every`` steps ``perf/tokens_per_s`` (all ranks), ``perf/step_ms`` and ``perf/mfu`` (per device,
only where :func:`recipes.perf.peak_flops` knows the device — never on CPU).  CSV rows use
Lightning's step index: the row with ``step = s`` holds values measured after optimizer step ``s + 1``.

:class:`MemmapDataModule` reads nanoGPT's ``train.bin``/``val.bin`` (uint16 memmaps) the way
nanoGPT's ``get_batch`` does — ``micro_batch_size`` random contiguous windows of ``block_size + 1``
tokens, ``x = w[:, :-1]``, ``y = w[:, 1:]`` — but deterministically: micro-batch ``k`` of rank ``r``
is drawn from ``numpy.random.default_rng((seed, 0, r, k))``.  Each rank draws different windows, a
rerun draws the same ones, and a resumed run continues the stream at ``k = global_step ×
accumulate_grad_batches`` (bit-identical continuation).  Validation uses ``val_batches`` fixed
windows drawn from ``eval_seed`` (the same for every run and seed, so losses compare), dealt to
the ranks round-robin.  The Trainer needs ``use_distributed_sampler=False`` (the data module does
the rank split itself) and an integer ``val_check_interval`` (the training stream is endless).

Example::

    >>> import lightning.pytorch as pl
    >>> from recipes.config import ModelConfig, OptimConfig
    >>> from recipes.lit import GPTLitModule
    >>> module = GPTLitModule(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64),
    ...                       OptimConfig(condition="B", warmup_steps=10), max_steps=100)
    >>> [g["name"] for g in module.configure_optimizers()["optimizer"].param_groups]
    ['matrices', 'multipliers', 'qk_multipliers', 'no_decay']
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from gaugeopt import lrm_param_groups

from .config import ModelConfig, OptimConfig
from .model import build_model
from .perf import device_name, peak_flops

__all__ = ["GPTLitModule", "MemmapDataModule", "CosineSchedule", "RandomWindows", "FixedWindows"]


# ---- learning-rate schedule ----------------------------------------------------------------------


class CosineSchedule:
    """nanoGPT's ``get_lr`` as a ``LambdaLR`` factor (picklable, so the scheduler checkpoints)."""

    def __init__(self, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> None:
        self.lr, self.min_lr, self.warmup, self.decay = lr, min_lr, warmup_steps, decay_steps

    def lr_at(self, it: int) -> float:
        if it < self.warmup:
            return self.lr * (it + 1) / (self.warmup + 1)
        if it > self.decay:
            return self.min_lr
        ratio = (it - self.warmup) / max(1, self.decay - self.warmup)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (self.lr - self.min_lr)

    def __call__(self, it: int) -> float:
        return self.lr_at(it) / self.lr


# ---- the training module -------------------------------------------------------------------------


class GPTLitModule(pl.LightningModule):
    """GPT + AdamW on paper 002's parameter groups + nanoGPT's schedule, with throughput logging and progress lines.

    Args:
        model: architecture (:class:`recipes.config.ModelConfig` or its dict).
        optim: optimizer settings (:class:`recipes.config.OptimConfig` or its dict).
        max_steps: training length (the cosine's end when ``optim.decay_steps`` is unset).
        vocab_size: the output vocabulary when ``model.vocab_size`` is ``None``.
        compile: ``torch.compile`` the GPT (in place; parameter names are unchanged).
        log_every: steps between throughput measurements.
        progress: ``"lines"`` prints one line per ``log_every`` steps and one per evaluation (global
            rank 0 only; readable in slurm logs), ``"evals"`` only the evaluation lines, anything else nothing.
        label: prefix of the progress lines.
    """

    def __init__(
        self,
        model: ModelConfig | dict,
        optim: OptimConfig | dict,
        max_steps: int,
        vocab_size: int | None = None,
        compile: bool = False,
        log_every: int = 10,
        progress: str = "none",
        label: str | None = None,
    ) -> None:
        super().__init__()
        model_cfg = model if isinstance(model, ModelConfig) else ModelConfig(**model)
        optim_cfg = optim if isinstance(optim, OptimConfig) else OptimConfig(**optim)
        self.save_hyperparameters(
            {"model": asdict(model_cfg), "optim": {**asdict(optim_cfg), "betas": list(optim_cfg.betas)},
             "max_steps": max_steps, "vocab_size": vocab_size, "compile": compile, "log_every": log_every}
        )
        self.model_cfg, self.optim_cfg = model_cfg, optim_cfg
        self.max_steps, self.log_every, self.compile_model = max_steps, log_every, compile
        self.progress, self._prefix = progress, f"[{label}] " if label else ""
        self.model = build_model(model_cfg, vocab_size)
        self.best_val_loss = math.inf
        self._micro_losses: list[torch.Tensor] = []
        self._grad_norm: torch.Tensor | None = None
        self._step_lr = optim_cfg.lr
        self._tokens_per_step: int | None = None
        self._peak: float | None = None
        self._mark_time = 0.0
        self._mark_step = 0
        self._seen_step = 0
        self.last_metrics: dict[str, float] = {}  # the latest logged step (every log_every steps)

    # -- model -----------------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(idx, targets)

    def configure_model(self) -> None:
        if self.compile_model and not getattr(self, "_compiled", False):
            self.model.compile()  # nn.Module.compile: in place, state_dict keys unchanged
            self._compiled = True

    # -- optimizer ---------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        o = self.optim_cfg
        groups = lrm_param_groups(
            self.model, o.condition, weight_decay=o.weight_decay, multiplier_decay=o.multiplier_decay,
            qk_multipliers=o.qk_multipliers,
        ) if self.model_cfg.lrm else _plain_groups(self.model, o.weight_decay)
        on_cuda = self.device.type == "cuda"
        fused = on_cuda if o.fused == "auto" else bool(o.fused)
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=fused or None)
        decay = o.decay_steps if o.decay_steps is not None else self.max_steps
        schedule = CosineSchedule(o.lr, o.min_lr, o.warmup_steps, decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    def on_before_optimizer_step(self, optimizer) -> None:
        self._step_lr = optimizer.param_groups[0]["lr"]  # the scheduler steps before on_train_batch_end

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if gradient_clip_val:
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}: this recipe clips by norm")
            self._grad_norm = torch.nn.utils.clip_grad_norm_(params, gradient_clip_val).detach()
        else:
            self._grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params]).detach()

    # -- training ----------------------------------------------------------------------------------
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T) int64 each
        _, loss = self.model(x, y)
        self._micro_losses.append(loss.detach())
        if self._tokens_per_step is None:
            self._tokens_per_step = x.numel() * self.trainer.accumulate_grad_batches * self.trainer.world_size
        return loss

    @property
    def tokens_seen(self) -> int:
        """Training tokens consumed over all ranks (optimizer steps × tokens per step)."""
        return self.global_step * (self._tokens_per_step or 0)

    def on_fit_start(self) -> None:
        self._peak = peak_flops(device_name(self.device), self.trainer.precision)
        self._flops_per_token = self.model.flops_per_token(self.model.config.block_size)

    def on_train_start(self) -> None:
        self._seen_step = self.global_step
        self._reset_timer()

    def _reset_timer(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._mark_time, self._mark_step = time.perf_counter(), self.global_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.global_step
        if step == self._seen_step:
            return  # still accumulating: no optimizer step in this micro-batch
        self._seen_step = step
        loss = torch.stack(self._micro_losses).mean()
        self._micro_losses = []
        metrics = {"train/loss": loss, "train/lr": self._step_lr, "train/tokens": float(self.tokens_seen)}
        if self._grad_norm is not None:
            metrics["train/grad_norm"] = self._grad_norm
        if step % self.log_every == 0 and step > self._mark_step:
            metrics.update(self._throughput(step))
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False)
        if step % self.log_every == 0:
            self.last_metrics = m = {k: float(v) for k, v in metrics.items()}
            if self.progress == "lines":
                line = f"{self._prefix}step {step}/{self.max_steps} | loss {m['train/loss']:.4f} | lr {m['train/lr']:.2e}"
                if "perf/tokens_per_s" in m:
                    line += f" | {m['perf/tokens_per_s'] / 1e3:.1f}k tok/s"
                if "perf/mfu" in m:
                    line += f" | mfu {100 * m['perf/mfu']:.1f}%"
                self.print(line, flush=True)

    def _throughput(self, step: int) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        dt, steps = now - self._mark_time, step - self._mark_step
        self._mark_time, self._mark_step = now, step
        tps = steps * (self._tokens_per_step or 0) / dt
        out = {"perf/tokens_per_s": tps, "perf/step_ms": 1000.0 * dt / steps}
        if self._peak is not None:
            out["perf/mfu"] = tps / self.trainer.world_size * self._flops_per_token / self._peak
        return out

    # -- validation --------------------------------------------------------------------------------
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val/loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        metrics = self.trainer.callback_metrics
        val = metrics.get("val/loss")
        if val is not None:
            self.best_val_loss = min(self.best_val_loss, float(val))
            self.log("val/best_loss", self.best_val_loss, sync_dist=False)
            if self.progress in ("lines", "evals"):
                line = f"{self._prefix}step {self.global_step}: val loss {float(val):.4f} (best {self.best_val_loss:.4f})"
                if "gauge/qk_drift" in metrics:  # GaugeMonitor's latest measurement
                    line += f" | qk drift {float(metrics['gauge/qk_drift']):.2e}"
                self.print(line, flush=True)

    def on_validation_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._reset_timer()  # keep evaluation time out of tokens/s

    # -- checkpoints -------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["recipe_state"] = {"best_val_loss": self.best_val_loss}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("recipe_state", {})
        self.best_val_loss = state.get("best_val_loss", math.inf)


def _plain_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's groups for a model without multipliers: decay ≥2-D tensors, not biases/gains."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, "name": "matrices"},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "name": "no_decay"},
    ]


# ---- data ----------------------------------------------------------------------------------------

TRAIN_STREAM, VAL_STREAM = 0, 1


def _windows(path: Path, block_size: int, batch_size: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's get_batch: ``batch_size`` random windows of ``block_size + 1`` tokens → (x, y), (B, T) int64."""
    data = np.memmap(path, dtype=np.uint16, mode="r")  # reopened per batch, as nanoGPT (avoids a leak)
    ix = rng.integers(0, len(data) - block_size, size=batch_size)
    w = torch.from_numpy(np.stack([data[i : i + block_size + 1] for i in ix]).astype(np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class RandomWindows(IterableDataset):
    """Endless training micro-batches; batch ``k`` (from ``start``) uses ``default_rng((seed, 0, rank, k))``.

    With DataLoader workers, worker ``w`` of ``n`` yields ``k = start + w, start + w + n, …``; the
    DataLoader interleaves workers in order, so the stream is the same with any number of workers.
    """

    def __init__(self, path: str | Path, block_size: int, batch_size: int, seed: int, rank: int, start: int = 0) -> None:
        self.path, self.block_size, self.batch_size = Path(path), block_size, batch_size
        self.seed, self.rank, self.start = seed, rank, start

    def batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.seed, TRAIN_STREAM, self.rank, k))
        return _windows(self.path, self.block_size, self.batch_size, rng)

    def __iter__(self):
        info = get_worker_info()
        k, stride = (self.start, 1) if info is None else (self.start + info.id, info.num_workers)
        while True:
            yield self.batch(k)
            k += stride


class FixedWindows(Dataset):
    """The validation micro-batches ``indices`` of the fixed set drawn from ``eval_seed``."""

    def __init__(self, path: str | Path, block_size: int, batch_size: int, eval_seed: int, indices: range) -> None:
        self.path, self.block_size, self.batch_size = Path(path), block_size, batch_size
        self.eval_seed, self.indices = eval_seed, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.eval_seed, VAL_STREAM, self.indices[j]))
        return _windows(self.path, self.block_size, self.batch_size, rng)


class MemmapDataModule(pl.LightningDataModule):
    """Random windows from ``<data_dir>/train.bin`` and fixed ones from ``val.bin`` (see module doc).

    Args:
        data_dir: folder written by ``python -m recipes.data`` (``meta.json`` must be present).
        block_size: tokens per sequence.
        micro_batch_size: sequences per rank per micro-batch.
        seed: training-window seed (combined with the rank and the micro-batch index).
        val_batches: validation micro-batches per evaluation, over all ranks.
        eval_seed: seed of the validation windows.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        data_dir: str | Path,
        block_size: int,
        micro_batch_size: int,
        seed: int,
        val_batches: int = 200,
        eval_seed: int = 1337,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.block_size, self.micro_batch_size = block_size, micro_batch_size
        self.seed, self.val_batches, self.eval_seed, self.num_workers = seed, val_batches, eval_seed, num_workers
        self.meta: dict[str, Any] | None = None

    def setup(self, stage: str | None = None) -> None:
        from .data import read_meta

        meta = read_meta(self.data_dir)
        if meta is None:
            raise FileNotFoundError(
                f"data.dir={str(self.data_dir)!r} holds no complete token memmaps (train.bin, val.bin, meta.json); "
                "prepare them first, e.g. `python -m recipes.data --source builtin --tokenizer char --out "
                f"{self.data_dir}` (see docs/recipes.md)"
            )
        if meta.get("dtype", "uint16") != "uint16":
            raise ValueError(f"{self.data_dir}/meta.json: dtype {meta['dtype']!r}; this reader expects uint16")
        for split in ("train", "val"):
            n = meta[f"{split}_tokens"]
            if n <= self.block_size + 1:
                raise ValueError(
                    f"{self.data_dir}/{split}.bin has {n} tokens, too few for windows of block_size+1="
                    f"{self.block_size + 1}; use a smaller model.block_size or more data"
                )
        self.meta = meta

    def _rank_world(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def _loader(self, dataset) -> DataLoader:
        t = self.trainer
        pin = t is not None and t.strategy.root_device.type == "cuda"
        return DataLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=pin,
                          persistent_workers=False)

    def train_dataloader(self) -> DataLoader:
        rank, _ = self._rank_world()
        t = self.trainer
        start = t.global_step * t.accumulate_grad_batches if t is not None else 0  # resume mid-stream
        ds = RandomWindows(self.data_dir / "train.bin", self.block_size, self.micro_batch_size, self.seed, rank, start)
        return self._loader(ds)

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        n = -(-self.val_batches // world) * world  # a multiple of the world size: equal shares
        ds = FixedWindows(self.data_dir / "val.bin", self.block_size, self.micro_batch_size, self.eval_seed,
                          range(rank, n, world))
        return self._loader(ds)
