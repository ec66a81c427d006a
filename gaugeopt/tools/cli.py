"""``gaugeopt``: the model tools on checkpoints, from the shell.

====================  ====================================================================
command               what it prints / writes
====================  ====================================================================
``count``             symmetry dimensions per sector: the papers' conventions (000, 003) and
                      gaugeopt's complete count
``flat``              the flat-direction meter on a small checkpoint or config: nullity of the
                      logits' Jacobian, attributed to the known symmetries; exit 1 when part
                      of it is unexplained
``verify``            relative output changes under random valid and invalid gauge
                      transforms (paper 000 Tables 5–7); exit 1 if they do not separate
``canonicalize``      paper 000 Table 8 metrics before/after and Table 9 exactness;
                      writes the canonical checkpoint
``equivalent``        per-layer head matching and circuit distances; exit 0 when equivalent,
(alias ``compare``)   1 when not
``merge``             per-layer alignment distances; writes the gauge-aligned average
====================  ====================================================================

``gaugeopt --version`` prints the version of the package that runs, with torch's and Python's.

A checkpoint argument is a directory (``config.json`` + ``model.safetensors``) or a weights
file (config from ``--config``, ``<weights>.json`` or a sibling ``config.json``); see
:mod:`gaugeopt.tools.checkpoint`. Computation is in float64 unless ``--dtype`` says otherwise;
outputs are stored in the input's dtype and never replace an existing file without
``--force``. Every error is one line on stderr and exit status 2 (``--debug`` shows the
traceback).

Example:
    >>> from gaugeopt.tools.cli import main
    >>> main(["count", "--help"]) == 0  # doctest: +ELLIPSIS
    usage: gaugeopt count ...
    True
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Sequence

import torch

from gaugeopt.errors import GaugeError
from gaugeopt.flat.meter import DEFAULT_MAX_PARAMS

__all__ = ["main", "build_parser", "version_line"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``gaugeopt <cmd>: error: ...``), exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------- formatting
def _fmt(x: float) -> str:
    return f"{x:.2e}" if x == x and abs(x) != float("inf") else str(x)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        first = r[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join([first, *rest]).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe(shapes, kind: str) -> str:
    s = shapes[0]
    rope = f", RoPE {s.rope.kind} r={s.rope.rotary_dim}" if s.rope.active else ""
    same = all(x == s for x in shapes)
    head = f"h={s.h}, h_kv={s.h_kv}, d_k={s.d_k}, d_v={s.d_v}, d_model={s.d_model}{rope}"
    return f"{kind}: {len(shapes)} layers, " + (head if same else head + " (first layer; layers differ)")


# ---------------------------------------------------------------------- shared helpers
def _load(path, config, args):
    from gaugeopt.tools.checkpoint import load_checkpoint

    return load_checkpoint(path, config, dtype=_DTYPES[args.dtype])


def _inputs(*ckpts) -> list[Path]:
    out = []
    for c in ckpts:
        out += [c.weights_path, c.config_path]
    return out


def _tokens(model, args, n_prompts: int | None = None, length: int | None = None) -> torch.Tensor:
    from gaugeopt.tools.checkpoint import context_length

    vocab, ctx = context_length(model)
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab, (n_prompts or args.batch, min(length or args.seq_len, ctx)), generator=g)


def _save(model, out, ckpt, args, extra_inputs=()):
    from gaugeopt.tools.checkpoint import save_checkpoint

    return save_checkpoint(
        model, out, ckpt.config | ({"gaugeopt_lrm": True} if _is_lrm(model) else {}),
        overwrite=args.force, dtype=ckpt.dtype, inputs=_inputs(ckpt, *extra_inputs),
    )


def _is_lrm(model) -> bool:
    from gaugeopt.models.lrm import is_lrm

    return is_lrm(model)


def _check_output(out: str, ckpts, force: bool) -> None:
    """Refuse before any work when the output exists or would replace an input."""
    from gaugeopt.tools.checkpoint import check_output

    check_output(out, overwrite=force, inputs=_inputs(*ckpts))


# ---------------------------------------------------------------------- count
def _cmd_count(args) -> int:
    from gaugeopt.tools.checkpoint import GPT_TYPE, build_model, gpt_config, read_config
    from gaugeopt.flat.counting import gauge_dimension, layer_shapes

    target = Path(args.target)
    if target.suffix == ".json" and args.config is None:
        if not target.is_file():
            raise GaugeError(f"config {target} does not exist")
        cfg = read_config(target)
        kind = cfg["model_type"]
        if cfg.get("gaugeopt_lrm"):
            subject = build_model(cfg)
        elif kind == GPT_TYPE:
            subject = gpt_config(cfg)
        else:
            subject = cfg
        n_params = None
    else:
        ckpt = _load(args.target, args.config, args)
        subject, kind = ckpt.model, ckpt.model_type
        n_params = sum(p.numel() for p in ckpt.model.parameters())
    wang = gauge_dimension(subject, "wang", per_symmetry=True)
    vn = gauge_dimension(subject, "van_nierop", per_symmetry=True)
    try:
        complete, why = gauge_dimension(subject, "complete", per_symmetry=True), ""
    except GaugeError as err:
        complete, why = None, str(err)
    cols = [wang, vn] + ([complete] if complete is not None else [])
    names = list(dict.fromkeys(n for c in cols for n in c))
    rows = [[n, *(f"{c[n]:,}" if n in c else "-" for c in cols)] for n in names]
    rows.append(["total", *(f"{sum(c.values()):,}" for c in cols)])
    print(f"symmetry dimensions of {args.target} ({_describe(layer_shapes(subject), kind)})")
    print(_table(["symmetry", "wang (paper 000)", "van_nierop (paper 003)"] + (["complete"] if complete else []), rows))
    if why:
        print(f"complete: not available ({why})")
    if n_params:
        frac = 100 * sum(wang.values()) / n_params
        extra = f", complete: {100 * sum(complete.values()) / n_params:.2f}%" if complete else ""
        print(f"parameters: {n_params:,}; symmetry directions (wang): {frac:.2f}% of them{extra}")
    return 0


# ---------------------------------------------------------------------- flat
def _cmd_flat(args) -> int:
    from gaugeopt.trust.invariance import randomize_parameters
    from gaugeopt.tools.checkpoint import build_model, context_length, read_config
    from gaugeopt.flat.counting import gauge_dimension
    from gaugeopt.flat.meter import covering_tokens, flat_directions, preflight, suggested_sequences

    if args.dtype != "float64":
        raise GaugeError(f"--dtype {args.dtype}: the meter resolves singular values down to 1e-15 only in float64")
    target = Path(args.target)
    if target.suffix == ".json" and args.config is None:
        if not target.is_file():
            raise GaugeError(f"config {target} does not exist")
        model = build_model(read_config(target)).double()
        randomize_parameters(model, torch.Generator().manual_seed(args.seed))
        origin = f"random generic weights from the config, seed {args.seed}"
    else:
        model = _load(args.target, args.config, args).model
        origin = "the checkpoint's weights"
    n = sum(p.numel() for p in model.parameters())
    vocab, ctx = context_length(model)
    length = min(args.seq_len, ctx)
    n_seq = args.sequences or suggested_sequences(model, vocab, length)
    x = covering_tokens(vocab, length, n_seq, seed=args.seed)
    cap = None if args.max_memory is None else args.max_memory * 2**30
    need, _ = preflight(model, x, max_params=args.max_params, max_memory=cap)  # refuse before printing anything
    print(f"flat directions of {args.target} ({origin}; {n:,} parameters; {n_seq} sequences of {length} tokens "
          f"covering every token id; outputs: the logits; {need.describe()})\n")
    rep = flat_directions(model, x, max_params=args.max_params, max_memory=cap, progress=None if not args.quiet else False)
    print(rep.table())
    try:
        complete = gauge_dimension(model, "complete")
        verdict = "equal" if complete == rep.nullity - len(rep.unused) else f"differs by {rep.nullity - len(rep.unused) - complete:+,}"
        print(f"\ncomplete count (gaugeopt count): {complete:,}; measured nullity without unused coordinates: "
              f"{rep.nullity - len(rep.unused):,} ({verdict})")
    except GaugeError as err:
        print(f"\ncomplete count: not available ({err})")
    return 0 if rep.remainder == 0 else 1


# ---------------------------------------------------------------------- verify
def _attention_outputs(model, sites, run):
    outs: list[torch.Tensor] = []
    def keep(module, args, out):
        outs.append(out[0] if isinstance(out, tuple) else out)

    hooks = [s.module.register_forward_hook(keep) for s in sites]
    try:
        logits = run(model)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([o.reshape(-1) for o in outs]), logits


def _cmd_verify(args) -> int:
    from gaugeopt import sectors as registry
    from gaugeopt.transforms import ALL_INVALID_KINDS, invalid_gauge_transform, random_gauge_transform, relative_change
    from gaugeopt.tools.checkpoint import forward_logits
    from gaugeopt.adapters.find import find_attention

    if args.trials < 1:
        raise GaugeError(f"--trials must be at least 1, got {args.trials}")
    ckpt = _load(args.target, args.config, args)
    model = ckpt.model
    x = _tokens(model, args)
    run = lambda m: forward_logits(m, x)  # noqa: E731
    sites = find_attention(model)
    # every registered sector some site has (QK-norm sites: qk_gain, not qk/lrm_qk); the multiplier sectors with LRM
    lrm = _is_lrm(model)
    kinds = tuple(sec.name for sec in registry.sectors()
                  if (lrm or sec.family != "multiplier") and any(sec.lacking(s) is None for s in sites))
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        att0, log0 = _attention_outputs(model, sites, run)
        valid = []
        for _ in range(args.trials):
            moved = random_gauge_transform(copy.deepcopy(model), "all", generator=g)
            att, log = _attention_outputs(moved, find_attention(moved), run)
            valid.append((relative_change(att0, att), relative_change(log0, log)))
        invalid = {}
        for kind in ALL_INVALID_KINDS:
            try:
                moved = invalid_gauge_transform(copy.deepcopy(model), kind, generator=g)
            except GaugeError:
                continue  # the control does not apply (no RoPE, a single KV head)
            att, log = _attention_outputs(moved, find_attention(moved), run)
            invalid[kind] = (relative_change(att0, att), relative_change(log0, log))
    v = torch.tensor(valid, dtype=torch.float64)
    print(f"gauge invariance of {args.target} ({args.dtype}, {args.trials} random valid transforms, "
          f"tokens {tuple(x.shape)}, seed {args.seed})\n")
    print(f"valid transforms (kinds: {', '.join(kinds)}): relative change  [paper 000 Tables 5-6]")
    def stats(c: torch.Tensor) -> list[str]:
        return [_fmt(float(s)) for s in (c.mean(), c.median(), torch.quantile(c, 0.95), c.max())]

    print(_table(["output", "mean", "median", "p95", "max"],
                 [["attention output", *stats(v[:, 0])], ["logits", *stats(v[:, 1])]]))
    print("\ninvalid transforms: relative change  [paper 000 Table 7]")
    print(_table(["transform", "attention output", "logits"], [[k, _fmt(a), _fmt(b)] for k, (a, b) in invalid.items()]))
    worst_valid = float(v.max())
    # a per-head scalar under QK-norm changes the function only through the norm's epsilon (docs/qk_norm.md)
    floor = {"head_scalar": 1e-6}
    least = {k: max(a, b) for k, (a, b) in invalid.items()}
    limit = 1e-8 if args.dtype == "float64" else 1e-4  # paper 000 Table 5: fp32 logits within 3.1e-5
    ok = worst_valid <= limit and all(c >= floor.get(k, 1e-3) for k, c in least.items())
    least_invalid = min(least.values(), default=float("inf"))
    print(f"\nverdict: {'PASS' if ok else 'FAIL'}: valid <= {_fmt(worst_valid)} (limit {limit:.0e}), "
          f"every invalid >= {_fmt(least_invalid)} (limit 1e-03; head_scalar 1e-06)")
    return 0 if ok else 1


# ---------------------------------------------------------------------- canonicalize
def _cmd_canonicalize(args) -> int:
    from gaugeopt.transforms import relative_change
    from gaugeopt.tools.canonical import canonicalize, section_residual
    from gaugeopt.tools.checkpoint import forward_logits, greedy_decode

    ckpt = _load(args.target, args.config, args)
    _check_output(args.output, [ckpt], args.force)
    report = canonicalize(
        ckpt.model, args.section, residual=args.residual, sort_heads=not args.no_sort,
        fold_multipliers=not args.keep_multipliers, biases=args.biases,
    )
    canon = report.model
    print(f"canonicalised {args.target} (section {args.section}, residual {args.residual}, "
          f"heads {'kept in place' if args.no_sort else 'sorted'}, biases {args.biases}, {args.dtype})\n")
    if args.biases == "fold":
        print(f"bias sectors: {report.bias_zeroed:,} bias entries are now zero (b_K on non-rotary channels; b_V, "
              "folded into b_O): parameters a checkpoint in this form does not need\n")
    b, a = report.before.summary(), report.after.summary()
    labels = [("value_orthonormality", "||W_V W_V^T - I||_F (value orthonormality)"),
              ("qk_imbalance", "Q/K imbalance ||P - R||_F / ||P||_F"),
              ("cond_q", "cond(P), P = sum_i W_Q[i] W_Q[i]^T"), ("cond_k", "cond(R), R = W_K W_K^T")]
    rows = [[label, f"{_fmt(b[k][0])} / {_fmt(b[k][1])}", f"{_fmt(a[k][0])} / {_fmt(a[k][1])}"] for k, label in labels]
    print("metric (mean / max over layers x KV groups)  [paper 000 Table 8]")
    print(_table(["metric", "before", "after"], rows))
    print(f"section equations: max residual {_fmt(section_residual(canon, args.section, args.residual))}")
    print("margins (relative; near 0 = representative fragile): "
          + ", ".join(f"{k} {_fmt(v)}" for k, v in report.margins.items()))
    x = _tokens(ckpt.model, args, n_prompts=args.prompts, length=8)
    with torch.no_grad():
        l0, l1 = forward_logits(ckpt.model, x), forward_logits(canon, x)
        g0, g1 = greedy_decode(ckpt.model, x, args.new_tokens), greedy_decode(canon, x, args.new_tokens)
    match = int((g0 == g1).all(dim=1).sum())
    print(f"\nexactness ({args.prompts} prompts x 8 tokens, {args.new_tokens} greedy tokens)  [paper 000 Table 9]")
    print(_table(["mean |dlogit|", "max |dlogit|", "relative", "greedy decode match"],
                 [[_fmt(float((l0 - l1).abs().mean())), _fmt(float((l0 - l1).abs().max())),
                   _fmt(relative_change(l0, l1)), f"{match}/{args.prompts}"]]))
    weights, cfg = _save(canon, args.output, ckpt, args)
    stored = str(ckpt.dtype).removeprefix("torch.")
    note = "" if ckpt.dtype == torch.float64 else f"; rounding to {stored} adds its own error"
    print(f"\nwrote {weights} and {cfg} ({stored}{note})")
    return 0


# ---------------------------------------------------------------------- equivalent / compare
def _auto_tol(*ckpts) -> float:
    worst = max(torch.finfo(c.dtype).eps for c in ckpts)
    return 1e-10 if worst < 1e-15 else (1e-5 if worst < 1e-6 else 1e-2)


def _cmd_equivalent(args) -> int:
    from gaugeopt.tools.equivalence import compare, spectral_fingerprint

    a = _load(args.model_a, args.config_a, args)
    b = _load(args.model_b, args.config_b, args)
    tol = args.tol if args.tol is not None else _auto_tol(a, b)
    rep = compare(a.model, b.model, tol)
    print(f"comparing {args.model_a} with {args.model_b} up to the attention gauge group "
          f"(tol {tol:.0e}, computed in {args.dtype})\n")
    if rep.layers:
        print(_table(["layer", "B heads matched to A's 0..h-1", "QK circuit", "OV circuit"],
                     [[m.name, m.q_perm.tolist(), _fmt(m.qk), _fmt(m.ov)] for m in rep.layers]))
        print(f"gauge-inert tensors: max relative difference {_fmt(rep.inert[0])}"
              + (f" ({rep.inert[1]})" if rep.inert[1] else ""))
        print(f"rank margin (min sigma_min/sigma_max of a head projection): {_fmt(rep.rank_margin)}")
        digits = max(2, min(8, round(-math.log10(max(tol, 1e-12))) - 2))
        fa, fb = spectral_fingerprint(a.model).digest(digits), spectral_fingerprint(b.model).digest(digits)
        print(f"spectral digests ({digits} digits; equal is necessary, not sufficient: the verdict decides): "
              f"{fa} vs {fb}")
    print(f"verdict: {'EQUIVALENT' if rep.equivalent else 'NOT EQUIVALENT: ' + rep.reason}")
    return 0 if rep.equivalent else 1


# ---------------------------------------------------------------------- merge
def _cmd_merge(args) -> int:
    from gaugeopt.transforms import relative_change
    from gaugeopt.tools.checkpoint import forward_logits
    from gaugeopt.tools.merging import average, merge

    a = _load(args.model_a, args.config_a, args)
    b = _load(args.model_b, args.config_b, args)
    _check_output(args.output, [a, b], args.force)
    if args.aligned_output:
        _check_output(args.aligned_output, [a, b], args.force)
    res = merge(a.model, b.model, args.alpha, section=args.section, residual=args.residual)
    print(f"merging {args.model_a} (A) and {args.model_b} (B), alpha {args.alpha} "
          f"(section {args.section}, residual {args.residual}, {args.dtype})\n")
    print("attention distance ||theta_A - theta_B|| / ||theta_A||  [paper 000 Algorithm 3]")
    rows = [[m.name, m.q_perm.tolist(), _fmt(m.canonical), _fmt(m.matched), _fmt(m.procrustes)] for m in res.layers]
    print(_table(["layer", "B heads matched", "canonical", "+ Hungarian", "+ Procrustes"], rows))
    x = _tokens(a.model, args)
    with torch.no_grad():
        la, lb, lm = (forward_logits(m, x) for m in (a.model, b.model, res.merged))
        ln = forward_logits(average(a.model, b.model, args.alpha), x)
    print("\nrelative logit distance")
    rows = [[label, _fmt(relative_change(la, m)), _fmt(relative_change(lb, m))]
            for label, m in (("aligned merge", lm), ("naive average", ln))]
    print(_table(["model", "to A", "to B"], rows))
    weights, cfg = _save(res.merged, args.output, a, args, [b])
    print(f"\nwrote {weights} and {cfg}")
    if args.aligned_output:
        weights, cfg = _save(res.aligned, args.aligned_output, b, args, [a])
        print(f"wrote {weights} and {cfg} (B aligned to A)")
    return 0


# ---------------------------------------------------------------------- parser and entry point
def version_line() -> str:
    """``gaugeopt <version> (torch <version>, Python <version>)``, for ``--version`` and bug reports."""
    import platform

    version = sys.modules["gaugeopt"].__version__  # the running package (imported before any of its modules)
    return f"gaugeopt {version} (torch {torch.__version__}, Python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dtype", choices=sorted(_DTYPES), default="float64", help="compute dtype (default float64)")
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common.add_argument("--seed", type=int, default=0, help="seed of random tokens and transforms")

    parser = _Parser(prog="gaugeopt", description="Gauge tools for transformer checkpoints (see docs/model_tools.md).")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("count", parents=[common], help="symmetry dimensions of a config or checkpoint")
    p.add_argument("target", help="config .json, checkpoint directory or weights file")
    p.add_argument("--config", help="config of a weights file")
    p.set_defaults(func=_cmd_count)

    p = sub.add_parser("flat", parents=[common], help="measure the flat directions of a small checkpoint or config")
    p.add_argument("target", help="config .json (random generic weights) or checkpoint directory or weights file")
    p.add_argument("--config", help="config of a weights file")
    p.add_argument("--sequences", type=int, help="number of token sequences (default: enough for the parameter count)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16, at most the context)")
    p.add_argument("--max-params", type=int, default=DEFAULT_MAX_PARAMS,
                   help=f"refuse larger models (default {DEFAULT_MAX_PARAMS:,}: the method is dense, memory grows like "
                        "outputs x parameters and parameters^2, time like outputs x parameters^2)")
    p.add_argument("--max-memory", type=float, metavar="GIB",
                   help="refuse a run whose memory estimate exceeds this many GiB (default: the memory available now)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (by default they start once a run "
                                                        "has taken 10 s)")
    p.set_defaults(func=_cmd_flat)

    p = sub.add_parser("verify", parents=[common], help="output change under valid and invalid gauge transforms")
    p.add_argument("target", help="checkpoint directory or weights file")
    p.add_argument("--config")
    p.add_argument("--trials", type=int, default=20, help="random valid transforms (default 20)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("canonicalize", parents=[common], help="write the canonical form of a checkpoint")
    p.add_argument("target", help="checkpoint directory or weights file")
    p.add_argument("-o", "--output", required=True, help="output directory, or a .safetensors/.pt file")
    p.add_argument("--config")
    p.add_argument("--section", choices=("qr", "balanced"), default="qr")
    p.add_argument("--residual", choices=("fix", "keep"), default="fix")
    p.add_argument("--no-sort", action="store_true", help="keep the head order")
    p.add_argument("--keep-multipliers", action="store_true",
                   help="LRM: keep the multipliers (only the effective weights become canonical)")
    p.add_argument("--biases", choices=("fold", "keep"), default="fold",
                   help="fold: b_K = 0 on non-rotary channels, b_V folded into b_O (default); keep: leave the biases")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--force", action="store_true", help="replace existing output files, even an input")
    p.set_defaults(func=_cmd_canonicalize)

    for name, aliases in (("equivalent", ["compare"]),):
        p = sub.add_parser(name, aliases=aliases, parents=[common],
                           help="same function up to the attention gauge group?")
        p.add_argument("model_a")
        p.add_argument("model_b")
        p.add_argument("--config-a")
        p.add_argument("--config-b")
        p.add_argument("--tol", type=float, help="relative tolerance (default by stored dtype: 1e-10 / 1e-5 / 1e-2)")
        p.set_defaults(func=_cmd_equivalent)

    p = sub.add_parser("merge", parents=[common], help="gauge-aligned average of two checkpoints")
    p.add_argument("model_a")
    p.add_argument("model_b")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--aligned-output", help="also write B aligned to A here")
    p.add_argument("--config-a")
    p.add_argument("--config-b")
    p.add_argument("--alpha", type=float, default=0.5, help="weight of B (default 0.5)")
    p.add_argument("--section", choices=("qr", "balanced"), default="qr")
    p.add_argument("--residual", choices=("fix", "keep"), default="fix")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=_cmd_merge)
    return parser


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, (GaugeError, OSError)):
        return text
    return f"{type(err).__name__}: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gaugeopt`` command line; returns the exit status (0 ok, 1 negative verdict, 2 error)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # config warnings are not ours to print
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, or a usage error already printed as one line
        return int(stop.code or 0)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"gaugeopt {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the one place every failure becomes a one-line message
        if args.debug:
            traceback.print_exc()
        else:
            hint = "" if isinstance(err, (GaugeError, OSError, ValueError)) else " (unexpected; rerun with --debug)"
            print(f"gaugeopt {args.command}: error: {_one_line(err)}{hint}", file=sys.stderr)
        return 2
