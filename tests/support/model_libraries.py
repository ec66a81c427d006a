"""The outside model libraries the suite tests against, and how the tests import them.

``tests/requirements-models.txt`` pins them (installed with ``pip install --no-deps``: their own
pins would replace the CPU build of torch). A test of a library skips when it is not importable;
CI sets ``GAUGEOPT_REQUIRE_MODELS=1`` and then a missing library fails the test instead.

timm imports torchvision at import time (for data transforms and ``FrozenBatchNorm2d``, none of
which a ``VisionTransformer`` uses), and only CUDA builds of torchvision exist next to a CPU
torch: :func:`install_torchvision_stub` serves an empty ``torchvision`` package whose names are
placeholders that raise when used. It lives here, in the tests; the library never imports timm.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import pathlib
import sys
import types

import pytest

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


def require(module: str):
    """Import ``module``: skip the test when it is missing, unless ``GAUGEOPT_REQUIRE_MODELS=1``."""
    if module.split(".")[0] == "timm":
        install_torchvision_stub()
    if os.environ.get("GAUGEOPT_REQUIRE_MODELS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def nanogpt():
    """nanoGPT's ``model.py`` as a module named like a user's copy of it: tests/fixtures/nanogpt holds
    the file and its MIT licence verbatim from github.com/karpathy/nanoGPT at commit
    3adf61e154c3fe3fca428ad6bc3818b27a3b8291."""
    name = "my_project.nanogpt_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FIXTURES / "nanogpt" / "model.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def quiet(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its prints swallowed (nanoGPT prints its parameter count)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------- torchvision stub for timm
class _Placeholder(type):
    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        sub = _Placeholder(attr, (_Unusable,), {"__module__": cls.__module__})
        setattr(cls, attr, sub)
        return sub


class _Unusable(metaclass=_Placeholder):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__module__}.{type(self).__name__}: torchvision is a test stub here")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _Placeholder(attr, (_Unusable,), {"__module__": self.__name__})
        setattr(self, attr, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0+stub"
        return mod

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        return None


_FINDER = _StubFinder()


def install_torchvision_stub() -> None:
    """Serve a stub ``torchvision`` unless a working one imports."""
    if _FINDER in sys.meta_path or "torchvision" in sys.modules:
        return
    try:
        importlib.import_module("torchvision")
        return
    except Exception:  # missing, or a CUDA-only build that fails to load
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    sys.meta_path.insert(0, _FINDER)
