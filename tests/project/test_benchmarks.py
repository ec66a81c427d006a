"""The benchmark scripts run (tiny shapes, CPU): a GPU session finds them working, not broken.

Nothing here is timed: speed lives in the benchmarks' own output (benchmarks/results/).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_speed_benchmark_smoke(tmp_path):
    speed = _load("speed")
    assert speed.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)]) == 0
    (js,) = tmp_path.glob("speed_*-smoke.json")
    rows = json.loads(js.read_text())["rows"]
    ops = {(r["model"], r["params"], r["op"]) for r in rows}
    for model, spec in speed.SMOKE.items():
        if spec.get("whole"):
            for op in ("adamw model", "gaugefix", "train step"):
                assert (model, "plain", op) in ops and (model, "lrm", op) in ops, (model, op)
            assert (model, "lrm", "LRM/plain adamw model") in ops and (model, "lrm", "LRM/plain tokens/s") in ops
            continue
        for op in ("adamw attn", "adamw blocks", "gaugefix", "proj qk+vo exact", "proj qk+vo approx", "train step"):
            assert (model, "plain", op) in ops and (model, "lrm", op) in ops, (model, op)
        assert (model, "lrm", "proj all sectors") in ops
        assert (model, "lrm", "LRM/plain tokens/s") in ops and (model, "lrm", "LRM/plain adamw blocks") in ops
    assert all(r["ms"] is None or r["ms"] > 0 for r in rows)
    assert (tmp_path / js.name.replace(".json", ".md")).read_text().startswith("### ")


@pytest.mark.slow
def test_bf16_drift_training_smoke(tmp_path, capsys):
    drift = _load("bf16_drift_training")
    out = tmp_path / "drift.json"
    assert drift.main(["--smoke", "--device", "cpu", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["precision"] for r in runs] == ["fp32", "bf16"]
    steps = [c["step"] for c in runs[0]["curve"]]
    assert steps == [c["step"] for c in runs[1]["curve"]] == [1, 10, 20]
    # float32 keeps the tied multipliers of standard MHA together (the drift is rounding-free zero)
    assert all(c["qk_drift"] == 0.0 for c in runs[0]["curve"])
    assert "Q/K drift" in capsys.readouterr().out


@pytest.mark.slow
def test_muon_drift_smoke(tmp_path):
    muon = _load("muon_drift")
    assert muon.main(["--steps", "2", "--out", str(tmp_path / "muon")]) == 0
    out = json.loads((tmp_path / "muon.json").read_text())
    assert list(out["runs"]) == ["plain", "plain + fix 100", "LRM", "LRM + fix 100"]
    assert out["newton_schulz"]["f64_row_rescale_vs_before"] > 0


@pytest.mark.slow
def test_approximate_state_smoke(tmp_path):
    approx = _load("approximate_state")
    assert approx.main(["--history", "2", "--k", "1", "--out", str(tmp_path / "approx")]) == 0
    rows = json.loads((tmp_path / "approx.json").read_text())["rows"]
    assert set(rows) == set(approx.CASES)
    assert all(r["gaugeopt_1"] >= 0 for r in rows.values())


def test_trust_cost_smoke(tmp_path):
    """The cost-of-trust benchmark runs on tiny models and reports every column; the re-check is far
    below a step (a ratio, not a timing assertion: the numbers are the benchmark's own output)."""
    trust = _load("trust_cost")
    out = tmp_path / "trust.md"
    report = trust.main(["--quick", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| GPT-2") or line.startswith("| Llama")]
    assert len(rows) == 2 and report.startswith("# The cost of trust")
    assert all(len(r.split("|")) == 10 for r in rows)


@pytest.mark.slow
def test_lr_sensitivity_quick(tmp_path):
    study = _load("lr_sensitivity")
    out = tmp_path / "study"
    assert study.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    runs = data["runs"]
    assert {r["condition"] for r in runs} == set(study.CONDITIONS) and len(runs) == len(study.CONDITIONS) * 2
    assert set(data["summary"]["sensitivity"]) == set(study.CONDITIONS)
    slow = [r for r in runs if r["lr"] == min(study.QUICK["rates"])]
    assert not any(r["diverged"] for r in slow) and all(r["val_loss"] < data["summary"]["loss0"] for r in slow)
    assert all(r["steps_clipped"] > 0 for r in slow if r["condition"].endswith("clip"))  # τ acts in the quick run
    assert all(r["qk_drift"] < 1e-6 for r in slow if r["condition"] in ("lrm_B_fix1", "lrm_B_fix1_pmax", "lrm_B_fix1_clip"))
    assert out.with_suffix(".csv").read_text().startswith("condition,lr,seed")
    assert out.with_suffix(".png").stat().st_size > 0 and "LR sensitivity" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_attention_logits_cost_smoke(tmp_path):
    cost = _load("attention_logits_cost")
    out = tmp_path / "cost.md"
    assert cost.main(["--smoke", "--out", str(out)]) == 0
    text = out.read_text()
    assert "forward + logits / forward" in text and "train step + QK-Clip / train step" in text
