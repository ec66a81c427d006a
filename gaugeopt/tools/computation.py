"""What a model computes besides its parameters: the buffers, settings and configs its modules read.

Two models with equal parameters compute different functions when their modules read different
non-parameter state: a RoPE base (``Rotary.base``, Hugging Face's ``rope_parameters`` and the
``inv_freq`` buffer derived from it), a RoPE scaling, a sliding window, a norm's ``eps``, an
attention scale, ``nn.MultiheadAttention.add_zero_attn``, a softcap read from the config at every
call. The model tools that compare or combine two models by their parameters
(:func:`gaugeopt.equivalent`, :func:`gaugeopt.spectral_fingerprint`, :func:`gaugeopt.merge`) read this
state too, so a difference there is named rather than averaged over or declared equivalent.

:func:`computation_state` walks every module (``named_modules``, shared modules at each of their
paths) and records, by dotted path,

* its class (``<path>.__class__``): a ``GELU`` swapped for a ``ReLU`` has no parameter to tell (an
  :class:`~gaugeopt.models.lrm.LRMLinear` counts as the ``nn.Linear`` of its effective weight, which
  the tools compare among the parameters);
* every buffer, persistent or not, and every tensor attribute that shares no storage with a
  parameter — compared as tensors, relative to their norm;
* every public attribute that is plain data (numbers, strings, ``None``, enums, functions by
  qualified name, tuples, lists, dicts) — compared exactly;
* the public fields of the objects the module holds (a Hugging Face config through its
  ``to_dict()``, a dataclass config, any other object's ``vars()``), flattened into paths like
  ``model.layers.0.self_attn.config.rope_parameters.rope_theta``, to a depth of four.

Nothing is listed per model family. Left out, because the forward in evaluation mode does not read
them: private attributes (``_name``: PyTorch's own bookkeeping, gaugeopt's stamps), ``training``,
dtypes and devices (the tools compare in float64), dropout settings (``dropout``, ``attn_pdrop``,
``layerdrop``, ``drop_path_rate`` ...; ``nn.Dropout`` modules' ``p``) and :data:`IGNORED_NAMES` —
names that only describe the checkpoint or select an implementation of the same function
(``transformers_version``, ``use_cache``, ``initializer_range``, ``padding_idx`` ...). A difference in
a value the forward happens to ignore in one configuration (Qwen2's ``sliding_window`` while
``use_sliding_window=False``) still counts: the check errs towards "different". An object of a class
with neither fields nor ``vars()`` is recorded by its class name only.

Example:
    >>> import copy, torch
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> from gaugeopt.tools.computation import computation_difference, computation_state
    >>> a = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, rope="split_half"))
    >>> b = copy.deepcopy(a)
    >>> computation_difference(computation_state(a), computation_state(b), tol=0.0)
    ''
    >>> b.transformer.h[0].attn.rotary.base = 500000.0
    >>> print(computation_difference(computation_state(a), computation_state(b), tol=0.0))
    1 setting differs: transformer.h.0.attn.rotary.base is 10000.0 in model_a, 500000.0 in model_b
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from gaugeopt.models.lrm import LRMLinear

__all__ = ["ComputationState", "computation_state", "computation_difference", "IGNORED_NAMES"]

IGNORED_NAMES = frozenset({
    # what the checkpoint is, not what it computes
    "name_or_path", "transformers_version", "architectures", "model_type_name", "commit_hash",
    "id2label", "label2id", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix",
    # token ids (generation and the loss's padding; the forward's logits do not read them)
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    # gradient or initialisation only
    "initializer_range", "initializer_factor", "init_std", "padding_idx", "gradient_checkpointing",
    # which implementation, or what is returned besides the logits
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "chunk_size_feed_forward", "generation_config", "dtype", "torch_dtype",
})
# dropout, attn_pdrop, hidden_dropout_prob, layerdrop, drop_path_rate, drop_rate: read in training only
# (not a MoE's drop_tokens, which changes what an evaluation computes)
_TRAIN_ONLY = re.compile(r"dropout|pdrop|drop_?path|layer_?drop|drop_(?:rate|prob)", re.IGNORECASE)
_DEPTH = 4
_MISSING = object()


@dataclass
class ComputationState:
    """The non-parameter state a model's modules read (see the module docstring), by dotted path.

    Attributes:
        settings: path → plain value (number, string, ``None``, tuple, class or function name).
        tensors: path → tensor (buffers and tensor attributes, detached, as stored).
    """

    settings: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def key(self) -> tuple:
        """A hashable summary: the settings and the tensors' names and shapes (not their values)."""
        return (tuple(sorted((k, repr(v)) for k, v in self.settings.items())),
                tuple(sorted((k, tuple(t.shape)) for k, t in self.tensors.items())))


def _ignored(name: str) -> bool:
    return name.startswith("_") or name == "training" or name in IGNORED_NAMES or bool(_TRAIN_ONLY.search(name))


def _callable_name(fn: Any) -> str:
    fn = getattr(fn, "__func__", fn)
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


class _Walker:
    def __init__(self, state: ComputationState, param_storages: set[int]) -> None:
        self.state, self.param_storages = state, param_storages
        self.seen: dict[int, str] = {}  # id(object) -> the path it was recorded at (a shared config: once)

    def tensor(self, path: str, t: torch.Tensor) -> None:
        if t.is_meta:
            self.state.settings[path] = f"meta tensor {tuple(t.shape)}"
        elif t.untyped_storage().data_ptr() not in self.param_storages or t.numel() == 0:
            self.state.tensors[path] = t.detach()

    def value(self, path: str, v: Any, depth: int) -> None:  # noqa: C901 - one case per kind of value
        s = self.state.settings
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            s[path] = v
        elif isinstance(v, enum.Enum):
            s[path] = f"{type(v).__qualname__}.{v.name}"
        elif isinstance(v, (torch.dtype, torch.device)):
            return
        elif isinstance(v, torch.Tensor):
            self.tensor(path, v)
        elif isinstance(v, type):
            s[path] = f"class {v.__module__}.{v.__qualname__}"
        elif isinstance(v, functools.partial):
            s[path] = f"partial {_callable_name(v.func)}"
            self.value(path + ".args", v.args, depth)
            self.value(path + ".keywords", v.keywords, depth)
        elif isinstance(v, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            s[path] = f"function {_callable_name(v)}"
        elif id(v) in self.seen:  # an object shared by several modules (Hugging Face's config): read once
            s[path] = f"the object at {self.seen[id(v)]}"
        elif isinstance(v, nn.Module):  # a module held outside the registry (a list, a plain attribute)
            self.seen[id(v)] = path
            s[path] = f"module {type(v).__module__}.{type(v).__qualname__}"
            if depth < _DEPTH:
                self.fields(path, vars(v), depth + 1)
        elif isinstance(v, (list, tuple)):
            s[path] = type(v).__name__  # the items below say how many
            if depth < _DEPTH:
                for i, item in enumerate(v):
                    self.value(f"{path}.{i}", item, depth + 1)
        elif isinstance(v, (set, frozenset)):
            s[path] = tuple(sorted(repr(x) for x in v))
        elif isinstance(v, dict):
            s[path] = "dict"
            if depth < _DEPTH:
                self.fields(path, {str(k): x for k, x in v.items()}, depth + 1)
        else:
            self.seen[id(v)] = path
            cls = type(v)
            s[path] = f"{cls.__module__}.{cls.__qualname__}"
            if depth >= _DEPTH:
                return
            to_dict = getattr(v, "to_dict", None)
            if dataclasses.is_dataclass(v):
                self.fields(path, {f.name: getattr(v, f.name, None) for f in dataclasses.fields(v)}, depth + 1)
            elif callable(to_dict) and cls.__module__.split(".")[0] == "transformers":
                self.fields(path, to_dict(), depth + 1)  # a Hugging Face config: every value, sub-configs too
            elif hasattr(v, "__dict__"):
                self.fields(path, vars(v), depth + 1)

    def fields(self, path: str, items: dict[str, Any], depth: int) -> None:
        for name, v in items.items():
            if not _ignored(name):
                self.value(f"{path}.{name}" if path else name, v, depth)


@torch.no_grad()
def computation_state(model: nn.Module) -> ComputationState:
    """Everything ``model``'s modules read besides their parameters, by dotted path (module docstring)."""
    state = ComputationState()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters() if not p.is_meta and p.numel()}
    walker = _Walker(state, storages)
    dropout = nn.modules.dropout._DropoutNd
    lrm_paths: list[str] = []
    for path, module in model.named_modules(remove_duplicate=False):
        if any(path.startswith(p + ".") for p in lrm_paths):
            continue  # an LRM layer's multiplier lists: parameters, compared as its effective weight
        if type(module) is LRMLinear:
            lrm_paths.append(path)
        cls = nn.Linear if type(module) is LRMLinear else type(module)
        state.settings[f"{path}.__class__" if path else "__class__"] = f"{cls.__module__}.{cls.__qualname__}"
        if isinstance(module, dropout):
            continue
        if cls is nn.Linear:  # an LRM layer computes the nn.Linear of its effective weight (parameters only)
            walker.fields(path, {"in_features": module.in_features, "out_features": module.out_features}, 0)
            continue
        for name, buf in module._buffers.items():
            if buf is not None and not _ignored(name):
                walker.tensor(f"{path}.{name}" if path else name, buf)
        walker.fields(path, vars(module), 0)  # _parameters, _buffers, _modules: private, left out
    return state


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y  # 2 and 2.0 read alike
    return type(x) is type(y) and x == y


def _tensor_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of two tensors (``inf`` across shapes, or across float and integer kinds)."""
    if a.shape != b.shape or a.is_floating_point() != b.is_floating_point() or a.is_complex() != b.is_complex():
        return float("inf")
    if not (a.is_floating_point() or a.is_complex()):
        return 0.0 if torch.equal(a.cpu(), b.cpu()) else float("inf")
    da, db = a.detach().cpu().to(torch.complex128 if a.is_complex() else torch.float64), \
        b.detach().cpu().to(torch.complex128 if b.is_complex() else torch.float64)
    if not (torch.isfinite(da).all() and torch.isfinite(db).all()):
        return 0.0 if torch.equal(da.nan_to_num(), db.nan_to_num()) and torch.equal(da.isnan(), db.isnan()) \
            else float("inf")
    den = max(float(da.abs().norm()), float(db.abs().norm()), torch.finfo(torch.float64).tiny)
    return float((da - db).abs().norm()) / den


def computation_difference(a: ComputationState, b: ComputationState, tol: float, *, limit: int = 3) -> str:
    """One line naming what differs between two :class:`ComputationState` s; ``""`` when nothing does.

    Settings compare exactly; tensors by ``‖a − b‖ / max(‖a‖, ‖b‖) <= tol`` (integer and boolean
    tensors exactly). At most ``limit`` differences of each kind are spelled out, the rest counted."""
    settings: list[str] = []
    for path in sorted(a.settings.keys() | b.settings.keys()):
        x, y = a.settings.get(path, _MISSING), b.settings.get(path, _MISSING)
        if x is _MISSING or y is _MISSING:
            settings.append(f"{path} is only in model_{'a' if y is _MISSING else 'b'}")
        elif not _same(x, y):
            settings.append(f"{path} is {x!r} in model_a, {y!r} in model_b")
    tensors: list[str] = []
    for path in sorted(a.tensors.keys() | b.tensors.keys()):
        x, y = a.tensors.get(path), b.tensors.get(path)
        if x is None or y is None:
            tensors.append(f"{path} is only in model_{'a' if y is None else 'b'}")
        elif (gap := _tensor_gap(x, y)) > tol:
            what = (f"shape {tuple(x.shape)} vs {tuple(y.shape)}" if x.shape != y.shape
                    else f"relative difference {gap:.2e} > tol {tol:.1e}")
            tensors.append(f"{path} ({what})")

    def part(found: list[str], what: str) -> str:
        more = f"; and {len(found) - limit} more" if len(found) > limit else ""
        return f"{len(found)} {what}{'s differ' if len(found) > 1 else ' differs'}: " + "; ".join(found[:limit]) + more

    return " | ".join(part(found, what) for found, what in ((settings, "setting"), (tensors, "tensor")) if found)
