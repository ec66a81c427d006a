"""Every name a module promises — in ``__all__`` or in a lazy table — resolves to an object."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import gaugeopt

MODULES = sorted(
    {"gaugeopt"} | {m.name for m in pkgutil.walk_packages(gaugeopt.__path__, "gaugeopt.")}
)


@pytest.mark.parametrize("name", MODULES)
def test_every_name_in___all___resolves(name):
    mod = importlib.import_module(name)
    missing = [n for n in getattr(mod, "__all__", ()) if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names {missing}, which do not resolve"
    lazy = getattr(mod, "_LAZY", {})
    for n in lazy:
        assert getattr(mod, n) is not None, f"{name}: the lazy name {n} does not resolve"


def test_the_checker_sees_a_stale_name(monkeypatch):
    import gaugeopt.kernels as kernels

    monkeypatch.setitem(kernels._LAZY, "fused_project", "gaugeopt.kernels.ops")
    with pytest.raises(ModuleNotFoundError):
        getattr(kernels, "fused_project")
