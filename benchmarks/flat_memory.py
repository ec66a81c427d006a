"""How much memory the flat-direction meter takes, measured, against what it estimates.

``gaugeopt.flat_directions`` holds the Jacobian ``J`` (outputs × parameters, float64) from its first
row to the end, and at its peak one more of: a reverse-mode chunk, the ``n×n`` Gram matrix with one
factor, the subspace block, the Rayleigh–Ritz factors or the attribution's bases
(``gaugeopt.flat.cost``). This script runs the meter on tiny Hugging Face GPT-2 models in fresh
child processes and reads the kernel's peak resident set size of the run (``VmHWM`` of
``/proc/self/status``, reset just before the call through ``/proc/self/clear_refs``: ``getrusage``'s
``ru_maxrss`` would keep the parent's peak, which survives ``fork`` and ``exec``), and compares the
peak above the memory held just before the call with
the estimate made before the run (the null-space block taken from the complete count) and with the
estimate for the block the run actually used. The sizes are chosen so that each term dominates in
turn (``J``: many outputs per parameter; the Gram matrix and its factors: about as many outputs as
parameters; the attribution: fewer outputs than parameters, a large null space).

Hardware: the CPU machine of the results file, one thread per run (memory does not depend on them).
Launch (repository root):

    python benchmarks/flat_memory.py              # writes benchmarks/results/flat_memory_cpu.{md,json}
    python benchmarks/flat_memory.py --smoke      # two tiny points, printed only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's gaugeopt, whatever is installed

# (n_layer, n_head, n_embd, vocab, seq_len, sequences or 0 for suggested_sequences); what dominates
POINTS = [
    (1, 2, 8, 16, 4, 0, "tiny: the overhead"),
    (1, 2, 8, 64, 8, 0, "J (suggested sequences)"),
    (1, 2, 16, 128, 8, 30, "J (wide vocabulary)"),
    (1, 2, 16, 64, 8, 24, "Gram matrix and factor"),
    (1, 2, 24, 24, 8, 50, "Gram matrix and factor"),
    (2, 2, 16, 32, 8, 30, "attribution (null space n/2)"),
]
SMOKE = [(1, 2, 8, 16, 4, 0, "tiny"), (1, 2, 8, 32, 4, 20, "tiny, wider vocabulary")]


def _rss() -> tuple[int, int]:
    """(resident set size, its peak since the last reset) of this process, in bytes (``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def _build(L: int, H: int, D: int, V: int, length: int, n_seq: int):
    """The point's model (generic weights) and inputs (``n_seq = 0``: suggested_sequences)."""
    import torch
    import transformers

    from gaugeopt.trust.invariance import randomize_parameters
    from gaugeopt.flat import meter as F

    cfg = transformers.GPT2Config(n_layer=L, n_head=H, n_embd=D, vocab_size=V, n_positions=length, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    randomize_parameters(model, torch.Generator().manual_seed(0))
    return model, F.covering_tokens(V, length, n_seq or F.suggested_sequences(model, V, length))


def before_block(L: int, H: int, D: int, V: int, length: int, n_seq: int) -> int:
    """The null-space block the meter assumes before the run (``preflight``; no run)."""
    from gaugeopt.flat import meter as F

    model, x = _build(L, H, D, V, length, n_seq)
    return F.preflight(model, x, max_params=10**9, max_memory=float("inf"))[0].block


def child(L: int, H: int, D: int, V: int, length: int, n_seq: int) -> dict:
    """One run in this process: the meter's peak above the memory held before the call."""
    import torch

    from gaugeopt.flat import meter as F

    torch.set_num_threads(1)
    model, x = _build(L, H, D, V, length, n_seq)
    n = sum(p.numel() for p in model.parameters())
    rows = x.shape[0] * length * V
    est, _ = F.preflight(model, x, max_params=10**9, max_memory=float("inf"))  # the estimate made before a run
    with open("/proc/self/clear_refs", "w") as fh:  # reset the peak to the current resident size (Linux ≥ 4.0)
        fh.write("5")
    before, peak_before = _rss()
    t0 = time.perf_counter()
    rep = F.flat_directions(model, x, progress=False, max_params=10**9)
    seconds = time.perf_counter() - t0
    _, peak = _rss()
    return {"config": [L, H, D, V, length, x.shape[0]], "n": n, "rows": rows, "rows_per_example": length * V,
            "seconds": round(seconds, 1), "rss_before": before, "peak_before": peak_before, "peak": peak,
            "measured": peak - before, "block": est.block, "block_used": min(n, rep.inertia_count + 48),
            "nullity": rep.nullity}


def estimate(row: dict) -> dict:
    """The estimates (before the run, and with the block the run used) of a measured point, by the current model."""
    from gaugeopt.flat.cost import estimate_memory

    for key, block in (("estimate", "block"), ("estimate_used_block", "block_used")):
        row[key] = estimate_memory(row["n"], row["rows"], row["rows_per_example"], row[block]).peak
    row["ratio"] = row["estimate"] / row["measured"]
    row["ratio_used"] = row["estimate_used_block"] / row["measured"]
    return row


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: the platform's name below
    return platform.processor() or platform.machine()


def run(points) -> list[dict]:
    out = []
    for *cfg, what in points:
        res = subprocess.run([sys.executable, __file__, "--child", *map(str, cfg)], capture_output=True, text=True,
                             check=True, cwd=ROOT)
        row = estimate(json.loads(res.stdout.strip().splitlines()[-1]))
        row["what"] = what
        print(f"{str(row['config']):<28} n {row['n']:>6,}  rows {row['rows']:>7,}  measured {row['measured'] / 2**20:>7.0f} MiB  "
              f"estimate {row['estimate'] / 2**20:>7.0f} MiB (×{row['ratio']:.2f}; block {row['block']:,}), with the block "
              f"used {row['estimate_used_block'] / 2**20:>7.0f} MiB (×{row['ratio_used']:.2f}; {row['block_used']:,})  "
              f"{row['seconds']:.0f} s  ({what})", flush=True)
        out.append(row)
    return out


def write(rows: list[dict], stem: str) -> None:
    cpu = _cpu_name()
    lines = [f"### flat_directions memory: measured peak vs estimate_memory ({cpu}, {os.cpu_count()} cores, one thread per run)",
             "", "Peak resident set size of the run above the memory held just before the call (`VmHWM`, reset just "
             "before the call; one run per process). Estimates: `gaugeopt.flat.cost.estimate_memory` with the null-space block assumed before "
             "the run (`gaugeopt.flat.meter.preflight`: the complete count, or the rank bound of too little data) and "
             "with the block the run used (the meter checks the memory again once it knows it). Seconds are wall time "
             "on a shared machine, not a speed measurement.", "",
             "| config (L, h, d, V, len, seqs) | parameters | J rows | nullity | measured | estimate before the run "
             "(block) | ratio | estimate, block used | ratio | s | dominant |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {tuple(r['config'])} | {r['n']:,} | {r['rows']:,} | {r['nullity']:,} | {r['measured'] / 2**20:,.0f} MiB | "
                     f"{r['estimate'] / 2**20:,.0f} MiB ({r['block']:,}) | {r['ratio']:.2f} | "
                     f"{r['estimate_used_block'] / 2**20:,.0f} MiB ({r['block_used']:,}) | {r['ratio_used']:.2f} | "
                     f"{r['seconds']:.0f} | {r['what']} |")
    path = os.path.join(ROOT, "benchmarks", "results", stem)
    with open(path + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(path + ".json", "w") as fh:
        json.dump({"machine": cpu, "rows": rows}, fh, indent=1)
    print(f"wrote {path}.md")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=6, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="two tiny points, printed, nothing written")
    ap.add_argument("--reestimate", action="store_true",
                    help="recompute the estimates of the measured points in the results file (after a change of the "
                         "estimate; the measured peaks are kept)")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    if args.reestimate:
        with open(os.path.join(ROOT, "benchmarks", "results", "flat_memory_cpu.json")) as fh:
            rows = json.load(fh)["rows"]
        for r in rows:  # the measured peaks stay; the block assumed before the run and the estimates are redone
            r["block"] = before_block(*r["config"])
            estimate(r)
        write(rows, "flat_memory_cpu")
        return 0
    rows = run(SMOKE if args.smoke else POINTS)
    if not args.smoke:
        write(rows, "flat_memory_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
