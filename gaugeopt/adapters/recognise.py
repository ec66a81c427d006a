r"""Recognition by equivalence: an attention class that is a renamed copy of a verified one.

Hugging Face generates most modeling files from "modular" sources, so many attention classes are
another family's class under a new name (``Qwen3MoeAttention`` is ``Qwen3Attention``,
``GraniteAttention`` is ``LlamaAttention``, ``RobertaAttention`` is ``BertAttention``). A class absent
from the adapter table is handled with a verified class's adapter when everything its ``forward``
computes with is, after normalising names, the verified class's:

1. its ``forward`` (through decorators: the wrapper's code, its closure, the wrapped function),
2. every module-level function that code reaches, transitively (``apply_rotary_pos_emb``,
   ``rotate_half``, ``eager_attention_forward``, ``repeat_kv``, ...),
3. every method of the class that it reaches through ``self.<name>``,
4. the classes of the module's sub-modules that are defined next to it (``Qwen3MoeRMSNorm``
   against ``Qwen3RMSNorm``: every function in the class body, ``__init__`` included, and its bases),
5. every other object it reaches — the attention-kernel registry ``ALL_ATTENTION_FUNCTIONS``, which
   picks the kernel from ``config._attn_implementation``, ``torch``, ``nn`` — must be the *same* object;
   constants (numbers, strings) equal.

Functions are compared as code objects: bytecode, constants (nested code compared the same way),
argument and local names, flags; line numbers, file names and docstrings are ignored. **Names are
normalised** by one substitution: the candidate's family stem (``"Qwen3Moe"``: its class name less
the tail it shares with the verified class, ``"Attention"``) and the verified class's stem
(``"Qwen3"``) are both replaced by the same placeholder in every global, attribute and qualified
name, so ``Qwen3MoeRMSNorm`` and ``Qwen3RMSNorm`` compare equal as names; the objects behind them are
then compared in turn. Nothing else is normalised: a different local name, constant or operation is
a different class.

A recognised record is **not verified**: it is built by the verified class's adapter (the same
refusals apply: an unverified attention kernel, a patched ``forward``) and must pass
:func:`gaugeopt.certify` before a gauge operation uses it. Equal code does not make equal modules:
``__init__`` of the attention class itself is not compared (Granite sets its own score scale
there), so head counts and widths come from the instance, and the certificate checks them.

Limits: a class whose source is generated at run time, a C extension or a ``functools.partial`` is
not comparable and stays refused; a copy that renames a local variable or reorders two
independent lines is refused although it computes the same function (describe it with
:class:`gaugeopt.AttentionSpec` and certify it); subclasses of a class in the adapter table are
not recognised here (a subclass may override what ``forward`` reaches).

Example:
    >>> import torch.nn as nn
    >>> from gaugeopt.adapters.recognise import same_code
    >>> def helper(x): return x * 2
    >>> class LlamaLikeAttention(nn.Module):
    ...     def forward(self, x): return helper(x) + 1
    >>> class CopyLikeAttention(nn.Module):
    ...     def forward(self, x): return helper(x) + 1
    >>> class EditLikeAttention(nn.Module):
    ...     def forward(self, x): return helper(x) + 2
    >>> same_code(CopyLikeAttention, LlamaLikeAttention), same_code(EditLikeAttention, LlamaLikeAttention)
    (True, False)
"""

from __future__ import annotations

import builtins
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn

__all__ = ["Recognition", "recognise", "recognised_adapter", "same_code", "equivalent_class"]

_PLACEHOLDER = "\x00F\x00"
_ATTENTION_TAIL = "Attention"
# Constants compared by value; anything else reached must be the very same object.
_VALUE_TYPES = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis))


@dataclass(frozen=True)
class Recognition:
    """The verified class a candidate was recognised as (:func:`recognise`)."""

    candidate: type
    reference: type
    key: object  # the adapter-table key of the reference (a class or an import path)

    @property
    def reference_path(self) -> str:
        return f"{self.reference.__module__}.{self.reference.__qualname__}"


def _stems(candidate: str, reference: str) -> tuple[str, str] | None:
    """``(candidate stem, reference stem)``: the names less their longest common tail that starts
    with a capital letter (``("Qwen3Moe", "Qwen3")`` for ``Qwen3MoeRMSNorm``/``Qwen3RMSNorm``)."""
    n = 0
    while n < min(len(candidate), len(reference)) and candidate[-1 - n] == reference[-1 - n]:
        n += 1
    tail = candidate[len(candidate) - n:]
    while tail and not tail[0].isupper():
        tail = tail[1:]
    if len(tail) < 4:
        return None
    a, b = candidate[: len(candidate) - len(tail)], reference[: len(reference) - len(tail)]
    return (a, b) if a and b and a != b else None


class _Comparer:
    """Structural equality of two functions/classes under one stem substitution (module docstring)."""

    def __init__(self, stem_a: str, stem_b: str, home_a: str, home_b: str) -> None:
        self.stem_a, self.stem_b = stem_a, stem_b
        self.home_a, self.home_b = home_a, home_b  # the modules whose classes are compared by content
        self.assumed: set[tuple[int, int]] = set()
        self.why = ""

    # ------------------------------------------------------------------ names
    def _name(self, s: str, side: int) -> str:
        stem = self.stem_a if side == 0 else self.stem_b
        return s.replace(stem, _PLACEHOLDER)

    def _names(self, names: tuple[str, ...], side: int) -> tuple[str, ...]:
        return tuple(self._name(n, side) for n in names)

    def _fail(self, why: str) -> bool:
        self.why = self.why or why
        return False

    # ------------------------------------------------------------------ code objects
    def _code_key(self, code: types.CodeType, side: int, doc: str | None) -> tuple:
        consts = []
        for i, c in enumerate(code.co_consts):
            if isinstance(c, types.CodeType):
                consts.append(("code", self._code_key(c, side, None)))
            elif i == 0 and doc is not None and c == doc:
                consts.append(("doc",))
            elif isinstance(c, str):
                consts.append(self._name(c, side))
            else:
                consts.append((type(c).__name__, repr(c)))
        return (
            code.co_code, tuple(consts), self._names(code.co_names, side), code.co_varnames, code.co_freevars,
            code.co_cellvars, code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
            code.co_stacksize, getattr(code, "co_exceptiontable", b""), self._name(code.co_name, side),
        )

    @staticmethod
    def _all_names(code: types.CodeType) -> list[str]:
        out = list(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                out += _Comparer._all_names(c)
        return out

    # ------------------------------------------------------------------ objects
    def same(self, a: Any, b: Any, where: str) -> bool:
        if a is b:
            return True
        key = (id(a), id(b))
        if key in self.assumed:
            return True
        if isinstance(a, _VALUE_TYPES) and type(a) is type(b):
            if isinstance(a, str):
                return self._name(a, 0) == self._name(b, 1) or self._fail(f"{where}: {a!r} != {b!r}")
            return a == b or self._fail(f"{where}: {a!r} != {b!r}")
        if isinstance(a, tuple) and isinstance(b, tuple):
            return (len(a) == len(b) and all(self.same(x, y, where) for x, y in zip(a, b))) or self._fail(
                f"{where}: tuples differ")
        if isinstance(a, (staticmethod, classmethod)) and type(a) is type(b):
            return self.same(a.__func__, b.__func__, where)
        if isinstance(a, property) and isinstance(b, property):
            return all(self.same(getattr(a, f), getattr(b, f), where) for f in ("fget", "fset", "fdel"))
        if isinstance(a, types.FunctionType) and isinstance(b, types.FunctionType):
            self.assumed.add(key)
            return self.same_function(a, b, where)
        if isinstance(a, type) and isinstance(b, type):
            self.assumed.add(key)
            return self.same_class(a, b, where)
        return self._fail(f"{where}: {_describe(a)} is not {_describe(b)}")

    def same_function(self, a: types.FunctionType, b: types.FunctionType, where: str) -> bool:
        where = f"{where} -> {a.__qualname__}"
        if self._code_key(a.__code__, 0, a.__doc__) != self._code_key(b.__code__, 1, b.__doc__):
            return self._fail(f"{where}: the code differs from {b.__module__}.{b.__qualname__}")
        if self._name(a.__qualname__, 0) != self._name(b.__qualname__, 1):
            return self._fail(f"{where}: qualified names differ ({b.__qualname__})")
        if not self.same(a.__defaults__, b.__defaults__, f"{where} defaults"):
            return False
        if not self.same(tuple(sorted((a.__kwdefaults__ or {}).items())),
                         tuple(sorted((b.__kwdefaults__ or {}).items())), f"{where} keyword defaults"):
            return False
        cells_a, cells_b = a.__closure__ or (), b.__closure__ or ()
        for ca, cb in zip(cells_a, cells_b):
            try:
                va, vb = ca.cell_contents, cb.cell_contents
            except ValueError:  # an empty cell
                return self._fail(f"{where}: an empty closure cell")
            if not self.same(va, vb, f"{where} closure"):
                return False
        ga, gb = a.__globals__, b.__globals__
        for na, nb in zip(self._all_names(a.__code__), self._all_names(b.__code__)):
            in_a, in_b = na in ga, nb in gb
            if in_a != in_b:
                return self._fail(f"{where}: the name {na!r} is a module-level object on one side only")
            if in_a:
                if not self.same(ga[na], gb[nb], f"{where} -> {na}"):
                    return False
            elif hasattr(builtins, na) != hasattr(builtins, nb):
                return self._fail(f"{where}: the builtin {na!r} on one side only")
        return True

    def same_class(self, a: type, b: type, where: str, *, methods: tuple[str, ...] | None = None) -> bool:
        """Classes defined in the two home modules compare by content (``methods``: only these
        names, else every function in the class body); any other pair must be the same class."""
        where = f"{where} -> class {a.__qualname__}"
        if a.__module__ != self.home_a or b.__module__ != self.home_b:
            return self._fail(f"{where}: a different class from {b.__module__}.{b.__qualname__}")
        if self._name(a.__qualname__, 0) != self._name(b.__qualname__, 1):
            return self._fail(f"{where}: names differ ({b.__qualname__})")
        if len(a.__bases__) != len(b.__bases__) or not all(
                self.same(x, y, f"{where} base") for x, y in zip(a.__bases__, b.__bases__)):
            return self._fail(f"{where}: bases differ")
        names = methods if methods is not None else tuple(sorted(set(_body(a)) | set(_body(b))))
        for n in names:
            va, vb = _lookup(a, n), _lookup(b, n)
            if va is None or vb is None:
                return self._fail(f"{where}: {n!r} defined on one side only")
            if not self.same(va, vb, f"{where}.{n}"):
                return False
        return True


def _body(cls: type) -> dict[str, Any]:
    skip = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
            "__firstlineno__", "__static_attributes__", "__orig_bases__", "__parameters__"}
    return {k: v for k, v in vars(cls).items()
            if k not in skip and isinstance(v, (types.FunctionType, staticmethod, classmethod, property))}


def _lookup(cls: type, name: str) -> Any:
    for c in cls.__mro__:
        if name in vars(c):
            return vars(c)[name]
    return None


def _describe(x: Any) -> str:
    return f"{type(x).__qualname__} {getattr(x, '__qualname__', '')}".strip()


def _self_methods(cls: type, fn: types.FunctionType) -> list[str]:
    """Names that ``fn`` (a method of ``cls``) reads and that are functions/properties on the class."""
    out = []
    for n in _Comparer._all_names(fn.__code__):
        v = _lookup(cls, n)
        if isinstance(v, (types.FunctionType, staticmethod, classmethod, property)) and n != "forward":
            out.append(n)
    return sorted(set(out))


def _compare(cand: type, ref: type, module: nn.Module | None) -> tuple[bool, str]:
    stems = _stems(cand.__name__, ref.__name__)
    if stems is None:
        return False, f"{cand.__name__} and {ref.__name__} share no family-name tail"
    cmp = _Comparer(stems[0], stems[1], cand.__module__, ref.__module__)
    fa, fb = _lookup(cand, "forward"), _lookup(ref, "forward")
    if not isinstance(fa, types.FunctionType) or not isinstance(fb, types.FunctionType):
        return False, "forward is not a Python function"
    # forward and every method it reaches through self (transitively), by name
    todo, seen = ["forward"], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        va, vb = _lookup(cand, n), _lookup(ref, n)
        if va is None or vb is None:
            return False, f"{cand.__qualname__}.{n} exists on one side only"
        if not cmp.same(va, vb, f"{cand.__qualname__}.{n}"):
            return False, cmp.why
        func = va.__func__ if isinstance(va, (staticmethod, classmethod)) else va
        if isinstance(func, types.FunctionType):
            todo += [m for m in _self_methods(cand, func) if m not in seen]
    if module is not None:  # the classes of its sub-modules defined next to it
        ref_mod = sys.modules.get(ref.__module__)
        for child_name, child in module.named_children():
            ccls = type(child)
            if ccls.__module__ != cand.__module__:
                continue
            rname = ccls.__qualname__.replace(stems[0], stems[1])
            rcls = getattr(ref_mod, rname, None) if ref_mod is not None else None
            if not isinstance(rcls, type):
                return False, f"sub-module {child_name} ({ccls.__qualname__}) has no counterpart {rname} next to {ref.__qualname__}"
            if not cmp.same_class(ccls, rcls, f"{cand.__qualname__}.{child_name}"):
                return False, cmp.why
    return True, ""


def same_code(candidate: type, reference: type) -> bool:
    """Whether ``candidate``'s ``forward`` and everything it reaches equal ``reference``'s after the
    stem substitution (module docstring), without looking at an instance's sub-modules."""
    return _compare(candidate, reference, None)[0]


_CLASS_CACHE: dict[tuple[int, str], tuple[type, bool]] = {}


def equivalent_class(cls: type, reference_path: str) -> bool:
    """Whether ``cls`` (a norm or other helper class) is a renamed copy of the class at
    ``reference_path``: every function in both class bodies and their bases compared as in the
    module docstring. Used by adapters that check the class of a sub-module (a QK-norm)."""
    key = (id(cls), reference_path)
    hit = _CLASS_CACHE.get(key)
    if hit is None or hit[0] is not cls:  # (an id can be reused once a class is gone)
        ref = _resolve(reference_path, cls)
        stems = None if ref is None else _stems(cls.__name__, ref.__name__)
        ok = False
        if ref is not None and stems is not None:
            ok = _Comparer(stems[0], stems[1], cls.__module__, ref.__module__).same_class(cls, ref, cls.__qualname__)
        hit = _CLASS_CACHE[key] = (cls, ok)
    return hit[1]


def _resolve(path: str, near: type) -> type | None:
    """The class at import path ``path``, importing its module only when its top-level package is
    already imported (by the model's own library): gaugeopt never imports optional libraries itself."""
    mod_name, _, cls_name = path.rpartition(".")
    mod = sys.modules.get(mod_name)
    if mod is None:
        top = mod_name.split(".")[0]
        if top not in sys.modules or top != near.__module__.split(".")[0]:
            return None
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - an optional module that does not import is simply not a reference
            return None
    cls = getattr(mod, cls_name, None)
    return cls if isinstance(cls, type) else None


def _subclass_of_table(cls: type, table: dict) -> bool:
    paths = {k for k in table if isinstance(k, str)}
    for base in cls.__mro__[1:]:
        if base in table or f"{base.__module__}.{base.__qualname__}" in paths:
            return True
    return False


_CACHE: dict[tuple, tuple[type, Recognition | None, str]] = {}


def recognise(module: nn.Module, table: dict, verified: Callable[[Any], bool]) -> tuple[Recognition | None, str]:
    """The verified class ``module``'s class is a renamed copy of, or ``(None, why not)``.

    ``table`` is the adapter table (classes and import paths), ``verified(adapter)`` says which of
    its adapters are built-in verified ones: only those are references. The result is cached per class
    and set of sub-module classes (an instance built from another config may have other sub-modules).
    """
    cls = type(module)
    key = (id(cls), tuple((n, id(type(c))) for n, c in module.named_children() if type(c).__module__ == cls.__module__))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is cls:
        return hit[1], hit[2]
    result: Recognition | None = None
    why = f"{cls.__qualname__} is not an attention class name ending in {_ATTENTION_TAIL!r}"
    if cls.__name__.endswith(_ATTENTION_TAIL) and not _subclass_of_table(cls, table):
        why = "no verified class has the same forward"
        for key, adapter in table.items():
            if not verified(adapter):
                continue
            ref = key if isinstance(key, type) else _resolve(key, cls)
            if ref is None or ref is cls or not ref.__name__.endswith(_ATTENTION_TAIL):
                continue
            if _stems(cls.__name__, ref.__name__) is None:
                continue
            ok, reason = _compare(cls, ref, module)
            if ok:
                result = Recognition(cls, ref, key)
                break
    _CACHE[key] = (cls, result, why)
    return result, why


def recognised_adapter(module: nn.Module, table: dict, verified: Callable[[Any], bool]):
    """An adapter for ``module`` built from the verified class it copies (its records unverified:
    :func:`gaugeopt.certify` must pass first), or ``None``."""
    rec, _ = recognise(module, table, verified)
    if rec is None:
        return None
    reference_adapter = table[rec.key]

    def adapt(root: nn.Module, name: str, m: nn.Module):
        site = reference_adapter(root, name, m)
        site.features = site.features + (f"recognised_as:{rec.reference_path}",)
        return site

    adapt.recognition = rec  # type: ignore[attr-defined]
    return adapt
