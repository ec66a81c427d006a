"""Does bf16 rounding alone make the Q/K multipliers drift in standard multi-head attention?

With one K head per query head and multipliers initialised to 1, gauge invariance ties the
gradients (``r_Q ⊙ ∂L/∂r_Q = r_K ⊙ ∂L/∂r_K`` per channel), so in exact arithmetic AdamW moves
``r_Q`` and ``r_K`` alike and the drift of paper 002 (eq. 3, ``max |log(s_Q/s_K)|``) stays 0; a
float32 run shows ~1e-7 after hundreds of steps. The README conjectures that paper 002's drift in
standard MHA comes from bf16 arithmetic breaking the tie. This experiment trains the same model
from the same initialisation twice, in float32 and under ``torch.autocast(bfloat16)`` (float32
master weights), and records the drift every ``--every`` steps.

Setup: GPT-2 124M shape (12 layers, 12 heads, d 768, MHA) with learnable multipliers, paper 002's
condition C (no weight decay on the Q/K multipliers, no GaugeFix), AdamW lr 6e-4 (10 warm-up
steps), betas (0.9, 0.95), 300 steps of ``B×T`` synthetic tokens from a fixed random chain (mostly
``x → perm[x]``, 20 % uniform jumps: learnable structure, no data files; the same batches in both runs). The curves are printed as a table and written as
JSON; they are reported whatever they show.

Run:
    python benchmarks/bf16_drift_training.py --device cuda            # ~1-2 min on an H100
    python benchmarks/bf16_drift_training.py --smoke                   # tiny model on CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaugeopt  # noqa: E402
from gaugeopt.models import GPT, GPTConfig  # noqa: E402


def token_pool(vocab: int, n: int, T: int, gen: torch.Generator, noise: float = 0.2) -> torch.Tensor:
    """``(n, T + 1)`` sequences of a fixed random chain: the next token is ``perm[x]`` except with
    probability ``noise``, when it is uniform (learnable structure, made once, sampled per step)."""
    perm = torch.randperm(vocab, generator=gen)
    x = torch.empty(n, T + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=gen)
    for t in range(T):
        jump = torch.rand(n, generator=gen) < noise
        x[:, t + 1] = torch.where(jump, torch.randint(0, vocab, (n,), generator=gen), perm[x[:, t]])
    return x


def run(cfg: GPTConfig, precision: str, steps: int, every: int, B: int, T: int, device: str, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = gaugeopt.apply_lrm(GPT(cfg)).to(device)
    opt = torch.optim.AdamW(gaugeopt.lrm_param_groups(model, "C", lr=6e-4, betas=(0.9, 0.95)),
                            fused=device.startswith("cuda"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    gen = torch.Generator().manual_seed(seed + 1)
    pool = token_pool(cfg.vocab_size, max(64, 4 * B), T, gen).to(device)
    amp = (torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if precision == "bf16"
           else torch.autocast(device.split(":")[0], enabled=False))
    curve = []
    t0 = time.time()
    for step in range(1, steps + 1):
        xy = pool[torch.randint(0, pool.shape[0], (B,), generator=gen).to(device)]
        with amp:
            loss = model(xy[:, :-1], xy[:, 1:])[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % every == 0 or step == 1:
            curve.append({"step": step, "loss": float(loss.detach()), "qk_drift": gaugeopt.qk_drift(model),
                          "vo_drift": gaugeopt.vo_drift(model)})
            print(f"{precision} step {step}: loss {curve[-1]['loss']:.3f}, Q/K drift {curve[-1]['qk_drift']:.2e}, "
                  f"V/O drift {curve[-1]['vo_drift']:.2e}", flush=True)
    return {"precision": precision, "curve": curve, "seconds": time.time() - t0}


def table(runs: list[dict]) -> str:
    head = "| step | " + " | ".join(f"{r['precision']} loss | {r['precision']} Q/K drift | {r['precision']} V/O drift"
                                    for r in runs) + " |"
    lines = [head, "|" + "---|" * (1 + 3 * len(runs))]
    for i, row in enumerate(runs[0]["curve"]):
        cells = [str(row["step"])]
        for r in runs:
            c = r["curve"][i]
            cells += [f"{c['loss']:.3f}", f"{c['qk_drift']:.2e}", f"{c['vo_drift']:.2e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--tokens", default="8x512", help="B×T per step")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer width-32 model for 20 steps (CPU, seconds)")
    ap.add_argument("--json", default=None, help="write the curves here")
    args = ap.parse_args(argv)
    B, T = (int(v) for v in args.tokens.split("x"))
    if args.smoke:
        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
        args.steps, args.every, B, T = 20, 10, 2, 16
    else:
        cfg = GPTConfig(vocab_size=50304, block_size=T)
    runs = [run(cfg, p, args.steps, args.every, B, T, args.device) for p in ("fp32", "bf16")]
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    took = " / ".join(f"{r['precision']} {r['seconds']:.0f} s" for r in runs)
    print(f"device: {name}, torch {torch.__version__}, {cfg.n_layer} layers, width {cfg.n_embd}, {B}×{T} tokens/step, {took}")
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "config": cfg.to_dict(), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
