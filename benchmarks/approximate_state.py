"""How far the *approximate* state moves are from exact, measured on the demo's model.

gaugeopt moves most optimizer state exactly under a gauge fix; a few entries it can only move
approximately, and says so (``report.approximate``, docs/optimizers.md): Adafactor's factor the
rescale does not determine, an ``eps`` inside an accumulated statistic (Adamax, RMSprop's momentum,
the Hugging Face Adafactor's ``g² + eps₀``), a coupled L2 term (``Adam(weight_decay>0)``,
``SGD(weight_decay>0)``). For each, this script trains the demo's model (the character GPT of
``recipes/configs/base/tiny_cpu.yaml``, in float64, 8×64-token batches of the demo corpus) for
``--history`` steps, gauge-fixes (Q/K and V/O, per head; without multipliers for Adafactor, whose
factored moments concern matrices, with them otherwise), and continues ``k`` steps from the fixed
point three ways on the same batches:

* **gaugeopt**: the state as the fix moved it;
* **exact**: the optimizer run from scratch in the new coordinates — the copy held at ``s ⊙ p_t``
  before each past step, so autograd gives the gradients ``g_t / s`` and the optimizer builds its
  state from them (the reference of the test suite);
* **stale**: the state left as it was (``transport_state=False``, paper 002's setting).

It reports ``‖θ_gaugeopt − θ_exact‖ / ‖θ_exact − θ_fix‖`` — the error as a fraction of the distance
the exact run travelled since the fix — after 1 and ``k`` steps, and the same for the stale state.

Hardware: one CPU thread, about 3 minutes. Launch (repository root):

    python benchmarks/approximate_state.py       # writes benchmarks/results/approximate_state_cpu.{md,json}
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gaugeopt  # noqa: E402
from gaugeopt.models import GPT, GPTConfig  # noqa: E402
from recipes.char_windows import corpus_char_ids, random_windows  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _hf_adafactor(ps):
    from transformers.optimization import Adafactor

    return Adafactor(ps, lr=1e-2, relative_step=False, scale_parameter=False)


# Coupled L2 is refused (its moments mix g, moving as 1/s, with λp, moving as s); the last two rows
# measure what dividing those moments by s would give, under a rule registered for the measurement.
COUPLED = {torch.optim.Adam: {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2}, torch.optim.SGD: {"momentum_buffer": 1}}
CASES = {  # name -> (multipliers, make the optimizer from the parameters)
    "torch Adafactor (factored)": (False, lambda ps: torch.optim.Adafactor(ps, lr=1e-2)),
    "HF Adafactor (factored, eps₀=1e-30)": (False, _hf_adafactor),
    "Adamax (eps=1e-8)": (True, lambda ps: torch.optim.Adamax(ps, lr=2e-3)),
    "RMSprop momentum 0.9 (eps=1e-8)": (True, lambda ps: torch.optim.RMSprop(ps, lr=1e-4, momentum=0.9)),
    "Adam weight_decay=0.1 (coupled L2, refused; moved as /s)": (True, lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1)),
    "SGD momentum, weight_decay=1e-2 (coupled L2, refused; moved as /s)": (True, lambda ps: torch.optim.SGD(ps, lr=3e-2, momentum=0.9,
                                                                                      weight_decay=1e-2)),
}


def data(n: int, batch: int = 8, block: int = 64, seed: int = 0):
    tokens, vocab, name = corpus_char_ids(1_000_000)
    return list(random_windows(tokens, n, batch, block, torch.Generator().manual_seed(seed))), vocab, name


def build(vocab: int, lrm: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64 * math.ceil(vocab / 64), block_size=64, n_layer=4, n_head=4, n_kv_head=2,
                          n_embd=128, bias=True))
    if lrm:
        gaugeopt.apply_lrm(model)
        # multipliers away from 1, as after training: drift for the fix to remove
        gaugeopt.random_gauge_transform(model, ("lrm_qk", "lrm_vo"), generator=torch.Generator().manual_seed(1),
                                        log_scale=0.5)
    return model.double()


def step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    model(*batch)[1].backward()
    opt.step()


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def load(model, values) -> None:
    for n, p in model.named_parameters():
        p.copy_(values[n])


def dist(a, b) -> float:
    return math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))


def measure(name: str, lrm: bool, make, batches, vocab: int, history: int, k: int) -> dict:
    model = build(vocab, lrm)
    initial = copy.deepcopy(model)
    opt = make(model.parameters())
    past = []
    for t in range(history):
        past.append(params(model))
        step(model, opt, batches[t])
    unfixed = params(model)
    stale_model, stale_opt = copy.deepcopy((model, opt))
    from gaugeopt.fix.transport import register_state_rule, state_rule

    cls = type(opt)
    saved = state_rule(opt)
    try:
        if "coupled" in name:
            register_state_rule(cls, COUPLED[cls])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = gaugeopt.gauge_fix(model, opt, granularity="head", vo=True)
            gaugeopt.gauge_fix(stale_model, stale_opt, granularity="head", vo=True, transport_state=False)
    finally:
        register_state_rule(cls, saved)
    fixed = params(model)
    scale = {n: torch.where(unfixed[n] != 0, fixed[n] / unfixed[n], torch.ones_like(fixed[n])) for n in fixed}
    exact_model = copy.deepcopy(initial)
    exact_opt = make(exact_model.parameters())
    for t in range(history):
        load(exact_model, {n: scale[n] * past[t][n] for n in scale})
        step(exact_model, exact_opt, batches[t])
    load(exact_model, fixed)
    out = {"approximate": len(report.approximate), "transported": len(report.transported),
           "refused": "coupled" in name}
    for j in range(1, k + 1):
        for m, o in ((model, opt), (exact_model, exact_opt), (stale_model, stale_opt)):
            step(m, o, batches[history + j - 1])
        if j in (1, k):
            exact, travelled = params(exact_model), dist(params(exact_model), fixed)
            out[f"gaugeopt_{j}"] = dist(params(model), exact) / travelled
            out[f"stale_{j}"] = dist(params(stale_model), exact) / travelled
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=20)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(RESULTS, "approximate_state_cpu"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    batches, vocab, corpus = data(args.history + args.k)
    t0 = time.time()
    rows = {}
    for name, (lrm, make) in CASES.items():
        rows[name] = measure(name, lrm, make, batches, vocab, args.history, args.k)
        print(name, {k: f"{v:.2e}" if isinstance(v, float) else v for k, v in rows[name].items()}, flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"corpus": corpus, "history": args.history, "k": args.k, "torch": torch.__version__, "rows": rows},
                  f, indent=1)
    lines = [
        f"### Approximate state moves against the exact state, demo model (float64, {corpus} characters), fix after "
        f"{args.history} steps (CPU, torch {torch.__version__}, {time.time() - t0:.0f} s)",
        "",
        "Error of the continued run, as a fraction of the distance the exact run travelled since the fix: "
        "`‖θ − θ_exact‖ / ‖θ_exact − θ_fix‖`, with the state gaugeopt moved and with the stale state.",
        "",
        f"| optimizer | params approximate / exact | gaugeopt, 1 step | gaugeopt, {args.k} steps | stale, 1 step | "
        f"stale, {args.k} steps |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        counts = "refused" if r["refused"] else f"{r['approximate']} / {r['transported']}"
        lines.append(f"| {name} | {counts} | {r['gaugeopt_1']:.1e} | "
                     f"{r[f'gaugeopt_{args.k}']:.1e} | {r['stale_1']:.1e} | {r[f'stale_{args.k}']:.1e} |")
    md = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
