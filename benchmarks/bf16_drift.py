"""Does Q/K scale drift hurt low-precision attention logits? Measured before and after GaugeFix.

Paper 002 motivates GaugeFix by quantisation error under bfloat16. This script measures it on
one GPT-2-small-sized attention layer with learnable multipliers (d_model 768, 12 heads,
d_k 64, B×T = 2×256): starting from a balanced layer, the Q/K multipliers are drifted by a
factor ``k`` (``r_Q ← √k·r_Q``, ``r_K ← r_K/√k``: ``s_Q/s_K = k``, the same function; each head's
ratio gets an extra factor ``e^u``, ``|u| ≤ 0.1``, so that nothing is an exact power of two), and the
pre-softmax logits ``q·kᵀ/√d_k`` are computed

* ``bf16 autocast``: fp32 master parameters, ``torch.autocast(bfloat16)`` (mixed precision training),
* ``fp16 autocast``: the same with float16,
* ``bf16 params``: parameters and activations stored in bfloat16 (pure-bf16 training),

and compared with float64 logits of the same parameter values (relative Frobenius error).
Then GaugeFix is applied (to the fp32 master, or to the bf16 parameters for the last column)
and the error measured again. ``fix Δ (bf16 params)`` is how much applying the fix *in bf16
storage* changes the logits (the rounding of ``r_Q/g`` and ``r_K·g``).

Expectation from floating-point arithmetic: a multiplication by a constant does not change
a relative rounding error, so drift only matters once a side leaves the format's range
(float16: ~6e-5 .. 65504); the rows beyond the issue's k ∈ {1, 2, 4, 16, 64} show where.

Hardware: any; the table in docs/gaugefix.md gives the machine. Launch:

    python benchmarks/bf16_drift.py                 # CPU, ~20 s
    python benchmarks/bf16_drift.py --device cuda   # GPU (bf16 tensor cores)
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

import gaugeopt
from gaugeopt.transforms import relative_change, scale_qk_multipliers
from gaugeopt.models import GPT, GPTConfig
from gaugeopt.trust.invariance import randomize_parameters

K_ISSUE = (1, 2, 4, 16, 64)
K_RANGE = (2.0**10, 2.0**20, 2.0**30, 2.0**40)


def build_layer(device: str, seed: int = 0):
    """One attention layer of GPT-2 small with LRM multipliers, random generic values, balanced."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=64, block_size=256, n_layer=1, n_head=12, n_embd=768)
    model = gaugeopt.apply_lrm(GPT(cfg)).double()
    randomize_parameters(model, torch.Generator().manual_seed(seed))
    gaugeopt.gauge_fix(model)  # start balanced: drift is then exactly log k
    attn = model.transformer.h[0].attn
    return attn.to(device)


def logits(attn, x: torch.Tensor, how: str) -> torch.Tensor:
    """Pre-softmax logits ``(B, h, T, T)`` of ``attn`` on ``x`` computed in precision ``how``."""
    if how == "f64":
        attn, x, ctx = copy.deepcopy(attn).double(), x.double(), torch.autocast(x.device.type, enabled=False)
    elif how == "bf16_params":
        attn, x, ctx = attn, x.bfloat16(), torch.autocast(x.device.type, enabled=False)
    else:
        dtype = torch.bfloat16 if how == "bf16_autocast" else torch.float16
        attn, x, ctx = attn, x.float(), torch.autocast(x.device.type, dtype=dtype)
    with torch.no_grad(), ctx:
        B, T, _ = x.shape
        q, k, _ = attn.c_attn(x).split(attn.split_sizes, dim=-1)
        q = q.reshape(B, T, attn.n_head, attn.head_dim).transpose(1, 2)
        k = k.reshape(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
        return (q @ k.transpose(-1, -2)) / math.sqrt(attn.head_dim)


def drifted(base, k: float, dtype: torch.dtype, jitter: float = 0.1):
    """A copy of the balanced layer with ``s_Q/s_K = k·e^{u_j}`` per head, ``u_j ~ U(-jitter, jitter)``
    (drift applied in float64, then cast). The jitter keeps the factors away from powers of
    two, which binary floating point would scale exactly."""
    layer = copy.deepcopy(base)
    (site,) = gaugeopt.find_attention(layer)
    u = (torch.rand(site.h_kv, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2 - 1) * jitter
    delta = (math.sqrt(k) * torch.exp(u / 2)).expand(site.h_kv, site.d_k).to(next(layer.parameters()).device)
    scale_qk_multipliers(site, delta)
    return layer.to(dtype)


def err(attn, x, how: str) -> float:
    ref = logits(attn, x, "f64")  # float64 logits of the *same stored values*
    out = logits(attn, x, how)
    return relative_change(ref, out) if torch.isfinite(out).all() else float("inf")


def run(device: str, ks) -> list[dict]:
    base = build_layer(device)
    x = torch.randn(2, 256, 768, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    rows = []
    for k in ks:
        row = {"k": k}
        fp32 = drifted(base, k, torch.float32)
        row["drift"] = gaugeopt.qk_drift(fp32)  # max over heads: log k + up to 0.1
        for how in ("bf16_autocast", "fp16_autocast"):
            row[f"{how}_before"] = err(fp32, x, how)
        fixed32 = copy.deepcopy(fp32)
        gaugeopt.gauge_fix(fixed32)
        row["drift_after"] = gaugeopt.qk_drift(fixed32)
        for how in ("bf16_autocast", "fp16_autocast"):
            row[f"{how}_after"] = err(fixed32, x, how)
        bf = drifted(base, k, torch.bfloat16)
        row["bf16_params_before"] = err(bf, x, "bf16_params")
        bf_fixed = copy.deepcopy(bf)
        gaugeopt.gauge_fix(bf_fixed)
        row["bf16_params_after"] = err(bf_fixed, x, "bf16_params")
        row["fix_delta_bf16"] = relative_change(logits(bf, x, "f64"), logits(bf_fixed, x, "f64"))
        rows.append(row)
    return rows


def _k(k: float) -> str:
    return str(int(k)) if k < 1000 else f"2^{int(math.log2(k))}"


def _e(v: float) -> str:
    return "inf/nan" if not math.isfinite(v) else f"{v:.2e}"


def table(rows: list[dict]) -> str:
    head = ("| k | drift | bf16 autocast before | after | fp16 autocast before | after "
            "| bf16 params before | after | fix Δ (bf16 params) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {_k(r['k'])} | {r['drift']:.3f} | {_e(r['bf16_autocast_before'])} | {_e(r['bf16_autocast_after'])} "
            f"| {_e(r['fp16_autocast_before'])} | {_e(r['fp16_autocast_after'])} | {_e(r['bf16_params_before'])} "
            f"| {_e(r['bf16_params_after'])} | {_e(r['fix_delta_bf16'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--issue-only", action="store_true", help="only k in {1, 2, 4, 16, 64}")
    args = ap.parse_args()
    t0 = time.time()
    rows = run(args.device, K_ISSUE + (() if args.issue_only else K_RANGE))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"device: {name}, torch {torch.__version__}, {time.time() - t0:.1f} s")
    print(table(rows))


if __name__ == "__main__":
    main()
