"""Every docstring example in the package runs and prints what it says (one test per module)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gaugeopt

# Modules whose examples need something a CPU test process does not have: the Triton kernels
# compile for a GPU unless TRITON_INTERPRET=1 was set before their import
# (tests/kernels_interpreter_cases.py runs their examples in such a process).
NEEDS_GPU = {"gaugeopt.kernels.gaugefix_triton", "gaugeopt.kernels.projection_triton"}


def _modules() -> list[str]:
    names = ["gaugeopt"]
    for info in pkgutil.walk_packages(gaugeopt.__path__, prefix="gaugeopt."):
        if info.name not in NEEDS_GPU:
            names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_every_package_is_walked():
    for pkg in ("structure", "fix", "projection", "tools", "integrations", "kernels", "models"):
        assert any(m.startswith(f"gaugeopt.{pkg}.") for m in MODULES), pkg


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
