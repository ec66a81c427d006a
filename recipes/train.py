"""Train a GPT with LRM (and GaugeFix) on Lightning from a YAML config.

    python -m recipes.train --config recipes/configs/tiny_cpu_B.yaml                 # CPU, ~1 min
    python -m recipes.train --config recipes/configs/gpt2_owt_A.yaml --set train.seed=123
    srun python -m recipes.train --config recipes/configs/gpt2_owt_B.yaml             # see slurm/
    python -m recipes.train --config recipes/configs/gpt2_owt_C.yaml --dry-run        # print the plan

A run lives in ``<train.out_dir>/<run name>/`` (``<config>_s<seed>`` unless ``train.run_name`` is
set): ``config.yaml`` (the resolved config), ``checkpoints/last.ckpt`` (every ``ckpt_every`` steps
and at the end), ``logs/version_N/metrics.csv`` (one folder per start), ``summary.json`` and
``ranks/rank_R.json`` (step and parameter hash of every rank at the end).  Starting the same
config again resumes from the newest of ``checkpoints/last.ckpt`` and Lightning's SLURM
``hpc_ckpt_*.ckpt`` — so a requeued slurm job continues where it stopped; ``--resume PATH``
picks a checkpoint, ``--no-resume`` starts over.

What gets built (each from one config section, :mod:`recipes.config`): the model and optimizer
(:class:`recipes.lit.GPTLitModule`), the data (:class:`recipes.lit.MemmapDataModule`), the
callbacks (``gaugeopt.callbacks.GaugeFix`` when ``gauge.fix_every`` is set, ``GaugeMonitor``
always), the loggers (CSV always; W&B with ``train.wandb``, offline unless ``WANDB_MODE=online``)
and the ``Trainer``: devices and nodes from the config or, under ``srun``, from SLURM
(``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``), DDP when there is more than one process,
``bf16-mixed`` on GPUs that support it, gradient accumulation so that one iteration is
``micro_batch_size × grad_accum_steps`` sequences over all ranks.

Example (in Python; the tests and the demo do this)::

    from recipes.config import load_config
    from recipes.train import train
    cfg = load_config("recipes/configs/tiny_cpu_B.yaml", ["train.max_steps=50", "train.out_dir=/tmp/runs"])
    result = train(cfg)
    result.summary["val_loss"], result.summary["qk_drift"]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from . import invocation
from .config import ConfigError, RunConfig, TrainConfig, load_config

__all__ = ["Hardware", "RunResult", "resolve_hardware", "find_checkpoint", "build_trainer", "train", "read_metrics", "main"]

LEAFSPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"  # from Lightning 2.6 on torch >= 2.10


# ---- hardware ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """The resolved ``Trainer`` hardware arguments."""

    accelerator: str
    devices: int
    num_nodes: int
    strategy: str
    precision: str

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def _slurm_tasks_per_node(env: dict[str, str]) -> int | None:
    """Tasks per node of the current srun step (``"2"`` or ``"2(x3)"``), or ``None`` outside srun."""
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if raw:
        return int(raw.split("(")[0].split(",")[0])
    if env.get("SLURM_NTASKS") and env.get("SLURM_NNODES"):
        return int(env["SLURM_NTASKS"]) // int(env["SLURM_NNODES"])
    return None


def _under_srun(env: dict[str, str]) -> bool:
    """Inside an ``srun`` step (Lightning's SLURM detection, minus interactive allocations)."""
    return "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def resolve_hardware(cfg: TrainConfig, env: dict[str, str] | None = None) -> Hardware:
    """Fill in the ``auto`` fields of ``cfg`` from the machine and, under ``srun``, from SLURM."""
    import torch

    env = dict(os.environ if env is None else env)
    acc = cfg.accelerator
    if acc == "auto":
        acc = "cuda" if torch.cuda.is_available() else "cpu"
    elif acc == "gpu":
        acc = "cuda"
    slurm = _under_srun(env)
    devices = cfg.devices
    if devices == "auto":
        devices = (_slurm_tasks_per_node(env) if slurm else None) or (
            torch.cuda.device_count() if acc == "cuda" else 1)
    nodes = cfg.num_nodes
    if nodes == "auto":
        nodes = int(env["SLURM_NNODES"]) if slurm and env.get("SLURM_NNODES") else 1
    strategy = cfg.strategy
    if strategy == "auto":
        strategy = "ddp" if devices * nodes > 1 else "auto"
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16-mixed" if acc == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    return Hardware(acc, int(devices), int(nodes), strategy, precision)


# ---- run directory, checkpoints, data ------------------------------------------------------------


def _global_rank() -> int:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0) or 0)


def find_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest of ``checkpoints/last.ckpt`` and Lightning's SLURM ``hpc_ckpt_*.ckpt`` in ``run_dir``."""
    run_dir = Path(run_dir)
    found = [p for p in [run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _ensure_data(cfg: RunConfig, rank: int, timeout_s: float = 1800.0) -> dict[str, Any]:
    """Read the data's meta.json; prepare a built-in corpus first if ``data.prepare`` says so (rank 0)."""
    from .data import prepare, read_meta
    from .data_sources import SourceSpec

    meta = read_meta(cfg.data.dir)
    if meta is not None or cfg.data.prepare is None:
        if meta is None:
            raise ConfigError(
                f"data.dir={cfg.data.dir!r} holds no prepared data (train.bin, val.bin, meta.json). Prepare it "
                f"with `python -m recipes.data ... --out {cfg.data.dir}` (docs/recipes.md), or set data.prepare "
                "for a built-in corpus"
            )
        return meta
    p = cfg.data.prepare
    if rank == 0:
        return prepare(SourceSpec("builtin", corpus=p.get("corpus", "auto")), cfg.data.dir,
                       tokenizer=p.get("tokenizer", "char"))
    deadline = time.monotonic() + timeout_s  # other ranks wait for rank 0's atomic meta.json
    while (meta := read_meta(cfg.data.dir)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: {cfg.data.dir} was not prepared by rank 0 within {timeout_s:.0f} s")
        time.sleep(1.0)
    return meta


def _model_vocab(cfg: RunConfig, meta: dict[str, Any]) -> int:
    from .model import padded_vocab_size

    need = int(meta["vocab_size"])
    if cfg.model.vocab_size is None:
        return padded_vocab_size(need)
    if cfg.model.vocab_size < need:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's vocabulary ({need}, "
            f"{cfg.data.dir}/meta.json); set model.vocab_size={padded_vocab_size(need)} or null"
        )
    return cfg.model.vocab_size


# ---- callbacks and loggers -----------------------------------------------------------------------


def build_callbacks(cfg: RunConfig, run_dir: Path) -> list:
    """GaugeFix (if configured), GaugeMonitor, and the last.ckpt writer."""
    from gaugeopt.callbacks import GaugeFix, GaugeMonitor
    from lightning.pytorch.callbacks import ModelCheckpoint

    class LastCheckpoint(ModelCheckpoint):
        """``last.ckpt`` every ``ckpt_every`` steps and, whatever the step, when training ends."""

        def on_train_end(self, trainer, pl_module) -> None:
            if trainer.global_step % cfg.train.ckpt_every:
                trainer.save_checkpoint(Path(self.dirpath) / "last.ckpt", weights_only=False)
            super().on_train_end(trainer, pl_module)

    g = cfg.gauge
    callbacks: list = []
    if g.fix_every is not None:  # before the monitor: both act in the optimizer's post-step hook
        callbacks.append(GaugeFix(every=g.fix_every, granularity=g.granularity, transport_state=g.transport_state,
                                  product_decay=g.product_decay, product_max=g.product_max))
    callbacks.append(GaugeMonitor(every=g.monitor_every, vertical_fraction=g.monitor_vertical_fraction))
    callbacks.append(LastCheckpoint(dirpath=run_dir / "checkpoints", filename="last", save_top_k=0, save_last=True,
                                    every_n_train_steps=cfg.train.ckpt_every, enable_version_counter=False))
    return callbacks


def build_loggers(cfg: RunConfig, run_dir: Path) -> list:
    """CSVLogger always; WandbLogger when ``train.wandb`` (offline unless ``WANDB_MODE=online``)."""
    from lightning.pytorch.loggers import CSVLogger

    loggers: list = [CSVLogger(save_dir=str(run_dir), name="logs")]
    if cfg.train.wandb:
        from lightning.pytorch.loggers import WandbLogger

        online = os.environ.get("WANDB_MODE", "offline") == "online"
        run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]  # stable: requeues continue it
        loggers.append(WandbLogger(project=cfg.train.wandb_project, name=cfg.run_name, id=run_id, resume="allow",
                                   save_dir=str(run_dir), offline=not online))
    return loggers


def build_trainer(cfg: RunConfig, run_dir: Path, hw: Hardware, *, callbacks: Sequence = (), loggers=None):
    """The ``lightning.pytorch.Trainer`` for ``cfg`` (see the module docstring)."""
    import lightning.pytorch as pl

    plan = cfg.batch_plan(hw.world_size)
    t = cfg.train
    return pl.Trainer(
        accelerator=hw.accelerator, devices=hw.devices, num_nodes=hw.num_nodes, strategy=hw.strategy,
        precision=hw.precision,
        max_steps=t.max_steps, max_epochs=-1,
        accumulate_grad_batches=plan.accum_per_rank,
        gradient_clip_val=cfg.optim.grad_clip or None,
        val_check_interval=t.eval_interval * plan.accum_per_rank,  # counted in micro-batches
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every,
        use_distributed_sampler=False,  # MemmapDataModule splits by rank itself
        callbacks=[*build_callbacks(cfg, run_dir), *callbacks],
        logger=build_loggers(cfg, run_dir) if loggers is None else loggers,
        default_root_dir=str(run_dir),
        enable_progress_bar=t.progress == "bar",
        enable_model_summary=t.progress in ("lines", "bar"),
        deterministic=t.deterministic,
    )


# ---- the run -------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What :func:`train` returns (on every rank)."""

    run_dir: Path
    summary: dict[str, Any]
    module: Any
    trainer: Any


def _param_digest(module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _quiet_lightning(quiet: bool) -> None:
    """Drop Lightning's known noise (a deprecation inside Lightning, an advert); with ``quiet``, its info lines too."""
    import logging

    warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        lg = logging.getLogger(name)  # logger filters do not apply to records from child loggers: name the source
        if not any(isinstance(f, _DropAdverts) for f in lg.filters):
            lg.addFilter(_DropAdverts())
    if quiet:
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if quiet:
        warnings.filterwarnings("ignore", message="The `srun` command is available on your system")
        # the demo's checkpoints are for resuming, which needs the multipliers as they are (docs/gaugefix.md)
        from gaugeopt.models.lrm import LRMExportWarning

        warnings.filterwarnings("ignore", category=LRMExportWarning)


class _DropAdverts:
    def filter(self, record) -> bool:
        return not str(record.getMessage()).startswith("💡")


def train(
    cfg: RunConfig,
    *,
    resume: str | Path | None = "auto",
    callbacks: Sequence = (),
    label: str | None = None,
    quiet: bool = False,
) -> RunResult:
    """Run ``cfg`` to ``train.max_steps``.

    Args:
        cfg: the run.
        resume: ``"auto"`` (newest checkpoint in the run directory, if any), a checkpoint path,
            or ``None`` (start over).
        callbacks: extra Lightning callbacks.
        label: prefix of the progress lines.
        quiet: print nothing but the progress lines.
    """
    import lightning
    import torch

    from .lit import GPTLitModule, MemmapDataModule

    _quiet_lightning(quiet)
    hw = resolve_hardware(cfg.train)
    plan = cfg.batch_plan(hw.world_size)
    rank = _global_rank()
    run_dir = Path(cfg.train.out_dir) / cfg.run_name
    say = (lambda *a: None) if quiet or rank != 0 else (lambda *a: print(*a, flush=True))

    meta = _ensure_data(cfg, rank)
    vocab = _model_vocab(cfg, meta)
    ckpt = find_checkpoint(run_dir) if resume == "auto" else (Path(resume) if resume else None)
    if ckpt is not None and not ckpt.is_file():
        raise FileNotFoundError(f"--resume {ckpt}: no such checkpoint")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _save_config(cfg, run_dir, resuming=ckpt is not None, say=say)

    torch.set_float32_matmul_precision(cfg.train.matmul_precision)
    lightning.seed_everything(cfg.train.seed, workers=True, verbose=False)
    module = GPTLitModule(cfg.model, cfg.optim, max_steps=cfg.train.max_steps, vocab_size=vocab,
                          compile=cfg.train.compile, log_every=cfg.train.log_every, progress=cfg.train.progress,
                          label=label)
    data = MemmapDataModule(cfg.data.dir, cfg.model.block_size, cfg.data.micro_batch_size, cfg.train.seed,
                            cfg.data.val_batches, cfg.data.eval_seed, cfg.data.num_workers)
    say(f"run: {run_dir}  ({cfg.optim.condition}, gauge fix every {cfg.gauge.fix_every}, seed {cfg.train.seed})")
    say(f"hardware: {hw.num_nodes} node(s) × {hw.devices} {hw.accelerator} process(es), {hw.strategy}, {hw.precision}")
    say(plan.describe())
    n = sum(p.numel() for p in module.model.parameters())
    say(f"model: {n / 1e6:.2f}M parameters, vocab {vocab} (data: {meta['vocab_size']}, {meta['tokenizer']}), "
        f"block {cfg.model.block_size}")
    if ckpt is not None:
        say(f"resuming from {ckpt}")

    trainer = build_trainer(cfg, run_dir, hw, callbacks=callbacks)
    started = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=str(ckpt) if ckpt else None)
    summary = _finish(cfg, run_dir, module, trainer, plan, time.perf_counter() - started)
    _close_wandb(trainer)
    say(f"done: step {summary['step']}, val loss {summary['val_loss']:.4f} (best {summary['best_val_loss']:.4f}), "
        f"qk drift {summary['qk_drift']:.2e}, {summary['seconds']:.0f} s -> {run_dir}")
    return RunResult(run_dir, summary, module, trainer)


def _close_wandb(trainer) -> None:
    """Finish the W&B run (Lightning leaves it open), so its files are complete and a next run starts fresh."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            logger.experiment.finish()


def _save_config(cfg: RunConfig, run_dir: Path, resuming: bool, say) -> None:
    import yaml

    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    path = run_dir / "config.yaml"
    if resuming and path.is_file() and path.read_text() != text:
        say(f"note: the config differs from the one saved in {path} when the run started; saving the new one")
    path.write_text(text)


def _finish(cfg: RunConfig, run_dir: Path, module, trainer, plan, seconds: float) -> dict[str, Any]:
    import gaugeopt

    cm = trainer.callback_metrics
    summary = {
        "config": cfg.name,
        "condition": cfg.optim.condition,
        "fix_every": cfg.gauge.fix_every,
        "seed": cfg.train.seed,
        "step": trainer.global_step,
        "world_size": trainer.world_size,
        "tokens": module.tokens_seen,
        "tokens_per_step": plan.tokens_per_step,
        "params": sum(p.numel() for p in module.model.parameters()),
        "val_loss": float(cm["val/loss"]) if "val/loss" in cm else float("nan"),
        "best_val_loss": module.best_val_loss,
        "qk_drift": float(gaugeopt.qk_drift(module.model)),
        "seconds": seconds,
    }
    rank_info = {"rank": trainer.global_rank, "step": trainer.global_step, "world_size": trainer.world_size,
                 "param_sha256": _param_digest(module.model), "val_loss": summary["val_loss"]}
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (run_dir / "ranks" / f"rank_{trainer.global_rank}.json").write_text(json.dumps(rank_info, indent=1) + "\n")
    if trainer.is_global_zero:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def read_metrics(run_dir: str | Path, version: int | None = None) -> list[dict[str, float]]:
    """The CSV logs of a run, empty cells dropped: every start in order (``logs/version_0``,
    ``version_1``, ... — one per start or resume), or only start ``version``.

    Each row has ``step`` (Lightning's 0-based index: values measured after optimizer step ``step + 1``).
    """
    import csv

    folders = sorted(Path(run_dir, "logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    if version is not None:
        folders = [Path(run_dir, "logs", f"version_{version}")]
    rows: list[dict[str, float]] = []
    for folder in folders:
        if (folder / "metrics.csv").is_file():
            with open(folder / "metrics.csv", newline="") as fh:
                rows += [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(fh)]
    return rows


def dry_run(cfg: RunConfig) -> int:
    """Print what a run would do (hardware, batch arithmetic, model size, Trainer arguments); touch nothing."""
    import torch
    import yaml

    from .model import build_model, count_parameters

    hw = resolve_hardware(cfg.train)
    plan = cfg.batch_plan(hw.world_size)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip())
    print(f"run dir: {Path(cfg.train.out_dir) / cfg.run_name}")
    print(f"hardware: {hw.num_nodes} node(s) × {hw.devices} {hw.accelerator} process(es), {hw.strategy}, {hw.precision}")
    print(plan.describe())
    with torch.device("meta"):
        model = build_model(cfg.model, cfg.model.vocab_size or 64)
    c = count_parameters(model)
    print(f"model: {c['total'] / 1e6:.2f}M parameters ({c['multipliers']:,} LRM multipliers)"
          + ("" if cfg.model.vocab_size else ", vocab from the data"))
    print(f"trainer: accumulate_grad_batches={plan.accum_per_rank} val_check_interval="
          f"{cfg.train.eval_interval * plan.accum_per_rank} gradient_clip_val={cfg.optim.grad_clip}")
    print(f"gauge: fix_every={cfg.gauge.fix_every} granularity={cfg.gauge.granularity} "
          f"transport_state={cfg.gauge.transport_state} monitor_every={cfg.gauge.monitor_every}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=invocation(__spec__), description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True,
                   help="YAML config: a file, or the name of one of recipes/configs/*.yaml (e.g. tiny_cpu_B)")
    p.add_argument("--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                   help="override config values, e.g. --set optim.lr=1e-3 train.seed=123")
    p.add_argument("--resume", metavar="CKPT", help="resume from this checkpoint (default: the run dir's newest)")
    p.add_argument("--no-resume", action="store_true", help="start over even if the run dir has checkpoints")
    p.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=LEAFSPEC_WARNING, category=FutureWarning)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            return dry_run(cfg)
        resume = None if args.no_resume else (args.resume or "auto")
        train(cfg, resume=resume)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
