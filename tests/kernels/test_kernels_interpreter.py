"""Every Triton kernel against its torch reference, on CPU, through the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before a kernel is decorated, and other modules of this
pytest process may already have imported the kernel modules compiled for a GPU, so the cases
(``tests/kernels/kernels_interpreter_cases.py``) run in a fresh interpreter process; a failure there
fails this test with the inner report (each failing case and its assertion).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CASES = HERE / "kernels_interpreter_cases.py"

pytest.importorskip("triton", reason="the kernels need triton (pip install 'gaugeopt[triton]')")


@pytest.mark.slow
def test_kernels_match_torch_under_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k not in ("GAUGEOPT_BACKEND", "PYTEST_ADDOPTS")}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-rfE", "-p", "no:cacheprovider", "--tb=short"],
        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-12000:]
    assert proc.returncode == 0, f"interpreter cases failed (exit {proc.returncode}):\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, summary
