"""Prepare token memmaps in nanoGPT's layout: ``train.bin``, ``val.bin`` and ``meta.json``.

Hardware: any CPU.  OpenWebText (8M documents, ~9B GPT-2 tokens) needs ~54 GB of datasets cache
for the text (nanoGPT's figure) plus ~18 GB for the tokens, and scales with ``--num-proc``; the
built-in Shakespeare corpus takes ~2 s on 2 cores.

What it does, exactly as nanoGPT's ``data/openwebtext/prepare.py`` so numbers stay comparable:
documents are split into train/val with ``train_test_split(test_size=0.0005, seed=2357,
shuffle=True)``, each document is encoded with ``encode_ordinary`` and followed by one end-of-text
token (GPT-2: 50256), and each split is written as one flat ``uint16`` array of token ids
(``np.memmap(path, dtype=np.uint16, mode="r")`` reads it back) in up to 1,024 shards.

``meta.json`` records the tokenizer (name, ``vocab_size``, ``eot_token``; the alphabet for
``--tokenizer char``), ``dtype``, token and document counts, the source and a hash of the inputs
and settings.  Outputs are written to ``*.tmp`` files and renamed into place, ``meta.json`` last:
a folder without ``meta.json`` is incomplete, whatever else it holds.  A rerun whose inputs and
settings hash to the recorded value does nothing (``--force`` redoes it); any other rerun deletes
the old outputs first and starts over (tokenisation is cached by ``datasets`` for file-backed
sources, so an interrupted run loses little).  ``vocab_size`` is the tokenizer's (50257 for GPT-2);
models usually pad it (nanoGPT: 50304).

Examples::

    python -m recipes.data --source builtin --corpus shakespeare --tokenizer char --out data/shakespeare_char
    python -m recipes.data --source openwebtext --num-proc 8                 # -> data/openwebtext
    python -m recipes.data --source text --files 'books/*.txt' --doc-sep '\\n\\s*\\n' --out data/books
    python -m recipes.data --source parquet --files shards/ --out data/mine
    python -m recipes.data --source hf-dir /data/owt_saved --out data/openwebtext

    from recipes.data import prepare
    from recipes.data_sources import SourceSpec
    meta = prepare(SourceSpec("builtin", corpus="pydoc"), "data/pydoc_char", tokenizer="char")
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import invocation
from .corpus import CORPORA
from .data_sources import (
    OPENWEBTEXT_HUB_NAME,
    SOURCES,
    DataPrepError,
    SourceSpec,
    content_hash,
    load_documents,
)
from .tokenizer import TOKENIZERS, CharTokenizer, gpt2_encoding

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DTYPE = np.uint16
SPLITS = ("train", "val")
NANOGPT_VAL_FRACTION = 0.0005
BUILTIN_VAL_FRACTION = 0.1  # the built-in corpora have 42-79 documents; 0.0005 would leave one
NANOGPT_SEED = 2357
MAX_SHARDS = 1024


class _Tokenize:
    """``map`` function: ids of one document followed by the end-of-text id (nanoGPT's process)."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding  # a tiktoken.Encoding or a CharTokenizer; both pickle

    def __call__(self, example: dict[str, str]) -> dict[str, Any]:
        ids = self.encoding.encode_ordinary(example["text"])
        ids.append(self.encoding.eot_token)
        return {"ids": ids, "len": len(ids)}


def _token_features() -> datasets.Features:
    import datasets

    # uint16 in the cache too: a quarter of the default int64 (OpenWebText: ~18 GB instead of ~72).
    list_type = getattr(datasets, "List", None) or datasets.Sequence  # List is datasets>=4
    return datasets.Features(
        {"ids": list_type(datasets.Value("uint16")), "len": datasets.Value("int64")}
    )


def _build_tokenizer(name: str, docs: datasets.Dataset, tokenizer_file: str | None) -> Any:
    if name == "gpt2":
        return gpt2_encoding(tokenizer_file)
    if name == "char":
        tok = CharTokenizer.from_texts(docs["text"])
        if tok.n_vocab > np.iinfo(DTYPE).max + 1:
            raise DataPrepError(
                f"the corpus has {tok.n_vocab - 1} distinct characters, more than uint16 ids can "
                "hold; use --tokenizer gpt2"
            )
        return tok
    raise DataPrepError(f"tokenizer={name!r} is not known; choose one of {TOKENIZERS}")


def _prep_hash(input_hash: str, settings: dict[str, Any]) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, "input": input_hash, **settings}, sort_keys=True)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def read_meta(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``meta.json`` of a complete output folder, or ``None`` if the folder is incomplete.

    Complete means ``meta.json`` parses and ``train.bin``/``val.bin`` have the recorded sizes.
    """
    out = Path(out_dir)
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    itemsize = np.dtype(meta.get("dtype", "uint16")).itemsize
    for split in SPLITS:
        path = out / f"{split}.bin"
        if not path.is_file() or path.stat().st_size != meta.get(f"{split}_tokens", -1) * itemsize:
            return None
    return meta


def _clear_outputs(out: Path) -> None:
    """Remove meta.json first (so nothing claims completeness), then bins and leftover temp files."""
    for name in ("meta.json", *(f"{s}.bin" for s in SPLITS)):
        (out / name).unlink(missing_ok=True)
    for leftover in out.glob("*.tmp"):
        leftover.unlink()


def _write_split(tokens: datasets.Dataset, path: Path) -> int:
    """Write the ``ids`` of every row of ``tokens`` to ``path`` as one flat uint16 array."""
    import pyarrow.compute as pc
    from tqdm.auto import tqdm

    total = int(np.sum(tokens.with_format("numpy")["len"], dtype=np.uint64))
    tmp = path.with_name(path.name + ".tmp")
    arr = np.memmap(tmp, dtype=DTYPE, mode="w+", shape=(total,))
    idx = 0
    n_shards = min(MAX_SHARDS, len(tokens))
    for i in tqdm(range(n_shards), desc=f"writing {path}"):
        shard = tokens.shard(num_shards=n_shards, index=i, contiguous=True).with_format("arrow")
        ids = pc.list_flatten(shard["ids"]).to_numpy()  # (n_tokens_in_shard,) uint16, zero-copy
        arr[idx : idx + len(ids)] = ids
        idx += len(ids)
    if idx != total:
        raise DataPrepError(f"wrote {idx} tokens to {tmp} but the lengths add up to {total}")
    arr.flush()
    del arr
    return total


def prepare(
    source: SourceSpec,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str = "gpt2",
    tokenizer_file: str | None = None,
    val_fraction: float | None = None,
    seed: int = NANOGPT_SEED,
    num_proc: int | None = None,
    cache_dir: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Tokenize ``source`` into ``out_dir/{train,val}.bin`` and ``meta.json``; return the meta.

    Args:
        source: the documents (see :mod:`recipes.data_sources`).
        out_dir: output folder, created if missing.
        tokenizer: ``"gpt2"`` (BPE, 50,257 ids) or ``"char"`` (alphabet of the corpus + EOT).
        tokenizer_file: local ``gpt2.tiktoken`` (see :func:`recipes.tokenizer.gpt2_encoding`).
        val_fraction: fraction of *documents* in val; ``None``: 0.0005 as nanoGPT, 0.1 for
            ``builtin`` corpora.
        seed: shuffle seed of the split (nanoGPT: 2357).
        num_proc: processes for tokenisation (``None``: one).
        cache_dir: datasets cache folder (``None``: the datasets default).
        force: redo even if ``out_dir`` is up to date.
    """
    if val_fraction is None:
        val_fraction = BUILTIN_VAL_FRACTION if source.kind == "builtin" else NANOGPT_VAL_FRACTION
    if not 0.0 < val_fraction < 1.0:
        raise DataPrepError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive)")
    if tokenizer not in TOKENIZERS:
        raise DataPrepError(f"tokenizer={tokenizer!r} is not known; choose one of {TOKENIZERS}")
    out = Path(out_dir)
    started = time.perf_counter()

    # The Hub source is hashed by its loaded fingerprint; file sources are hashed before loading.
    docs = load_documents(source, cache_dir, num_proc) if source.kind == "openwebtext" else None
    input_hash = content_hash(source, docs)
    described = source.describe()
    settings = {
        # Where the files are is not part of the recipe: moving a corpus must not force a rebuild.
        "source": {k: v for k, v in described.items() if k not in ("files", "path")},
        "tokenizer": tokenizer,
        "val_fraction": val_fraction,
        "seed": seed,
        "dtype": np.dtype(DTYPE).name,
    }
    prep_hash = _prep_hash(input_hash, settings)
    existing = read_meta(out)
    if existing is not None and existing.get("prep_hash") == prep_hash and not force:
        log.info("%s is up to date (prep_hash %s); --force redoes it", out, prep_hash[:19])
        return existing

    if docs is None:
        docs = load_documents(source, cache_dir, num_proc)
    if len(docs) < 2:
        raise DataPrepError(
            f"the source yields {len(docs)} document(s); a train/val split needs at least 2 "
            "(for one big text file, split it with --doc-sep, e.g. '\\n\\s*\\n' for blank lines)"
        )
    enc = _build_tokenizer(tokenizer, docs, tokenizer_file)

    split = docs.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
    split["val"] = split.pop("test")  # nanoGPT's name for it
    tokens = split.map(
        _Tokenize(enc),
        remove_columns=["text"],
        features=_token_features(),
        desc="tokenizing the splits",
        num_proc=num_proc,
    )
    # The old output stays valid until here (it matches its own meta.json); now it goes.
    out.mkdir(parents=True, exist_ok=True)
    _clear_outputs(out)
    counts = {s: _write_split(tokens[s], out / f"{s}.bin") for s in SPLITS}
    for s in SPLITS:  # both complete: move them into place
        os.replace(out / f"{s}.bin.tmp", out / f"{s}.bin")

    meta: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer,
        "vocab_size": enc.n_vocab,
        "eot_token": enc.eot_token,
        "dtype": np.dtype(DTYPE).name,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "train_documents": len(split["train"]),
        "val_documents": len(split["val"]),
        "val_fraction": val_fraction,
        "seed": seed,
        "source": described,
        "input_hash": input_hash,
        "prep_hash": prep_hash,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if isinstance(enc, CharTokenizer):
        meta.update(enc.to_meta())
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, out / "meta.json")
    log.info(
        "wrote %s: %d train / %d val tokens (%s, vocab %d)",
        out, counts["train"], counts["val"], tokenizer, enc.n_vocab,
    )
    return meta


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=invocation(__spec__),
        description="Tokenize documents into nanoGPT-style train.bin/val.bin (uint16) + meta.json.",
        epilog="Reruns with unchanged inputs do nothing. See docs/data.md for offline use.",
    )
    p.add_argument("--source", choices=SOURCES, default="openwebtext",
                   help="where the documents come from (default: openwebtext, from the HF Hub)")
    p.add_argument("inputs", nargs="*", metavar="PATH",
                   help="input files/globs/folders (text, parquet) or the folder (hf-dir)")
    p.add_argument("--files", nargs="+", default=[], metavar="PATH",
                   help="same as the positional PATHs")
    p.add_argument("--out", help="output folder (default: data/<source or corpus>[_char])")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2",
                   help="gpt2: GPT-2 BPE via tiktoken; char: the corpus's characters (default: gpt2)")
    p.add_argument("--tokenizer-file", metavar="PATH",
                   help="local gpt2.tiktoken (else $GAUGEOPT_GPT2_TIKTOKEN, the cache, the network)")
    p.add_argument("--corpus", default="auto", choices=CORPORA,
                   help="built-in corpus for --source builtin (default: auto)")
    p.add_argument("--doc-sep", metavar="REGEX",
                   help=r"split text files into documents at this regex, e.g. '\n\s*\n'")
    p.add_argument("--text-column", default="text", help="document column (parquet, hf-dir)")
    p.add_argument("--split", default="train", help="split to read (hf-dir, openwebtext)")
    p.add_argument("--hub-name", default=OPENWEBTEXT_HUB_NAME, help="Hub dataset for openwebtext")
    p.add_argument("--val-fraction", type=float,
                   help="fraction of documents in val (default 0.0005 as nanoGPT; builtin: 0.1)")
    p.add_argument("--seed", type=int, default=NANOGPT_SEED, help="split seed (default: 2357)")
    p.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="tokenizing processes (default: half the CPUs)")
    p.add_argument("--cache-dir", help="datasets cache folder (default: the datasets default)")
    p.add_argument("--force", action="store_true", help="redo even if the output is up to date")
    return p


def _default_out(args: argparse.Namespace) -> str:
    if args.source == "builtin":
        from .corpus import resolve_corpus_name

        name = resolve_corpus_name(args.corpus)
    elif args.source == "openwebtext":
        name = "openwebtext"
    else:
        raise DataPrepError(f"--source {args.source} needs --out DIR")
    return os.path.join("data", name + ("_char" if args.tokenizer == "char" else ""))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; errors are printed as one message, not a traceback."""
    from .corpus import CorpusUnavailableError
    from .tokenizer import TokenizerUnavailableError

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        spec = SourceSpec(
            kind=args.source,
            inputs=tuple(args.inputs) + tuple(args.files),
            corpus=args.corpus,
            doc_sep=args.doc_sep,
            text_column=args.text_column,
            split=args.split,
            hub_name=args.hub_name,
        )
        meta = prepare(
            spec,
            args.out or _default_out(args),
            tokenizer=args.tokenizer,
            tokenizer_file=args.tokenizer_file,
            val_fraction=args.val_fraction,
            seed=args.seed,
            num_proc=args.num_proc,
            cache_dir=args.cache_dir,
            force=args.force,
        )
    except (DataPrepError, TokenizerUnavailableError, CorpusUnavailableError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({k: meta[k] for k in ("tokenizer", "vocab_size", "train_tokens", "val_tokens")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
