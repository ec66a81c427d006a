r"""nanoGPT's ``CausalSelfAttention``, recognised wherever its ``model.py`` was copied to.

Users copy Karpathy's nanoGPT ``model.py`` into their own project, so the class lives in *their*
module and cannot be matched by import path. It is recognised by structure — a class named
``CausalSelfAttention`` with ``c_attn``, ``c_proj``, ``n_head`` and ``n_embd`` — and then by the
source of its ``forward``: comments and layout are dropped (Python tokens, with indentation
kept as block markers) and the hash must equal that of nanoGPT's own ``forward`` at commit
``3adf61e1`` (:data:`NANOGPT_COMMIT`). A modified copy is refused: describe it with
:class:`gaugeopt.AttentionSpec` and certify it.

Layout: ``c_attn = [Q|K|V]`` (``nn.Linear(E, 3E)``), heads ``n_head`` of width ``E / n_head``,
``c_proj`` the output; no GQA, no RoPE (learned positions).

Example:
    >>> from gaugeopt.adapters.nanogpt import text_fingerprint
    >>> a = "def f(x):\n    return x + 1   # a comment\n"
    >>> b = "def f(x):\n\n  return x+1\n"
    >>> c = "def f(x):\n    if x:\n        pass\n    return x + 1\n"
    >>> text_fingerprint(a) == text_fingerprint(b), text_fingerprint(a) == text_fingerprint(c)
    (True, False)
"""

from __future__ import annotations

import hashlib
import inspect
import io
import textwrap
import tokenize

import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.records.site import AttentionSite
from gaugeopt.adapters.spec import AttentionSpec

__all__ = ["NANOGPT_COMMIT", "NANOGPT_FORWARD", "adapt_nanogpt", "looks_like_nanogpt", "source_fingerprint", "text_fingerprint"]

NANOGPT_COMMIT = "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"
# source_fingerprint(CausalSelfAttention.forward) of nanoGPT's model.py at NANOGPT_COMMIT
NANOGPT_FORWARD = "ff9aed427ae314d113980cca1b255390666bd92a83728529ed11926aa1a79c0d"

NANOGPT_SPEC = AttentionSpec(qkv="c_attn", o="c_proj", num_heads="n_head", kind="nanogpt", stock_forward=False)


def source_fingerprint(fn) -> str:
    """:func:`text_fingerprint` of ``fn``'s source (``inspect.getsource``)."""
    return text_fingerprint(inspect.getsource(fn))


def text_fingerprint(source: str) -> str:
    """sha256 of Python source as tokens: comments, blank lines and spacing dropped, indentation
    kept as ``INDENT``/``DEDENT`` markers (so moving a line between blocks counts)."""
    src = textwrap.dedent(source)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.NEWLINE:
            out.append("NEWLINE")
        elif tok.type == tokenize.INDENT:
            out.append("INDENT")
        elif tok.type == tokenize.DEDENT:
            out.append("DEDENT")
        else:
            out.append(tok.string)
    return hashlib.sha256(" ".join(out).encode()).hexdigest()


def looks_like_nanogpt(module: nn.Module) -> bool:
    """A class named ``CausalSelfAttention`` with nanoGPT's attributes (not gaugeopt's own GPT)."""
    cls = type(module)
    return (
        cls.__name__ == "CausalSelfAttention"
        and not cls.__module__.startswith(("gaugeopt.", "litgpt."))
        and all(hasattr(module, a) for a in ("c_attn", "c_proj", "n_head", "n_embd"))
    )


def adapt_nanogpt(root: nn.Module, name: str, m: nn.Module) -> AttentionSite:
    cls = type(m)
    if "forward" in vars(m):
        raise GaugeError(f"{name}: forward was overridden on the instance; gaugeopt cannot vouch for its gauge group")
    try:
        got = source_fingerprint(cls.forward)
    except (OSError, TypeError) as err:
        raise GaugeError(
            f"{name}: {cls.__module__}.{cls.__qualname__} looks like nanoGPT's CausalSelfAttention, but the source of "
            f"its forward is not available ({err}) to compare with nanoGPT's; describe it with gaugeopt.AttentionSpec "
            "and certify it (docs/adapters.md)"
        ) from None
    if got != NANOGPT_FORWARD:
        raise GaugeError(
            f"{name}: {cls.__module__}.{cls.__qualname__} looks like nanoGPT's CausalSelfAttention (c_attn, c_proj, "
            f"n_head) but its forward differs from nanoGPT's (commit {NANOGPT_COMMIT[:8]}): a modified copy may compute "
            "another function, and gaugeopt does not guess. Describe it with "
            "gaugeopt.AttentionSpec(qkv='c_attn', o='c_proj', num_heads='n_head').register(CausalSelfAttention) and "
            "prove it with gaugeopt.certify(model, example_batch) (docs/adapters.md)"
        )
    return NANOGPT_SPEC.build(m, name, root)
