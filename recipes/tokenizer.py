"""Tokenizers for the recipes: GPT-2 BPE (via tiktoken, works offline) and a character-level one.

GPT-2 BPE is what nanoGPT and the paper use (50,257 ids, ``<|endoftext|>`` = 50256).
``tiktoken.get_encoding("gpt2")`` downloads its ranks from Azure blob storage on first use, which
fails on machines without internet.  The same ranks ship as ``whisper/assets/gpt2.tiktoken`` in the
``openai-whisper`` sdist on PyPI (MIT, 835,554 bytes, sha256 306cd27f…d930, byte-identical to
tiktoken's ``r50k_base`` file), so :func:`gpt2_encoding` builds the encoding from that file when it
is available locally, and only then falls back to the network.  Where the file is looked for, in order:

1. the ``tokenizer_file`` argument (``--tokenizer-file`` on the command line);
2. the environment variable ``GAUGEOPT_GPT2_TIKTOKEN``;
3. ``$XDG_CACHE_HOME/gaugeopt/gpt2.tiktoken`` (default ``~/.cache/gaugeopt/gpt2.tiktoken``);
4. otherwise ``tiktoken.get_encoding("gpt2")`` (network, or tiktoken's own cache).

Local files are checked against the sha256 above, so every path gives the same token ids.
``.ci/fetch-gpt2-tokenizer DEST_DIR`` fetches the file through pip.

:class:`CharTokenizer` maps each distinct character of a corpus to an id (sorted order) and adds one
end-of-text id after them; its alphabet is stored in ``meta.json`` so ids can be decoded later.
It keeps the CPU demo's output layer small (~100 ids instead of 50,257).

Example::

    >>> from recipes.tokenizer import CharTokenizer
    >>> tok = CharTokenizer.from_texts(["hello world"])
    >>> tok.encode_ordinary("hello"), tok.eot_token, tok.n_vocab
    ([3, 2, 4, 4, 5], 8, 9)
    >>> tok.decode([3, 2, 4, 4, 5, tok.eot_token])
    'hello<|endoftext|>'

    enc = gpt2_encoding()              # or gpt2_encoding("/path/to/gpt2.tiktoken")
    enc.encode_ordinary("Hello world")  # [15496, 995]
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tiktoken

GPT2_TIKTOKEN_ENV = "GAUGEOPT_GPT2_TIKTOKEN"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOT = 50256
GPT2_N_VOCAB = 50257
EOT_TEXT = "<|endoftext|>"
TOKENIZERS = ("gpt2", "char")


class TokenizerUnavailableError(RuntimeError):
    """The GPT-2 ranks could be found neither locally nor through tiktoken's download."""


def default_gpt2_cache_path() -> Path:
    """Where :func:`gpt2_encoding` looks for ``gpt2.tiktoken`` when no path is given."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gaugeopt" / "gpt2.tiktoken"


def _offline_instructions(cache_path: Path) -> str:
    return (
        "To use GPT-2 BPE without internet, get the ranks file gpt2.tiktoken (MIT licence, 835,554 "
        f"bytes, sha256 {GPT2_TIKTOKEN_SHA256}) from the openai-whisper source distribution, which "
        "any PyPI mirror serves: run `.ci/fetch-gpt2-tokenizer DIR` from the gaugeopt repository, or "
        "by hand `pip download --no-deps openai-whisper==20250625 -d /tmp/w && tar -xzf "
        "/tmp/w/openai_whisper-20250625.tar.gz -C /tmp/w` and take "
        "/tmp/w/openai_whisper-20250625/whisper/assets/gpt2.tiktoken (on a machine without a mirror, "
        "do this elsewhere and copy the file). Then pass --tokenizer-file PATH, set "
        f"{GPT2_TIKTOKEN_ENV}=PATH, or put the file at {cache_path}. For a small demo, "
        "--tokenizer char needs no file."
    )


def _encoding_from_ranks_file(path: Path) -> tiktoken.Encoding:
    import tiktoken
    import tiktoken.load
    from tiktoken_ext.openai_public import r50k_pat_str

    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path), expected_hash=GPT2_TIKTOKEN_SHA256)
    except ValueError as err:  # tiktoken raises ValueError on a hash mismatch
        raise TokenizerUnavailableError(
            f"{path} is not the GPT-2 ranks file ({err}). "
            + _offline_instructions(default_gpt2_cache_path())
        ) from None
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: GPT2_EOT},
        explicit_n_vocab=GPT2_N_VOCAB,
    )


def gpt2_encoding(tokenizer_file: str | os.PathLike | None = None) -> tiktoken.Encoding:
    """Return tiktoken's GPT-2 encoding, built from a local ranks file when one is available.

    Args:
        tokenizer_file: path to ``gpt2.tiktoken``.  ``None`` looks at ``$GAUGEOPT_GPT2_TIKTOKEN``,
            then the cache path (:func:`default_gpt2_cache_path`), then asks tiktoken (network).

    Raises:
        TokenizerUnavailableError: an explicit file is missing or has the wrong hash, or no source
            worked; the message says how to fetch the file without internet.
    """
    cache_path = default_gpt2_cache_path()
    explicit = tokenizer_file if tokenizer_file is not None else os.environ.get(GPT2_TIKTOKEN_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            origin = "tokenizer_file" if tokenizer_file is not None else f"${GPT2_TIKTOKEN_ENV}"
            raise TokenizerUnavailableError(
                f"{origin}={str(explicit)!r} does not exist. " + _offline_instructions(cache_path)
            )
        return _encoding_from_ranks_file(path)
    if cache_path.is_file():
        return _encoding_from_ranks_file(cache_path)

    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as err:  # requests/urllib errors when offline; the reason goes into the message
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        raise TokenizerUnavailableError(
            f'tiktoken.get_encoding("gpt2") could not download the GPT-2 ranks ({reason}) and no '
            f"local gpt2.tiktoken was found (no tokenizer_file, ${GPT2_TIKTOKEN_ENV} unset, nothing "
            f"at {cache_path}). " + _offline_instructions(cache_path)
        ) from None


class CharTokenizer:
    """Character-level tokenizer: sorted distinct characters, then one end-of-text id.

    Mirrors the part of ``tiktoken.Encoding`` that data preparation uses (``name``, ``n_vocab``,
    ``eot_token``, ``encode_ordinary``, ``decode``), so both tokenizers go through the same code.

    Args:
        chars: the alphabet; ids are positions in ``sorted(set(chars))``.
    """

    name = "char"

    def __init__(self, chars: str) -> None:
        self.chars = "".join(sorted(set(chars)))
        self._stoi = {c: i for i, c in enumerate(self.chars)}
        self.eot_token = len(self.chars)
        self.n_vocab = len(self.chars) + 1

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """Build the alphabet from every character that occurs in ``texts``."""
        alphabet: set[str] = set()
        for text in texts:
            alphabet.update(text)
        return cls("".join(alphabet))

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of ``text``; every character must be in the alphabet."""
        try:
            return [self._stoi[c] for c in text]
        except KeyError as err:
            raise ValueError(
                f"character {err.args[0]!r} is not in this CharTokenizer's alphabet of "
                f"{len(self.chars)} characters; build the tokenizer from a corpus that contains it"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; the end-of-text id decodes to ``<|endoftext|>``."""
        return "".join(EOT_TEXT if i == self.eot_token else self.chars[i] for i in map(int, ids))

    def to_meta(self) -> dict[str, Any]:
        """What ``meta.json`` stores to rebuild this tokenizer (see :meth:`from_meta`)."""
        return {"chars": self.chars}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> CharTokenizer:
        """Rebuild the tokenizer saved by a data-preparation run (``json.load(meta.json)``)."""
        return cls(meta["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(n_vocab={self.n_vocab}, eot_token={self.eot_token})"
