"""One benchmark for the gauge work's speed: every op against one fused AdamW step, on one device.

For each model shape, with and without learnable multipliers (LRM), the same layers are built
as a real model (``gaugeopt.models.GPT``: embeddings, blocks, head) and every op is timed
**side by side in one run**: the ops of a shape are interleaved round by round and each keeps
its fastest round (CPU; on CUDA the median of ``triton.testing.do_bench``). Ratios, never
absolute times from different runs, are what the table is for.

On CPU the clock is the compute thread's CPU time (one intra-op thread, ``--threads``):
preemption by other jobs on a shared machine is not counted, contention for memory bandwidth is.

Shapes (``MODELS``): ``gpt-4l128`` (the 4-layer, width-128 char model of
``benchmarks/vertical_fraction.py``, 12×128 tokens), ``gpt2-124m`` (12 L, 12 H, d 768),
``gpt2-1.5b`` (48 L, 25 H, d 1600), ``llama-gqa`` (Llama-3-8B-like: 32 L, 32 query / 8 KV heads,
d_k 128, d 4096, split-half RoPE, SwiGLU 14336, no biases, 32k vocabulary). On CPU a few layers
of each (column ``layers``), on CUDA all of them (``llama-gqa``: 4, so that AdamW's state and the
projection's temporaries fit an 80 GB GPU).

Rows (``ms`` per call):

* ``adamw attn`` / ``adamw blocks``: one fused AdamW step (``fused=True``) over the attention
  parameters of those layers / over the whole blocks (attention, MLP, norms; embeddings
  excluded, which makes the "whole model" ratio conservative). Every other row is divided by both.
* ``gaugefix``: :class:`gaugeopt.GaugeFixer` (Q/K, torch backend; on CUDA also the Triton
  kernel, tables packed once) — the multipliers (``lrm``) or the W_Q/W_K rows and their Adam
  state (``plain``).
* ``proj qk+vo exact|approx|paper000``: :meth:`gaugeopt.projection.GaugeProjector.vertical` of a
  random field over both dense sectors; ``lrm_qk`` (closed form), ``lrm_internal``, ``all
  sectors`` (the joint projection of an LRM model: the head and multiplier sectors, as in the
  recorded runs; the bias sectors, which these biased models also have, are left out).
* ``gemm floor (qk+vo)``: not a measurement of the projector — the exact projection's three
  ``n×n×m`` products per head and side (Gram, cross term, vertical part) at the bmm rate measured
  on that shape: the time no implementation of the exact method can beat here.
* ``train step``: forward, backward and fused AdamW of the whole model on B×T tokens (eager on
  CPU; ``torch.compile`` + bf16 autocast on CUDA for ``gpt2-124m``, eager for the others); ``LRM/plain`` rows: the AdamW step over the
  blocks and the tokens/s of the LRM model relative to the plain one.
* ``gpt2-124m-whole``: the whole GPT-2 124M model (all 12 layers, embeddings, head) for the ops
  whose cost does not grow like the layers' weights — ``adamw model`` (one fused AdamW step over
  every parameter, condition-C groups with multipliers), ``gaugefix`` against it, and the
  LRM/plain AdamW and tokens/s ratios at full depth (column ``×AdamW blocks`` holds the ratio to
  ``adamw model`` there).

``GB/s``: the minimum traffic of the op (every tensor read once, every output written once;
AdamW 7 accesses per entry) over its time, and its share of a measured device copy.

Results: ``benchmarks/results/speed_<machine>.md`` and ``.json``, the table also printed.

Run:
    python benchmarks/speed.py                 # CPU, one thread (see --threads), ~4 min on 2 cores
    python benchmarks/speed.py --device cuda   # one GPU, every layer, < 8 min (benchmarks/gpu_check.sh)
    python benchmarks/speed.py --smoke         # tiny shapes, seconds (tests/project/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaugeopt  # noqa: E402
from gaugeopt.fix.plan import plan_pairs  # noqa: E402
from gaugeopt.models import GPT, GPTConfig  # noqa: E402
from gaugeopt.projection.projector import GaugeProjector  # noqa: E402

MODELS = {
    "gpt-4l128": dict(cfg=dict(n_layer=4, n_head=4, n_embd=128, vocab_size=96), tokens=(12, 128), cpu_layers=4,
                      gpu_tokens=(12, 128)),
    "gpt2-124m": dict(cfg=dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304), tokens=(1, 256), cpu_layers=2,
                      gpu_tokens=(8, 1024), compile=True),
    "gpt2-124m-whole": dict(cfg=dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304), tokens=(1, 256), cpu_layers=12,
                            gpu_tokens=None, whole=True),
    "gpt2-1.5b": dict(cfg=dict(n_layer=48, n_head=25, n_embd=1600, vocab_size=50304), tokens=None, cpu_layers=1,
                      gpu_tokens=None),
    "llama-gqa": dict(cfg=dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, rope="split_half", norm="rmsnorm",
                               mlp="swiglu", mlp_hidden=14336, bias=False, vocab_size=32000, tie_weights=False),
                      tokens=None, cpu_layers=1, gpu_layers=4, gpu_tokens=None),
}
SMOKE = {
    "gpt-tiny": dict(cfg=dict(n_layer=2, n_head=4, n_embd=32, vocab_size=64), tokens=(2, 16), cpu_layers=2),
    "gqa-tiny": dict(cfg=dict(n_layer=1, n_head=4, n_kv_head=2, n_embd=32, rope="split_half", norm="rmsnorm", mlp="swiglu",
                              bias=False, vocab_size=64, tie_weights=False), tokens=(2, 16), cpu_layers=1),
    "gpt-tiny-whole": dict(cfg=dict(n_layer=2, n_head=4, n_embd=32, vocab_size=64), tokens=(2, 16), cpu_layers=2, whole=True),
}


# ---------------------------------------------------------------------- device facts
def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            name = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name} ({os.cpu_count()} cores)"


def copy_gbps(device: torch.device, bench) -> float:
    n = (1 << 28) if device.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    ms = bench({"copy": lambda: b.copy_(a)})["copy"]
    return 2 * a.numel() * 4 / ms / 1e6


def make_bench(device: torch.device, rounds: int):
    """``bench({name: fn}) -> {name: ms}``: interleaved rounds, fastest (CPU) or median (CUDA).

    On CPU the time is the compute thread's CPU time (``time.thread_time``; one intra-op thread),
    so that preemption by other jobs on a shared machine does not count; contention for memory
    bandwidth still does."""
    if device.type == "cuda":
        import triton.testing

        def cuda(fns):
            return {k: float(triton.testing.do_bench(f, warmup=5, rep=40, return_mode="median")) for k, f in fns.items()}

        return cuda

    def cpu(fns):
        best = {}
        for k, f in fns.items():  # warm-up (and the state a first call creates)
            f()
        for _ in range(rounds):
            for k, f in fns.items():
                t0 = time.thread_time_ns()
                f()
                ms = (time.thread_time_ns() - t0) / 1e6
                best[k] = min(best.get(k, math.inf), ms)
        return best

    return cpu


# ---------------------------------------------------------------------- models and bytes
def build(spec: dict, layers: int, lrm: bool, device: torch.device, block: int) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block, **{**spec["cfg"], "n_layer": layers})
    with torch.device(device):
        model = GPT(cfg)
    if lrm:
        gaugeopt.apply_lrm(model)
        with torch.no_grad():  # multipliers away from 1, as after some training
            g = torch.Generator(device="cpu").manual_seed(1)
            for m in model.modules():
                if isinstance(m, gaugeopt.LRMLinear):
                    for r in (*m.row_mults, *m.col_mults):
                        r.copy_(torch.exp(0.2 * torch.randn(r.shape, generator=g)).to(r))
    return model


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def adamw_bytes(params) -> int:
    return sum(7 * nbytes(p) for p in params)  # p, m, v read and written, g read


def sector_bytes(proj: GaugeProjector) -> int:
    """Parameters and the field read once, the vertical part written once."""
    params = dict(proj.model.named_parameters())
    return sum(3 * nbytes(params[n]) for n in proj.param_names())


def gaugefix_bytes(sites, opt) -> int:
    """Touched rows read (statistics), then read and written with each AdamW moment."""
    total = 0
    for plan in plan_pairs(sites):
        for _, members in plan.sides():
            for m in members:
                v = m.ref.get()
                moments = [s for s in opt.state[m.ref.param].values() if torch.is_tensor(s) and s.dim() > 0]
                total += 3 * nbytes(v) + sum(2 * v.numel() * s.element_size() for s in moments)
    return total


def gemm_floor(site, device: torch.device, bench) -> tuple[float, float]:
    """``(ms, GFLOP/s)``: the exact qk+vo projection's three ``n×n×m`` products per head and side of
    one layer (Gram, cross term, vertical part; ``n`` the dense block's width: the non-rotary
    channels for ``qk``, whose RoPE planes are a closed form) at the bmm rate measured on the
    Gram shape ``(h, d_v, d) @ (h, d, d_v)``."""
    h, m = site.h, site.d_model
    n_qk = site.d_k - site.rope.rotary_dim if site.rope.active else site.d_k
    A = torch.randn(h, site.d_v, m, device=device)
    ms = bench({"bmm": lambda: torch.bmm(A, A.mT)})["bmm"]
    rate = 2 * h * site.d_v**2 * m / ms / 1e6
    heads = site.h + site.h_kv  # per pair: h query (or O) heads, h_kv key (or V) heads
    flops = 3 * 2 * heads * (n_qk**2 + site.d_v**2) * (m + 1)
    return flops / rate / 1e6, rate


# ---------------------------------------------------------------------- one shape
def measure_whole(name: str, spec: dict, layers: int, tokens, device, bench, out: list, deadline: float) -> None:
    """AdamW over the whole model, GaugeFix against it, and the LRM/plain ratios at full depth."""
    rows = {}
    for variant in ("plain", "lrm"):
        if time.time() > deadline:
            rows[(variant, "all")] = dict(model=name, layers=layers, params=variant, op="all", ms=None,
                                          note="skipped: time budget spent")
            continue
        model = build(spec, layers, variant == "lrm", device, tokens[1] if tokens else 64)
        groups = _groups(model, variant)
        gen = torch.Generator(device=device).manual_seed(2)
        for p in model.parameters():
            p.grad = 1e-3 * torch.randn(p.shape, generator=gen, device=device)
        opt = torch.optim.AdamW(groups, lr=1e-4, fused=True)
        opt.step()
        sites = gaugeopt.find_attention(model)
        fns = {"adamw model": opt.step, "gaugefix": gaugeopt.GaugeFixer(None, opt, sites=sites, backend="torch")}
        nb = {"adamw model": adamw_bytes(list(model.parameters())), "gaugefix": gaugefix_bytes(sites, opt)}
        if device.type == "cuda":
            fns["gaugefix triton"] = gaugeopt.GaugeFixer(None, opt, sites=sites, backend="triton")
            nb["gaugefix triton"] = nb["gaugefix"]
        if tokens:
            fns["train step"] = _train_step(model, groups, tokens, device, compiled=False)
        ms = bench(fns)
        for k, v in ms.items():
            what = "multipliers" if variant == "lrm" else "W_Q/W_K rows + Adam state"
            note = {"gaugefix": what, "gaugefix triton": what,
                    "train step": f"{tokens[0]}×{tokens[1]} tokens, eager" if tokens else ""}.get(k, "")
            rows[(variant, k)] = dict(model=name, layers=layers, params=variant, op=k, ms=v, bytes=nb.get(k),
                                      x_blocks=v / ms["adamw model"], note=note)
        del fns, opt, model, groups
        gc.collect()
    for op, label, invert in (("adamw model", "LRM/plain adamw model", False), ("train step", "LRM/plain tokens/s", True)):
        p, l_ = rows.get(("plain", op), {}).get("ms"), rows.get(("lrm", op), {}).get("ms")
        if p and l_:
            rows[("lrm", label)] = dict(model=name, layers=layers, params="lrm", op=label, ms=None,
                                        ratio=p / l_ if invert else l_ / p, note="whole model")
    out.extend(rows.values())


def _groups(model, variant: str) -> list[dict]:
    """Paper 002's condition-C groups with multipliers; decay on matrices only without."""
    if variant == "lrm":
        return gaugeopt.lrm_param_groups(model, "C", lr=1e-4)
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def measure(name: str, spec: dict, layers: int, tokens, device, bench, rounds: int, out: list, deadline: float,
            compile_tokens: bool) -> None:
    if spec.get("whole"):
        return measure_whole(name, spec, layers, tokens, device, bench, out, deadline)
    on_gpu = device.type == "cuda"
    T = tokens[1] if tokens else 64
    full = spec["cfg"]["n_layer"]
    print(f"{name}: {layers}/{full} layers, tokens {tokens}", flush=True)
    rows = {}

    def row(variant, op, ms, nbytes_=None, note=""):
        rows[(variant, op)] = dict(model=name, layers=layers, params=variant, op=op, ms=ms, bytes=nbytes_, note=note)

    for variant in ("plain", "lrm"):  # one model at a time (memory)
        if time.time() > deadline:
            row(variant, "all", None, note="skipped: time budget spent")
            continue
        model = build(spec, layers, variant == "lrm", device, T)
        sites = gaugeopt.find_attention(model)
        named = dict(model.named_parameters())
        attn = [named[n] for n in dict.fromkeys(n for s in sites for n in s.parameter_names())]
        blocks = [p for n, p in model.named_parameters() if ".h." in n]
        groups = _groups(model, variant)
        block_ids = {id(p) for p in blocks}
        block_groups = [{**g, "params": [p for p in g["params"] if id(p) in block_ids]} for g in groups]
        block_groups = [g for g in block_groups if g["params"]]
        gen = torch.Generator(device=device).manual_seed(2)
        for p in model.parameters():
            p.grad = 1e-3 * torch.randn(p.shape, generator=gen, device=device)
        opt_attn = torch.optim.AdamW(attn, lr=1e-4, weight_decay=0.1, fused=True)
        opt_blocks = torch.optim.AdamW(block_groups, lr=1e-4, fused=True)
        opt_attn.step()
        opt_blocks.step()
        u = {n: torch.randn(p.shape, generator=gen, device=device) for n, p in model.named_parameters()}
        fns, nb, notes = {}, {}, {}
        fns["adamw attn"], nb["adamw attn"] = opt_attn.step, adamw_bytes(attn)
        fns["adamw blocks"], nb["adamw blocks"] = opt_blocks.step, adamw_bytes(blocks)
        fixer = gaugeopt.GaugeFixer(None, opt_attn, sites=sites, backend="torch")
        fns["gaugefix"], nb["gaugefix"] = fixer, gaugefix_bytes(sites, opt_attn)
        notes["gaugefix"] = "multipliers" if variant == "lrm" else "W_Q/W_K rows + Adam state"
        if on_gpu:
            tfix = gaugeopt.GaugeFixer(None, opt_attn, sites=sites, backend="triton")
            fns["gaugefix triton"], nb["gaugefix triton"] = tfix, nb["gaugefix"]
        for mode in ("exact", "approx", "paper000"):
            proj = GaugeProjector(model, sectors=("qk", "vo"), mode=mode)
            fns[f"proj qk+vo {mode}"] = (lambda proj=proj: proj.vertical(u))
            nb[f"proj qk+vo {mode}"] = sector_bytes(proj)
        if variant == "lrm":
            for label, sectors in (("proj lrm_qk", ("lrm_qk",)), ("proj lrm_internal", ("lrm_internal",)),
                                   ("proj all sectors", ("qk", "vo", "lrm_qk", "lrm_vo", "lrm_internal"))):
                proj = GaugeProjector(model, sectors=sectors)
                fns[label], nb[label] = (lambda proj=proj: proj.vertical(u)), sector_bytes(proj)
            if on_gpu:
                tproj = GaugeProjector(model, sectors=("lrm_qk",), backend="triton")
                fns["proj lrm_qk triton"], nb["proj lrm_qk triton"] = (lambda: tproj.vertical(u)), nb["proj lrm_qk"]
        if tokens and not (on_gpu and compile_tokens):
            fns["train step"] = _train_step(model, groups, tokens, device, compiled=False)
            notes["train step"] = f"{tokens[0]}×{tokens[1]} tokens, eager"
        times = {}
        for k, f in fns.items():  # an op that alone would overrun the budget is skipped, not timed out
            if time.time() > deadline:
                row(variant, k, None, note="skipped: time budget spent")
                continue
            times[k] = f
        ms = bench(times)
        for k, v in ms.items():
            row(variant, k, v, nb.get(k), notes.get(k, ""))
        if on_gpu and tokens and compile_tokens and time.time() < deadline:
            step = _train_step(model, groups, tokens, device, compiled=True)
            t0 = time.time()
            step()
            step()
            warm = time.time() - t0
            row(variant, "train step", bench({"s": step})["s"],
                note=f"{tokens[0]}×{tokens[1]} tokens, torch.compile + bf16 (warm-up {warm:.0f} s)")
        if on_gpu or variant == "plain":
            fl, rate = gemm_floor(sites[0], device, bench)
            row(variant, "gemm floor (qk+vo)", fl * len(sites), note=f"bmm {rate:.0f} GFLOP/s on the Gram shape; eigh excluded")
        del fns, times, opt_attn, opt_blocks, fixer, u, model, named, attn, blocks, groups, block_groups
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    # ratios
    for variant in ("plain", "lrm"):
        a = rows.get((variant, "adamw attn"), {}).get("ms")
        b = rows.get((variant, "adamw blocks"), {}).get("ms")
        for (v, op), r in rows.items():
            if v != variant or r["ms"] is None:
                continue
            r["x_attn"] = r["ms"] / a if a else None
            r["x_blocks"] = r["ms"] / b if b else None
            ts = rows.get((variant, "train step"), {}).get("ms")
            r["x_train"] = r["ms"] / ts if ts and op.startswith("proj") else None
    pb, lb = rows.get(("plain", "adamw blocks"), {}).get("ms"), rows.get(("lrm", "adamw blocks"), {}).get("ms")
    if pb and lb:
        rows[("lrm", "LRM/plain adamw blocks")] = dict(model=name, layers=layers, params="lrm", op="LRM/plain adamw blocks",
                                                       ms=None, ratio=lb / pb, note="fused AdamW, condition-C groups")
    pt, lt = rows.get(("plain", "train step"), {}).get("ms"), rows.get(("lrm", "train step"), {}).get("ms")
    if pt and lt:
        rows[("lrm", "LRM/plain tokens/s")] = dict(model=name, layers=layers, params="lrm", op="LRM/plain tokens/s",
                                                   ms=None, ratio=pt / lt, note=rows[("lrm", "train step")]["note"])
    out.extend(rows.values())


def _train_step(model, groups, tokens, device, compiled: bool):
    B, T = tokens
    opt = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    x = torch.randint(0, model.config.vocab_size, (B, T), device=device,
                      generator=torch.Generator(device=device).manual_seed(3))
    fwd = torch.compile(model) if compiled else model
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if compiled else torch.autocast(device.type, enabled=False)

    def step():
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = fwd(x, x)[1]
        loss.backward()
        opt.step()

    return step


# ---------------------------------------------------------------------- the table
def markdown(rows: list[dict], head: dict) -> str:
    lines = [f"### {head['machine']}", "",
             f"torch {head['torch']}, {head['threads']} thread(s), device copy {head['copy_gbps']:.1f} GB/s, "
             f"load average {head['load_before']} before / {head['load_after']} after, run {head['seconds']:.0f} s. "
             f"{head['timing']}", "",
             "| model | layers | params | op | ms | ×AdamW attn | ×AdamW blocks | ×train step | GB/s (% copy) | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.3g}"):
        return "—" if x is None else fmt.format(x)

    for r in rows:
        if r.get("ratio") is not None:
            lines.append(f"| {r['model']} | {r['layers']} | {r['params']} | **{r['op']}** | | | | | | "
                         f"**{r['ratio']:.3f}** {r.get('note', '')} |")
            continue
        gbps = r["bytes"] / r["ms"] / 1e6 if (r.get("bytes") and r.get("ms")) else None
        cell = "—" if gbps is None else f"{gbps:.1f} ({100 * gbps / head['copy_gbps']:.0f}%)"
        lines.append(f"| {r['model']} | {r['layers']} | {r['params']} | {r['op']} | {f(r['ms'], '{:.3f}')} | "
                     f"{f(r.get('x_attn'), '{:.3f}')} | {f(r.get('x_blocks'), '{:.3f}')} | {f(r.get('x_train'), '{:.3f}')} | "
                     f"{cell} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=None, help="comma list of MODELS (default: all)")
    ap.add_argument("--layers", type=int, default=None, help="layers per model (default: the model's cpu_layers on CPU, all on CUDA)")
    ap.add_argument("--rounds", type=int, default=5, help="CPU: interleaved rounds, the fastest counts")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU intra-op threads (default 1: on a shared machine OpenMP spin-waiting dominates otherwise)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the remaining rows after this many seconds")
    ap.add_argument("--no-compile", action="store_true", help="CUDA: eager train steps instead of torch.compile + bf16")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one round: checks that the script runs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if not on_gpu:
        torch.set_num_threads(args.threads)
    catalog = SMOKE if args.smoke else MODELS
    names = args.models.split(",") if args.models else list(catalog)
    rounds = 1 if args.smoke else args.rounds
    bench = make_bench(device, rounds)
    t_start = time.time()
    deadline = t_start + (args.budget_s if args.budget_s is not None else math.inf)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    head = dict(machine=machine(device), torch=torch.__version__, threads=torch.get_num_threads() if not on_gpu else "-",
                copy_gbps=copy_gbps(device, bench), load_before=load_before,
                timing=("Times: median of `triton.testing.do_bench`." if on_gpu else
                        f"Times: CPU time of the single compute thread (`time.thread_time`: preemption by other jobs "
                        f"excluded, memory contention not), fastest of {rounds} interleaved rounds."))
    rows: list[dict] = []
    for name in names:
        spec = catalog[name]
        if time.time() > deadline:
            rows.append(dict(model=name, layers=0, params="-", op="all", ms=None, note="skipped: time budget spent"))
            continue
        layers = args.layers or (spec.get("gpu_layers", spec["cfg"]["n_layer"]) if on_gpu else spec["cpu_layers"])
        tokens = spec.get("gpu_tokens") if on_gpu else spec.get("tokens")
        try:
            measure(name, spec, layers, tokens, device, bench, rounds, rows, deadline,
                    on_gpu and spec.get("compile", False) and not args.no_compile)
        except torch.cuda.OutOfMemoryError as err:  # recorded; the next shape still runs
            rows.append(dict(model=name, layers=layers, params="-", op="all", ms=None, note=f"out of memory: {err}"[:160]))
            gc.collect()
            torch.cuda.empty_cache()
        print(markdown([r for r in rows if r["model"] == name], {**head, "load_after": "-", "seconds": time.time() - t_start}),
              flush=True)
    head["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    head["seconds"] = time.time() - t_start
    md = markdown(rows, head)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", head["machine"].lower()).strip("-") + ("-smoke" if args.smoke else "")
    (out / f"speed_{slug}.md").write_text(md)
    (out / f"speed_{slug}.json").write_text(json.dumps({"head": head, "rows": rows}, indent=1, default=str))
    print(f"wrote {out / f'speed_{slug}.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
