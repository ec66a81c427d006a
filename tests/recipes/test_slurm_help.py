"""Every script in slurm/ answers ``--help`` with its header, listing every environment knob it reads,
and does nothing else (no srun, no cluster started, no state written)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from train_helpers import REPO

SCRIPTS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "slurm").rglob("*") if p.suffix in (".sh", ".sbatch"))
SOURCED = {"slurm/train_8xA100.sbatch": "slurm/launch.sh", "slurm/train_8xH100.sbatch": "slurm/launch.sh",
           "slurm/train_multinode.sbatch": "slurm/launch.sh"}  # templates list the launch's knobs too


def knobs(script: str) -> set[str]:
    """Environment variables the script reads with a default (``${NAME:-…}``, ``${NAME-…}``), outside comments;
    Slurm's own variables (set by the job, not by the user) and the script's internal flags left out."""
    code = "\n".join(line for line in (REPO / script).read_text().splitlines() if not line.lstrip().startswith("#"))
    names = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-|-)", code))
    internal = {n for n in names if re.search(rf"^\s*{n}=(?!.*\$\{{{n}[:-])", code, re.M)}
    return {n for n in names - internal if not n.startswith("SLURM_") or n.startswith("SLURM_LOCAL_")}


def test_the_knob_reader_finds_the_knobs():  # control: a reader that found nothing would pass every help
    assert {"SEED", "PYTHON", "EXTRA_ARGS", "DRY_RUN", "REPO", "OMP_NUM_THREADS"} <= knobs("slurm/launch.sh")
    assert {"CONFIG", "SEED", "GPUS_PER_NODE"} <= knobs("slurm/train_8xA100.sbatch")
    assert "PURGE" not in knobs("slurm/local/down.sh") and "SLURM_NNODES" not in knobs("slurm/launch.sh")
    assert {"BATCH_ARGS", "NCCL_SOCKET_IFNAME"} <= knobs("slurm/train_multinode.sbatch")
    assert {"SLURM_LOCAL_DIR", "SLURM_LOCAL_INSTALL", "TMPDIR"} <= knobs("slurm/local/up.sh")


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_knob_and_runs_nothing(script, flag, tmp_path):
    state = tmp_path / "slurm-state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(SLURM_LOCAL_DIR=str(state), SLURM_LOCAL_INSTALL="0", PATH="/usr/bin:/bin")  # no srun, no sbatch
    out = subprocess.run(["bash", str(REPO / script), flag], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.splitlines()[0].strip() and "=====" not in text and not text.lstrip().startswith("#")
    wanted = knobs(script) | (knobs(SOURCED[script]) if script in SOURCED else set())
    missing = {k for k in wanted if not re.search(rf"\b{k}\b", text)}
    assert not missing, f"{script} --help does not list {sorted(missing)}"
    assert not state.exists() and list(tmp_path.iterdir()) == []  # nothing started, nothing written
