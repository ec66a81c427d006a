"""Example inputs gaugeopt can make up for a model it knows, so that a proof needs no batch from you.

The certificate (:mod:`gaugeopt.trust.proof`) needs one forward to record how each
attention module is called (hidden states, masks, position embeddings); the values do not matter —
each layer is then rerun alone with random weights. For the model classes below gaugeopt builds a
tiny input itself (batch 1, 32 tokens or one image), so :func:`gaugeopt.gauge_fix` in a plain loop,
:func:`gaugeopt.canonicalize` or :func:`gaugeopt.gauge_dimension` can prove the records on their own:

==========================================  ============================================================
model (the model passed, or the outermost   input
module inside it holding every attention)
==========================================  ============================================================
Hugging Face ``PreTrainedModel``            ``input_ids`` (``decoder_input_ids`` too for encoder-decoders,
                                            ``use_cache=False``), or ``pixel_values`` for vision models
``gaugeopt.models.GPT``, nanoGPT, litgpt,   token ids: ``forward``'s first parameter is ``idx``,
torchtitan, any module whose ``forward``    ``input_ids`` or ``tokens`` and the module holds an
takes token ids                             ``nn.Embedding`` (its vocabulary bounds the ids)
timm ``VisionTransformer``                  one image of ``patch_embed.img_size``
==========================================  ============================================================

Anything else returns ``None``: the caller then records the next real forward, or asks for
``gaugeopt.certify(model, example_batch)``. The inputs come from a private generator (the global
RNG is not touched) on the model's device. Wrappers (DDP's ``.module``, ``torch.compile``'s
``_orig_mod``) are looked through so that the example runs no collective and triggers no recompile.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.trust.examples import example_forward
    >>> model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    >>> what, run = example_forward(model, gaugeopt.find_attention(model))
    >>> what, tuple(run()[0].shape)
    ('GPT(idx: 1×8 token ids)', (1, 8, 16))
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from gaugeopt.records.site import AttentionSite

__all__ = ["EXAMPLE_TOKENS", "example_forward", "unwrap_model"]

EXAMPLE_TOKENS = 32
_TOKEN_ARGS = ("idx", "input_ids", "tokens")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module under DDP / FSDP1 (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)
        if inner is None and type(model).__name__ in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def _first_param(model: nn.Module) -> torch.Tensor | None:
    return next((p for p in model.parameters()), None)


def _first_arg(model: nn.Module) -> str | None:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[0].name if params else None


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _length(model: nn.Module) -> int:
    t = EXAMPLE_TOKENS
    cfg = getattr(model, "config", None)
    for attr in ("block_size", "max_position_embeddings", "n_positions", "max_seq_len", "max_seq_length"):
        limit = getattr(cfg, attr, None) or getattr(model, attr, None)
        if isinstance(limit, int) and limit > 0:
            t = min(t, limit)
    return t


def _ids(vocab: int, t: int, device: torch.device, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab, (1, t), generator=g).to(device)


def _hf(model: nn.Module, g: torch.Generator) -> tuple[str, dict] | None:
    main = getattr(model, "main_input_name", None)
    cfg = getattr(model, "config", None)
    getter = getattr(model, "get_input_embeddings", None)
    if main is None or cfg is None or not callable(getter):
        return None
    p = _first_param(model)
    device = p.device if p is not None else torch.device("cpu")
    if main == "input_ids":
        emb = getter()
        vocab = getattr(emb, "num_embeddings", None) or getattr(cfg, "vocab_size", None)
        if not vocab:
            return None
        t = _length(model)
        kwargs: dict[str, Any] = {"input_ids": _ids(vocab, t, device, g)}
        if getattr(cfg, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = kwargs["input_ids"].clone()
        if _accepts(model, "use_cache"):
            kwargs["use_cache"] = False
        return f"{type(model).__name__}(input_ids: 1×{t} token ids)", kwargs
    if main == "pixel_values":
        size = getattr(cfg, "image_size", None)
        channels = getattr(cfg, "num_channels", 3)
        if not isinstance(size, int):
            return None
        dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
        x = torch.randn(1, channels, size, size, generator=g).to(device=device, dtype=dtype)
        return f"{type(model).__name__}(pixel_values: 1 image {size}×{size})", {"pixel_values": x}
    return None


def _tokens(model: nn.Module, g: torch.Generator) -> tuple[str, dict] | None:
    arg = _first_arg(model)
    if arg not in _TOKEN_ARGS:
        return None
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        return None
    t = _length(model)
    p = _first_param(model)
    ids = _ids(emb.num_embeddings, t, p.device if p is not None else torch.device("cpu"), g)
    return f"{type(model).__name__}({arg}: 1×{t} token ids)", {arg: ids}


def _image(model: nn.Module, g: torch.Generator) -> tuple[str, dict] | None:
    patch = getattr(model, "patch_embed", None)
    size = getattr(patch, "img_size", None)
    proj = getattr(patch, "proj", None)
    if size is None or not isinstance(proj, nn.Conv2d):
        return None
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    p = _first_param(model)
    x = torch.randn(1, proj.in_channels, h, w, generator=g).to(device=p.device, dtype=p.dtype)
    return f"{type(model).__name__}(x: 1 image {h}×{w})", {_first_arg(model) or "x": x}


_MAKERS = (_hf, _tokens, _image)


def _holds_all(module: nn.Module, sites: Sequence[AttentionSite]) -> bool:
    inside = {id(m) for m in module.modules()}
    return all(id(s.module) in inside for s in sites)


def example_forward(model: nn.Module, sites: Sequence[AttentionSite]) -> tuple[str, Callable[[], Any]] | None:
    """``(description, run)`` where ``run()`` calls the outermost known model inside ``model`` that holds
    every site on a made-up input; ``None`` when gaugeopt knows no input for it."""
    g = torch.Generator().manual_seed(0)
    for _, candidate in model.named_modules():
        candidate = unwrap_model(candidate)
        if not _holds_all(candidate, sites):
            continue
        for make in _MAKERS:
            made = make(candidate, g)
            if made is not None:
                what, kwargs = made
                return what, (lambda m=candidate, kw=kwargs: m(**kw))
    return None
