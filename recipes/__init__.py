"""Training recipes built on gaugeopt: data preparation, configs, Lightning training, the CPU demo.

From a source checkout they run from the repository root (``python -m recipes.demo``); installed, the
same modules are :mod:`gaugeopt.recipes` (``gaugeopt/recipes`` links to this folder, and the wheel
ships it with its configs) and the console scripts ``gaugeopt-demo``, ``gaugeopt-train`` and
``gaugeopt-data`` run them from any directory. The modules import each other relatively, so either
name works.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"


def invocation(spec) -> str:
    """How the user ran an entry point, for its ``--help``: ``python -m <module>``, or the console script's name.

    ``spec`` is the module's ``__spec__`` (``__name__`` is ``"__main__"`` under ``python -m``)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if spec is not None and (not name or name.endswith(".py") or name in ("-c", "-m")):
        return f"python -m {spec.name}"
    return name or "python"
