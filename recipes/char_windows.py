"""A built-in corpus as character ids, and random training windows over it: what the benchmarks' small
runs train on (``benchmarks/muon_drift.py``, ``qk_norm_drift.py``, ``approximate_state.py``,
``lr_sensitivity.py``).

Ids are positions in the sorted alphabet of the text read (no end-of-text id, unlike
:class:`recipes.tokenizer.CharTokenizer`, whose extra id would change the models' vocabulary). A window
is ``(x, y)`` with ``y`` the next characters, starting at a position drawn with one ``randint`` call per
batch from the caller's generator, so a seed gives the same batches wherever the helper is used.

Example:
    >>> import torch
    >>> from recipes.char_windows import char_ids, random_windows
    >>> ids, vocab = char_ids("abracadabra")
    >>> vocab, ids[:4].tolist()
    (5, [0, 1, 4, 0])
    >>> x, y = next(random_windows(ids, 1, batch=2, block=4, generator=torch.Generator().manual_seed(0)))
    >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
    (torch.Size([2, 4]), True)
"""

from __future__ import annotations

from typing import Iterator

import torch

from .corpus import load_corpus, resolve_corpus_name

__all__ = ["char_ids", "corpus_char_ids", "random_windows"]


def char_ids(text: str) -> tuple[torch.Tensor, int]:
    """``text`` as ids in its sorted alphabet, and the alphabet's size."""
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)


def corpus_char_ids(max_chars: int = 2_000_000) -> tuple[torch.Tensor, int, str]:
    """The first ``max_chars`` characters of the built-in corpus (documents joined by newlines) as ids, the
    alphabet's size and the corpus's name."""
    ids, vocab = char_ids("\n".join(load_corpus("auto"))[:max_chars])
    return ids, vocab, resolve_corpus_name("auto")


def random_windows(tokens: torch.Tensor, n: int, batch: int, block: int,
                   generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of ``batch`` windows of ``block`` ids and their next-id targets, at random starts."""
    for _ in range(n):
        idx = torch.randint(0, len(tokens) - block - 1, (batch,), generator=generator).tolist()
        yield torch.stack([tokens[i:i + block] for i in idx]), torch.stack([tokens[i + 1:i + block + 1] for i in idx])
