"""Every ```python block of the README and of docs/*.md runs as written.

Blocks of one page run in order in one namespace, in a scratch directory; a block that is a
sketch rather than a program is fenced ```text instead. Pages whose blocks need a GPU or the
network have none.
"""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
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
    assert {"gaugefix.md", "projection.md", "model_tools.md", "lightning.md", "integrations.md", "adapters.md"} <= {
        p.name for p in PAGES if _blocks(p)}


def test_ci_runs_the_readme_test_command():
    """.ci/run ends with exactly the README's test command, and makes missing model libraries fail."""
    readme = (REPO / "README.md").read_text()
    command = re.search(r"# the test suite \(what CI runs\)\n(.*?)\n```", readme).group(1)
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == command
    assert "pip install --no-deps -r tests/requirements-models.txt" in command
    assert "export GAUGEOPT_REQUIRE_MODELS=1" in ci
