"""The ``gaugeopt`` command line and checkpoint I/O (gaugeopt.tools.cli, gaugeopt.tools.checkpoint) on tiny
saved checkpoints: paper-style tables, exit codes, one-line errors, no overwriting of inputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import gaugeopt
import zoo
from gaugeopt.tools.canonical import section_residual
from gaugeopt.tools.checkpoint import forward_logits, load_checkpoint, read_weights, save_checkpoint
from gaugeopt.tools.cli import main
from model_tools_helpers import perturb

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    g = torch.Generator().manual_seed(0)
    a = zoo.build("gpt_rope_split_half_gqa", 0)
    paths = {"root": root, "case": a}
    save_checkpoint(a.model, root / "a")
    save_checkpoint(gaugeopt.random_gauge_transform(a.copy(), generator=g), root / "b")
    p = a.copy()
    perturb(p, "q", g, rel=1e-6)
    save_checkpoint(gaugeopt.random_gauge_transform(p, generator=g), root / "p")
    hf = zoo.build("hf_gpt2", 0)
    paths["hf_case"] = hf
    save_checkpoint(hf.model, root / "hf")
    save_checkpoint(gaugeopt.random_gauge_transform(hf.copy(), generator=g), root / "hf_b")
    save_checkpoint(zoo.build("hf_llama", 0).model, root / "llama")
    paths["lrm_case"] = zoo.build("gpt", 0, lrm=True)
    save_checkpoint(paths["lrm_case"].model, root / "lrm")
    return paths


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}


# ---------------------------------------------------------------------- the commands
def test_count_prints_both_conventions(ckpts, capsys):
    root = ckpts["root"]
    for target, model in ((root / "a", ckpts["case"].model), (root / "a" / "config.json", ckpts["case"].model),
                          (root / "hf", ckpts["hf_case"].model), (root / "lrm", ckpts["lrm_case"].model)):
        rc, out, err = run(capsys, "count", target)
        assert rc == 0 and err == ""
        assert "wang (paper 000)" in out and "van_nierop (paper 003)" in out
        rows = _rows(out)
        for conv, col in (("wang", 0), ("van_nierop", 1)):
            counts = gaugeopt.gauge_dimension(model, conv, per_symmetry=True)
            for sym, n in counts.items():
                assert rows[sym][col] == f"{n:,}"
            assert rows["total"][col] == f"{sum(counts.values()):,}"
        assert ("RoPE split_half r=8" in out) == (target.parent.name == "a" or target.name == "a")


def test_count_prints_the_complete_count(ckpts, capsys, tmp_path):
    rc, out, err = run(capsys, "count", ckpts["root"] / "hf")
    assert rc == 0 and err == "" and "complete" in out.splitlines()[1]
    complete = gaugeopt.gauge_dimension(ckpts["hf_case"].model, "complete", per_symmetry=True)
    rows = _rows(out)
    for sym, n in complete.items():
        assert rows[sym][-1] == f"{n:,}"
    assert rows["key_bias"][:2] == ["-", "-"] and rows["total"][-1] == f"{sum(complete.values()):,}"
    cfg = tmp_path / "g.json"  # a config complete cannot count: the papers' columns, and why not
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 32}))
    rc, out, err = run(capsys, "count", cfg)
    assert rc == 0 and "complete: not available (" in out and "needs vocab_size and n_positions" in out
    assert "complete" not in out.splitlines()[1]


def test_flat_measures_a_config_and_a_checkpoint(capsys, tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 7, "n_positions": 4, "n_layer": 1, "n_head": 2,
                               "n_embd": 4, "n_inner": 8}))
    rc, out, err = run(capsys, "flat", cfg, "--quiet")
    print(out)
    assert rc == 0 and err == ""
    assert "random generic weights from the config, seed 0" in out
    assert "unexplained remainder of the null space: 0" in out and "(equal)" in out
    assert "complete count (gaugeopt count): 78" in out and "nullity 78" in out
    model, _ = __import__("zoo.tiny", fromlist=["tiny"]).build("gpt_nobias")
    save_checkpoint(model, tmp_path / "ck")
    rc, out, err = run(capsys, "flat", tmp_path / "ck", "--seq-len", "4")
    assert rc == 0 and "the checkpoint's weights" in out and "nullity 117" in out and "(equal)" in out
    assert "flat_directions: Jacobian" not in err  # small models print no progress
    rc, out, err = run(capsys, "flat", tmp_path / "ck", "--max-params", "100")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "max_params=100" in err and "gaugeopt count" in err
    assert "of memory: the Jacobian" in err  # the refusal quotes the estimate
    rc, out, err = run(capsys, "flat", tmp_path / "ck", "--max-memory", "0.01")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "is allowed (max_memory)" in err
    assert "fewer example sequences" in err
    rc, out, err = run(capsys, "flat", tmp_path / "ck", "--dtype", "float32")
    assert rc == 2 and "float64" in err


def test_verify_prints_paper_tables(ckpts, capsys):
    rc, out, err = run(capsys, "verify", ckpts["root"] / "a", "--trials", "3")
    assert rc == 0 and err == ""
    assert "Tables 5-6" in out and "Table 7" in out
    rows = _rows(out)
    actions = gaugeopt.transforms
    plain = [k for k in actions.INVALID_KINDS if k not in actions.QK_NORM_INVALID_KINDS + actions.SINK_INVALID_KINDS]
    assert set(plain) <= set(rows)  # every control of plain attention applies (RoPE, two KV groups)
    assert not set(gaugeopt.transforms.QK_NORM_INVALID_KINDS) & set(rows)
    assert float(rows["logits"][-1]) <= 1e-12
    assert min(float(rows[k][-1]) for k in plain) > 1e-3
    assert "verdict: PASS" in out


def test_verify_a_qk_norm_checkpoint(capsys, tmp_path):
    """A QK-norm model: the gain gauge among the valid kinds, the QK-norm controls among the invalid."""
    save_checkpoint(zoo.build("gpt_qknorm", 0).model, tmp_path / "qk")
    rc, out, err = run(capsys, "verify", tmp_path / "qk", "--trials", "2")
    assert rc == 0 and err == "" and "verdict: PASS" in out
    assert "kinds: vo, perm, qk_gain" in out
    rows = _rows(out)
    assert {"qk_under_norm", "head_scalar", "gain_off_plane"} <= set(rows)
    assert float(rows["logits"][-1]) <= 1e-12 and float(rows["head_scalar"][-1]) > 1e-6


def test_canonicalize_writes_an_exact_canonical_checkpoint(ckpts, capsys, tmp_path):
    root = ckpts["root"]
    for src, section in (("a", "qr"), ("hf", "balanced"), ("lrm", "qr")):
        out_dir = tmp_path / f"canon_{src}"
        rc, out, err = run(capsys, "canonicalize", root / src, "-o", out_dir, "--section", section)
        assert rc == 0 and err == ""
        assert "Table 8" in out and "Table 9" in out and "10/10" in out
        orig, canon = load_checkpoint(root / src), load_checkpoint(out_dir)
        x = torch.randint(0, zoo.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        assert gaugeopt.relative_change(forward_logits(orig.model, x), forward_logits(canon.model, x)) <= 1e-10
        assert section_residual(canon.model, section) <= 1e-10
        assert json.loads((out_dir / "config.json").read_text()).get("gaugeopt_lrm", False) == (src == "lrm")
    rows = _rows(out)  # the LRM run: value orthonormality went from O(1) to rounding
    before, after = float(rows["||W_V"][-4]), float(rows["||W_V"][-1])
    assert before > 0.1 and after < 1e-12


def test_canonicalize_folds_the_bias_sectors_unless_kept(ckpts, capsys, tmp_path):
    """GPT-2's key and value biases: folded by default, the number of zeroed entries printed; --biases keep leaves them."""
    root, site = ckpts["root"], gaugeopt.find_attention(ckpts["hf_case"].model)[0]
    n_layers = len(gaugeopt.find_attention(ckpts["hf_case"].model))
    expect = n_layers * (site.h_kv * site.d_k + site.h_kv * site.d_v)
    rc, out, err = run(capsys, "canonicalize", root / "hf", "-o", tmp_path / "fold")
    assert rc == 0 and f"bias sectors: {expect:,} bias entries are now zero" in out and "biases fold" in out
    folded = load_checkpoint(tmp_path / "fold").model
    for s in gaugeopt.find_attention(folded):
        assert bool((s.k.bias.get() == 0).all()) and bool((s.v.bias.get() == 0).all())
    rc, out, err = run(capsys, "canonicalize", root / "hf", "-o", tmp_path / "keep", "--biases", "keep")
    assert rc == 0 and "bias sectors" not in out and "biases keep" in out
    kept = load_checkpoint(tmp_path / "keep").model
    assert all(bool((s.k.bias.get() != 0).all()) for s in gaugeopt.find_attention(kept))
    x = torch.randint(0, zoo.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    assert gaugeopt.relative_change(forward_logits(kept, x), forward_logits(folded, x)) <= 1e-12


def test_equivalent_exit_codes_and_table(ckpts, capsys):
    root = ckpts["root"]
    rc, out, _ = run(capsys, "equivalent", root / "a", root / "b")
    assert rc == 0 and "verdict: EQUIVALENT" in out and "QK circuit" in out
    rc, out, _ = run(capsys, "compare", root / "a", root / "p")
    assert rc == 1 and "NOT EQUIVALENT" in out and "QK circuits" in out
    rc, out, _ = run(capsys, "equivalent", root / "hf", root / "hf_b")
    assert rc == 0
    rc, out, _ = run(capsys, "equivalent", root / "a", root / "hf")
    assert rc == 1 and "different architectures" in out
    rc, out, _ = run(capsys, "equivalent", root / "llama", root / "llama")
    assert rc == 0 and "tol 1e-10" in out


def test_merge_writes_aligned_average(ckpts, capsys, tmp_path):
    root = ckpts["root"]
    rc, out, err = run(capsys, "merge", root / "a", root / "b", "-o", tmp_path / "m",
                       "--aligned-output", tmp_path / "al.safetensors")
    assert rc == 0 and err == ""
    assert "+ Procrustes" in out and "naive average" in out
    x = torch.randint(0, zoo.VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = forward_logits(load_checkpoint(root / "a").model, x)
    assert gaugeopt.relative_change(ref, forward_logits(load_checkpoint(tmp_path / "m").model, x)) <= 1e-10
    assert gaugeopt.relative_change(ref, forward_logits(load_checkpoint(tmp_path / "al.safetensors").model, x)) <= 1e-10


# ---------------------------------------------------------------------- bad inputs
def _bad_inputs(root: Path, tmp: Path) -> dict[str, tuple[list, str]]:
    a = root / "a"
    weights = (a / "model.safetensors").read_bytes()
    cfg = json.loads((a / "config.json").read_text())

    def ckpt_dir(name, *, data=weights, config=cfg, config_text=None):
        d = tmp / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(data)
        (d / "config.json").write_text(config_text if config_text is not None else json.dumps(config))
        return d

    pt = tmp / "trunc.pt"
    torch.save(read_weights(a / "model.safetensors"), pt)
    pt.write_bytes(pt.read_bytes()[: pt.stat().st_size // 2])
    shutil.copy(a / "config.json", tmp / "trunc.json")
    lonely = tmp / "lonely"
    lonely.mkdir()
    shutil.copy(a / "model.safetensors", lonely / "w.safetensors")
    return {
        "missing file": (["verify", tmp / "nope"], "does not exist"),
        "truncated safetensors": (["verify", ckpt_dir("trunc", data=weights[: len(weights) // 2])],
                                  "truncated or corrupt"),
        "truncated torch file": (["count", pt], "truncated or corrupt"),
        "empty file": (["verify", ckpt_dir("empty", data=b"")], "is empty"),
        "fewer layers in config": (["canonicalize", ckpt_dir("layers", config={**cfg, "n_layer": 3}), "-o", tmp / "o1"],
                                   "does not match its config: missing transformer.h.2"),
        "wider model in config": (["merge", ckpt_dir("width", config={**cfg, "n_embd": 48}), a, "-o", tmp / "o2"],
                                  "shape (checkpoint vs config)"),
        "unknown model type": (["equivalent", ckpt_dir("bert", config={**cfg, "model_type": "bert"}), a],
                               "unknown model_type 'bert'"),
        "invalid json": (["count", ckpt_dir("json", config_text="{not json")], "not valid JSON"),
        "output is the input dir": (["canonicalize", a, "-o", a], "is an input of this command"),
        "output is the input file": (["canonicalize", a / "model.safetensors", "-o", a / "model.safetensors"],
                                     "is an input of this command"),
        "output exists": (["canonicalize", a, "-o", root / "b"], "already exists"),
        "no config": (["verify", lonely / "w.safetensors"], "no config for checkpoint"),
        "unknown command": (["frobnicate"], "invalid choice"),
        "missing option": (["canonicalize", a], "required: -o/--output"),
        "bad number": (["verify", a, "--trials", "0"], "--trials must be at least 1"),
    }


def test_bad_inputs_exit_2_with_one_line(ckpts, capsys, tmp_path):
    for label, (argv, expect) in _bad_inputs(ckpts["root"], tmp_path).items():
        rc, out, err = run(capsys, *argv)
        assert rc == 2, label
        assert err.count("\n") == 1 and err.startswith("gaugeopt"), (label, err)
        assert "Traceback" not in err and expect in err, (label, err)
    # nothing was written next to the inputs
    assert sorted(p.name for p in (ckpts["root"] / "a").iterdir()) == ["config.json", "model.safetensors"]


def test_debug_shows_the_traceback(ckpts, capsys, tmp_path):
    rc, _, err = run(capsys, "verify", tmp_path / "nope", "--debug")
    assert rc == 2 and "Traceback" in err and "GaugeError" in err


def test_force_replaces_outputs_and_inputs(ckpts, capsys, tmp_path):
    work = tmp_path / "a"
    shutil.copytree(ckpts["root"] / "a", work)
    before = load_checkpoint(work).model
    rc, _, _ = run(capsys, "canonicalize", work, "-o", work, "--force")
    assert rc == 0
    after = load_checkpoint(work).model
    x = torch.randint(0, zoo.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    assert gaugeopt.relative_change(forward_logits(before, x), forward_logits(after, x)) <= 1e-10
    assert section_residual(after, "qr") <= 1e-10 < section_residual(before, "qr")


def test_python_m_and_console_script(ckpts):
    """A real process: argument parsing, checkpoint loading, the error path and the exit status."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bad = subprocess.run([sys.executable, "-m", "gaugeopt", "count", str(ckpts["root"] / "a" / "model.safetensors"),
                          "--config", str(ckpts["root"] / "lrm" / "config.json")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert bad.stderr.count("\n") == 1 and "does not match its config" in bad.stderr and "Traceback" not in bad.stderr
    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts") if e.name == "gaugeopt"}
    assert scripts.get("gaugeopt", "gaugeopt.tools.cli:main") == "gaugeopt.tools.cli:main"


# ---------------------------------------------------------------------- checkpoint I/O
def test_checkpoint_formats_and_tied_weights(ckpts, tmp_path):
    case = ckpts["case"]
    stored = read_weights(ckpts["root"] / "a" / "model.safetensors")
    assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored  # tied: stored once
    loaded = load_checkpoint(ckpts["root"] / "a").model
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    x = case.inputs
    assert torch.equal(forward_logits(loaded, x), case.logits())
    # torch.save state dict, nanoGPT's {"model": ...} with torch.compile prefixes, float32 storage
    sd = {f"_orig_mod.{k}": v.float() for k, v in case.model.state_dict().items()}
    torch.save({"model": sd, "iter_num": 3}, tmp_path / "ckpt.pt")
    shutil.copy(ckpts["root"] / "a" / "config.json", tmp_path / "config.json")
    ck = load_checkpoint(tmp_path / "ckpt.pt")
    assert ck.dtype == torch.float32 and ck.model.lm_head.weight.dtype == torch.float64
    assert gaugeopt.relative_change(case.logits(), forward_logits(ck.model, x)) <= 1e-6
    weights, cfg = save_checkpoint(ck.model, tmp_path / "out.pt", dtype=ck.dtype)
    assert cfg == tmp_path / "out.json" and read_weights(weights)["transformer.wte.weight"].dtype == torch.float32
    with pytest.raises(gaugeopt.GaugeError, match="already exists"):
        save_checkpoint(ck.model, tmp_path / "out.pt")


def test_hf_checkpoints_round_trip(ckpts):
    for name in ("hf", "llama"):
        ck = load_checkpoint(ckpts["root"] / name)
        assert ck.model_type == {"hf": "gpt2", "llama": "llama"}[name]
    hf = ckpts["hf_case"]
    assert torch.equal(forward_logits(load_checkpoint(ckpts["root"] / "hf").model, hf.inputs), hf.logits())


def test_flat_refuses_what_would_not_fit_before_starting(capsys, tmp_path):
    """A 28,544-parameter GPT-2 (width 32, vocabulary 80, context 16) with max_params raised: the default
    inputs give a 149,760-row Jacobian (32 GiB in float64) — the run a 24 GiB machine cannot hold. It is
    refused before anything is computed, with the estimate and what to do."""
    cfg = tmp_path / "gpt2_28k.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 80, "n_positions": 16, "n_layer": 2, "n_head": 2,
                               "n_embd": 32}))
    rc, out, err = run(capsys, "flat", cfg, "--max-params", "30000", "--max-memory", "24")
    print(err)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "149,760×28,544 in float64 (31.8 GiB)" in err and "24.0 GiB is allowed (max_memory)" in err
    assert "smaller model of the same architecture" in err and "gaugeopt count" in err
