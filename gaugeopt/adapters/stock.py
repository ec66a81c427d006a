"""Is the code an attention module runs the code its library ships? Provenance by code object.

A built-in adapter was written for one ``forward`` and the helpers it calls (HF's
``apply_rotary_pos_emb``, ``eager_attention_forward``, litgpt's ``apply_rope`` ...). A patching
library or a user can replace any of them — a class's ``forward``, a module-level helper, a method
— keeping the name, the module and the docstring (``functools.wraps`` copies all three). What it
cannot keep is the *code object*: its ``co_filename`` and first line are where the replacement was
compiled. So provenance is decided against the library's source file:

* a name the file defines with ``def`` (a module-level function, or a method of a class defined
  there) must be bound to the function compiled from that ``def`` — unwrapped through
  ``__wrapped__``, with no more wrapping layers than the ``def`` has decorators (a
  ``functools.wraps`` patch adds one);
* a name the file imports (``from .x import y``) must be bound to the same object as in the module it
  is imported from;
* any other global is recorded but not judged (constants, registries).

The walk starts at the ``forward`` that runs (first class along the MRO defining it), follows the
module-level functions it names through their globals, a few levels deep (``apply_rotary_pos_emb`` →
``rotate_half``), and the class's methods it names; it follows only code of the class's own library.

:func:`code_bindings` returns every binding it looked at, ``(namespace, name, object)``; a
:class:`Binding` re-checks in a dictionary lookup that the name still holds the same object, which is
how a gauge operation notices a helper patched *after* its records were proved.

What this cannot see: code that computes differently with the same objects (a global flag read at
run time, a replaced attribute of ``torch``); the numerical certificate
(:mod:`gaugeopt.trust.proof`) is the proof, this is the cheap tripwire beside it.

Example:
    >>> import functools, torch.nn as nn
    >>> from gaugeopt.adapters.stock import forward_problems
    >>> forward_problems(nn.Linear)
    []
    >>> stock = nn.Linear.forward
    >>> nn.Linear.forward = functools.wraps(stock)(lambda self, x: 2 * stock(self, x))  # name, module, doc kept
    >>> "is wrapped by <lambda>" in forward_problems(nn.Linear)[0]
    True
    >>> nn.Linear.forward = stock
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import types
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["MISSING", "Binding", "accept_patch", "code_bindings", "defining_class", "forward_problems", "global_problem", "library_of",
           "library_root"]

MISSING = _MISSING = object()  # what a namespace holds for a name it does not bind
# How deep the walk follows helpers through their own globals (forward -> apply_rotary_pos_emb -> rotate_half).
_MAX_DEPTH = 4


def _unwrap(fn: Any) -> list[types.FunctionType]:
    """``fn`` and the functions it wraps (``__wrapped__``), outermost first; ``[]`` if not a Python function."""
    chain: list[types.FunctionType] = []
    seen: set[int] = set()
    while isinstance(fn, (types.FunctionType, types.MethodType, staticmethod, classmethod)) and id(fn) not in seen:
        seen.add(id(fn))
        fn = fn.__func__ if isinstance(fn, (types.MethodType, staticmethod, classmethod)) else fn
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return chain


@dataclass(frozen=True, eq=False)
class Binding:
    """``namespace[name] is value`` when it was checked; :meth:`holds` says whether it still is.

    ``namespace`` is a dictionary (a module's globals, a class's ``__dict__``, a kernel registry) or,
    for ``attribute=True``, an object whose attribute ``name`` is compared by equality (a config value).
    """

    namespace: Any
    name: str
    value: Any
    attribute: bool = False

    def holds(self) -> bool:
        if self.attribute:
            return getattr(self.namespace, self.name, _MISSING) == self.value
        return self.namespace.get(self.name, _MISSING) is self.value

    def _key(self) -> tuple:
        return (id(self.namespace), self.name, self.value if self.attribute else id(self.value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Binding) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def code_key(self) -> tuple:
        """What the bound object is, without identities: ``(name, file, line, bytecode hash, layers)`` for a
        function, ``(name, value)`` for an attribute, ``(name, type)`` otherwise — part of the key a proof
        is stamped under."""
        chain = _unwrap(self.value)
        if chain:
            code = chain[-1].__code__
            return (self.name, code.co_filename, code.co_firstlineno, hash(code.co_code), len(chain))
        return (self.name, repr(self.value) if self.attribute else type(self.value).__qualname__)


def library_of(module_name: str | None) -> str:
    """The top-level package of a module name (``"transformers.models.llama..."`` → ``"transformers"``)."""
    return (module_name or "").split(".")[0]


def _real(path: str) -> str:
    return os.path.realpath(path)


def _module_file(module_name: str | None) -> str | None:
    path = getattr(sys.modules.get(module_name or ""), "__file__", None)
    return _real(path) if path else None


def library_root(module_name: str) -> str | None:
    """Where the library of ``module_name`` lives: the directory of its top-level package if imported,
    else the directory of the module's own file."""
    top = sys.modules.get(library_of(module_name))
    path = getattr(top, "__file__", None)
    if path and getattr(top, "__path__", None) is not None:
        return os.path.dirname(_real(path))
    own = _module_file(module_name)
    return os.path.dirname(own) if own else None


def _inside(file: str, root: str | None) -> bool:
    return root is not None and (file == root or file.startswith(root + os.sep))


@dataclass(frozen=True)
class _Source:
    """What a source file binds: ``defs[qualname] = (first line of the def, the names its decorators
    start with)``, the names it imports, ``imports[name] = (module, attribute)``, class attributes
    bound to a module-level name, ``aliases["Class.attr"] = name``, and the qualified names of the
    classes it defines."""

    defs: dict
    imports: dict
    aliases: dict
    classes: frozenset


def _resolve(module: str | None, level: int, package: str) -> str | None:
    if level == 0:
        return module
    parts = package.split(".")
    if level > len(parts):
        return None
    base = ".".join(parts[: len(parts) - level + 1])
    return f"{base}.{module}" if module else base


@functools.lru_cache(maxsize=512)
def _source(path: str, package: str) -> _Source:
    defs: dict[str, tuple[int, tuple[str, ...]]] = {}
    imports: dict[str, tuple[str, str]] = {}
    aliases: dict[str, str] = {}
    classes: set[str] = set()
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return _Source(defs, imports, aliases, frozenset())

    def entry(node) -> tuple[int, tuple[str, ...]]:  # co_firstlineno is the first decorator's line
        names = []
        for d in node.decorator_list:
            while isinstance(d, (ast.Call, ast.Attribute)):
                d = d.func if isinstance(d, ast.Call) else d.value
            names.append(d.id if isinstance(d, ast.Name) else "")
        return min([node.lineno, *(d.lineno for d in node.decorator_list)]), tuple(names)

    def visit(body, prefix: str, in_class: bool) -> None:  # qualified names as Python builds them
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs[prefix + node.name] = entry(node)
                visit(node.body, f"{prefix}{node.name}.<locals>.", False)
            elif isinstance(node, ast.ClassDef):
                classes.add(prefix + node.name)
                visit(node.body, f"{prefix}{node.name}.", True)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # defs under `if TYPE_CHECKING:`, `try:` ...
                nested = list(node.body) + list(getattr(node, "orelse", [])) + list(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    nested += handler.body
                visit(nested, prefix, in_class)
            elif in_class and isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Name):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(target, ast.Name):  # forward = _forward_unimplemented
                        aliases[prefix + target.id] = node.value.id

    visit(tree.body, "", False)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            src = _resolve(node.module, node.level, package)
            for alias in node.names:
                if src is not None and alias.name != "*":
                    imports[alias.asname or alias.name] = (src, alias.name)
    return _Source(defs, imports, aliases, frozenset(classes))


def _describe(fn: types.FunctionType) -> str:
    code = fn.__code__
    return f"{code.co_name} from {code.co_filename}:{code.co_firstlineno}"


def _source_of(module_name: str) -> tuple[str | None, _Source]:
    mod = sys.modules.get(module_name)
    path = _module_file(module_name)
    package = getattr(mod, "__package__", None) or module_name.rpartition(".")[0]
    if getattr(mod, "__path__", None) is not None:  # a package's __init__: relative imports start here
        package = module_name
    return path, (_source(path, package) if path else _Source({}, {}, {}, frozenset()))


def _root_of_object(obj: Any) -> str | None:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return library_root(name) if name else None


_STDLIB = os.path.dirname(_real(os.__file__))


def _wrapper_roots(module_name: str, decorators: tuple[str, ...]) -> list[str]:
    """Where the wrapping layers of a decorated ``def`` may come from: the module's own library, the
    standard library, torch, and the libraries its decorators are taken from."""
    namespace = vars(sys.modules[module_name]) if module_name in sys.modules else {}
    roots = [library_root(module_name), _STDLIB, library_root("torch")]
    roots += [_root_of_object(namespace[d]) for d in decorators if d in namespace]
    return [r for r in roots if r]


ACCEPTED_ATTR = "_gaugeopt_accepted_patch"


def accept_patch(fn: Any) -> Any:
    """Vouch for a replacement function (a patched ``forward``, method or helper of a supported class).

    gaugeopt refuses records whose code is not the library's own, because a patch may compute
    something else. A patch you wrote on purpose — the same formula at another precision, a faster
    kernel of the same function — can be marked with this decorator *before* it is installed: the
    static checks then let it pass, and the certificate still proves every record numerically with
    the patch in place (a wrong patch fails there). Returns ``fn``.

    Example:
        >>> import torch, gaugeopt
        >>> @gaugeopt.accept_patch
        ... def rms_norm_forward(self, x):  # the same formula, without a float32 round trip
        ...     return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    """
    target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        setattr(target, ACCEPTED_ATTR, True)
    except AttributeError as exc:
        from gaugeopt.errors import GaugeError

        raise GaugeError(f"accept_patch: cannot mark {fn!r}; pass a plain Python function") from exc
    return fn


def _accepted(chain: list) -> bool:
    return any(getattr(layer, ACCEPTED_ATTR, False) for layer in chain)


def _def_problem(value: Any, qualname: str, path: str, src: _Source, label: str, module_name: str) -> str | None:
    """Why ``value`` is not the function compiled from ``def qualname`` in ``path`` (``None`` when it is)."""
    line, decorators = src.defs[qualname]
    chain = _unwrap(value)
    if _accepted(chain):
        return None
    if not chain:
        if decorators and not isinstance(value, functools.partial):
            return None  # a decorator returned a callable object (a compiled function): nothing to place
        return f"{label} is {type(value).__qualname__} object {value!r:.60}, not the function defined at {path}:{line}"
    inner = chain[-1]
    code = inner.__code__
    if _real(code.co_filename) != path or code.co_firstlineno != line:
        return f"{label} is {_describe(inner)}, not the function defined at {path}:{line}"
    if len(chain) - 1 > len(decorators):
        return (f"{label} is wrapped by {_describe(chain[0])}: {len(chain) - 1} layer(s) around the function defined "
                f"at {path}:{line}, which has {len(decorators)} decorator(s)")
    roots = _wrapper_roots(module_name, decorators)
    for layer in chain[:-1]:
        if not any(_inside(_real(layer.__code__.co_filename), r) for r in roots):
            return f"{label} is wrapped by {_describe(layer)}, which none of its decorators provides"
    return None


def defining_class(cls: type, attr: str = "forward") -> type | None:
    """The first class along ``cls``'s MRO whose own ``__dict__`` defines ``attr``."""
    return next((c for c in cls.__mro__ if attr in vars(c)), None)


def forward_problems(cls: type, instance: Any = None, *, attr: str = "forward") -> list[str]:
    """Why the ``forward`` of ``cls`` (or of ``instance``) is not the one its class's source defines (``[]``)."""
    if instance is not None and attr in vars(instance):
        return [f"{type(instance).__qualname__}.{attr} was replaced on the instance"]
    owner = defining_class(cls, attr)
    if owner is None:
        return []
    path, src = _source_of(owner.__module__)
    qualname = f"{owner.__qualname__}.{attr}"
    label = f"{cls.__qualname__}.{attr}"
    if path is not None and qualname in src.aliases:
        problem = global_problem(vars(owner)[attr], src.aliases[qualname], owner.__module__, label)
        if problem is None and vars(owner)[attr] is not vars(sys.modules[owner.__module__]).get(src.aliases[qualname]):
            problem = f"{label} is not {src.aliases[qualname]}, which the class body binds it to"
        return [problem] if problem else []
    if path is None or qualname not in src.defs:
        if owner.__qualname__ not in src.classes:
            return []  # a class its module's source does not define (built in a doctest, exec'd): nothing to compare
        chain = _unwrap(vars(owner)[attr])
        if chain and path is not None and not _accepted(chain):  # assigned to the class after its body ran: a patch
            return [f"{label} is {_describe(chain[-1])}, not defined in the class body at {path}"]
        return []
    problem = _def_problem(vars(owner)[attr], qualname, path, src, label, owner.__module__)
    return [problem] if problem else []


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def global_problem(value: Any, name: str, module_name: str, label: str) -> str | None:
    """Why the global ``name`` of module ``module_name`` is not what that module's source binds."""
    path, src = _source_of(module_name)
    if path is None:
        return None
    if name in src.defs:
        return _def_problem(value, name, path, src, label, module_name)
    if name in src.imports:
        origin, attr = src.imports[name]
        mod = sys.modules.get(origin)
        if mod is None:  # never imported here (an optional import the file guards): nothing to compare
            return None
        expected = getattr(mod, attr, _MISSING)
        if expected is not _MISSING and expected is not value and not _accepted(_unwrap(value)):
            chain = _unwrap(value)
            what = _describe(chain[-1]) if chain else repr(value)[:80]
            return f"{label} is {what}, not {origin}.{attr} as {path} imports it"
    return None


def code_bindings(cls: type, *, attr: str = "forward", check: bool = True) -> tuple[list[str], list[Binding]]:
    """The helpers ``cls.forward`` reaches, checked for provenance (``check``), and their bindings.

    Returns ``(problems, bindings)``: ``problems`` name each function that is not what its source
    binds; ``bindings`` hold every ``(namespace, name, object)`` looked up — the class's own
    ``forward`` included — so that a later patch is noticed by :meth:`Binding.holds`.
    """
    owner = defining_class(cls, attr)
    if owner is None:
        return [], []
    library = library_root(owner.__module__)
    problems: list[str] = forward_problems(cls) if check else []
    bindings: list[Binding] = [Binding(vars(owner), attr, vars(owner)[attr])]
    seen: set[int] = set()

    def walk(fn: Any, depth: int, where: str) -> None:
        chain = _unwrap(fn)
        if not chain or depth > _MAX_DEPTH:
            return
        inner = chain[-1]
        if id(inner) in seen or not _inside(_real(inner.__code__.co_filename), library):
            return  # only the library's own code is followed (not torch's, not the standard library's)
        seen.add(id(inner))
        namespace = inner.__globals__
        module_name = namespace.get("__name__", "")
        for code in _codes(inner.__code__):
            for name in code.co_names:
                value = namespace.get(name, _MISSING)
                if isinstance(value, (types.FunctionType, types.MethodType)):
                    bindings.append(Binding(namespace, name, value))
                    if check:
                        problem = global_problem(value, name, module_name, f"{name} (called by {where})")
                        if problem:
                            problems.append(problem)
                    walk(value, depth + 1, name)
                elif depth == 0 and value is _MISSING:
                    method = _class_function(cls, name)
                    if method is not None:
                        klass, fn_ = method
                        bindings.append(Binding(vars(klass), name, vars(klass)[name]))
                        if check:
                            problems.extend(forward_problems(klass, attr=name))
                        walk(fn_, depth + 1, f"{cls.__qualname__}.{name}")

    walk(vars(owner)[attr], 0, f"{cls.__qualname__}.{attr}")
    return list(dict.fromkeys(problems)), bindings


def _class_function(cls: type, name: str) -> tuple[type, Any] | None:
    """``(defining class, function)`` for a method ``name`` of ``cls`` defined in Python, else ``None``."""
    if name.startswith("__"):
        return None
    owner = defining_class(cls, name)
    if owner is None or owner.__module__.startswith(("builtins", "torch.nn.modules.module")):
        return None
    chain = _unwrap(vars(owner)[name])
    return (owner, chain[0]) if chain else None
