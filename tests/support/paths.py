"""Where the suite's files are, for tests that read a file or start a script in a fresh process, and
:func:`suite_module` for a test module that reuses another's checks.

Example:
    >>> from paths import REPO, SUPPORT
    >>> (REPO / "pyproject.toml").exists(), (SUPPORT / "zoo" / "__init__.py").exists()
    (True, True)
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"


def suite_module(path: str) -> ModuleType:
    """The test module at ``tests/<path>`` (``"projection/test_projection.py"``), imported under the name
    pytest gives it (its file name), so its checks can run on other models."""
    folder = str((TESTS / path).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(Path(path).stem)
