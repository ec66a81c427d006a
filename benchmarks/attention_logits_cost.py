"""What reading the attention logits costs next to a forward, and QK-Clip next to a training step.

:func:`gaugeopt.max_attention_logits` and the training integrations (``QKClip``, ``QKClipCallback``,
:class:`gaugeopt.integrations.clip.ClipSteps`) rebuild each layer's queries and keys from the record and
form the scores a batch chunk at a time, in float32, whatever kernel the forward uses: about the Q and K
projections plus ``q·kᵀ`` again. Rows (``ms`` per call, interleaved rounds, fastest kept; the clock is
the compute thread's CPU time, one intra-op thread — :func:`speed.make_bench`):

* ``forward``: the model's forward, no gradients; ``forward + logits``: the same under a
  :class:`~gaugeopt.clip.logits.LogitTracker` (the replay check already done once, as in training);
* ``train step``: forward, backward, AdamW; ``train step + QK-Clip``: the same with
  :class:`~gaugeopt.integrations.clip.ClipSteps` attached (logits read in the training forward, the clip
  after the step; τ chosen so that some heads are clipped).

Shapes: the CPU demo's char GPT (4 layers, width 128, 4 query / 2 KV heads, 16×128 tokens), GPT-2 small's
layer shape (width 768, 12 heads, 2 layers, 1×512 tokens), a Llama-like GQA layer shape (width 1024, 16
query / 4 KV heads, split-half RoPE, 2 layers, 1×512 tokens).

Run (repository root): ``python benchmarks/attention_logits_cost.py`` (CPU, ~2 min) — writes
``benchmarks/results/attention_logits_cost_cpu.md``; ``--smoke`` for a seconds-long check.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import gaugeopt  # noqa: E402
from gaugeopt.integrations.clip import ClipSteps  # noqa: E402
from gaugeopt.models import GPT, GPTConfig  # noqa: E402
from gaugeopt.clip.logits import LogitTracker  # noqa: E402
from speed import make_bench  # noqa: E402

SHAPES = {
    "demo-4l128": (dict(vocab_size=128, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, bias=True), 16, 128),
    "gpt2-layer": (dict(vocab_size=50304, n_layer=2, n_head=12, n_embd=768, bias=True), 1, 512),
    "llama-gqa-layer": (dict(vocab_size=32000, n_layer=2, n_head=16, n_kv_head=4, n_embd=1024, bias=False, rope="split_half",
                             norm="rmsnorm", mlp="swiglu"), 1, 512),
}
SMOKE = {"demo-tiny": (dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=True), 2, 16)}


def measure(name: str, cfg: dict, batch: int, block: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=block, **cfg))
    x = torch.randint(0, cfg["vocab_size"], (batch, block + 1))
    sites = gaugeopt.find_attention(model)
    bench = make_bench(torch.device("cpu"), rounds)

    def forward():
        with torch.no_grad():
            model(x[:, :-1])

    tracker = LogitTracker(sites)
    forward()  # the one-off float64 replay check happens here
    tracker.pop()
    tracker.close()

    def tracked():
        with LogitTracker(sites, check=False) as t, torch.no_grad():
            model(x[:, :-1])
        t.pop()

    base = bench({"forward": forward, "forward + logits": tracked})
    m = gaugeopt.max_attention_logits(model, x[:, :-1], sites=sites)
    tau = 0.9 * min(float(v.max()) for v in m.values())  # every layer has a head over τ
    plain = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clipped_model = GPT(GPTConfig(block_size=block, **cfg))
    clipped_model.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(clipped_model.parameters(), lr=1e-4)
    clip = ClipSteps(tau=tau).watch(clipped_model, opt)

    def step(mod, o):
        def run():
            mod(x[:, :-1], x[:, 1:])[1].backward()
            o.step()
            o.zero_grad(set_to_none=True)
        return run

    train = bench({"train step": step(model, plain), "train step + QK-Clip": step(clipped_model, opt)})
    clip.detach()
    rows = [dict(shape=name, op=k, ms=v) for k, v in {**base, **train}.items()]
    rows.append(dict(shape=name, op="forward + logits / forward", ratio=base["forward + logits"] / base["forward"]))
    rows.append(dict(shape=name, op="train step + QK-Clip / train step", ratio=train["train step + QK-Clip"] / train["train step"]))
    rows.append(dict(shape=name, op="heads clipped in the last step", ratio=float(clip.last_report.heads_over)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, 2 rounds (what the test runs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "attention_logits_cost_cpu.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = SMOKE if args.smoke else SHAPES
    started = time.perf_counter()
    rows = []
    for name, (cfg, batch, block) in shapes.items():
        rows += measure(name, cfg, batch, block, 2 if args.smoke else args.rounds)
        print(f"{name}: done", flush=True)
    lines = [f"### Attention logits and QK-Clip, cost (CPU, one thread, torch {torch.__version__}, "
             f"{time.perf_counter() - started:.0f} s; fastest of {2 if args.smoke else args.rounds} interleaved rounds, "
             "thread CPU time)", "", "| shape | op | ms | ratio |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['op']} | {r['ms']:.1f} | |" if "ms" in r else f"| {r['shape']} | {r['op']} | | {r['ratio']:.2f} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
