"""Where data preparation reads its documents from: the Hub, local files, or a built-in corpus.

Every source becomes a ``datasets.Dataset`` with one string column ``text`` (one row per document)
plus a content hash, so :mod:`recipes.data` can tell whether its output is up to date.

=============  =============================================================  ==========================
``kind``       what ``inputs`` are                                            content hash over
=============  =============================================================  ==========================
openwebtext    nothing; ``load_dataset(hub_name)`` (network or the HF cache)  the dataset's fingerprint
text           ``.txt`` files, globs or folders (searched recursively)       the files' bytes, in order
parquet        ``.parquet`` files, globs or folders; column ``text_column``  the files' bytes, in order
hf-dir         one folder: ``save_to_disk`` output or a local dataset repo   the folder's data files
builtin        nothing; :func:`recipes.corpus.load_corpus` (``corpus``)      the documents' text
=============  =============================================================  ==========================

A text file is one document unless ``doc_sep`` (a regular expression, e.g. ``r"\\n\\s*\\n"`` for
blank lines) splits it; pieces that are empty or only whitespace are dropped.  Text files are read
as UTF-8 in Python's text mode, so ``\\r\\n`` becomes ``\\n``.

Example::

    from recipes.data_sources import SourceSpec, load_documents
    ds = load_documents(SourceSpec("text", inputs=("notes/",), doc_sep=r"\\n\\s*\\n"))
    ds[0]["text"]
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

SOURCES = ("openwebtext", "text", "parquet", "hf-dir", "builtin")
OPENWEBTEXT_HUB_NAME = "Skylion007/openwebtext"


class DataPrepError(RuntimeError):
    """Data preparation cannot go on; the message says what to change."""


@dataclass(frozen=True)
class SourceSpec:
    """Which documents to prepare (see the module docstring for each ``kind``)."""

    kind: str
    """One of :data:`SOURCES`."""
    inputs: tuple[str, ...] = ()
    """Files, globs or folders for ``text``/``parquet``; the one folder for ``hf-dir``."""
    corpus: str = "auto"
    """Built-in corpus for ``builtin``: ``shakespeare``, ``pydoc`` or ``auto``."""
    doc_sep: str | None = None
    """Regular expression that splits each text file into documents; ``None``: one per file."""
    text_column: str = "text"
    """Column holding the documents for ``parquet`` and ``hf-dir``."""
    split: str = "train"
    """Split to read from a dataset with several (``hf-dir``, ``openwebtext``)."""
    hub_name: str = OPENWEBTEXT_HUB_NAME
    """Hub dataset for ``openwebtext``."""

    def __post_init__(self) -> None:
        if self.kind not in SOURCES:
            raise DataPrepError(f"source={self.kind!r} is not known; choose one of {SOURCES}")
        needs_inputs = self.kind in ("text", "parquet", "hf-dir")
        if needs_inputs and not self.inputs:
            raise DataPrepError(f"source={self.kind!r} needs input paths (e.g. --files PATH ...)")
        if not needs_inputs and self.inputs:
            raise DataPrepError(
                f"source={self.kind!r} takes no input paths, got {list(self.inputs)}; "
                "use --source text/parquet/hf-dir for local files"
            )
        if self.kind == "hf-dir" and len(self.inputs) != 1:
            raise DataPrepError(f"source='hf-dir' takes one folder, got {list(self.inputs)}")
        if self.doc_sep is not None:
            if self.kind != "text":
                raise DataPrepError(f"doc_sep applies to source='text' only, not {self.kind!r}")
            try:
                re.compile(self.doc_sep)
            except re.error as err:
                raise DataPrepError(f"doc_sep={self.doc_sep!r} is not a valid regex: {err}") from None

    @functools.cached_property
    def files(self) -> list[Path]:
        """The input files of a ``text`` or ``parquet`` source, expanded and checked (once)."""
        return expand_files(self.inputs, ".txt" if self.kind == "text" else ".parquet")

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for ``meta.json``."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind in ("text", "parquet"):
            out["files"] = [str(p) for p in self.files]
        if self.kind == "hf-dir":
            out["path"] = str(Path(self.inputs[0]).resolve())
        if self.kind in ("parquet", "hf-dir"):
            out["text_column"] = self.text_column
        if self.kind in ("hf-dir", "openwebtext"):
            out["split"] = self.split
        if self.kind == "openwebtext":
            out["hub_name"] = self.hub_name
        if self.kind == "text":
            out["doc_sep"] = self.doc_sep
        if self.kind == "builtin":
            from .corpus import resolve_corpus_name

            out["corpus"] = resolve_corpus_name(self.corpus)
        return out


def expand_files(inputs: tuple[str, ...] | list[str], suffix: str) -> list[Path]:
    """Expand files, globs and folders (recursively, files ending in ``suffix``), in given order.

    Each folder or glob contributes its matches sorted by path; duplicates are kept once.
    """
    found: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            matches = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
        elif glob.has_magic(item):
            matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(item), recursive=True))
            matches = [p for p in matches if p.is_file()]
        elif path.is_file():
            matches = [path]
        else:
            raise DataPrepError(f"input {item!r} is neither a file, a folder nor a matching glob")
        if not matches:
            raise DataPrepError(f"input {item!r} matched no {suffix} files")
        found.extend(matches)
    return list(dict.fromkeys(p.resolve() for p in found))


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.stat().st_size}\0".encode())  # length-prefix: file boundaries count
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _hf_dir_data_files(root: Path) -> list[Path]:
    # datasets writes map() caches (cache-*.arrow) next to save_to_disk files; they are outputs.
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and not p.name.startswith(("cache-", "tmp"))
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def content_hash(spec: SourceSpec, dataset: datasets.Dataset | None = None) -> str:
    """A hash that changes whenever the documents ``spec`` yields change.

    ``openwebtext`` hashes the loaded ``dataset``'s fingerprint (the Hub revision's data), so it
    needs ``dataset``; the other sources hash their inputs without loading them.
    """
    if spec.kind in ("text", "parquet"):
        return _hash_files(spec.files)
    if spec.kind == "hf-dir":
        return _hash_files(_hf_dir_data_files(Path(spec.inputs[0])))
    if spec.kind == "builtin":
        from .corpus import load_corpus

        digest = hashlib.sha256()
        for doc in load_corpus(spec.corpus):
            data = doc.encode("utf-8")
            digest.update(f"{len(data)}\0".encode() + data)
        return "sha256:" + digest.hexdigest()
    if dataset is None:
        raise ValueError("content_hash(openwebtext) needs the loaded dataset")
    return "fingerprint:" + dataset._fingerprint  # datasets has no public accessor for it


class _SplitDocuments:
    """Batched ``map`` function: split each text at ``pattern``, drop blank pieces."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def __call__(self, batch: dict[str, list[str]]) -> dict[str, list[str]]:
        regex = re.compile(self.pattern)
        return {"text": [p for t in batch["text"] for p in regex.split(t) if p.strip()]}


def _pick_split(loaded: Any, spec: SourceSpec, where: str) -> datasets.Dataset:
    import datasets

    if isinstance(loaded, (datasets.DatasetDict, dict)):
        if spec.split not in loaded:
            raise DataPrepError(
                f"{where} has splits {sorted(loaded)}, not split={spec.split!r}; pass --split NAME"
            )
        loaded = loaded[spec.split]
    return loaded


def _text_column_only(ds: datasets.Dataset, spec: SourceSpec, where: str) -> datasets.Dataset:
    if spec.text_column not in ds.column_names:
        raise DataPrepError(
            f"{where} has no column {spec.text_column!r} (columns: {ds.column_names}); "
            "pass --text-column NAME"
        )
    ds = ds.select_columns([spec.text_column])
    if spec.text_column != "text":
        ds = ds.rename_column(spec.text_column, "text")
    return ds


def _hub_error(spec: SourceSpec, err: Exception) -> DataPrepError:
    reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    if "scripts are no longer supported" in str(err):
        problem = (
            f"The Hub repo {spec.hub_name!r} still uses a loading script, which this `datasets` "
            "version no longer runs"
        )
    else:
        problem = f"Could not load {spec.hub_name!r} from the Hugging Face Hub"
    return DataPrepError(
        f"{problem} ({reason}). To prepare OpenWebText without reaching the Hub from here, on a "
        "machine that can, run `python -c \"import datasets; datasets.load_dataset("
        f"'{spec.hub_name}', num_proc=8)['train'].save_to_disk('owt')\"` (any `datasets` version "
        "that loads it; ~54 GB), copy the `owt` folder here and run `python -m recipes.data "
        "--source hf-dir owt --out data/openwebtext`. Any local copy of the text works too: "
        "`--source parquet --files DIR_OR_GLOB` (a `text` column) or `--source text --files "
        "DIR_OR_GLOB` (.txt files). If the dataset is already in this machine's datasets cache, "
        "set HF_DATASETS_OFFLINE=1 and rerun to read it from there."
    )


def load_documents(
    spec: SourceSpec, cache_dir: str | None = None, num_proc: int | None = None
) -> datasets.Dataset:
    """Load the documents of ``spec`` as a ``Dataset`` with one column, ``text``.

    Args:
        spec: what to read.
        cache_dir: datasets cache folder (``None``: the datasets default, ``~/.cache/huggingface``).
        num_proc: processes for downloading/splitting (``None``: one).

    Raises:
        DataPrepError: the Hub cannot be reached, inputs are missing, or a column/split is absent.
    """
    import datasets

    if spec.kind == "builtin":
        from .corpus import load_corpus

        return datasets.Dataset.from_dict({"text": load_corpus(spec.corpus)})

    if spec.kind == "text":
        files = [str(p) for p in spec.files]
        ds = datasets.load_dataset(
            "text", data_files=files, sample_by="document", split="train", cache_dir=cache_dir
        )
        if spec.doc_sep is not None:
            ds = ds.map(
                _SplitDocuments(spec.doc_sep),
                batched=True,
                remove_columns=ds.column_names,
                num_proc=num_proc,
                desc="splitting documents",
            )
        return ds

    if spec.kind == "parquet":
        files = [str(p) for p in spec.files]
        ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache_dir)
        return _text_column_only(ds, spec, f"parquet files {files[:3]}")

    if spec.kind == "hf-dir":
        root = Path(spec.inputs[0]).expanduser()
        if not root.is_dir():
            raise DataPrepError(f"hf-dir {str(root)!r} is not a folder")
        if (root / "dataset_dict.json").is_file() or (root / "state.json").is_file():
            loaded = datasets.load_from_disk(str(root))  # written by save_to_disk
        else:
            loaded = datasets.load_dataset(str(root), cache_dir=cache_dir)  # a local dataset repo
        ds = _pick_split(loaded, spec, f"hf-dir {str(root)!r}")
        return _text_column_only(ds, spec, f"hf-dir {str(root)!r}")

    # openwebtext: the real path, as nanoGPT's data/openwebtext/prepare.py.
    try:
        loaded = datasets.load_dataset(spec.hub_name, num_proc=num_proc, cache_dir=cache_dir)
    except (OSError, RuntimeError) as err:  # ConnectionError is an OSError; scripts: RuntimeError
        raise _hub_error(spec, err) from None
    ds = _pick_split(loaded, spec, f"Hub dataset {spec.hub_name!r}")
    return _text_column_only(ds, spec, f"Hub dataset {spec.hub_name!r}")
