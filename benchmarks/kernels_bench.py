"""Kernel benchmark: GaugeFix and the gauge projections per call, Triton vs torch vs torch.compile.

Shapes: attention-only layer stacks of GPT-2 124M (12 L, 12 H, d 768), 355M (24 L, 16 H, d 1024),
1.5B (48 L, 25 H, d 1600) — learned positions, biases, fused ``c_attn`` — and a LLaMA-7B-shaped
stack (32 L, 32 H, d_k 128, d 4096, split-half RoPE, no biases), each with LRM multipliers
("lrm") and without ("plain": GaugeFix rescales the W_Q/W_K rows). float32 parameters, AdamW
state after one step.

Rows: ``gaugefix`` (Q/K, granularity auto), ``proj_lrm_qk`` (diagonal multiplier gauge),
``proj_qk`` (full-rotary RoPE planes on LLaMA: closed form; GPT-2: dense Sylvester ``exact`` and
``approx``), ``proj_vo_exact`` (dense). Backends: ``triton`` (the fused kernels;
``triton-cached`` = :class:`gaugeopt.GaugeFixer` reusing its packed tables),
``torch`` (the core, eager), ``torch.compile`` (the core compiled; first call excluded).

On CUDA: ``triton.testing.do_bench`` medians, the minimum traffic of each op (every tensor
read once, every output written once) over the time, against the device's datasheet
bandwidth and a measured device-to-device copy. On CPU: the torch path only, timed by
``perf_counter`` (the fastest of a few runs), as a multiple of one AdamW step over the same parameters (Triton
does not run there: the interpreter is a test tool, not a benchmark).

Results: ``benchmarks/results/kernels_<device>.csv`` (one row per measurement, written as it
goes) and ``kernels_<device>.md`` (the table, also printed).

Run:
    python benchmarks/kernels_bench.py                    # CPU: 1 layer per model, ~3 min on 2 cores
    python benchmarks/kernels_bench.py --max-layers 0     # CUDA: every layer (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaugeopt  # noqa: E402
from gaugeopt.fix.plan import plan_pairs  # noqa: E402
from gaugeopt.models.gpt import CausalSelfAttention, GPTConfig  # noqa: E402
from gaugeopt.projection.projector import GaugeProjector  # noqa: E402

MODELS = {
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, bias=True, rope="none"),
    "gpt2-355m": dict(n_layer=24, n_head=16, n_embd=1024, bias=True, rope="none"),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600, bias=True, rope="none"),
    "llama-7b": dict(n_layer=32, n_head=32, n_embd=4096, bias=False, rope="split_half", norm="rmsnorm", mlp="swiglu"),
}
# datasheet memory bandwidth, GB/s (first matching substring of torch.cuda.get_device_name())
PEAK_GBPS = [("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("GH200", 4000.0),
             ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("L40S", 864.0),
             ("A10G", 600.0), ("RTX 4090", 1008.0), ("V100", 900.0)]
FIELDS = ["device", "model", "layers", "params", "op", "backend", "ms", "min_bytes", "gbps", "pct_peak",
          "adamw_ms", "x_adamw", "note"]


# ---------------------------------------------------------------------- setup
def build(name: str, lrm: bool, layers: int, device: torch.device) -> tuple[nn.Module, list, torch.optim.Optimizer]:
    cfg = GPTConfig(vocab_size=64, block_size=64, **MODELS[name])
    g = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        stack = nn.ModuleList([CausalSelfAttention(cfg) for _ in range(layers)])
    if lrm:
        gaugeopt.apply_lrm(stack)
    with torch.no_grad():
        for p in stack.parameters():  # generic values: multipliers drift away from 1
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, device=device))
            else:
                p.normal_(0.0, 0.02, generator=g)
    sites = gaugeopt.find_attention(stack)
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-4, weight_decay=0.1)
    for p in stack.parameters():
        p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-3
    opt.step()
    return stack, sites, opt


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def gaugefix_bytes(sites, opt) -> int:
    """Touched Q/K tensors read + written once, each AdamW moment read + written once."""
    total = 0
    for plan in plan_pairs(sites):
        for _, members in plan.sides():
            for m in members:
                ref = m.ref
                v = ref.get()
                states = [s for k, s in opt.state[ref.param].items() if torch.is_tensor(s) and s.dim() > 0]
                total += 2 * nbytes(v) + sum(2 * v.numel() * s.element_size() for s in states)
    return total


def sector_bytes(sites, sector: str) -> int:
    """Parameters and the field read once, the output written once (3 passes over the sector)."""
    total = 0
    for s in sites:
        if sector == "lrm_qk":
            refs = [s.q.row_mult, s.k.row_mult]
        elif sector == "qk":
            refs = [s.q.weight, s.q.bias, s.k.weight, s.k.bias]
        else:
            refs = [s.v.weight, s.v.bias, s.o.weight]
        total += sum(3 * nbytes(r.get()) for r in refs if r is not None)
    return total


# ---------------------------------------------------------------------- timing
def timer(device: torch.device, reps: int):
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))

    def cpu(fn):
        t0 = time.perf_counter()
        fn()  # warm-up; a slow op (> 1 s) is timed twice, not `reps` times
        ts = []
        for _ in range(reps if time.perf_counter() - t0 < 1.0 else 2):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return min(ts)  # the least disturbed run: CPU machines are often shared

    return cpu


def device_info(device: torch.device) -> tuple[str, float | None, float | None]:
    """(name, datasheet GB/s, measured copy GB/s)."""
    if device.type != "cuda":
        return f"cpu-{platform.machine()}-{os.cpu_count()}cores", None, None
    name = torch.cuda.get_device_name(device)
    peak = next((bw for key, bw in PEAK_GBPS if key in name), None)
    import triton.testing

    a = torch.empty(1 << 28, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    copy = 2 * nbytes(a) / ms / 1e6
    del a, b
    return name, peak, copy


def measure(model: str, params: str, layers: int, device: torch.device, bench, record, compile_models) -> None:
    """Every row of one stack (``params``: "lrm" or "plain"); ``record(op, backend, ms, bytes, adamw_ms, note)``."""
    on_gpu = device.type == "cuda"
    full = MODELS[model]["n_layer"]
    stack, sites, opt = build(model, params == "lrm", layers, device)
    print(f"{model} ({layers}/{full} layers, {params}, "
          f"{sum(p.numel() for p in stack.parameters()) / 1e6:.0f}M attention parameters)", flush=True)
    adamw_ms = bench(opt.step)
    record("adamw_step", "torch", adamw_ms, None, adamw_ms, "the baseline")
    opt.zero_grad(set_to_none=True)  # the gradients are not needed any more (memory)
    compiled = model in compile_models
    # ---- GaugeFix
    gb = gaugefix_bytes(sites, opt)
    eager = lambda: gaugeopt.gauge_fix(None, opt, sites=sites, backend="torch")  # noqa: E731
    record("gaugefix", "torch", bench(eager), gb, adamw_ms)
    if on_gpu:
        record("gaugefix", "triton",
               bench(lambda: gaugeopt.gauge_fix(None, opt, sites=sites, backend="triton")), gb, adamw_ms,
               "plans, packs and launches each call")
        fix = gaugeopt.GaugeFixer(None, opt, sites=sites, backend="triton")
        record("gaugefix", "triton-cached", bench(fix), gb, adamw_ms,
               "GaugeFixer: packed once")
    if compiled:
        cf = torch.compile(eager)
        t0 = time.time()
        cf()
        record("gaugefix", "torch.compile", bench(cf), gb, adamw_ms,
               f"first call {time.time() - t0:.0f} s")
    # ---- projections
    u = {n: torch.randn_like(p) for n, p in stack.named_parameters()}
    sectors = (["lrm_qk"] if params == "lrm" else []) + ["qk"]
    for sector in sectors:
        closed = sector == "lrm_qk" or sites[0].rope.active
        modes = ("exact",) if closed else ("exact", "approx")
        for mode in modes:
            proj = GaugeProjector(stack, sectors=(sector,), mode=mode, sites=sites)
            op = f"proj_{sector}" + ("" if closed else f"_{mode}")
            sb = sector_bytes(sites, sector)
            ref = lambda: proj.vertical(u)  # noqa: E731
            record(op, "torch", bench(ref), sb, adamw_ms,
                   "closed form" if closed else "Sylvester (batched eigh)")
            if on_gpu and closed:
                record(op, "triton",
                       bench(lambda tp=GaugeProjector(stack, sectors=(sector,), sites=sites, backend="triton"): tp.vertical(u)),
                       sb, adamw_ms, "packs and launches each call")
            if compiled and closed:
                cr = torch.compile(ref)
                t0 = time.time()
                cr()
                record(op, "torch.compile", bench(cr), sb, adamw_ms,
                       f"first call {time.time() - t0:.0f} s")
    proj = GaugeProjector(stack, sectors=("vo",), sites=sites)
    record("proj_vo_exact", "torch", bench(lambda: proj.vertical(u)),
           sector_bytes(sites, "vo"), adamw_ms, "Sylvester (batched eigh)")
    del stack, sites, opt, u, proj
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- the run
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--max-layers", type=int, default=None,
                    help="layers per stack (0: all; default 1 on CPU, all on CUDA); times scale with layers")
    ap.add_argument("--compile", default=None,
                    help="models whose torch.compile rows to measure (comma list, 'none'; default gpt2-124m on CUDA, none on CPU)")
    ap.add_argument("--reps", type=int, default=3, help="CPU repetitions (the fastest counts)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new models after this many seconds")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    max_layers = args.max_layers if args.max_layers is not None else (0 if on_gpu else 1)
    compile_models = (args.compile or ("gpt2-124m" if on_gpu else "none")).split(",")
    bench = timer(device, args.reps)
    name, peak, copy_gbps = device_info(device)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"kernels_{slug}" + (f"_{args.tag}" if args.tag else "")
    csv_path, md_path = out / f"{stem}.csv", out / f"{stem}.md"
    rows: list[dict] = []
    t_start = time.time()
    with open(csv_path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=FIELDS)
        wr.writeheader()

        def record(model, layers, params, op, backend, ms, min_bytes, adamw_ms, note=""):
            gbps = min_bytes / ms / 1e6 if (ms and min_bytes) else None
            row = dict(device=name, model=model, layers=layers, params=params, op=op, backend=backend,
                       ms=round(ms, 4) if ms is not None else None, min_bytes=min_bytes,
                       gbps=round(gbps, 1) if gbps else None,
                       pct_peak=round(100 * gbps / peak, 1) if (gbps and peak) else None,
                       adamw_ms=round(adamw_ms, 4), x_adamw=round(ms / adamw_ms, 3) if ms is not None else None, note=note)
            rows.append(row)
            wr.writerow(row)
            fh.flush()
            print(f"  {op:18s} {backend:14s} {ms if ms is not None else float('nan'):10.3f} ms  "
                  f"{'' if gbps is None else f'{gbps:8.1f} GB/s'}  x{row['x_adamw']} AdamW  {note}", flush=True)

        for model in args.models.split(","):
            if args.budget_s is not None and time.time() - t_start > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: skipping {model} and after", flush=True)
                break
            full = MODELS[model]["n_layer"]
            layers = full if max_layers == 0 else min(full, max_layers)
            for params in ("lrm", "plain"):
                try:
                    measure(model, params, layers, device, bench,
                            lambda *a, **k: record(model, layers, params, *a, **k), compile_models)
                except torch.cuda.OutOfMemoryError as err:  # recorded, and the next stack still runs
                    record(model, layers, params, "all", "-", None, None, float("nan"), f"out of memory: {err}"[:200])
                gc.collect()
                if on_gpu:
                    torch.cuda.empty_cache()
                md_path.write_text(markdown(rows, name, peak, copy_gbps, time.time() - t_start, on_gpu))  # so far
    md = markdown(rows, name, peak, copy_gbps, time.time() - t_start, on_gpu)
    md_path.write_text(md)
    print("\n" + md)
    print(f"wrote {csv_path} and {md_path}")
    return 0


def markdown(rows: list[dict], name: str, peak, copy_gbps, seconds: float, on_gpu: bool) -> str:
    head = [f"### {name}", ""]
    if on_gpu:
        head.append(f"Memory bandwidth: datasheet {peak or 'unknown'} GB/s, measured device copy {copy_gbps:.0f} GB/s. "
                    "Times: `triton.testing.do_bench` medians (ms per call).")
    else:
        head.append("Torch path only (Triton needs a GPU). Times: fastest of 3 `perf_counter` runs (2 above 1 s; ms per call); "
                    "`×AdamW`: the call's time over one AdamW step of the same (attention-only) parameters.")
    head += [f"Run took {seconds:.0f} s.", ""]
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["layers"], r["params"], r["op"]), {})[r["backend"]] = r
    backends = ["triton-cached", "triton", "torch", "torch.compile"] if on_gpu else ["torch"]
    cols = ["model", "layers", "params", "op"] + [f"{b} ms" for b in backends]
    if on_gpu:
        cols += ["best Triton GB/s (% peak)", "torch / best Triton"]
    cols += ["torch ×AdamW"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for (model, layers, params, op), d in by.items():
        if op == "adamw_step":
            cells = [model, str(layers), params, "AdamW step"] + ["" for _ in backends]
            cells[4 + backends.index("torch")] = f"{d['torch']['ms']:.3f}"
            cells += (["", ""] if on_gpu else []) + ["1"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [model, str(layers), params, op]
        for b in backends:
            cells.append(f"{d[b]['ms']:.3f}" if b in d else "—")
        if on_gpu:
            tri = [d[b] for b in ("triton-cached", "triton") if b in d]
            best = min(tri, key=lambda r: r["ms"]) if tri else None
            cells.append(f"{best['gbps']} ({best['pct_peak']}%)" if best and best["gbps"] else "—")
            cells.append(f"{d['torch']['ms'] / best['ms']:.1f}×" if best and "torch" in d else "—")
        cells.append(f"{d['torch']['x_adamw']:.2f}" if "torch" in d else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(head + lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
