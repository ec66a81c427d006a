"""The package's layers import downwards only: records → the group, finding, trust → the math → tools → integrations.

Every ``import`` statement of every module (module level and inside functions) is read with
``ast``; a module may import from its own layer's package or a layer below it:

=================================  =============================================================
layer                              may import (besides torch, the standard library, its own package)
=================================  =============================================================
``errors``, ``linalg``,            nothing of gaugeopt but ``errors``
``distributed``
``kernels`` (Triton backends)      ``errors`` only: the kernels know tensors and tables, not models
``models``                         ``errors``
``records`` (what a layer is)      the above
``sectors`` (the group),           the above and ``records``; neither imports the other
``adapters`` (finding records)
``trust`` (the gate)               the above
``transforms``                     the above: whole-model gauge transformations, through the gate
``fix``, ``projection`` (the       the above and ``kernels``; neither imports the other
math)
``clip``                           the above and ``fix`` (QK-Clip moves optimizer state as the fix does)
``flat`` (the meter)               the layers up to ``transforms``
``tools``                          every layer above
``integrations``, ``callbacks``,   anything
``metrics``, ``recipes`` (the
training recipes), the top level
=================================  =============================================================

Inside one subpackage the modules' imports form no cycle (:func:`test_no_import_cycles_inside_a_subpackage`):
every import counts, at module level or inside a function — a function-level import hides a cycle from
Python's import order, not from a reader — except those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
import pathlib

import gaugeopt

ROOT = pathlib.Path(gaugeopt.__file__).resolve().parent

LEAVES = {"errors", "linalg", "distributed"}
ALLOWED = {
    "errors": set(),
    "linalg": {"errors"},
    "distributed": {"errors"},
    "kernels": {"errors"},
    "models": {"errors"},
    "records": LEAVES | {"models"},
    "sectors": LEAVES | {"models", "records"},
    "adapters": LEAVES | {"models", "records"},
    "trust": LEAVES | {"models", "records", "sectors", "adapters"},
    "transforms": LEAVES | {"models", "records", "sectors", "adapters", "trust"},
    "fix": LEAVES | {"models", "records", "sectors", "adapters", "trust", "transforms", "kernels"},
    "projection": LEAVES | {"models", "records", "sectors", "adapters", "trust", "transforms", "kernels"},
    "clip": LEAVES | {"models", "records", "sectors", "adapters", "trust", "transforms", "kernels", "fix"},
    "flat": LEAVES | {"models", "records", "sectors", "adapters", "trust", "transforms"},
    "tools": LEAVES | {"models", "records", "sectors", "adapters", "trust", "transforms", "kernels", "fix", "projection",
                       "clip", "flat"},
}


def _package_of(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    return rel.parts[0] if rel.parts[0] != "__init__" else "__init__"


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """``(line, top-level gaugeopt package)`` of every gaugeopt import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    module_parts = ["gaugeopt", *path.relative_to(root).with_suffix("").parts]
    if module_parts[-1] == "__init__":
        module_parts = module_parts[:-1]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                pkg = module_parts if path.name == "__init__.py" else module_parts[:-1]
                base = pkg[: len(pkg) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            elif node.module:
                names = [node.module] if node.module != "gaugeopt" else [f"gaugeopt.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "gaugeopt" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def _modules(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Every module under ``root``, through the ``kernels`` symbolic link too."""
    import os

    out = []
    for folder, _, files in os.walk(root, followlinks=True):
        out += [pathlib.Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(out)


def test_every_layer_is_known():
    packages = {_package_of(p) for p in _modules()}
    known = set(ALLOWED) | {"integrations", "callbacks", "metrics", "recipes", "__init__", "__main__"}
    assert packages <= known, packages - known
    assert {"records", "sectors", "adapters", "trust", "fix", "projection", "clip", "flat", "tools", "kernels",
            "integrations"} <= packages


def _violations(root: pathlib.Path) -> list[str]:
    out = []
    for path in _modules(root):
        layer = _package_of(path, root)
        if layer not in ALLOWED:
            continue  # integrations and the top level may import anything
        for line, target in _imports(path, root):
            if target != layer and target not in ALLOWED[layer]:
                out.append(f"{path.relative_to(root.parent)}:{line} ({layer}) imports gaugeopt.{target}")
    return out


def test_imports_point_downwards_only():
    violations = _violations(ROOT)
    assert not violations, "\n".join(violations)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = ["gaugeopt", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST):
    """Every import statement of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def _cycles(root: pathlib.Path) -> list[list[str]]:
    """Strongly connected groups (more than one module) of the import graph restricted to each subpackage;
    ``from pkg import name`` points at the submodule ``pkg.name`` when there is one, else at ``pkg``."""
    paths = {_module_name(p, root): p for p in _modules(root)}
    edges: dict[str, set[str]] = {}
    for mod, path in paths.items():
        pkg_parts = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        out = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = ".".join(pkg_parts[: len(pkg_parts) - (node.level - 1)] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            out |= {t for t in targets if t in paths and t != mod and t.split(".")[:2] == mod.split(".")[:2]}
        edges[mod] = out
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycles_inside_a_subpackage():
    cycles = _cycles(ROOT)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_checker_sees_cycles(tmp_path):
    """Negative control: a cycle through a function-level import and a package ``__init__`` is found; the same
    imports under ``TYPE_CHECKING``, or across subpackages, are not cycles."""
    pkg = tmp_path / "gaugeopt"
    (pkg / "structure").mkdir(parents=True)
    (pkg / "tools").mkdir()
    (pkg / "structure" / "__init__.py").write_text("from gaugeopt.structure.a import f\n")
    (pkg / "structure" / "a.py").write_text("def f():\n    from gaugeopt.structure import b\n")
    (pkg / "structure" / "b.py").write_text("from . import c\n")
    (pkg / "structure" / "c.py").write_text("from gaugeopt.structure import a\n")
    (pkg / "tools" / "x.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gaugeopt.tools import y\n")
    (pkg / "tools" / "y.py").write_text("from gaugeopt.tools import x\n")
    assert _cycles(pkg) == [["gaugeopt.structure.a", "gaugeopt.structure.b", "gaugeopt.structure.c"]]


def test_the_checker_sees_violations(tmp_path):
    """Negative control: imports against the direction, absolute, relative and inside a function."""
    pkg = tmp_path / "gaugeopt"
    (pkg / "fix").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    (pkg / "fix" / "bad.py").write_text(
        "from ..projection import sylvester\n"
        "def f():\n    from gaugeopt.integrations.optim import GaugeOptimizer\n"
    )
    (pkg / "kernels" / "bad.py").write_text("import gaugeopt.records.site\n")
    found = _violations(pkg)
    assert len(found) == 3 and any("imports gaugeopt.projection" in v for v in found), found
    assert any("gaugeopt.integrations" in v for v in found) and any("(kernels)" in v for v in found)
