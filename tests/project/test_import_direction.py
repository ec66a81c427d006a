"""The package's layers import downwards only: structure → math → backends → integrations, never back.

Every ``import`` statement of every module (module level and inside functions) is read with
``ast``; a module may import from its own layer's package or a layer below it:

=================================  =============================================================
layer                              may import (besides torch, the standard library, its own package)
=================================  =============================================================
``errors``, ``linalg``,            nothing of gaugeopt but ``errors``
``distributed``
``kernels`` (Triton backends)      ``errors`` only: the kernels know tensors and tables, not models
``models``                         ``errors``
``structure``                      the above, ``models`` (built-in adapters register its classes)
``fix``, ``projection`` (the       the above and ``kernels``; neither imports the other
math)
``tools``                          the above
``integrations``, ``callbacks``,   anything
``metrics``, the top level
=================================  =============================================================
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
    "structure": LEAVES | {"models"},
    "fix": LEAVES | {"models", "structure", "kernels"},
    "projection": LEAVES | {"models", "structure", "kernels"},
    "tools": LEAVES | {"models", "structure", "kernels", "fix", "projection"},
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
    known = set(ALLOWED) | {"integrations", "callbacks", "metrics", "__init__", "__main__"}
    assert packages <= known, packages - known
    assert {"structure", "fix", "projection", "tools", "kernels", "integrations"} <= packages


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


def test_the_checker_sees_violations(tmp_path):
    """Negative control: imports against the direction, absolute, relative and inside a function."""
    pkg = tmp_path / "gaugeopt"
    (pkg / "fix").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    (pkg / "fix" / "bad.py").write_text(
        "from ..projection import sylvester\n"
        "def f():\n    from gaugeopt.integrations.optim import GaugeOptimizer\n"
    )
    (pkg / "kernels" / "bad.py").write_text("import gaugeopt.structure.site\n")
    found = _violations(pkg)
    assert len(found) == 3 and any("imports gaugeopt.projection" in v for v in found), found
    assert any("gaugeopt.integrations" in v for v in found) and any("(kernels)" in v for v in found)
