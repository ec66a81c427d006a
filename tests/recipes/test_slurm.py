"""The slurm templates: what the GPU templates would launch, and a real run through a local Slurm.

The local run starts a one-node Slurm on loopback (slurm/local/up.sh, with its own state folder and
ports), submits the tiny recipe through the real ``slurm/train_multinode.sbatch`` with the GPU
defaults overridden for 2 CPU tasks (DDP over gloo), polls ``squeue`` until the job is gone, checks
the job completed, wrote a checkpoint and that both ranks ended with the same parameters, and stops
the daemons.  Without Slurm (no apt-get, no packages) it skips locally; CI sets
``GAUGEOPT_REQUIRE_SLURM=1`` and then it fails instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from train_helpers import REPO

TEMPLATES = {"train_8xA100.sbatch": 1, "train_8xH100.sbatch": 1, "train_multinode.sbatch": 2}


def sbatch_directives(path: Path) -> dict[str, str]:
    """``--option: value`` of the ``#SBATCH`` lines (flags map to ``""``)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("#SBATCH"):
            opt = line.split(None, 1)[1].strip()
            key, _, value = opt.partition("=")
            out[key] = value
    return out


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(extra)
    return env


# ---- what the GPU templates launch ----------------------------------------------------------------


@pytest.mark.parametrize("template, nodes", TEMPLATES.items())
def test_gpu_template_directives(template, nodes):
    d = sbatch_directives(REPO / "slurm" / template)
    assert d["--ntasks-per-node"] == d["--gpus-per-node"] == "8"  # one process per GPU
    assert "--ntasks" not in d and "--gpus" not in d  # Lightning rejects --ntasks; --gpus is per job
    assert d["--nodes"] == str(nodes)
    assert d["--signal"] == "SIGUSR1@90" and "--requeue" in d  # Lightning's SLURM auto-requeue
    assert d["--open-mode"] == "append"  # a requeued job keeps its log


@pytest.mark.parametrize("template, nodes", TEMPLATES.items())
def test_gpu_template_launches_the_paper_run(template, nodes):
    """DRY_RUN=1: the script prints its srun line and runs `recipes.train --dry-run` on that command line."""
    env = clean_env(DRY_RUN="1", PYTHON=sys.executable, CONFIG="recipes/configs/gpt2_owt_B.yaml", SEED="123")
    res = subprocess.run(["bash", str(REPO / "slurm" / template)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    srun = next(l for l in res.stdout.splitlines() if l.startswith("would run: "))[len("would run: "):]
    expected = (f"srun --kill-on-bad-exit=1 --ntasks-per-node=8 {sys.executable} -m recipes.train "
                f"--config recipes/configs/gpt2_owt_B.yaml --set train.seed=123 train.accelerator=gpu "
                f"train.devices=8 train.num_nodes={nodes}")
    assert srun.startswith(expected), srun
    assert f"hardware: {nodes} node(s) × 8 cuda process(es), ddp, bf16-mixed" in res.stdout
    assert "= 480 sequences/iteration" in res.stdout  # the paper's batch on 8 or 16 GPUs
    assert "491,520 tokens/iteration; × 20,000 iterations = 9,830,400,000 tokens" in res.stdout
    assert "runs/gpt2_owt_B_s123" in res.stdout and "fix_every=1 " in res.stdout


# ---- a real run on a local Slurm ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def local_slurm():
    state = tempfile.mkdtemp(prefix="gslurm-")  # short: munge's socket path must fit in sun_path
    env = clean_env(SLURM_LOCAL_DIR=state, SLURM_LOCAL_CTLD_PORT=str(_free_port()),
                    SLURM_LOCAL_SLURMD_PORT=str(_free_port()), SLURM_LOCAL_CPUS="4")
    up = subprocess.run([str(REPO / "slurm" / "local" / "up.sh")], env=env, capture_output=True, text=True, timeout=300)
    if up.returncode != 0:
        shutil.rmtree(state, ignore_errors=True)
        why = f"slurm/local/up.sh failed ({up.returncode}):\n{up.stderr[-3000:]}"
        if os.environ.get("GAUGEOPT_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    env["SLURM_CONF"] = re.search(r"export SLURM_CONF=(\S+)", up.stdout).group(1)
    env["PATH"] = env["PATH"] + ":/usr/sbin"
    yield env
    subprocess.run([str(REPO / "slurm" / "local" / "down.sh"), "--purge"], env=env, capture_output=True, timeout=60)


def _wait_for(job: str, env: dict[str, str], timeout: float) -> dict[str, str]:
    """Poll squeue until the job leaves the queue, then read its final state from scontrol."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
        state = q.stdout.strip()
        if q.returncode == 0 and state in ("", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job], env=env)
        pytest.fail(f"job {job} still {state!r} after {timeout:.0f} s")
    show = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", show))


@pytest.mark.slow
@pytest.mark.slurm
def test_tiny_recipe_through_sbatch_with_two_cpu_ranks(local_slurm, tmp_path):
    out = tmp_path / "runs"
    extra = " ".join([
        f"data.dir={tmp_path / 'data'}",  # not prepared yet: rank 0 prepares it, rank 1 waits
        "model.n_layer=2", "model.n_embd=64", "model.block_size=64", "data.micro_batch_size=8",
        "data.val_batches=4", "data.grad_accum_steps=2", "train.max_steps=20", "train.eval_interval=10",
        "train.log_every=5", "gauge.monitor_every=5", "gauge.fix_every=5", "optim.warmup_steps=5",
    ])
    env = {**local_slurm, "CONFIG": "recipes/configs/tiny_cpu_B.yaml", "ACCELERATOR": "cpu", "BATCH_ARGS": "",
           "PYTHON": sys.executable, "EXTRA_ARGS": extra, "OUT_DIR": str(out), "RUN_NAME": "slurm"}
    log = tmp_path / "slurm-%j.out"
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
         "--time=10", f"--output={log}", f"--chdir={REPO}", str(REPO / "slurm" / "train_multinode.sbatch")],
        env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    info = _wait_for(job, env, timeout=150)
    text = Path(str(log).replace("%j", job)).read_text()
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", text[-4000:]

    run = out / "slurm"
    assert "batch: 8 sequences/micro-batch × 1 micro-batches/rank × 2 ranks = 16 sequences/iteration" in text
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 20
    ranks = [json.loads((run / "ranks" / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 and r["step"] == 20 for r in ranks)
    assert ranks[0]["param_sha256"] == ranks[1]["param_sha256"]  # DDP kept the replicas identical
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["qk_drift"] <= 1e-5  # step 20 is a GaugeFix step
