"""What a gauge fix did: :class:`GaugeFixReport`, assembled the same way whatever backend ran.

Example:
    >>> import torch, gaugeopt
    >>> from gaugeopt.models import GPT, GPTConfig
    >>> model = gaugeopt.apply_lrm(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)))
    >>> with torch.no_grad(): _ = model.transformer.h[1].attn.c_attn.row_mults[1].mul_(3.0)  # r_K ← 3 r_K
    >>> report = gaugeopt.gauge_fix(model)
    >>> report.heads_fixed, report.per_layer("qk", "drift_before") == [0.0, report.max_drift_before]
    (4, True)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from gaugeopt.fix.drift import product_stats, worst

__all__ = ["PairRecord", "GaugeFixReport"]


@dataclass
class PairRecord:
    """What the fix did to one gauge of one layer (tensors ``(h_kv, n_slots)``).

    ``drift_after`` and ``product_after`` are measured on the stored tensors after the writes (a
    bf16 parameter's drift is what rounding left, not what the factors promised); ``floor`` is the
    relative precision of those tensors, the drift rounding alone can leave. ``heads_fixed`` counts the query heads (Q/K) or KV heads (V/O) whose factor differed from 1
    beyond rounding in at least one slot (:func:`gaugeopt.fix.balance.changed_groups`); it is read
    from the ``changed`` tensor when asked for, so a fix itself never waits for the device.
    """

    name: str
    layer: int
    kind: str
    mode: str
    granularity: str
    drift_before: torch.Tensor
    drift_after: torch.Tensor
    product_before: torch.Tensor
    product_after: torch.Tensor
    changed: torch.Tensor  # (h_kv,) bool
    heads_per_group: int = 1
    skipped: torch.Tensor | None = None  # (h_kv,) bool: a slot with a non-finite scale was left alone
    floor: float = 0.0  # relative precision of the stored tensors (eps of their dtype)

    @property
    def heads_fixed(self) -> int:
        return int(self.changed.sum()) * self.heads_per_group


@dataclass
class GaugeFixReport:
    """Result of :func:`gaugeopt.gauge_fix`.

    Attributes:
        pairs: one :class:`PairRecord` per layer and gauge (``"qk"``, then ``"vo"`` if asked; a
            QK-norm layer's Q/K record has kind ``"qk_gain"`` and counts as Q/K in every summary).
        transported: names of the parameters whose optimizer state was moved, every entry exactly.
        approximate: names of the parameters at least one of whose state entries was moved by a
            declared approximation (an ``eps`` inside a statistic, a coupled L2 term, Adafactor's
            unrecoverable factor; docs/optimizers.md).
        reset, left: names of the parameters whose unknown state was reset, or left stale
            (``unknown_state``). A parameter without state, or whose state holds nothing that
            depends on the coordinates, is in none of the lists.
        frozen: the pairs left out because a tensor of theirs does not require gradients
            (``rescale_frozen=False``, the default).
        backend: ``"torch"`` or ``"triton"``: which implementation computed the numbers.

    Drift and scale-product summaries are over the finite slots; :attr:`nonfinite_groups` counts the
    groups with a slot left alone because its scale was NaN or infinite (a NaN weight).
    """

    pairs: list[PairRecord] = field(default_factory=list)
    transported: list[str] = field(default_factory=list)
    approximate: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    backend: str = "torch"

    def _of(self, kind: str) -> list[PairRecord]:
        """Records of one gauge: ``"qk"`` is every layer's Q/K gauge, its gains under QK-norm included."""
        kinds = ("qk", "qk_gain") if kind == "qk" else (kind,)
        return [p for p in self.pairs if p.kind in kinds]

    def _max(self, kind: str, attr: str) -> float:
        return worst(getattr(p, attr) for p in self._of(kind))

    @property
    def max_drift_before(self) -> float:
        """Q/K slot drift before the fix, max over layers, groups and slots."""
        return self._max("qk", "drift_before")

    @property
    def max_drift_after(self) -> float:
        return self._max("qk", "drift_after")

    @property
    def nonfinite_groups(self) -> int:
        """Groups (of every gauge) with a slot left alone because its scale was not finite (one host sync)."""
        flags = [p.skipped.sum() for p in self.pairs if p.skipped is not None]
        return int(torch.stack(flags).sum()) if flags else 0

    @property
    def rounding_floor(self) -> float:
        """The largest :attr:`PairRecord.floor`: no fix can bring a drift below about this."""
        return max((p.floor for p in self.pairs), default=0.0)

    @property
    def limited_by_rounding(self) -> bool:
        """Whether the Q/K drift left is at the stored dtype's rounding (a few :attr:`rounding_floor`)."""
        return self.max_drift_after <= 8 * self.rounding_floor

    def warn_nonfinite(self) -> None:
        """Warn when slots were left alone for a non-finite scale (reads the flags: one host sync)."""
        n = self.nonfinite_groups
        if n:
            bad = sorted({p.name for p in self.pairs if p.skipped is not None and bool(p.skipped.any())})
            warnings.warn(
                f"gauge_fix: {n} group(s) in {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} have a NaN or "
                "infinite weight; their slots were left alone (nothing spread to the rest of the head). "
                "report.nonfinite_groups counts them", RuntimeWarning, stacklevel=3,
            )

    @property
    def heads_fixed(self) -> int:
        """Query heads (Q/K) whose factor differed from 1 beyond rounding in at least one slot
        (one host synchronisation)."""
        recs = self._of("qk")
        if not recs:
            return 0
        counts = torch.stack([p.changed.sum() * p.heads_per_group for p in recs])
        return int(counts.sum())

    def per_layer(self, kind: str = "qk", attr: str = "drift_after") -> list[float]:
        """``attr`` (``drift_before``, ``product_after``, ...) max per layer."""
        return [float(getattr(p, attr).max()) for p in self._of(kind)]

    def as_dict(self, prefix: str = "gaugefix/", per_layer: bool = False) -> dict[str, float]:
        """Flat ``{name: float}`` for loggers (``self.log_dict(report.as_dict())``)."""
        out: dict[str, float] = {
            f"{prefix}heads_fixed": float(self.heads_fixed),
            f"{prefix}params_transported": float(len(self.transported)),
            f"{prefix}params_approximate": float(len(self.approximate)),
            f"{prefix}params_reset": float(len(self.reset)),
            f"{prefix}params_left": float(len(self.left)),
            f"{prefix}nonfinite_groups": float(self.nonfinite_groups),
            f"{prefix}rounding_floor": self.rounding_floor,
        }
        for kind in ("qk", "vo"):
            recs = self._of(kind)
            if not recs:
                continue
            mean, top = product_stats(p.product_after for p in recs)
            out[f"{prefix}{kind}_drift_before"] = self._max(kind, "drift_before")
            out[f"{prefix}{kind}_drift_after"] = self._max(kind, "drift_after")
            out[f"{prefix}{kind}_scale_product_mean"] = mean
            out[f"{prefix}{kind}_scale_product_max"] = top
            if per_layer:
                for p in recs:
                    out[f"{prefix}layer{p.layer}/{kind}_drift_before"] = float(p.drift_before.max())
                    out[f"{prefix}layer{p.layer}/{kind}_scale_product"] = float(p.product_after.mean())
        return out
