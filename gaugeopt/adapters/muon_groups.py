"""Parameter groups for Muon beside AdamW, split the way Muon's authors split them.

Muon orthogonalises the update of a *hidden* weight matrix; its authors train everything else —
the input embeddings, the output head, and the gains and biases (any tensor of fewer than two
dimensions) — with AdamW (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; Moonlight,
Liu et al. 2025, keeps the same split). :func:`muon_param_groups` finds that split on any model
:func:`gaugeopt.find_attention` reads, without a list of names per family:

* the **blocks** are the repeated layers that hold attention: for each attention record, the outermost
  ancestor of its module that is a numbered entry of an ``nn.ModuleList``, ``nn.Sequential`` or
  ``nn.ModuleDict`` (``model.layers.3``, ``transformer.h.0``, ``blocks.1``; T5's ``encoder.block.0``,
  not the ``layer.0`` list inside it that holds only the attention); a record in no such list is its
  own block (so a model wrapped whole in a one-entry ``nn.Sequential`` is one block: pass the model);
* **hidden** (Muon): the 2-D tensors inside the blocks — attention and MLP projections, a fused
  ``c_attn`` as one matrix, an LRM layer's ``W̄``; a lookup table inside a block (T5's relative
  position bias, an ``nn.Embedding``) is an embedding;
* **embeddings** (AdamW): the tensors of two or more dimensions outside the blocks that come before
  them in the model's parameter order (token and position tables, a patch embedding's convolution,
  a ViT's ``cls_token``), and every ``nn.Embedding``'s table; a head tied to the input embedding is
  that one tensor, here;
* **head** (AdamW): the tensors of two or more dimensions outside the blocks that come after them
  (``lm_head``, a classifier);
* **scalars** (AdamW): every tensor of fewer than two dimensions — norm gains, biases, LRM
  multipliers, attention sinks;
* **hidden_nd** (AdamW): tensors of three or more dimensions inside the blocks (stacked experts,
  convolutions), which ``torch.optim.Muon`` does not take.

Frozen tensors (``requires_grad=False``) are left out; a tensor shared by several modules is listed
once, under its first name.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, tie_weights=False))
    >>> muon_groups, adamw_groups = gaugeopt.muon_param_groups(model)
    >>> [(g["name"], len(g["params"])) for g in muon_groups + adamw_groups]
    [('hidden', 8), ('embeddings', 2), ('head', 1), ('scalars', 18)]
    >>> muon = torch.optim.Muon(muon_groups, lr=2e-2)
    >>> adamw = torch.optim.AdamW(adamw_groups, lr=3e-3)
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from gaugeopt.adapters.find import find_attention
from gaugeopt.errors import GaugeError

__all__ = ["muon_param_groups", "MUON_GROUPS", "ADAMW_GROUPS"]

MUON_GROUPS = ("hidden",)
ADAMW_GROUPS = ("embeddings", "head", "scalars", "hidden_nd")
_ENTRY = re.compile(r"\.\d+$|^\d+$")  # the last part of a path that indexes a ModuleList / Sequential


def _block_of(model: nn.Module, path: str) -> str:
    """The outermost ancestor of ``path`` (itself included) that is a numbered entry of a list of layers."""
    parts = path.split(".") if path else []
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        parent = model.get_submodule(".".join(parts[: end - 1])) if end > 1 else model
        if _ENTRY.search(prefix) and isinstance(parent, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            return prefix
    return path


def muon_param_groups(model: nn.Module, *, sites=None) -> tuple[list[dict], list[dict]]:
    """``(muon_groups, adamw_groups)``: the model's trainable tensors split as Muon's authors split them.

    The groups (module docstring) are dictionaries with ``"name"`` and ``"params"``; empty ones are
    dropped. Give each its own options before building the optimizers, e.g.
    ``for g in adamw_groups: g["lr"] = {"embeddings": 0.3, "head": 0.008}.get(g["name"], 0.04)``.

    Args:
        model: a model :func:`gaugeopt.find_attention` reads (plain or after :func:`gaugeopt.apply_lrm`).
        sites: its attention records (default ``find_attention(model)``): where the blocks are.

    Returns:
        ``[{"name": "hidden", ...}]`` for ``torch.optim.Muon`` and the ``"embeddings"``, ``"head"``,
        ``"scalars"``, ``"hidden_nd"`` groups for ``torch.optim.AdamW``.
    """
    if not isinstance(model, nn.Module):
        raise GaugeError(f"muon_param_groups: expected the model (an nn.Module), got {type(model).__qualname__}")
    sites = find_attention(model) if sites is None else sites
    blocks = sorted({_block_of(model, s.name) for s in sites})
    in_block = lambda name: any(not b or name == b or name.startswith(b + ".") for b in blocks)  # noqa: E731
    tables = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    named, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    block_positions = [i for i, (name, _) in enumerate(named) if in_block(name)]
    if not block_positions:
        raise GaugeError("muon_param_groups: no trainable tensor lies in an attention block; pass the model whose "
                         "attention find_attention reads")
    last = block_positions[-1]
    groups: dict[str, list[torch.nn.Parameter]] = {n: [] for n in MUON_GROUPS + ADAMW_GROUPS}
    for i, (name, p) in enumerate(named):
        if not p.requires_grad:
            continue
        if p.dim() < 2:
            kind = "scalars"
        elif id(p) in tables:
            kind = "embeddings"
        elif in_block(name):
            kind = "hidden" if p.dim() == 2 else "hidden_nd"
        else:
            kind = "head" if i > last else "embeddings"
        groups[kind].append(p)
    muon = [{"name": n, "params": groups[n]} for n in MUON_GROUPS if groups[n]]
    adamw = [{"name": n, "params": groups[n]} for n in ADAMW_GROUPS if groups[n]]
    return muon, adamw
