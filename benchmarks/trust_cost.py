"""What trust costs: the one-time proof of a model's attention records, and the per-step re-check.

Every gauge operation passes the gate (:mod:`gaugeopt.trust.gate`): static checks, then a proof
of each record — one forward on a made-up input to record each attention module's call, then each
layer rerun alone in float64 under random gauge transformations — once per model structure. Long-
lived users (a fixer, a projector, a callback) then re-check a snapshot of what the records rely on
before every use. This script measures, on one machine, side by side in one run:

* ``proof``: :func:`gaugeopt.trust.gate.trusted_sites` on a freshly built model (records found,
  static checks, the example forward, every layer certified) — the one-time cost;
* ``static checks``: the checks alone, on the proved model (what a full gate pass costs again after
  a change is detected);
* ``re-check``: :meth:`Gate.ensure` when nothing changed (what every step pays), against one AdamW
  step (``foreach``, the CPU default) over the whole model — over the attention parameters only for
  the 1B model, whose whole optimizer state does not fit beside it here (an upper bound on its ratio) —
  the ratio is what matters.

Models: GPT-2 124M (``gaugeopt.models.GPT``: 12 layers, 12 heads, width 768, vocabulary 50304) and
a Llama-3.2-1B-shaped Hugging Face Llama (16 layers, 32 query / 8 key-value heads, width 2048,
SwiGLU 8192, vocabulary 128256; float32, random weights — the proof does not look at the values).

Run:
    python benchmarks/trust_cost.py            # both models, a few minutes on 2 cores, ~12 GB
    python benchmarks/trust_cost.py --quick    # tiny models, seconds (tests/project/test_benchmarks.py)
    python benchmarks/trust_cost.py --device cuda   # on one GPU (benchmarks/gpu_check.sh)

Results: ``benchmarks/results/trust_cost_<machine>.md`` (and the table printed).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn

from gaugeopt.trust.gate import Gate, trusted_sites
from gaugeopt.adapters.find import find_attention
from gaugeopt.trust.static_checks import static_problems

RESULTS = Path(__file__).resolve().parent / "results"


def gpt2(quick: bool) -> nn.Module:
    from gaugeopt.models import GPT, GPTConfig

    if quick:
        return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32))
    return GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768))


def llama_1b(quick: bool) -> nn.Module:
    import transformers

    if quick:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:
        cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                       num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                       max_position_embeddings=131072, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")  # values do not matter to the proof; skip the slow initialisation
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # its buffers, computed (not left empty)
    with torch.no_grad():
        for p in model.parameters():  # norm gains at 1, as initialised: the attention must see unit-RMS inputs
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model.eval()


def _clock() -> float:
    return time.perf_counter()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, build, quick: bool, repeats: int, whole: bool = True, device: str = "cpu") -> dict:
    dev = torch.device(device)
    model = build(quick).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = _clock()
    sites = trusted_sites(model, "benchmark")
    proof = _clock() - t0
    t0 = _clock()
    problems = static_problems(model, find_attention(model))
    static = _clock() - t0
    assert not problems, problems
    gate = Gate(model, "benchmark")
    ensure = []
    for _ in range(repeats * 20):
        t0 = _clock()
        changed = gate.ensure()
        ensure.append(_clock() - t0)
        assert not changed
    stepped = list(model.parameters()) if whole else [ref.param for s in sites for _, ref in s.refs()]
    opt = torch.optim.AdamW(stepped, lr=1e-4, **({"fused": True} if dev.type == "cuda" else {"foreach": True}))
    for p in stepped:
        p.grad = torch.randn_like(p) * 1e-3
    steps = []
    for _ in range(repeats):
        _sync(dev)
        t0 = _clock()
        opt.step()
        _sync(dev)
        steps.append(_clock() - t0)
    del opt, model
    gc.collect()
    return {
        "model": name, "params": n_params, "layers": len(sites), "proof_s": proof, "static_ms": 1e3 * static,
        "ensure_us": 1e6 * statistics.median(ensure), "adamw_ms": 1e3 * statistics.median(steps),
        "adamw_over": "whole model" if whole else "attention only",
    }


def table(rows: list[dict]) -> str:
    out = ["| model | parameters | layers | one-time proof | static checks | re-check per step | AdamW step (over) | "
           "re-check / AdamW |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['layers']} | {r['proof_s']:.2f} s | "
                   f"{r['static_ms']:.1f} ms | {r['ensure_us']:.0f} µs | {r['adamw_ms']:.0f} ms ({r['adamw_over']}) | "
                   f"{r['ensure_us'] / 1e3 / r['adamw_ms']:.1e} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny models (a smoke test)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the proof's float64 reruns run there too)")
    ap.add_argument("--out", type=Path, default=None, help="where to write the markdown table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 5
    # the 1B model's whole AdamW state would not fit beside it in 24 GB: its step is timed over the attention
    # parameters only, which makes its ratio an upper bound
    cuda = args.device.startswith("cuda")
    rows = [measure("GPT-2 124M", gpt2, args.quick, repeats, device=args.device),
            measure("Llama-3.2-1B shape", llama_1b, args.quick, repeats, whole=args.quick or cuda, device=args.device)]
    text = table(rows)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    if cuda:
        machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    else:
        machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} threads, torch "
                   f"{torch.__version__}; load average {load} at the end of the run (other jobs share the cores)")
    report = f"# The cost of trust ({'quick' if args.quick else 'full'} run)\n\nMachine: {machine}.\n\n{text}\n"
    print(report)
    tag = "cpu" if not cuda else re.sub("[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    out = args.out or (None if args.quick else RESULTS / f"trust_cost_{tag}.md")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    return report


if __name__ == "__main__":
    main()
