"""The commands a user types: ``gaugeopt --version``, and the recipes after ``pip install``.

From a checkout the recipes run from the repository root (``python -m recipes.demo``); installed, the
same modules are ``gaugeopt.recipes`` with the console scripts ``gaugeopt-demo``, ``gaugeopt-train`` and
``gaugeopt-data``. The fast tests run a copy of the package, with no ``recipes`` on the path, from
another directory; the slow one builds the wheel, installs it into a folder and runs its console scripts.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

import gaugeopt
from gaugeopt.tools.cli import main

SRC = Path(gaugeopt.__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((SRC / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]


def test_version_is_the_running_package_s(capsys):
    assert main(["--version"]) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"gaugeopt {gaugeopt.__version__} (torch {torch.__version__}, Python {platform.python_version()})"
    assert gaugeopt.__version__ == PYPROJECT["project"]["version"]  # one version, wherever it is read
    out = subprocess.run([sys.executable, "-m", "gaugeopt", "--version"], cwd=SRC, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == line


def test_every_console_script_resolves():
    assert {"gaugeopt", "gaugeopt-demo", "gaugeopt-train", "gaugeopt-data"} <= set(SCRIPTS)
    for name, target in SCRIPTS.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


def _package_copy(tmp_path: Path) -> Path:
    """The package as a wheel lays it out (links resolved), in a folder of its own: no recipes/ beside it."""
    site = tmp_path / "site"
    shutil.copytree(SRC / "gaugeopt", site / "gaugeopt", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _run(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("module", ["demo", "train", "data"])
def test_the_recipes_run_as_gaugeopt_recipes_from_another_directory(module, tmp_path):
    site, elsewhere = _package_copy(tmp_path), tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _run([sys.executable, "-m", f"gaugeopt.recipes.{module}", "--help"], site, elsewhere)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: python -m gaugeopt.recipes.{module}")
    # control: the top-level name is the checkout's only, so the copy really runs without it
    missing = _run([sys.executable, "-c", "import recipes"], site, elsewhere)
    assert missing.returncode != 0 and "No module named 'recipes'" in missing.stderr


def test_packaged_configs_load_by_name_from_another_directory(tmp_path):
    site = _package_copy(tmp_path)
    code = ("from gaugeopt.recipes.config import load_config; "
            "print(load_config('tiny_cpu_B').name, load_config('recipes/configs/gpt2_owt_A.yaml').name)")
    out = _run([sys.executable, "-c", code], site, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["tiny_cpu_B", "gpt2_owt_A"]


def test_python_m_recipes_still_runs_from_the_root():
    out = subprocess.run([sys.executable, "-m", "recipes.demo", "--help"], cwd=SRC, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m recipes.demo"), out.stderr


@pytest.mark.slow
def test_the_installed_console_scripts_run_from_another_directory(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(SRC),
                    "-w", str(tmp_path)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("gaugeopt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"gaugeopt/recipes/demo.py", "gaugeopt/recipes/configs/tiny_cpu_B.yaml",
            "gaugeopt/recipes/configs/base/gpt2_owt.yaml"} <= names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, text=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for script in ("gaugeopt", "gaugeopt-demo", "gaugeopt-train", "gaugeopt-data"):
        out = _run([str(site / "bin" / script), "--help"], site, elsewhere)
        assert out.returncode == 0, (script, out.stderr)
        assert out.stdout.startswith(f"usage: {script}"), (script, out.stdout[:80])
    out = _run([str(site / "bin" / "gaugeopt"), "--version"], site, elsewhere)
    assert out.stdout.startswith(f"gaugeopt {gaugeopt.__version__} ")
