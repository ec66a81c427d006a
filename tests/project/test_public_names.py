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


def test_former_names_are_the_same_objects():
    """The names kept for a release (docs/names.md) are the current objects, not copies."""
    from gaugeopt.integrations import lightning, metrics, optim

    assert gaugeopt.GaugeProjected is gaugeopt.GaugeOptimizer is optim.GaugeProjected
    import gaugeopt.callbacks as cb
    import gaugeopt.metrics as gm

    for name in cb.__all__:
        assert getattr(cb, name) is getattr(lightning, name)
    for name in gm.__all__:
        assert getattr(gm, name) is getattr(metrics, name)


def test_a_pickle_made_under_the_former_name_loads():
    import pickle

    import torch

    from gaugeopt.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=1, n_head=2, n_embd=8))
    wrapped = gaugeopt.GaugeOptimizer(torch.optim.AdamW(model.parameters()), model, project=None, fix_every=2)
    data = pickle.dumps(wrapped).replace(b"GaugeOptimizer", b"GaugeProjected")  # as the former class pickled itself
    assert b"GaugeProjected" in data
    assert type(pickle.loads(data)) is gaugeopt.GaugeOptimizer
