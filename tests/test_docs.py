"""Every ```python block of the README and of docs/*.md runs as written.

Blocks of one page run in order in one namespace, in a scratch directory; a block that is a
sketch rather than a program is fenced ```text instead. Pages whose blocks need a GPU or the
network have none.
"""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for block in _blocks(page):
        exec(compile(block, str(page.relative_to(REPO)), "exec"), namespace)


def test_every_page_with_code_is_covered():
    assert {"gaugefix.md", "projection.md", "model_tools.md", "lightning.md", "integrations.md"} <= {
        p.name for p in PAGES if _blocks(p)}
