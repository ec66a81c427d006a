"""Training end to end on CPU: loss goes down, resume is bit-identical, GaugeFix controls drift, data windows.

Runs are test-sized (2 layers, width 64, 8 × 64 tokens per step) on the built-in pydoc corpus,
prepared once per session in a temporary folder.  Torch runs single-threaded here: on a shared
2-core machine two OpenMP threads per process make these small steps up to 30× slower.
"""

import json
import math
import re

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

import gaugeopt
from recipes.config import config_from_dict
from recipes.lit import CosineSchedule, FixedWindows, RandomWindows
from recipes.train import find_checkpoint, main, read_metrics, train
from train_helpers import prepare_corpus, series, tiny

pytestmark = pytest.mark.filterwarnings(
    "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning",
    "ignore:The `srun` command is available",
)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("data") / "pydoc_char")


# ---- a short run: loss, logs, run directory -------------------------------------------------------


@pytest.fixture(scope="module")
def short_run(corpus, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("runs")
    cfg = tiny("A", corpus, out, "train.max_steps=60", "train.eval_interval=20", "train.log_every=5",
               "gauge.monitor_every=5", "optim.warmup_steps=5", "optim.lr=3e-3")
    return cfg, train(cfg, resume=None, quiet=True)


def test_tiny_run_loss_decreases(short_run, corpus):
    cfg, result = short_run
    rows = read_metrics(result.run_dir)
    val = series(rows, "val/loss")
    assert sorted(val) == [19, 39, 59]  # evaluated after steps 20, 40, 60 (CSV steps are 0-based)
    v20, v40, v60 = val[19], val[39], val[59]
    assert v60 < v40 < v20, val
    vocab = json.loads((corpus / "meta.json").read_text())["vocab_size"]
    assert v60 < math.log(vocab) - 1.0  # far below the uniform guess (~4.6 nats)
    train_loss = list(series(rows, "train/loss").values())  # after steps 5, 10, ..., 60
    assert np.mean(train_loss[-3:]) < train_loss[0] - 0.8
    assert result.summary["val_loss"] == pytest.approx(v60) and result.summary["best_val_loss"] == pytest.approx(v60)


def test_tiny_run_logs_schedule_throughput_and_drift(short_run):
    cfg, result = short_run
    rows = read_metrics(result.run_dir)
    schedule = CosineSchedule(cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.max_steps)
    lr = series(rows, "train/lr")
    assert sorted(lr) == list(range(4, 60, 5))  # every log_every=5 optimizer steps
    for step, value in lr.items():  # row `step` = optimizer step step+1, which used lr_at(step)
        assert value == pytest.approx(schedule.lr_at(step), rel=1e-6)
    tokens_per_step = 8 * 64
    assert series(rows, "train/tokens") == {s: float((s + 1) * tokens_per_step) for s in lr}
    tps = series(rows, "perf/tokens_per_s")
    assert len(tps) >= 10 and all(v > 0 for v in tps.values())
    assert not series(rows, "perf/mfu")  # CPU: peak FLOP/s unknown, so no MFU rather than a made-up one
    assert all(v > 0 for v in series(rows, "train/grad_norm").values())
    assert sorted(series(rows, "gauge/qk_drift")) == list(range(4, 60, 5))  # GaugeMonitor, always on


def test_tiny_run_writes_the_run_directory(short_run):
    cfg, result = short_run
    d = result.run_dir
    assert d == cfg_dir(cfg)
    import yaml

    assert config_from_dict(yaml.safe_load((d / "config.yaml").read_text()), name=cfg.name) == cfg
    assert find_checkpoint(d) == d / "checkpoints" / "last.ckpt"
    ckpt = torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 60
    summary = json.loads((d / "summary.json").read_text())
    assert summary["step"] == 60 and summary["tokens"] == 60 * 8 * 64 and summary["condition"] == "A"
    rank0 = json.loads((d / "ranks" / "rank_0.json").read_text())
    assert rank0["world_size"] == 1 and len(rank0["param_sha256"]) == 64


def cfg_dir(cfg):
    from pathlib import Path

    return Path(cfg.train.out_dir) / cfg.run_name


# ---- resume ---------------------------------------------------------------------------------------


class StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_resume_continues_bit_identically(corpus, tmp_path, capsys):
    """Stop at step 10 of 20, resume through the CLI: same parameters, bit for bit, as one uninterrupted run.

    The run exercises what a resume must restore: AdamW moments, the LR schedule, gradient accumulation
    (2 micro-batches), the data stream position, GaugeFix every 3 steps with state transport, and
    validations every 5 steps.
    """
    overrides = ["train.max_steps=20", "train.eval_interval=5", "train.log_every=1", "gauge.monitor_every=1",
                 "train.ckpt_every=10", "data.grad_accum_steps=2", "gauge.fix_every=3", "gauge.transport_state=true",
                 "optim.warmup_steps=5", "train.run_name=resume"]
    full = train(tiny("B", corpus, tmp_path / "full", *overrides), resume=None, quiet=True)
    cut = tiny("B", corpus, tmp_path / "cut", *overrides, "train.progress=lines")
    first = train(cut, resume=None, quiet=True, callbacks=[StopAt(10)])
    assert first.summary["step"] == 10 and find_checkpoint(first.run_dir) is not None
    args = ["--config", str(tmp_path / "cut.yaml")]
    import yaml

    (tmp_path / "cut.yaml").write_text(yaml.safe_dump({k: v for k, v in cut.to_dict().items() if k != "name"}))
    capsys.readouterr()
    assert main(args) == 0  # auto-resumes from the run directory's last.ckpt
    printed = capsys.readouterr().out
    assert "resuming from" in printed
    resumed_rows = read_metrics(tmp_path / "cut" / "resume", version=1)
    # progress lines show the step they name (a callback printing before the module logs would lag by one)
    lines = dict(re.findall(r"^step (\d+)/20 \| loss ([\d.]+) \|", printed, flags=re.M))
    assert sorted(map(int, lines)) == list(range(11, 21))
    assert all(float(lines[str(s + 1)]) == pytest.approx(v, abs=6e-5)
               for s, v in series(resumed_rows, "train/loss").items())
    assert min(series(resumed_rows, "train/loss")) == 10  # it did start at step 11, not from scratch
    final = torch.load(tmp_path / "cut" / "resume" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == 20
    expected = full.module.state_dict()
    got = final["state_dict"]
    assert expected.keys() == got.keys()
    mismatched = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not mismatched, f"{len(mismatched)} tensors differ after resume, e.g. {mismatched[:3]}"
    full_loss = series(read_metrics(full.run_dir), "train/loss")
    assert series(resumed_rows, "train/loss") == {s: full_loss[s] for s in range(10, 20)}


def test_resume_picks_the_newest_of_last_and_slurm_hpc_checkpoints(tmp_path):
    """A requeued slurm job resumes from Lightning's hpc_ckpt_N.ckpt when it is newer than last.ckpt."""
    import os

    assert find_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    last, hpc = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "hpc_ckpt_3.ckpt"
    last.write_bytes(b"x")
    hpc.write_bytes(b"x")
    os.utime(last, (1000, 1000))
    os.utime(hpc, (2000, 2000))
    assert find_checkpoint(tmp_path) == hpc
    os.utime(last, (3000, 3000))
    assert find_checkpoint(tmp_path) == last


# ---- GaugeFix vs drift ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conditions(corpus, tmp_path_factory):
    """40 steps at lr 1e-2 under A, B, C and GaugeFix every 10; monitor every 5."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("conditions")
    common = ["train.max_steps=40", "train.eval_interval=20", "train.log_every=5", "gauge.monitor_every=5",
              "optim.warmup_steps=5", "optim.lr=1e-2"]
    runs = {}
    for label, cond, extra in [("A", "A", []), ("B", "B", []), ("C", "C", []), ("every10", "B", ["gauge.fix_every=10"])]:
        runs[label] = train(tiny(cond, corpus, out, *common, *extra, f"train.run_name={label}"), resume=None, quiet=True)
    return runs


def test_gaugefix_conditions_end_balanced_while_baselines_drift(conditions):
    drift = {k: gaugeopt.qk_drift(r.module.model) for k, r in conditions.items()}  # measured on the final model
    assert drift["B"] <= 1e-5 and drift["every10"] <= 1e-5, drift  # step 40 is a fix step for both
    assert drift["A"] >= 1e-3 and drift["C"] >= 1e-3, drift
    assert min(drift["A"], drift["C"]) >= 100 * max(drift["B"], drift["every10"]), drift
    for k, r in conditions.items():
        assert r.summary["qk_drift"] == pytest.approx(drift[k])


def test_gaugefix_logs_drift_before_and_after(conditions):
    b = read_metrics(conditions["B"].run_dir)
    after = series(b, "gauge/qk_drift_after")
    assert after and max(after.values()) <= 1e-5
    assert max(series(b, "gauge/qk_drift_before").values()) > 1e-5  # there was drift to remove
    monitored = series(read_metrics(conditions["every10"].run_dir), "gauge/qk_drift")
    # between fixes (monitored after steps 5, 15, 25, 35) drift comes back; right after them it is gone
    assert max(monitored[s] for s in (4, 14, 24, 34)) > 1e-4, monitored
    assert max(monitored[s] for s in (9, 19, 29, 39)) <= 1e-5, monitored
    c = series(read_metrics(conditions["C"].run_dir), "gauge/qk_drift")
    assert c[39] > c[4] > 0  # without control it grows


# ---- the data stream ------------------------------------------------------------------------------


def test_windows_are_nanogpt_get_batch_and_deterministic(corpus):
    data = np.memmap(corpus / "train.bin", dtype=np.uint16, mode="r")
    ds = RandomWindows(corpus / "train.bin", block_size=32, batch_size=4, seed=7, rank=1)
    x, y = ds.batch(5)
    ix = np.random.default_rng((7, 0, 1, 5)).integers(0, len(data) - 32, size=4)  # the documented draw
    for b, i in enumerate(ix):
        assert x[b].tolist() == data[i : i + 32].tolist() and y[b].tolist() == data[i + 1 : i + 33].tolist()
    assert x.dtype == torch.int64 and x.shape == (4, 32)
    again = RandomWindows(corpus / "train.bin", 32, 4, seed=7, rank=1).batch(5)
    assert torch.equal(again[0], x)
    other_rank = RandomWindows(corpus / "train.bin", 32, 4, seed=7, rank=0).batch(5)
    other_seed = RandomWindows(corpus / "train.bin", 32, 4, seed=8, rank=1).batch(5)
    assert not torch.equal(other_rank[0], x) and not torch.equal(other_seed[0], x)


def test_stream_resumes_at_an_offset_and_ignores_worker_count(corpus):
    from torch.utils.data import DataLoader

    def take(ds, n, workers):
        it = iter(DataLoader(ds, batch_size=None, num_workers=workers))
        return [next(it)[0] for _ in range(n)]

    base = take(RandomWindows(corpus / "train.bin", 16, 2, seed=3, rank=0), 6, 0)
    later = take(RandomWindows(corpus / "train.bin", 16, 2, seed=3, rank=0, start=2), 4, 0)
    assert all(torch.equal(a, b) for a, b in zip(base[2:], later))
    with_workers = take(RandomWindows(corpus / "train.bin", 16, 2, seed=3, rank=0), 6, 2)
    assert all(torch.equal(a, b) for a, b in zip(base, with_workers))


def test_validation_windows_are_fixed_and_split_over_ranks(corpus):
    whole = FixedWindows(corpus / "val.bin", 16, 2, eval_seed=11, indices=range(6))
    parts = [FixedWindows(corpus / "val.bin", 16, 2, eval_seed=11, indices=range(r, 6, 2)) for r in (0, 1)]
    assert [len(p) for p in parts] == [3, 3]
    got = sorted((p.indices[j], p[j][0]) for p in parts for j in range(len(p)))
    assert all(torch.equal(t, whole[k][0]) for k, t in got) and [k for k, _ in got] == list(range(6))


# ---- command line and errors ----------------------------------------------------------------------


def test_cli_dry_run_prints_the_batch_arithmetic(capsys):
    from train_helpers import CONFIGS

    assert main(["--config", str(CONFIGS / "gpt2_owt_B.yaml"), "--set", "train.seed=123", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "12 sequences/micro-batch × 5 micro-batches/rank × 8 ranks = 480 sequences/iteration" in out
    assert "491,520 tokens/iteration; × 20,000 iterations = 9,830,400,000 tokens" in out
    assert "runs/gpt2_owt_B_s123" in out and "bf16-mixed" in out and "fix_every=1 " in out


def test_cli_reports_config_errors_without_a_traceback(capsys):
    from train_helpers import CONFIGS

    assert main(["--config", str(CONFIGS / "gpt2_owt_C.yaml"), "--set", "gauge.fix_every=10", "--dry-run"]) == 2
    assert "no-control ablation" in capsys.readouterr().err


@pytest.mark.slow
def test_wandb_logs_offline_by_default(corpus, tmp_path, monkeypatch):
    """`train.wandb: true` with no WANDB_MODE: an offline run in the run directory, holding the gauge metrics."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = train(tiny("B", corpus, tmp_path, "train.max_steps=10", "train.eval_interval=10", "train.wandb=true",
                        "optim.warmup_steps=2"), resume=None, quiet=True)
    runs = list((result.run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and not list((result.run_dir / "wandb").glob("run-*"))  # offline, nothing synced
    records = next(runs[0].glob("run-*.wandb")).read_bytes()
    for key in (b"gauge/qk_drift", b"gauge/qk_drift_after", b"train/loss", b"val/loss"):
        assert key in records


def test_missing_data_says_how_to_prepare_it(tmp_path):
    from recipes.config import ConfigError

    with pytest.raises(ConfigError, match="python -m recipes.data"):
        train(tiny("A", tmp_path / "nothing", tmp_path / "runs"), resume=None, quiet=True)


# ---- the demo ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_quick_shows_the_drift_contrast(corpus, tmp_path, capsys):
    """`python -m recipes.demo --quick`: four runs in parallel worker processes, a table, a plot."""
    from recipes.demo import main as demo_main

    out = tmp_path / "demo"
    assert demo_main(["--quick", "--out", str(out), "--data", str(corpus)]) == 0
    printed = capsys.readouterr().out
    for row in ("| A | 2e-3 | - |", "| B | 0 | every 1 |", "| C | 0 | - |", "| every 100 | 0 | every 100 |"):
        assert row in printed
    results = json.loads((out / "results.json").read_text())
    drift = {r["label"]: r["summary"]["qk_drift"] for r in results["runs"]}
    assert drift["B"] <= 1e-5 and drift["every 100"] <= 1e-5, drift  # step 100 is a fix step for both
    assert drift["A"] >= 1e-3 and drift["C"] >= 1e-3, drift
    every100 = dict(next(r for r in results["runs"] if r["label"] == "every 100")["drift"])
    assert every100[90] >= 1e-3 and every100[100] <= 1e-5  # drifts like C until its first fix
    assert all(r["summary"]["step"] == 100 for r in results["runs"])
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "table.md").read_text().count("\n| ") == 5  # header + four runs
