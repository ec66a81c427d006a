"""Training-run configuration: YAML files → typed dataclasses, with inheritance and overrides.

A config file has five sections (``model``, ``data``, ``optim``, ``gauge``, ``train``) whose keys
are the fields of the dataclasses below; every field has a docstring and is checked in
``__post_init__``.  An optional top-level ``base: other.yaml`` (path relative to the file) is
loaded first and deep-merged under the file, so the paper's conditions share one base.  Unknown
keys are errors (a misspelt key must not silently fall back to a default).

Batch arithmetic (nanoGPT's conventions, so the paper's "12 × 40" reads literally):
``data.micro_batch_size`` sequences per rank per forward/backward, ``data.grad_accum_steps``
micro-batches per optimizer step *summed over all ranks* (nanoGPT's ``gradient_accumulation_steps``;
each rank runs ``grad_accum_steps / world_size`` of them).  One iteration therefore processes
``micro_batch_size × grad_accum_steps`` sequences whatever the number of GPUs:

    12 × 40 = 480 sequences = 12 per micro-batch × 5 micro-batches per rank × 8 ranks
    480 × 1024 = 491,520 tokens per iteration;  × 20,000 iterations = 9,830,400,000 tokens

Example::

    >>> from recipes.config import load_config
    >>> cfg = load_config("recipes/configs/gpt2_owt_A.yaml", ["train.seed=123"])
    >>> plan = cfg.batch_plan(world_size=8)
    >>> plan.accum_per_rank, plan.sequences_per_step, plan.tokens_per_step
    (5, 480, 491520)
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

__all__ = [
    "ConfigError",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "GaugeConfig",
    "TrainConfig",
    "RunConfig",
    "BatchPlan",
    "load_config",
    "resolve_config_path",
    "config_from_dict",
    "apply_overrides",
]

CONDITIONS = ("A", "B", "C")
GRANULARITIES = ("head", "channel", "plane", "auto")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "64-true")
PROGRESS = ("lines", "evals", "bar", "none")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or inconsistent; the message says which and why."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass
class ModelConfig:
    """Architecture (passed to :class:`gaugeopt.models.GPTConfig`) and the LRM switch."""

    n_layer: int = 12
    """Transformer blocks (GPT-2 124M: 12)."""
    n_head: int = 12
    """Query heads."""
    n_embd: int = 768
    """Model width."""
    block_size: int = 1024
    """Context length; also the training sequence length."""
    vocab_size: int | None = 50304
    """Output vocabulary.  GPT-2's 50,257 padded to 50,304 (a multiple of 64, as nanoGPT).  ``null``:
    the data's ``meta.json`` vocabulary rounded up to a multiple of 64."""
    n_kv_head: int | None = None
    """Key/value heads (GQA when fewer than ``n_head``); ``null`` = ``n_head``."""
    bias: bool = True
    """Biases in linears and LayerNorms (GPT-2: true)."""
    dropout: float = 0.0
    """Dropout (0 for pre-training, as nanoGPT)."""
    rope: str = "none"
    """``none`` (learned positions, GPT-2), ``interleaved`` or ``split_half``."""
    rotary_dim: int | None = None
    """Rotated coordinates per head (``null`` = the head width)."""
    norm: str = "layernorm"
    """``layernorm`` (GPT-2) or ``rmsnorm`` (LLaMA)."""
    mlp: str = "gelu"
    """``gelu`` (GPT-2) or ``swiglu`` (LLaMA)."""
    tie_weights: bool = True
    """Share the token embedding with the output head (GPT-2: true)."""
    lrm: bool = True
    """Learnable multipliers ``W = diag(r)·W̄·diag(c)`` on every linear (paper 002, eq. 1)."""

    def __post_init__(self) -> None:
        if self.vocab_size is not None:
            _check(self.vocab_size > 0, f"model.vocab_size={self.vocab_size} must be positive (or null)")
        _check(self.block_size > 0, f"model.block_size={self.block_size} must be positive")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")
        self.gpt_config(self.vocab_size or 64)  # GPTConfig validates heads, rope, norm, mlp

    def gpt_config(self, vocab_size: int | None = None):
        """The :class:`gaugeopt.models.GPTConfig` for this architecture."""
        from gaugeopt.errors import GaugeError
        from gaugeopt.models import GPTConfig

        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        kwargs = {k: v for k, v in asdict(self).items() if k in fields}
        kwargs["vocab_size"] = vocab_size if vocab_size is not None else self.vocab_size
        try:
            return GPTConfig(**kwargs)
        except GaugeError as err:
            raise ConfigError(f"model: {err}") from err


@dataclass
class DataConfig:
    """Token memmaps (nanoGPT layout, written by ``python -m recipes.data``) and batching."""

    dir: str = "data/openwebtext"
    """Folder with ``train.bin``, ``val.bin`` (uint16 token ids) and ``meta.json``."""
    micro_batch_size: int = 12
    """Sequences per rank per forward/backward pass (nanoGPT's ``batch_size``)."""
    grad_accum_steps: int = 40
    """Micro-batches per optimizer step summed over all ranks (nanoGPT's
    ``gradient_accumulation_steps``); must be divisible by the world size."""
    val_batches: int = 200
    """Validation micro-batches per evaluation, summed over ranks (nanoGPT's ``eval_iters``)."""
    eval_seed: int = 1337
    """Seed of the fixed validation windows: the same for every run, so runs compare."""
    num_workers: int = 0
    """DataLoader worker processes (0: load in the training process; windows are cheap)."""
    prepare: dict[str, Any] | None = None
    """If set and ``dir`` is incomplete, rank 0 runs :func:`recipes.data.prepare` first, e.g.
    ``{source: builtin, corpus: auto, tokenizer: char}`` (keys: source, corpus, tokenizer)."""

    def __post_init__(self) -> None:
        _check(self.micro_batch_size > 0, f"data.micro_batch_size={self.micro_batch_size} must be positive")
        _check(self.grad_accum_steps > 0, f"data.grad_accum_steps={self.grad_accum_steps} must be positive")
        _check(self.val_batches > 0, f"data.val_batches={self.val_batches} must be positive")
        _check(self.num_workers >= 0, f"data.num_workers={self.num_workers} must be >= 0")
        if self.prepare is not None:
            allowed = {"source", "corpus", "tokenizer"}
            _check(
                isinstance(self.prepare, dict) and set(self.prepare) <= allowed,
                f"data.prepare={self.prepare!r}: expected a mapping with keys among {sorted(allowed)}",
            )
            _check(
                self.prepare.get("source", "builtin") == "builtin",
                f"data.prepare.source={self.prepare.get('source')!r}: only 'builtin' corpora are prepared "
                "on the fly; prepare other data once with `python -m recipes.data` (see docs/recipes.md)",
            )


@dataclass
class OptimConfig:
    """AdamW, nanoGPT's learning-rate schedule, and paper 002's weight-decay conditions."""

    condition: str = "A"
    """Paper 002's condition: ``A`` (2e-3 decay on all multipliers), ``B`` (no decay on the Q/K
    multipliers, GaugeFix on), ``C`` (no Q/K decay, no GaugeFix).  See :func:`gaugeopt.lrm_param_groups`."""
    lr: float = 6e-4
    """Peak learning rate."""
    min_lr: float = 6e-5
    """Final learning rate of the cosine decay (nanoGPT: lr / 10)."""
    warmup_steps: int = 2000
    """Linear warmup steps: lr·(it+1)/(warmup+1) for it < warmup (nanoGPT's get_lr)."""
    decay_steps: int | None = None
    """Step where the cosine reaches ``min_lr`` (nanoGPT's ``lr_decay_iters``); ``null`` = max_steps."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW β₁, β₂."""
    eps: float = 1e-8
    """AdamW ε."""
    weight_decay: float = 0.1
    """Decoupled decay of matrices and embeddings (parameters with ≥ 2 dimensions)."""
    multiplier_decay: float = 2e-3
    """Decay of the LRM multipliers (λ_lrm); the Q/K ones get 0 under conditions B and C."""
    qk_multipliers: str = "rows"
    """Which multipliers B/C exempt: ``rows`` (r_Q, r_K: the gauge pair) or ``all`` (also c_Q, c_K)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value (``null`` or 0: no clipping; the norm is logged)."""
    fused: str | bool = "auto"
    """Fused AdamW kernel: ``auto`` (on CUDA), true or false."""

    def __post_init__(self) -> None:
        _check(self.condition in CONDITIONS, f"optim.condition={self.condition!r} must be one of {CONDITIONS}")
        _check(self.lr > 0, f"optim.lr={self.lr} must be positive")
        _check(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas={list(self.betas)} must be two numbers in [0, 1)",
        )
        _check(self.weight_decay >= 0 and self.multiplier_decay >= 0,
               f"optim.weight_decay={self.weight_decay}, multiplier_decay={self.multiplier_decay} must be >= 0")
        _check(self.qk_multipliers in ("rows", "all"),
               f"optim.qk_multipliers={self.qk_multipliers!r} must be 'rows' or 'all'")
        _check(self.fused in ("auto", True, False), f"optim.fused={self.fused!r} must be auto, true or false")
        if self.grad_clip is not None:
            _check(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0 (or null)")


@dataclass
class GaugeConfig:
    """GaugeFix (paper 002, eqs. 4-6) and the drift monitor."""

    fix_every: int | None = None
    """Apply GaugeFix after every N-th optimizer step (``null``: never).  Condition B needs it."""
    granularity: str = "head"
    """``head`` (the paper: one scale per head), ``channel``, ``plane`` (RoPE) or ``auto``."""
    transport_state: bool = False
    """Rescale Adam's moments with the multipliers.  The paper did not (it blames the resulting stale
    state for the per-step instability), so the paper's configs keep ``false``."""
    monitor_every: int = 10
    """Log the Q/K drift (paper eq. 3) and the scale product every N optimizer steps; a multiple of
    ``train.log_every`` (Lightning writes logs only at those steps)."""
    monitor_vertical_fraction: bool = False
    """Also log the vertical (gauge) fraction of the update at the monitored steps."""
    product_decay: float | None = None
    """Magnitude control (paper 002 §5's follow-up, not in its runs): shrink the Q/K scale product by
    this fraction at each fix.  Changes the function on purpose; ``null`` = off."""
    product_max: float | None = None
    """Cap the Q/K scale product per head at each fix (``null`` = off)."""

    def __post_init__(self) -> None:
        for name in ("product_decay", "product_max"):
            v = getattr(self, name)
            _check(v is None or v >= 0, f"gauge.{name}={v} must be >= 0 (or null)")
        if self.fix_every is not None:
            _check(self.fix_every > 0, f"gauge.fix_every={self.fix_every} must be a positive step count (or null)")
        _check(self.granularity in GRANULARITIES,
               f"gauge.granularity={self.granularity!r} must be one of {GRANULARITIES}")
        _check(self.monitor_every > 0, f"gauge.monitor_every={self.monitor_every} must be positive")


@dataclass
class TrainConfig:
    """Trainer, hardware, logging, checkpoints and seeds."""

    max_steps: int = 20000
    """Optimizer steps (iterations)."""
    eval_interval: int = 1000
    """Validate every N optimizer steps; must divide ``max_steps`` so the last step is evaluated."""
    log_every: int = 10
    """Log training metrics (and print a progress line) every N optimizer steps."""
    ckpt_every: int | None = None
    """Write ``checkpoints/last.ckpt`` every N optimizer steps (``null`` = ``eval_interval``), and at the end."""
    seed: int = 42
    """Seed of initialisation and of the training windows (``lightning.seed_everything``)."""
    accelerator: str = "auto"
    """``auto`` (CUDA when available), ``gpu``/``cuda`` or ``cpu``."""
    devices: int | str = "auto"
    """Processes per node.  ``auto``: SLURM's tasks per node under ``srun``, else all GPUs, else 1."""
    num_nodes: int | str = "auto"
    """Nodes.  ``auto``: ``SLURM_NNODES`` under ``srun``, else 1."""
    strategy: str = "auto"
    """Lightning strategy; ``auto`` gives ``ddp`` with more than one process."""
    precision: str = "auto"
    """``auto``: ``bf16-mixed`` on CUDA with bf16 support, else ``32-true``."""
    compile: bool = False
    """``torch.compile`` the model (GPU runs; on CPU it costs ~25 s and gains nothing)."""
    matmul_precision: str = "high"
    """``torch.set_float32_matmul_precision``: ``high`` lets float32 matmuls use TF32 (as nanoGPT)."""
    out_dir: str = "runs"
    """Parent folder of the run directories."""
    run_name: str | None = None
    """Run directory name under ``out_dir`` (``null``: ``<config name>_s<seed>``); reruns resume there."""
    wandb: bool = False
    """Also log to Weights & Biases (offline unless ``WANDB_MODE`` says otherwise)."""
    wandb_project: str = "gaugeopt"
    """W&B project."""
    progress: str = "lines"
    """``lines`` (one line per log and eval step, readable in slurm logs), ``evals`` (eval lines only),
    ``bar`` (Lightning's progress bar) or ``none``."""
    deterministic: bool = False
    """``Trainer(deterministic=True)``: deterministic kernels (slower on GPU)."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "eval_interval", "log_every"):
            _check(getattr(self, name) > 0, f"train.{name}={getattr(self, name)} must be positive")
        if self.ckpt_every is None:
            self.ckpt_every = self.eval_interval
        _check(self.ckpt_every > 0, f"train.ckpt_every={self.ckpt_every} must be positive")
        _check(
            self.max_steps % self.eval_interval == 0,
            f"train.eval_interval={self.eval_interval} must divide train.max_steps={self.max_steps} so the "
            "final step is evaluated; pick e.g. eval_interval="
            f"{math.gcd(self.max_steps, self.eval_interval)}",
        )
        for name in ("devices", "num_nodes"):
            v = getattr(self, name)
            _check(v == "auto" or (isinstance(v, int) and v > 0),
                   f"train.{name}={v!r} must be a positive integer or 'auto'")
        _check(self.precision in PRECISIONS, f"train.precision={self.precision!r} must be one of {PRECISIONS}")
        _check(self.progress in PROGRESS, f"train.progress={self.progress!r} must be one of {PROGRESS}")
        _check(self.matmul_precision in ("highest", "high", "medium"),
               f"train.matmul_precision={self.matmul_precision!r} must be highest, high or medium")


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is assembled: the numbers printed at the start of a run."""

    micro_batch_size: int
    accum_per_rank: int
    world_size: int
    block_size: int
    max_steps: int

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch_size * self.accum_per_rank * self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.block_size

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.max_steps

    def describe(self) -> str:
        return (
            f"batch: {self.micro_batch_size} sequences/micro-batch × {self.accum_per_rank} micro-batches/rank"
            f" × {self.world_size} ranks = {self.sequences_per_step:,} sequences/iteration\n"
            f"       {self.sequences_per_step:,} × {self.block_size:,} tokens = {self.tokens_per_step:,}"
            f" tokens/iteration; × {self.max_steps:,} iterations = {self.total_tokens:,} tokens"
            f" ({self.total_tokens / 1e9:.2f}B)"
        )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "gauge": GaugeConfig,
    "train": TrainConfig,
}


@dataclass
class RunConfig:
    """One training run: the five sections plus the config's name (its file stem)."""

    name: str = "run"
    """Config name (the YAML file's stem), used for the default run directory."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    gauge: GaugeConfig = field(default_factory=GaugeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        cond, every = self.optim.condition, self.gauge.fix_every
        _check(not (cond == "B" and every is None),
               "optim.condition='B' (GaugeFix-LRM) needs gauge.fix_every (the paper: 1)")
        _check(not (cond == "C" and every is not None),
               f"optim.condition='C' is the no-control ablation but gauge.fix_every={every}; "
               "use condition B for GaugeFix without Q/K decay")
        _check(self.gauge.monitor_every % self.train.log_every == 0,
               f"gauge.monitor_every={self.gauge.monitor_every} must be a multiple of train.log_every="
               f"{self.train.log_every}: Lightning writes metrics to the loggers only every log_every steps")
        _check(self.gauge.fix_every is not None or (self.gauge.product_decay is None and self.gauge.product_max is None),
               "gauge.product_decay/product_max act at GaugeFix time; set gauge.fix_every too")
        decay = self.optim.decay_steps if self.optim.decay_steps is not None else self.train.max_steps
        _check(decay >= self.optim.warmup_steps,
               f"optim.decay_steps={decay} must be >= optim.warmup_steps={self.optim.warmup_steps}")

    @property
    def run_name(self) -> str:
        return self.train.run_name or f"{self.name}_s{self.train.seed}"

    def batch_plan(self, world_size: int | None = None) -> BatchPlan:
        """The batch arithmetic for ``world_size`` ranks (default: devices × num_nodes if both are set)."""
        if world_size is None:
            d, n = self.train.devices, self.train.num_nodes
            world_size = (d if isinstance(d, int) else 1) * (n if isinstance(n, int) else 1)
        ga, mb = self.data.grad_accum_steps, self.data.micro_batch_size
        if ga % world_size:
            raise ConfigError(
                f"data.grad_accum_steps={ga} (micro-batches per step over all ranks) is not divisible by the "
                f"world size {world_size}. {_batch_suggestion(mb, ga, world_size)}"
            )
        return BatchPlan(mb, ga // world_size, world_size, self.model.block_size, self.train.max_steps)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["optim"]["betas"] = list(self.optim.betas)
        return d


def _batch_suggestion(mb: int, ga: int, world: int) -> str:
    """A (micro_batch_size, grad_accum_steps) with the same sequences per step that ``world`` divides."""
    total = mb * ga
    options = [(m, total // m) for m in range(mb, 0, -1) if total % m == 0 and (total // m) % world == 0]
    if not options:
        return f"No split of {total} sequences per step fits {world} ranks; change the batch size."
    m, g = options[0]
    return f"To keep {total} sequences per step, set data.micro_batch_size={m} data.grad_accum_steps={g}."


# ---- construction from dicts and YAML ------------------------------------------------------------


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert YAML scalars to the annotated type (YAML 1.1 reads ``2e-3`` as a string)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                pass
        allowed = " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a)) for a in args)
        raise ConfigError(f"{where}={value!r} must be {allowed}")
    if hint is Any:
        return value
    if origin is tuple:
        args = typing.get_args(hint)
        _check(isinstance(value, (list, tuple)) and len(value) == len(args),
               f"{where}={value!r} must be a list of {len(args)} values")
        return tuple(_coerce(v, a, where) for v, a in zip(value, args))
    if origin is dict:
        _check(isinstance(value, dict), f"{where}={value!r} must be a mapping")
        return dict(value)
    if hint is bool:
        _check(isinstance(value, bool), f"{where}={value!r} must be true or false")
        return value
    if hint is int:
        _check(isinstance(value, int) and not isinstance(value, bool), f"{where}={value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), f"{where}={value!r} must be a number")
        return float(value)
    if hint is str:
        _check(isinstance(value, str), f"{where}={value!r} must be a string")
    return value


def _section(cls: type, values: dict[str, Any], name: str) -> Any:
    _check(isinstance(values, dict), f"section {name!r} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    _check(not unknown, f"unknown key(s) {', '.join(f'{name}.{k}' for k in unknown)}; {name} accepts: {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{name}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def config_from_dict(d: dict[str, Any], name: str = "run") -> RunConfig:
    """Build and validate a :class:`RunConfig` from a nested mapping (a parsed YAML file)."""
    d = dict(d)
    d.pop("base", None)
    name = d.pop("name", name)
    unknown = sorted(set(d) - set(SECTIONS))
    _check(not unknown, f"unknown section(s) {unknown}; a config has: base, name, {', '.join(SECTIONS)}")
    return RunConfig(name=name, **{k: _section(cls, d.get(k) or {}, k) for k, cls in SECTIONS.items()})


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "prepare" else v
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    import yaml

    path = path.resolve()
    _check(path not in chain, f"config inheritance cycle: {' -> '.join(str(p) for p in (*chain, path))}")
    _check(path.is_file(), f"config file {path} does not exist")
    d = yaml.safe_load(path.read_text()) or {}
    _check(isinstance(d, dict), f"{path}: a config file must hold a mapping, got {type(d).__name__}")
    base = d.get("base")
    if base is None:
        return d
    parent = _read_yaml(path.parent / base, (*chain, path))
    parent.pop("name", None)  # a name belongs to the file that sets it, not to the files inheriting it
    return _deep_merge(parent, d)


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (values parsed as YAML) to a nested mapping."""
    import yaml

    d = _deep_merge({}, d)
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        _check(sep == "=" and len(parts) == 2 and all(parts),
               f"--set {item!r}: expected section.key=value, e.g. optim.lr=1e-3")
        section, k = parts
        _check(section in SECTIONS, f"--set {item!r}: unknown section {section!r}; sections: {', '.join(SECTIONS)}")
        d.setdefault(section, {})
        d[section] = dict(d[section] or {})
        d[section][k] = yaml.safe_load(raw) if raw.strip() else None
    return d


def resolve_config_path(path: str | Path) -> Path:
    """``path`` itself when it exists, else the packaged config of that name (``recipes/configs/<name>.yaml``):
    so ``recipes/configs/tiny_cpu_B.yaml`` and ``tiny_cpu_B`` work from any directory once gaugeopt is installed."""
    path = Path(path)
    if path.exists():
        return path
    packaged = Path(__file__).resolve().parent / "configs" / (path.name if path.suffix else f"{path.name}.yaml")
    return packaged if packaged.is_file() else path


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (following ``base:``), apply ``section.key=value`` overrides, validate.

    ``path`` is a file, or the name of a packaged config (:func:`resolve_config_path`)."""
    path = resolve_config_path(path)
    d = apply_overrides(_read_yaml(path), list(overrides or []))
    return config_from_dict(d, name=d.get("name", path.stem))
