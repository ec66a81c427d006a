"""Shared fixtures for the recipes tests: small corpora on disk, an isolated datasets cache, GPT-2 ranks."""

import os
import sys
from pathlib import Path

import pytest

# recipes/ is not an installed package (it is run from the repository root, like nanoGPT's scripts);
# `pytest` started from the repository root does not put the root on sys.path, `python -m pytest` does.
_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

# Documents chosen to catch decoding mistakes: multi-line text, non-ASCII, leading/trailing blanks,
# and the literal text of GPT-2's end-of-text token (which must be encoded as ordinary text).
DOCS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "All:\nSpeak, speak.\n\n",
    "  Café, naïve — “quoted” text.\nSecond line.",
    "The literal <|endoftext|> inside a document is ordinary text.\n",
    "x",
    "Last document, with numbers 12345 and tabs\tand spaces   .\n",
]


@pytest.fixture
def text_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    """A folder of .txt files, one document each (names sort in document order)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    return folder, list(DOCS)


@pytest.fixture
def hf_cache(tmp_path: Path) -> str:
    """A datasets cache folder private to the test."""
    return str(tmp_path / "hf_cache")


@pytest.fixture
def gpt2_ranks() -> str:
    """Path of a fetched gpt2.tiktoken; skips when there is none (no network here)."""
    from recipes.tokenizer import GPT2_TIKTOKEN_ENV, default_gpt2_cache_path

    candidates = [os.environ.get(GPT2_TIKTOKEN_ENV), str(default_gpt2_cache_path())]
    for path in candidates:
        if path and os.path.isfile(path):
            return path
    pytest.skip(
        f"GPT-2 ranks file not available: set {GPT2_TIKTOKEN_ENV} to a gpt2.tiktoken fetched with "
        "`.ci/fetch-gpt2-tokenizer DIR` (CI does this)"
    )
