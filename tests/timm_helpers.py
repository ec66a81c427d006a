"""Import timm in the test environment, where torchvision may be missing or unusable.

timm imports torchvision at import time (``timm.layers`` pulls in ``torchvision.ops.misc`` and
friends) although its ``VisionTransformer`` never calls it, and a CPU-only torch may have no
matching torchvision wheel. :func:`import_timm` puts a ``sys.meta_path`` finder in front that serves
an empty module for ``torchvision`` and every ``torchvision.*`` whose attributes are placeholder
classes (so ``from torchvision.ops.misc import FrozenBatchNorm2d`` works; *using* one raises), unless
a working torchvision is importable. It returns the ``timm`` module, or skips the test when timm
is not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest

_PREFIX = "torchvision"


class _MissingMeta(type):
    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        sub = _MissingMeta(attr, (_Missing,), {"_qualname": f"{cls._qualname}.{attr}", "__module__": cls.__module__})
        setattr(cls, attr, sub)
        return sub


class _Missing(metaclass=_MissingMeta):
    _qualname = "torchvision.<placeholder>"

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{self._qualname} is a placeholder: torchvision is not installed")

    def __init_subclass__(cls, **kwargs):  # timm subclasses a few torchvision classes
        super().__init_subclass__()


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        ph = _MissingMeta(attr, (_Missing,), {"_qualname": f"{self.__name__}.{attr}", "__module__": self.__name__})
        setattr(self, attr, ph)
        return ph


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = _PlaceholderModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0+placeholder"
        return mod

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _PREFIX or fullname.startswith(_PREFIX + "."):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


_FINDER = _Finder()


def _torchvision_works() -> bool:
    if importlib.util.find_spec(_PREFIX) is None:
        return False
    try:
        __import__(_PREFIX)
        return True
    except Exception:
        for name in [n for n in sys.modules if n == _PREFIX or n.startswith(_PREFIX + ".")]:
            del sys.modules[name]
        return False


def import_timm():
    """The ``timm`` module (skips the test when timm is not installed)."""
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed")
    if "timm" not in sys.modules and _FINDER not in sys.meta_path and not _torchvision_works():
        sys.meta_path.insert(0, _FINDER)
    import timm

    return timm
