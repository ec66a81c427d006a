"""`import gaugeopt.kernels` resolves inside the tree it is imported from: a source checkout, a
second checkout, an installed wheel — never another copy's kernels."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import gaugeopt

SRC = pathlib.Path(gaugeopt.__file__).resolve().parent.parent


def _where(cwd: pathlib.Path, path_entry: pathlib.Path) -> dict[str, str]:
    """Module files of gaugeopt and gaugeopt.kernels as seen by a fresh interpreter."""
    code = ("import json, gaugeopt, gaugeopt.kernels.dispatch as d; "
            "print(json.dumps({'gaugeopt': gaugeopt.__file__, 'kernels': d.__file__}))")
    env = {**os.environ, "PYTHONPATH": str(path_entry)}
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    import json

    return json.loads(out.stdout)


def _python_files(root: pathlib.Path) -> set[str]:
    found = set()
    for folder, _, files in os.walk(root / "gaugeopt", followlinks=True):
        for f in files:
            if f.endswith(".py"):
                found.add((pathlib.Path(folder) / f).relative_to(root).as_posix())
    return found


def test_a_second_checkout_imports_its_own_kernels(tmp_path):
    copy = tmp_path / "checkout"
    shutil.copytree(SRC / "gaugeopt", copy / "gaugeopt", symlinks=True)
    shutil.copytree(SRC / "kernels", copy / "kernels")
    where = _where(copy, copy)
    assert where["gaugeopt"].startswith(str(copy)) and where["kernels"].startswith(str(copy)), where


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_imports_its_own_kernels(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(SRC),
                    "-w", str(tmp_path)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("gaugeopt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _python_files(SRC) - names
    assert not missing, f"modules left out of the wheel: {sorted(missing)}"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert not (site / "gaugeopt" / "kernels").is_symlink()  # real files in the installed package
    where = _where(tmp_path, site)
    assert where["gaugeopt"].startswith(str(site)) and where["kernels"].startswith(str(site)), where
