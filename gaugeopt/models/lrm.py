"""The learnable-multiplier layer (LRM): ``W = diag(r) · W̄ · diag(c)`` without materialising ``W``.

Velikanov et al. (2026), as used by GaugeFix-LRM (paper 002, eq. 1). A linear layer keeps its
base matrix ``W̄`` (weight-decayed as usual) and learns a row scale ``r`` and a column scale
``c``, both initialised to 1:

    y = ((x ⊙ c) W̄ᵀ + b̄) ⊙ r          # O(tokens·d) extra work, never O(d²)

The bias sits inside the row scale, so ``[W̄ | b̄]`` is one augmented matrix whose rows ``r``
scales (docs/gauge_group.md): every diagonal gauge acts on the multipliers alone.

A fused projection (GPT-2's ``c_attn``) is split into blocks (Q, K, V) that each get their
own ``r`` and ``c`` — the Q/K gauge lives on ``r_Q`` vs ``r_K`` and the paper's conditions
decay them differently, so they must be separate parameters:

    y = concat_s ( ((x ⊙ c_s) W̄_sᵀ + b̄_s) ⊙ r_s )

This module is the layer alone, a building block of models like :mod:`gaugeopt.models.gpt`; it
imports nothing of gaugeopt but its errors, so every layer of the package may read it. Converting
a model's linear layers and grouping the multipliers for an optimizer read the attention records,
and live with them (:mod:`gaugeopt.adapters.apply_lrm`: :func:`gaugeopt.apply_lrm`,
:func:`gaugeopt.lrm_param_groups`). Undoing the conversion needs only the layer, so it is here:
:func:`fold_lrm` (public as :func:`gaugeopt.fold_lrm`) replaces every LRM layer by the plain layer it
computes, ``W = diag(r)·W̄·diag(c)``, ``b = r ⊙ b̄`` — what to save for a library that knows no
multipliers (a stock Hugging Face ``from_pretrained``).

Example:
    >>> import torch
    >>> from gaugeopt.models.lrm import LRMLinear
    >>> layer = LRMLinear(4, 6, split_sizes=(2, 4))
    >>> [tuple(r.shape) for r in layer.row_mults], layer.internal_gauge_dim
    ([(2,), (4,)], 14)
    >>> x = torch.randn(3, 4)
    >>> torch.allclose(layer(x), x @ layer.effective_weight().T + layer.bias)
    True
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gaugeopt.errors import GaugeError

__all__ = ["LRMLinear", "is_lrm", "fold_lrm", "LRMExportWarning", "warn_unfolded_save"]


class LRMLinear(nn.Module):
    """A linear layer with learnable row and column multipliers (``nn.Linear`` layout).

    Args:
        in_features, out_features: as ``nn.Linear``.
        bias: learn a base bias ``b̄`` (scaled by ``r`` like the rows it belongs to).
        split_sizes: output blocks with separate multipliers (default: one block).

    Parameters:
        weight: ``W̄``, ``(out_features, in_features)``.
        bias: ``b̄``, ``(out_features,)`` or ``None``.
        row_mults: one ``(split_sizes[s],)`` vector ``r_s`` per block.
        col_mults: one ``(in_features,)`` vector ``c_s`` per block.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        split_sizes: Sequence[int] | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        sizes = tuple(split_sizes) if split_sizes is not None else (out_features,)
        if sum(sizes) != out_features or any(s <= 0 for s in sizes):
            raise GaugeError(f"LRMLinear: split_sizes={sizes} must be positive and sum to out_features={out_features}")
        self.split_sizes = sizes
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
        self.row_mults = nn.ParameterList([nn.Parameter(torch.ones(s, **factory)) for s in sizes])
        self.col_mults = nn.ParameterList([nn.Parameter(torch.ones(in_features, **factory)) for _ in sizes])
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self._plain_class: type = nn.Linear  # what folded() builds: the class from_linear converted

    @classmethod
    def from_linear(cls, linear: nn.Module, split_sizes: Sequence[int] | None = None) -> "LRMLinear":
        """Convert an ``nn.Linear`` or HF ``Conv1D`` (multipliers = 1: same function)."""
        if type(linear) is nn.Linear:
            w = linear.weight.detach()
        elif _is_conv1d(linear):
            w = linear.weight.detach().t()  # Conv1D stores (in, out)
        else:
            raise GaugeError(f"LRMLinear.from_linear: cannot convert {type(linear).__qualname__}")
        out_f, in_f = w.shape
        new = cls(in_f, out_f, bias=linear.bias is not None, split_sizes=split_sizes, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight.copy_(w)
            if linear.bias is not None:
                new.bias.copy_(linear.bias.detach())
        new.weight.requires_grad_(linear.weight.requires_grad)
        new._plain_class = type(linear)
        return new

    @torch.no_grad()
    def folded(self) -> nn.Module:
        """The plain layer computing this one's function: ``W = diag(r)·W̄·diag(c)`` (per block of a fused
        layer) and ``b = r ⊙ b̄``, formed in float64 and stored in ``W̄``'s dtype and device.

        It is an ``nn.Linear``, or the Hugging Face ``Conv1D`` that :meth:`from_linear` converted (weight
        stored ``(in, out)`` again); its parameters are new tensors, ``requires_grad`` as ``W̄`` and ``b̄``.
        """
        w = torch.cat([r.double()[:, None] * wb.double() * c.double()[None, :] for wb, r, c in
                       zip(self.weight.split(self.split_sizes, dim=0), self.row_mults, self.col_mults)])
        w = w.to(self.weight.dtype)
        cls = getattr(self, "_plain_class", nn.Linear)  # a layer pickled before the attribute existed: Linear
        conv1d = cls is not nn.Linear
        with torch.device("meta"):  # no initialisation work; every tensor is replaced below
            plain = cls(self.out_features, self.in_features) if conv1d else \
                nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        plain.weight = nn.Parameter(w.t().contiguous() if conv1d else w, requires_grad=self.weight.requires_grad)
        if self.bias is not None:
            b = (self.bias.double() * self.row_multiplier().double()).to(self.bias.dtype)
            plain.bias = nn.Parameter(b, requires_grad=self.bias.requires_grad)
        return plain.train(self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.split_sizes) == 1:
            return F.linear(x * self.col_mults[0], self.weight, self.bias) * self.row_mults[0]
        ws = self.weight.split(self.split_sizes, dim=0)
        bs = self.bias.split(self.split_sizes) if self.bias is not None else (None,) * len(ws)
        outs = [F.linear(x * c, w, b) * r for w, b, r, c in zip(ws, bs, self.row_mults, self.col_mults)]
        return torch.cat(outs, dim=-1)

    def row_multiplier(self) -> torch.Tensor:
        """All row multipliers concatenated, ``(out_features,)`` (a new tensor)."""
        return torch.cat(list(self.row_mults))

    def effective_weight(self) -> torch.Tensor:
        """``diag(r) · W̄ · diag(c)`` as a dense ``(out, in)`` matrix (for tools and tests only)."""
        ws = self.weight.split(self.split_sizes, dim=0)
        return torch.cat([r[:, None] * w * c[None, :] for w, r, c in zip(ws, self.row_mults, self.col_mults)])

    @property
    def internal_gauge_dim(self) -> int:
        """Dimension of the internal rescalings ``r ← r⊙t, W̄ ← W̄⊘(t⊗s), c ← c⊙s``: one ``t`` per
        output row and one ``s`` per input column of every multiplier block."""
        return self.out_features + self.in_features * len(self.split_sizes)

    def extra_repr(self) -> str:
        split = f", split_sizes={self.split_sizes}" if len(self.split_sizes) > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{split}"


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers")


def is_lrm(model: nn.Module) -> bool:
    """True when ``model`` contains at least one :class:`LRMLinear`."""
    return any(isinstance(m, LRMLinear) for m in model.modules())


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook")


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Move ``old``'s forward and backward hooks onto ``new``, which computes the same outputs from the
    same inputs: the dictionaries themselves move, so the users' ``RemovableHandle`` s still remove them."""
    for attr in _HOOK_DICTS:
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))


@torch.no_grad()
def fold_lrm(model: nn.Module) -> nn.Module:
    """Replace every :class:`LRMLinear` in ``model`` by the plain layer it computes, in place.

    Per layer ``W = diag(r)·W̄·diag(c)`` (each block of a fused Q/K/V projection with its own ``r``,
    ``c``) and ``b = r ⊙ b̄``, formed in float64 (:meth:`LRMLinear.folded`): an ``nn.Linear``, or the
    Hugging Face ``Conv1D`` the layer was converted from, so the model's state dict has the parameter
    names and layouts of the model before :func:`gaugeopt.apply_lrm` and a stock ``from_pretrained``
    loads it as the same function. Hooks move to the new layers; a layer used at several places stays
    one layer. A model without LRM layers is returned unchanged.

    **Optimizer state.** The folded model has new parameters: an optimizer built over the old ones
    keeps ``W̄``, ``r``, ``c`` (and their moments), which the model no longer reads, and never steps
    ``W``. Fold for export or evaluation — ``fold_lrm(copy.deepcopy(model))`` while training goes on —
    or build a new optimizer afterwards (the multipliers' moments have no counterpart in ``W``).

    Raises:
        GaugeError: a subclass of :class:`LRMLinear` (its forward may differ), a parametrised layer
            (``torch.nn.utils.parametrize``), a sharded (DTensor) or meta parameter — fold a gathered
            full copy instead.

    Example:
        >>> import copy, torch, gaugeopt
        >>> from gaugeopt.models import GPT, GPTConfig
        >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)))
        >>> with torch.no_grad():
        ...     _ = model.transformer.h[0].attn.c_attn.row_mults[0].mul_(3.0)
        >>> x = torch.randint(0, 64, (2, 8))
        >>> plain = gaugeopt.fold_lrm(copy.deepcopy(model))
        >>> type(plain.transformer.h[0].attn.c_attn).__name__, "row_mults" in str(list(plain.state_dict()))
        ('Linear', False)
        >>> torch.allclose(plain(x)[0], model(x)[0], atol=1e-5)
        True
    """
    from torch.nn.utils import parametrize

    if isinstance(model, LRMLinear):
        raise GaugeError("fold_lrm: pass the model containing the layer (a module's own type cannot change in "
                         "place); for a single layer use layer.folded()")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LRMLinear)]
    for name, m in layers:
        if parametrize.is_parametrized(m):
            raise GaugeError(f"fold_lrm: {name} carries a parametrization (torch.nn.utils.parametrize), which "
                             "recomputes its tensors at every call; remove it first "
                             "(parametrize.remove_parametrizations)")
        if type(m) is not LRMLinear:
            raise GaugeError(f"fold_lrm: {name} is a {type(m).__qualname__}, a subclass of LRMLinear whose forward "
                             "may compute something else; fold it by hand (LRMLinear.folded gives the plain layer)")
        for pname, p in m.named_parameters():
            if p.is_meta or type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor":
                raise GaugeError(
                    f"fold_lrm: {name}.{pname} is {'on the meta device' if p.is_meta else 'sharded (DTensor)'}; fold "
                    "a full, materialised copy (e.g. the state dict gathered with full_state_dict=True, loaded into "
                    "an unsharded model)")
    paths: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(name)
    for _, m in layers:
        plain = m.folded()
        carry_hooks(m, plain)
        for path in paths[id(m)]:
            parent_name, _, attr = path.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, plain)
    return model


class LRMExportWarning(UserWarning):
    """Saving a model with learnable multipliers where a library without them may load it (see :func:`fold_lrm`)."""


def warn_unfolded_save(model: nn.Module | None, where: str) -> bool:
    """Warn (:class:`LRMExportWarning`) that ``where`` stores ``model``'s multipliers as they are.

    What the training integrations call when they save: the checkpoint must keep ``W̄``, ``r``, ``c``
    to resume, and a library that knows no multipliers reads it as another function. Returns whether
    it warned (``model`` has LRM layers)."""
    if model is None or not is_lrm(model):
        return False
    import warnings

    warnings.warn(
        f"{where} stores a model with learnable multipliers (LRMLinear: W = diag(r)·W̄·diag(c)) as W̄, r and c, "
        "which is what resuming needs. Loaded by a library that knows no multipliers (a stock Hugging Face "
        "from_pretrained, load_state_dict(strict=False) into the original model) it is a different model: W̄ is "
        "read as the weight and r, c are dropped, silently. To export, save a folded copy: "
        "gaugeopt.fold_lrm(copy.deepcopy(model)).save_pretrained(path) (docs/gaugefix.md, 'Exporting').",
        LRMExportWarning, stacklevel=3,
    )
    return True
