"""Load and save checkpoints for the model tools: weights plus a JSON config.

A checkpoint is a weights file (safetensors, or a ``torch.save`` state dict — nanoGPT's
``{"model": state_dict, ...}`` works too) and a config that says how to build the model:

* the project's GPT: ``{"model_type": "gaugeopt_gpt", **GPTConfig fields}``;
* a Hugging Face ``config.json`` with ``model_type`` ``gpt2``, ``llama``, ``mistral`` or
  ``qwen2`` (the model is built from the config with random init, then the weights are
  loaded; ``transformers`` is imported only then);
* ``"gaugeopt_lrm": true`` marks a model with learnable multipliers (also detected from
  ``row_mults`` keys), converted with :func:`gaugeopt.apply_lrm` before loading.

Paths: a directory holding ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``
/ ``model.pt`` / ``ckpt.pt``), as ``save_pretrained`` writes; or a weights file whose config
is ``--config``, else ``<weights>.json``, else ``config.json`` beside it. Every failure —
missing, empty, truncated or corrupt file, unknown ``model_type``, a state dict that does not
fit the config — is a :class:`~gaugeopt.errors.GaugeError` with a one-line message. Tied
weights are stored once and restored from their alias. :func:`save_checkpoint` writes
atomically and never replaces an existing file unless ``overwrite=True``.

Example:
    >>> import tempfile, torch
    >>> from gaugeopt.tools.checkpoint import load_checkpoint, save_checkpoint
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    >>> out = tempfile.mkdtemp() + "/tiny"
    >>> weights, config = save_checkpoint(model, out)
    >>> ckpt = load_checkpoint(out)
    >>> ckpt.model_type, ckpt.dtype, torch.equal(ckpt.model.lm_head.weight.float(), model.lm_head.weight)
    ('gaugeopt_gpt', torch.float32, True)
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterable

import torch
import torch.nn as nn

from gaugeopt.errors import GaugeError
from gaugeopt.adapters.apply_lrm import apply_lrm, is_lrm

__all__ = [
    "GPT_TYPE",
    "HF_TYPES",
    "MODEL_TYPES",
    "LRM_FLAG",
    "Checkpoint",
    "resolve_paths",
    "read_config",
    "read_weights",
    "build_model",
    "gpt_config",
    "load_checkpoint",
    "save_checkpoint",
    "output_paths",
    "check_output",
    "config_of",
    "forward_logits",
    "greedy_decode",
    "context_length",
]

GPT_TYPE = "gaugeopt_gpt"
HF_TYPES = ("gpt2", "llama", "mistral", "qwen2")
MODEL_TYPES = (GPT_TYPE, *HF_TYPES)
LRM_FLAG = "gaugeopt_lrm"
WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "model.pt", "ckpt.pt")
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model (in the requested dtype, eval mode) and where it came from.

    ``dtype`` is the floating dtype the weights were *stored* in.
    """

    model: nn.Module
    config: dict
    model_type: str
    weights_path: Path
    config_path: Path
    dtype: torch.dtype


# ---------------------------------------------------------------------- paths and files
def resolve_paths(path: str | os.PathLike, config: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """``(weights, config)`` for a checkpoint directory or weights file (see module docstring)."""
    p = Path(path)
    if not p.exists():
        raise GaugeError(f"checkpoint {p} does not exist")
    if p.is_dir():
        found = [p / n for n in WEIGHT_NAMES if (p / n).is_file()]
        if not found:
            cands = sorted(c for c in p.iterdir() if c.suffix in WEIGHT_SUFFIXES)
            if len(cands) != 1:
                listed = ", ".join(c.name for c in cands) or "expected " + " or ".join(WEIGHT_NAMES)
                raise GaugeError(
                    f"checkpoint directory {p} has {'no' if not cands else 'several'} weights files ({listed}); "
                    "pass the weights file itself"
                )
            found = cands
        weights = found[0]
        cfg = Path(config) if config is not None else p / "config.json"
    else:
        weights = p
        if config is not None:
            cfg = Path(config)
        elif p.with_suffix(".json").is_file() and p.suffix != ".json":
            cfg = p.with_suffix(".json")
        else:
            cfg = p.parent / "config.json"
    if not cfg.is_file():
        raise GaugeError(
            f"no config for checkpoint {p}: {cfg} does not exist; pass --config PATH (a GPTConfig or HF config.json)"
        )
    return weights, cfg


def read_config(path: str | os.PathLike) -> dict:
    """The JSON config at ``path`` with a known ``model_type`` (see :data:`MODEL_TYPES`)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise GaugeError(f"config {p} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise GaugeError(f"config {p} is not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise GaugeError(f"config {p} must hold a JSON object, got {type(cfg).__name__}")
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise GaugeError(
            f"config {p}: unknown model_type {kind!r}; supported: {', '.join(MODEL_TYPES)} "
            f"(a GPTConfig saved by gaugeopt has model_type {GPT_TYPE!r})"
        )
    return cfg


def _sniff(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(9)
    if not head:
        raise GaugeError(f"checkpoint {path} is empty (0 bytes)")
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    if path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{"):
        return "safetensors"
    return "torch"


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict stored at ``path`` (safetensors or ``torch.save``), on the CPU."""
    p = Path(path)
    if not p.is_file():
        raise GaugeError(f"checkpoint {p} does not exist")
    fmt = _sniff(p)
    try:
        if fmt == "safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError as err:
                raise GaugeError("reading .safetensors needs `pip install safetensors` (or gaugeopt[tools])") from err
            sd = load_file(str(p))
        else:
            sd = torch.load(p, map_location="cpu", weights_only=True)
    except GaugeError:
        raise
    except Exception as err:  # any deserialisation failure means a damaged file; say so in one line
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GaugeError(
            f"cannot read checkpoint {p}: truncated or corrupt {fmt} file ({type(err).__name__}: {msg[:160]})"
        ) from err
    if isinstance(sd, dict):
        for key in ("model", "state_dict"):
            if key in sd and isinstance(sd[key], dict):
                sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise GaugeError(f"checkpoint {p} does not hold a state dict of tensors")
    return {k.removeprefix("_orig_mod."): v for k, v in sd.items()}


# ---------------------------------------------------------------------- building models
def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise GaugeError(
            "this checkpoint is a Hugging Face model; install transformers (`pip install transformers`) to load it"
        ) from err
    return transformers


def gpt_config(config: dict):
    """The :class:`~gaugeopt.models.GPTConfig` described by a ``gaugeopt_gpt`` config dict."""
    from gaugeopt.models.gpt import GPTConfig

    known = {f.name for f in fields(GPTConfig)}
    args = {k: v for k, v in config.items() if k not in ("model_type", LRM_FLAG)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise GaugeError(f"GPT config has unknown fields {unknown}; known fields: {sorted(known)}")
    return GPTConfig(**args)


def build_model(config: dict, *, lrm: bool | None = None) -> nn.Module:
    """A randomly initialised model for ``config`` (eval mode); ``lrm`` defaults to the config's flag."""
    from gaugeopt.models.gpt import GPT

    kind = config.get("model_type")
    lrm = bool(config.get(LRM_FLAG, False)) if lrm is None else lrm
    if kind == GPT_TYPE:
        model = GPT(gpt_config(config))
    elif kind in HF_TYPES:
        tf = _transformers()
        cfg = tf.AutoConfig.for_model(**{k: v for k, v in config.items() if k != LRM_FLAG})
        model = tf.AutoModelForCausalLM.from_config(cfg)
    else:
        raise GaugeError(f"unknown model_type {kind!r}; supported: {', '.join(MODEL_TYPES)}")
    if lrm:
        apply_lrm(model)
    return model.eval()


def config_of(model: nn.Module) -> dict:
    """The JSON config that rebuilds ``model`` with :func:`build_model`."""
    from gaugeopt.models.gpt import GPT

    if isinstance(model, GPT):
        cfg = {"model_type": GPT_TYPE, **model.config.to_dict()}
    elif getattr(getattr(model, "config", None), "model_type", None) in HF_TYPES:
        cfg = model.config.to_dict()
    else:
        raise GaugeError(
            f"cannot describe a {type(model).__qualname__} as a checkpoint config; supported: the gaugeopt GPT and "
            f"Hugging Face {', '.join(HF_TYPES)} causal LMs"
        )
    if is_lrm(model):
        cfg[LRM_FLAG] = True
    return cfg


def _alias_groups(model: nn.Module) -> dict[str, list[str]]:
    """Each state-dict name → every name sharing its tensor (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def _fit_state(model: nn.Module, sd: dict[str, torch.Tensor], kind: str, where: str) -> dict[str, torch.Tensor]:
    expected = model.state_dict()
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not set(sd) & set(expected) and {f"{prefix}.{k}" for k in sd} & set(expected):
        sd = {f"{prefix}.{k}": v for k, v in sd.items()}  # saved from the bare base model (e.g. the hub's gpt2)
    aliases = _alias_groups(model)
    missing = [k for k in expected if k not in sd and not any(a in sd for a in aliases.get(k, ()))]
    legacy = (".attn.bias", ".attn.masked_bias") if kind == "gpt2" else ()  # old GPT-2 causal-mask buffers
    unexpected = [k for k in sd if k not in expected and not k.endswith(legacy)]
    wrong = [f"{k} {tuple(sd[k].shape)} vs {tuple(expected[k].shape)}" for k in sd
             if k in expected and sd[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        def few(xs):
            return ", ".join(xs[:3]) + (f" (+{len(xs) - 3} more)" if len(xs) > 3 else "")

        parts = [f"missing {few(missing)}" if missing else "", f"unexpected {few(unexpected)}" if unexpected else "",
                 f"shape (checkpoint vs config) {few(wrong)}" if wrong else ""]
        raise GaugeError(f"{where} does not match its config: " + "; ".join(p for p in parts if p))
    return {k: v for k, v in sd.items() if k in expected}


def _storage_dtype(sd: dict[str, torch.Tensor]) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for v in sd.values():
        if v.is_floating_point():
            counts[v.dtype] = counts.get(v.dtype, 0) + v.numel()
    return max(counts, key=counts.get) if counts else torch.float32


@torch.no_grad()
def load_checkpoint(
    path: str | os.PathLike, config: str | os.PathLike | None = None, *, dtype: torch.dtype | None = torch.float64
) -> Checkpoint:
    """Load a checkpoint (see module docstring) into a model in ``dtype`` (``None``: as stored)."""
    weights, cfg_path = resolve_paths(path, config)
    cfg = read_config(cfg_path)
    sd = read_weights(weights)
    lrm = bool(cfg.get(LRM_FLAG, False)) or any(".row_mults." in k for k in sd)
    model = build_model(cfg, lrm=lrm)
    stored = _storage_dtype(sd)
    model.to(dtype or stored)
    fitted = _fit_state(model, sd, cfg["model_type"], f"checkpoint {weights}")
    model.load_state_dict(fitted, strict=False)
    return Checkpoint(model, cfg, cfg["model_type"], weights, cfg_path, stored)


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would surprise whoever reads the checkpoint next
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def output_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """``(weights, config)`` that :func:`save_checkpoint` writes for ``path``."""
    p = Path(path)
    if p.suffix in WEIGHT_SUFFIXES:
        return p, p.with_suffix(".json")
    return p / "model.safetensors", p / "config.json"


def check_output(
    path: str | os.PathLike, *, overwrite: bool = False, inputs: Iterable[str | os.PathLike] = ()
) -> tuple[Path, Path]:
    """The output paths for ``path``, refusing (without ``overwrite``) an input or any existing file."""
    protected = {Path(i).resolve() for i in inputs}
    targets = output_paths(path)
    for target in targets:
        if not overwrite and target.resolve() in protected:
            raise GaugeError(f"output {target} is an input of this command; choose another output path or pass --force")
        if not overwrite and target.exists():
            raise GaugeError(f"output {target} already exists; choose another path or pass --force to replace it")
    return targets


@torch.no_grad()
def save_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    config: dict | None = None,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    inputs: Iterable[str | os.PathLike] = (),
) -> tuple[Path, Path]:
    """Write ``model`` as a checkpoint and return ``(weights_path, config_path)``.

    Args:
        path: a directory (``config.json`` + ``model.safetensors`` inside, created if needed) or
            a weights file ending in ``.safetensors`` (or ``.pt``/``.pth``/``.bin`` for
            ``torch.save``) whose config goes to ``<path>.json``.
        config: the config to write (default :func:`config_of`).
        overwrite: replace existing files; without it any existing target is refused.
        dtype: cast floating tensors (default: as they are).
        inputs: paths this output must not replace (named as inputs in the error).
    """
    weights, cfg_path = check_output(path, overwrite=overwrite, inputs=inputs)
    cfg = config_of(model) if config is None else config
    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen and t.numel():
            continue  # a tied alias: restored from its twin on load
        seen.add(key)
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous().clone()
    weights.parent.mkdir(parents=True, exist_ok=True)
    if weights.suffix == ".safetensors":
        from safetensors.torch import save_file

        _atomic_write(weights, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    else:
        _atomic_write(weights, lambda tmp: torch.save(tensors, tmp))
    text = json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n"
    _atomic_write(cfg_path, lambda tmp: Path(tmp).write_text(text))
    return weights, cfg_path


# ---------------------------------------------------------------------- running models
def forward_logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Logits ``(B, T, vocab)`` of a gaugeopt GPT or a Hugging Face causal LM."""
    from gaugeopt.models.gpt import GPT

    if isinstance(model, GPT):
        return model(idx)[0]
    return model(input_ids=idx).logits


@torch.no_grad()
def greedy_decode(model: nn.Module, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Append ``n`` greedy tokens (``GPT.generate(idx, n, temperature=0)`` for the gaugeopt GPT)."""
    from gaugeopt.models.gpt import GPT

    if isinstance(model, GPT):
        return model.generate(idx, n, temperature=0.0)
    for _ in range(n):
        nxt = forward_logits(model, idx)[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
    return idx


def context_length(model: nn.Module) -> tuple[int, int]:
    """``(vocab_size, max positions)`` of a gaugeopt GPT or Hugging Face causal LM."""
    cfg = model.config
    ctx = next((getattr(cfg, k) for k in ("block_size", "n_positions", "max_position_embeddings")
                if getattr(cfg, k, None)), 64)
    return int(cfg.vocab_size), int(ctx)
