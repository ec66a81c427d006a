"""How vertical are raw gradients and AdamW updates, and what does projecting them cost?

Goal (docs/projection.md; paper 000 Prop. 38, paper 004 Fig. 3): train a small GPT with AdamW and
measure, every few steps, the vertical (pure-gauge) fraction ``‖u_vert‖/‖u‖`` of

* the raw gradient ``g`` (a gauge-invariant loss: horizontal up to rounding), and
* the update AdamW actually takes, ``Δ = θ_new − θ_old`` (per-coordinate scaling and weight
  decay are not gauge-equivariant: a real vertical part),

per attention layer and per sector, in float64 at ``θ_old``. Then time, in one interleaved
loop on the trained model, one optimizer step (forward + backward + AdamW) against one exact
and one approximate projection of an update (what :class:`gaugeopt.GaugeOptimizer` adds per
step), and a whole ``GaugeOptimizer(AdamW)`` step — ratios from the same run. A second cost
block repeats the timing for a GPT-2-small-shaped model (12 layers, 12 heads, d 768).

Model: nanoGPT-style GPT (4 layers, 4 heads, d 128, learned positions, LayerNorm, GELU,
biases), character-level on CPython's own documentation (``pydoc_data.topics``, in every
Python install), batch 12 × 128, AdamW lr 1e-3 (20 warm-up steps), betas (0.9, 0.95),
weight decay 0.1 on matrices. ``--lrm`` converts it with :func:`gaugeopt.apply_lrm` and uses
paper 002's condition A groups (all five sectors are then measured).

Hardware: the docs table names the machine. Launch (from the repo root):

    python benchmarks/vertical_fraction.py                      # CPU, ~2-4 min on 2 cores
    python benchmarks/vertical_fraction.py --lrm                # the same with learnable multipliers
    python benchmarks/vertical_fraction.py --device cuda --cost-only --gpt2 --gpt2-tokens 8x1024   # GPU

On CPU the script runs single-threaded (``--threads``): on a shared machine OpenMP spin-waiting
otherwise dominates the timings; plain step and projection then use the same resources.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import gaugeopt
from gaugeopt.projection.diagnostics import vertical_report
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.projection.projector import GaugeProjector


def corpus() -> tuple[torch.Tensor, int]:
    from pydoc_data import topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    chars = sorted(set(text))
    lut = {c: i for i, c in enumerate(chars)}
    return torch.tensor([lut[c] for c in text], dtype=torch.long), len(chars)


def batch(data: torch.Tensor, B: int, T: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - T - 1, (B,), generator=gen)
    x = torch.stack([data[i : i + T] for i in ix])
    y = torch.stack([data[i + 1 : i + T + 1] for i in ix])
    return x.to(device), y.to(device)


def adamw(model: torch.nn.Module, lrm: bool, lr: float) -> torch.optim.Optimizer:
    if lrm:
        groups = gaugeopt.lrm_param_groups(model, "A")
    else:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def build(cfg: GPTConfig, lrm: bool, device) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    if lrm:
        gaugeopt.apply_lrm(model)
    return model.to(device)


def train_and_measure(args, data, vocab) -> dict:
    cfg = GPTConfig(vocab_size=vocab, block_size=args.T, n_layer=4, n_head=4, n_embd=128)
    model = build(cfg, args.lrm, args.device)
    opt = adamw(model, args.lrm, args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    gen = torch.Generator().manual_seed(1)
    at_steps = sorted({1, *range(args.every, args.steps + 1, args.every)})
    rows, losses = [], []
    for step in range(1, args.steps + 1):
        x, y = batch(data, args.B, args.T, gen, args.device)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        measure = step in at_steps
        if measure:
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if measure:
            update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
            g = vertical_report(model, grads, at=before, dtype=torch.float64)
            u = vertical_report(model, update, at=before, dtype=torch.float64)
            rows.append({"step": step, "loss": float(loss.detach()), "grad": _summary(g), "update": _summary(u)})
            print(f"step {step:4d}  loss {float(loss.detach()):.3f}  vertical fraction: grad {g.total:.2e}  AdamW update {u.total:.3e}", flush=True)
    return {"config": cfg.to_dict(), "rows": rows, "final_loss": sum(losses[-20:]) / 20, "model": model, "opt": opt}


def _summary(rep) -> dict:
    return {"total": rep.total, "sectors": rep.sectors, "layers": rep.layers, "defect": rep.defect}


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def cost(model: GPT, lrm: bool, data, args, reps: int, B: int, T: int, label: str) -> dict:
    """Median seconds of a plain step, an exact and an approx projection, a wrapped step; interleaved."""
    device = args.device
    plain, wrapped_model = model, copy.deepcopy(model)
    opt = adamw(plain, lrm, 1e-4)
    sectors = args.sectors.split(",") if args.sectors != "auto" else "auto"
    wopt = gaugeopt.GaugeOptimizer(adamw(wrapped_model, lrm, 1e-4), wrapped_model, sectors=sectors)
    exact, approx = GaugeProjector(plain, sectors, mode="exact"), GaugeProjector(plain, sectors, mode="approx")
    gen = torch.Generator().manual_seed(2)
    times: dict[str, list[float]] = {"step": [], "exact": [], "approx": [], "wrapped_step": []}

    def timed(key, fn):
        _sync(device)
        t = time.perf_counter()
        out = fn()
        _sync(device)
        times[key].append(time.perf_counter() - t)
        return out

    def step(m, o):
        x, y = batch(data, B, T, gen, device)
        o.zero_grad(set_to_none=True)
        m(x, y)[1].backward()
        o.step()

    for i in range(reps + 2):  # two warm-up rounds, discarded
        before = {n: p.detach().clone() for n, p in plain.named_parameters()}
        timed("step", lambda: step(plain, opt))
        update = {n: p.detach() - before[n] for n, p in plain.named_parameters()}
        timed("exact", lambda: exact.vertical(update, at=before))
        timed("approx", lambda: approx.vertical(update, at=before))
        timed("wrapped_step", lambda: step(wrapped_model, wopt))
        if i < 2:
            for v in times.values():
                v.clear()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "label": label,
        "tokens_per_step": B * T,
        "median_s": med,
        "exact_over_step": med["exact"] / med["step"],
        "approx_over_step": med["approx"] / med["step"],
        "wrapped_over_plain": med["wrapped_step"] / med["step"],
        "reps": reps,
    }
    print(
        f"[{label}] step {med['step'] * 1e3:.1f} ms, exact projection {med['exact'] * 1e3:.1f} ms "
        f"({out['exact_over_step']:.3f}×), approx {med['approx'] * 1e3:.1f} ms ({out['approx_over_step']:.3f}×), "
        f"GaugeOptimizer step {out['wrapped_over_plain']:.3f}× the plain step",
        flush=True,
    )
    return out


def per_layer_table(res: dict) -> str:
    rows = [r for r in res["rows"] if r["step"] >= 50] or res["rows"]
    layers = list(rows[0]["grad"]["layers"])
    sectors = list(rows[0]["grad"]["sectors"])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    fmt = lambda x: f"{x:.3f}" if x >= 1e-2 else f"{x:.1e}"  # noqa: E731
    out = ["| layer | raw gradient | AdamW update |", "|---|---|---|"]
    for ly in layers:
        g = mean([r["grad"]["layers"][ly] for r in rows])
        u = mean([r["update"]["layers"][ly] for r in rows])
        out.append(f"| {ly} | {g:.1e} | {fmt(u)} |")
    for s in sectors:
        g = mean([r["grad"]["sectors"][s] for r in rows])
        u = mean([r["update"]["sectors"][s] for r in rows])
        out.append(f"| sector `{s}` (of all parameters) | {g:.1e} | {fmt(u)} |")
    g = mean([r["grad"]["total"] for r in rows])
    u = mean([r["update"]["total"] for r in rows])
    out.append(f"| all sectors (of all parameters) | {g:.1e} | {fmt(u)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--B", type=int, default=12)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lrm", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--cost-only", action="store_true", help="skip training; time the projection only")
    ap.add_argument("--gpt2", action="store_true", help="also time a GPT-2-small-shaped model")
    ap.add_argument("--gpt2-tokens", type=str, default="2x128", help="B×T of the GPT-2-small-shaped cost run")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    ap.add_argument("--sectors", default="auto", help="sectors projected in the cost block, e.g. qk,vo,lrm_qk,lrm_vo")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data, vocab = corpus()
    result: dict = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads(), "lrm": args.lrm,
                    "sectors": args.sectors}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    t0 = time.time()
    if not args.cost_only:
        res = train_and_measure(args, data, vocab)
        model = res.pop("model")
        res.pop("opt")
        result["training"] = res
        print(f"\nmean over steps >= 50 (vertical fraction ‖u_vert‖/‖u‖; layers: over that layer's attention parameters)\n")
        print(per_layer_table(res))
    else:
        model = build(GPTConfig(vocab_size=vocab, block_size=args.T, n_layer=4, n_head=4, n_embd=128), args.lrm, args.device)
    result["cost_small"] = cost(model, args.lrm, data, args, args.reps, args.B, args.T, "4L/4H/128")
    if args.gpt2:
        gb, gt = (int(v) for v in args.gpt2_tokens.split("x"))
        big = build(GPTConfig(vocab_size=50304, block_size=max(gt, 64)), args.lrm, args.device)
        big_data = torch.randint(0, 50304, (100_000,), generator=torch.Generator().manual_seed(3))
        result["cost_gpt2_small"] = cost(big, args.lrm, big_data, args, max(3, args.reps // 3), gb, gt, f"GPT-2 small shape, {gb}×{gt} tokens")
    result["wall_s"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
    print(f"\ntotal {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
