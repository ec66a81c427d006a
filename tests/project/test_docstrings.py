"""Every docstring example in the package runs and prints what it says (one test per module)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gaugeopt

# Modules whose examples need something a CPU test process does not have: the Triton kernels
# compile for a GPU unless TRITON_INTERPRET=1 was set before their import
# (tests/kernels/kernels_interpreter_cases.py runs their examples in such a process).
NEEDS_GPU = {"gaugeopt.kernels.gaugefix.fused", "gaugeopt.kernels.projection.fused"}


def _modules() -> list[str]:
    names = ["gaugeopt"]
    for info in pkgutil.walk_packages(gaugeopt.__path__, prefix="gaugeopt."):
        if info.name not in NEEDS_GPU:
            names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_every_package_is_walked():
    for pkg in ("records", "adapters", "sectors", "trust", "fix", "projection", "clip", "flat", "tools",
                "integrations", "kernels", "models"):
        assert any(m.startswith(f"gaugeopt.{pkg}.") for m in MODULES), pkg


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    mod = importlib.import_module(name)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


def _resolve(dotted: str) -> bool:
    """Whether ``gaugeopt.a.b.c`` names a module or an attribute chain of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _references() -> dict[str, set[str]]:
    """Every ``gaugeopt.…`` name a docstring role (``:func:``, ``:class:``, …) or a docs page points to."""
    import pathlib
    import re

    root = pathlib.Path(gaugeopt.__file__).resolve().parent.parent
    role = re.compile(r":(?:func|class|mod|meth|attr|data|exc):`~?(gaugeopt(?:\.\w+)+)`")
    ticked = re.compile(r"`(gaugeopt(?:\.\w+)+)`")
    found: dict[str, set[str]] = {}
    for path in [*root.joinpath("gaugeopt").rglob("*.py"), *root.joinpath("kernels").rglob("*.py")]:
        for name in role.findall(path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(root)))
    for path in [root / "README.md", *root.joinpath("docs").glob("*.md")]:
        for name in ticked.findall(path.read_text()):
            found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


def test_every_reference_to_a_gaugeopt_name_resolves():
    refs = _references()
    assert len(refs) > 50  # not vacuous
    broken = {name: sorted(where) for name, where in refs.items() if not _resolve(name)}
    assert not broken, broken
