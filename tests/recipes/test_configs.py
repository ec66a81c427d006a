"""The YAML configs: paper 002's exact numbers, validation errors, inheritance, overrides, schedule, MFU table.

Nothing here trains; the paper's numbers are written out literally (not read back from the code) so
that a changed config or a changed batch convention fails loudly.
"""

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

import gaugeopt
from recipes.config import ConfigError, apply_overrides, config_from_dict, load_config
from recipes.lit import CosineSchedule
from recipes.model import build_model, count_parameters
from recipes.perf import peak_flops
from recipes.train import resolve_hardware

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "recipes" / "configs"
PAPER = ["gpt2_owt_A", "gpt2_owt_B", "gpt2_owt_C"] + [f"gpt2_owt_fix_every_{n}" for n in (1, 10, 100, 1000)]
TINY = ["tiny_cpu_A", "tiny_cpu_B", "tiny_cpu_C", "tiny_cpu_fix_every_10", "tiny_cpu_fix_every_100"]


def nanogpt_get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """nanoGPT train.py's get_lr, verbatim."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


# ---- paper 002's runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", PAPER)
def test_paper_configs_reproduce_the_batch_arithmetic_and_schedule(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    # 12 sequences per GPU per micro-batch, 40 micro-batches per iteration over 8 GPUs (5 each)
    assert (cfg.data.micro_batch_size, cfg.data.grad_accum_steps) == (12, 40)
    assert (cfg.train.devices, cfg.train.num_nodes) == (8, 1)
    plan = cfg.batch_plan()
    assert plan.world_size == 8 and plan.accum_per_rank == 5
    assert plan.sequences_per_step == 480 == 12 * 40
    assert plan.tokens_per_step == 480 * 1024 == 491_520
    assert plan.total_tokens == 20_000 * 491_520 == 9_830_400_000  # the paper's "~10B tokens"
    # GPT-2 124M
    m = cfg.model
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size) == (12, 12, 768, 1024, 50304)
    assert m.lrm and m.bias and m.dropout == 0.0 and m.tie_weights and m.rope == "none" and m.n_kv_head is None
    # AdamW 6e-4 cosine to 6e-5, 2,000 warmup, betas 0.9/0.95, clip 1.0, decay 0.1 / 2e-3, bf16
    o = cfg.optim
    assert (o.lr, o.min_lr, o.warmup_steps, o.betas, o.grad_clip) == (6e-4, 6e-5, 2000, (0.9, 0.95), 1.0)
    assert (o.weight_decay, o.multiplier_decay) == (0.1, 2e-3)
    assert o.decay_steps in (None, 20_000)
    assert cfg.train.max_steps == 20_000 and cfg.train.precision == "bf16-mixed"
    assert cfg.train.max_steps % cfg.train.eval_interval == 0
    assert cfg.gauge.granularity == "head" and cfg.gauge.transport_state is False  # the paper's GaugeFix


@pytest.mark.parametrize(
    "name, condition, fix_every, seed",
    [("gpt2_owt_A", "A", None, 42), ("gpt2_owt_B", "B", 1, 42), ("gpt2_owt_C", "C", None, 42)]
    + [(f"gpt2_owt_fix_every_{n}", "B", n, 42) for n in (1, 10, 100, 1000)],
)
def test_paper_conditions_and_frequencies(name, condition, fix_every, seed):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert (cfg.optim.condition, cfg.gauge.fix_every, cfg.train.seed) == (condition, fix_every, seed)


@pytest.mark.parametrize("condition, qk_decay", [("A", 2e-3), ("B", 0.0), ("C", 0.0)])
def test_paper_conditions_decay_the_qk_multipliers_as_the_paper(condition, qk_decay):
    """Condition A decays r_Q, r_K by 2e-3; B and C by 0; every other multiplier by 2e-3 and matrices by 0.1."""
    cfg = load_config(CONFIGS / f"gpt2_owt_{condition}.yaml")
    with torch.device("meta"):
        model = build_model(cfg.model)
    groups = gaugeopt.lrm_param_groups(model, cfg.optim.condition, weight_decay=cfg.optim.weight_decay,
                                       multiplier_decay=cfg.optim.multiplier_decay)
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    for block in model.transformer.h:
        r_q, r_k, r_v = block.attn.c_attn.row_mults
        assert decay_of[id(r_q)] == decay_of[id(r_k)] == qk_decay
        assert decay_of[id(r_v)] == 2e-3 and decay_of[id(block.mlp.c_fc.row_mults[0])] == 2e-3
        assert decay_of[id(block.attn.c_attn.weight)] == 0.1 and decay_of[id(block.attn.c_attn.bias)] == 0.0
    assert count_parameters(model)["multipliers"] == 165_888  # "170K additional multiplier parameters"


def test_paper_seeds_in_the_sweep():
    out = subprocess.run([str(REPO / "slurm" / "sweep.sh"), "--dry-run"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    runs = {(re.search(r"CONFIG=\S+/(\S+)\.yaml", l).group(1), int(re.search(r"SEED=(\d+)", l).group(1))) for l in out}
    table1 = {(f"gpt2_owt_{c}", s) for c in "ABC" for s in (42, 123, 456)}
    table2 = {(f"gpt2_owt_fix_every_{n}", 42) for n in (10, 100, 1000)}
    assert runs == table1 | table2 and len(out) == 12  # every 1 step = gpt2_owt_B at seed 42


def test_schedule_is_nanogpts_get_lr():
    s = CosineSchedule(6e-4, 6e-5, 2000, 20_000)
    for it in [0, 1, 999, 1999, 2000, 2001, 7000, 11_000, 19_999, 20_000, 20_001, 25_000]:
        assert s.lr_at(it) == pytest.approx(nanogpt_get_lr(it, 6e-4, 6e-5, 2000, 20_000), rel=1e-12, abs=0)
    assert s.lr_at(11_000) == pytest.approx((6e-4 + 6e-5) / 2, rel=1e-12)  # half-way down the cosine
    # the LambdaLR drives the optimizer with the same numbers, step by step
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=6e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, s)
    seen = []
    for _ in range(2003):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(6e-4 / 2001) and seen[2000] == pytest.approx(6e-4)
    assert seen == pytest.approx([nanogpt_get_lr(i, 6e-4, 6e-5, 2000, 20_000) for i in range(2003)], rel=1e-12)


# ---- every config file ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", PAPER + TINY)
def test_every_config_opens_with_goal_hardware_and_launch_command(name):
    text = (CONFIGS / f"{name}.yaml").read_text()
    header = text[: text.index("\nbase:")]
    assert all(line.startswith("#") for line in header.splitlines())
    assert "Hardware:" in header and "Launch" in header and f"{name}.yaml" in header
    load_config(CONFIGS / f"{name}.yaml")  # and it validates


@pytest.mark.parametrize("name", TINY)
def test_tiny_configs_are_cpu_sized(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.train.precision == "32-true" and cfg.train.devices == 1 and cfg.data.prepare is not None
    assert cfg.model.n_kv_head < cfg.model.n_head  # GQA: see base/tiny_cpu.yaml for why
    with torch.device("meta"):
        n = sum(p.numel() for p in build_model(cfg.model, 128).parameters())
    assert n < 1_000_000


# ---- validation, inheritance, overrides -----------------------------------------------------------


def base_dict(**sections):
    d = {"train": {"max_steps": 100, "eval_interval": 50}, "optim": {"warmup_steps": 10}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return d


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"optim": {"condition": "D"}}, "optim.condition='D'"),
        ({"optim": {"condition": "B"}}, "needs gauge.fix_every"),
        ({"optim": {"condition": "C"}, "gauge": {"fix_every": 10}}, "no-control ablation"),
        ({"train": {"eval_interval": 30}}, "must divide train.max_steps=100"),
        ({"optim": {"lr": 1e-3, "min_lr": 1e-2}}, "optim.min_lr"),
        ({"model": {"n_head": 5}}, "n_embd=768 is not divisible by n_head=5"),
        ({"model": {"n_layers": 4}}, "unknown key(s) model.n_layers"),
        ({"optim": {"lr": "fast"}}, "optim.lr='fast'"),
        ({"gauge": {"monitor_every": 15}}, "multiple of train.log_every"),
        ({"gauge": {"granularity": "row"}}, "gauge.granularity='row'"),
        ({"train": {"precision": "fp8"}}, "train.precision='fp8'"),
    ],
)
def test_invalid_configs_are_refused_with_the_field_named(sections, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(base_dict(**sections))


def test_unknown_section_is_refused():
    with pytest.raises(ConfigError, match="unknown section"):
        config_from_dict({**base_dict(), "trainer": {}})


def test_yaml_scientific_notation_without_a_dot_is_a_float(tmp_path):
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 2e-3\n  min_lr: 1e-4\n  warmup_steps: 10\ntrain:\n  max_steps: 100\n  eval_interval: 50\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.optim.lr == 2e-3 and isinstance(cfg.optim.lr, float)


def test_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  n_layer: 2\n  n_embd: 64\n  n_head: 4\ntrain:\n  max_steps: 100\n  eval_interval: 50\n"
                                        "optim:\n  warmup_steps: 10\n")
    (tmp_path / "mid.yaml").write_text("base: base.yaml\nmodel:\n  n_layer: 3\n")
    (tmp_path / "leaf.yaml").write_text("base: mid.yaml\noptim:\n  condition: B\ngauge:\n  fix_every: 5\n")
    cfg = load_config(tmp_path / "leaf.yaml", ["optim.lr=1e-3", "train.seed=7", "model.n_kv_head=2"])
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_kv_head) == (3, 64, 2)  # leaf > mid > base
    assert (cfg.optim.condition, cfg.gauge.fix_every, cfg.optim.lr, cfg.train.seed) == ("B", 5, 1e-3, 7)
    assert cfg.name == "leaf" and cfg.run_name == "leaf_s7"
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="expected section.key=value"):
        apply_overrides({}, ["lr=1e-3"])
    with pytest.raises(ConfigError, match="unknown section 'optimizer'"):
        apply_overrides({}, ["optimizer.lr=1e-3"])


def test_uneven_batch_split_suggests_one_that_keeps_the_batch():
    cfg = load_config(CONFIGS / "gpt2_owt_A.yaml", ["train.devices=8", "train.num_nodes=2"])
    with pytest.raises(ConfigError, match=r"micro_batch_size=10 data.grad_accum_steps=48"):
        cfg.batch_plan()
    fixed = load_config(CONFIGS / "gpt2_owt_A.yaml",
                        ["train.num_nodes=2", "data.micro_batch_size=10", "data.grad_accum_steps=48"])
    assert fixed.batch_plan().sequences_per_step == 480 and fixed.batch_plan().accum_per_rank == 3


# ---- hardware resolution and the peak-FLOPs table ----------------------------------------------------


def test_hardware_from_slurm_environment():
    cfg = load_config(CONFIGS / "tiny_cpu_A.yaml", ["train.devices=auto", "train.num_nodes=auto", "train.accelerator=cpu"])
    srun = {"SLURM_NTASKS": "6", "SLURM_NNODES": "3", "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "job",
            "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}
    hw = resolve_hardware(cfg.train, srun)
    assert (hw.devices, hw.num_nodes, hw.strategy, hw.world_size) == (2, 3, "ddp", 6)
    hw = resolve_hardware(cfg.train, {})  # no SLURM, no GPU: one CPU process
    assert (hw.devices, hw.num_nodes, hw.strategy, hw.precision) == (1, 1, "auto", "32-true")
    interactive = {**srun, "SLURM_JOB_NAME": "bash"}  # salloc shell: not an srun step Lightning manages
    assert resolve_hardware(cfg.train, interactive).devices == 1


@pytest.mark.parametrize(
    "device, precision, expected",
    [
        ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312e12),
        ("NVIDIA A100 80GB PCIe", "bf16-mixed", 312e12),
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4e12),
        ("NVIDIA H100 PCIe", "bf16-mixed", 756.5e12),
        ("NVIDIA H200", "bf16-true", 989.4e12),
        ("NVIDIA L4", "bf16-mixed", 121e12),
        ("NVIDIA A10", "16-mixed", 125e12),
        ("Tesla V100-SXM2-32GB", "16-mixed", 125e12),
        ("Tesla V100-SXM2-32GB", "bf16-mixed", None),  # Volta has no bf16 tensor cores
        ("NVIDIA A10G", "bf16-mixed", None),  # not published: no guess
        ("NVIDIA A100-SXM4-80GB", "32-true", None),  # fp32 peak depends on TF32: no MFU
        ("cpu", "32-true", None),
        ("cpu", "bf16-mixed", None),
    ],
)
def test_peak_flops_table(device, precision, expected):
    assert peak_flops(device, precision) == expected
