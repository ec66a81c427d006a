"""Triton kernel or torch reference: one decision per call, with its reason on record.

Rules (the first that applies wins):

1. ``backend="torch"`` (argument) — or ``"auto"`` with ``GAUGEOPT_BACKEND=torch`` — runs the
   torch reference.
2. ``backend="triton"`` (argument, or ``"auto"`` with ``GAUGEOPT_BACKEND=triton``) runs the
   Triton kernel, or raises :class:`~gaugeopt.GaugeError` saying why it cannot run — Triton not
   installed, CPU tensors without ``TRITON_INTERPRET=1`` (set before the kernel modules are
   imported), a device other than CUDA/CPU, inputs the kernel does not take (DTensor shards,
   mixed dtypes). A forced Triton path never falls back silently.
3. ``"auto"`` runs Triton on CUDA tensors when Triton is importable and the inputs are
   supported, and the torch reference otherwise (CPU tensors always take torch under
   ``"auto"``: the interpreter is for tests). The reason is recorded.

The argument beats the environment variable; an unknown value of either is an error. Every
decision is kept per operation: :func:`explain` prints the last one, :func:`last_decision`
returns it (``.backend``, ``.reason``, ``.source``).

Example:
    >>> import torch
    >>> from gaugeopt.kernels import dispatch
    >>> d = dispatch.choose("gauge_fix", torch.device("cpu"))
    >>> d.backend, d.reason
    ('torch', 'tensors on cpu: the Triton kernels run on CUDA tensors (on CPU only when forced, through TRITON_INTERPRET=1)')
    >>> dispatch.choose("gauge_fix", torch.device("cpu"), backend="torch").source
    'argument'
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from gaugeopt.errors import GaugeError

__all__ = ["BACKENDS", "ENV_VAR", "Decision", "choose", "explain", "last_decision", "remember", "requested_backend",
           "triton_version"]

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "GAUGEOPT_BACKEND"
_INSTALL_HINT = "install it with `pip install 'gaugeopt[triton]'` (or `pip install triton`)"


@dataclass(frozen=True)
class Decision:
    """One dispatch decision.

    Attributes:
        op: the operation (``"gauge_fix"``, ``"project_diagonal"``, ...).
        backend: what runs: ``"triton"`` or ``"torch"``.
        requested: what was asked: ``"auto"``, ``"triton"`` or ``"torch"``.
        source: where the request came from: ``"argument"``, ``"environment"`` or ``"default"``.
        reason: why ``backend`` was chosen (for a fallback: what stood in the way).
    """

    op: str
    backend: str
    requested: str
    source: str
    reason: str

    def __str__(self) -> str:
        return f"{self.op}: {self.backend} (requested {self.requested!r} by {self.source}): {self.reason}"


_LAST: dict[str, Decision] = {}


def requested_backend(backend: str = "auto") -> tuple[str, str]:
    """``(request, source)`` from the argument and ``GAUGEOPT_BACKEND`` (the argument wins)."""
    if backend not in BACKENDS:
        raise GaugeError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend != "auto":
        return backend, "argument"
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env in ("", "auto"):
        return "auto", "default"
    if env not in ("triton", "torch"):
        raise GaugeError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not one of ('triton', 'torch', 'auto'); unset it to let gaugeopt choose"
        )
    return env, "environment"


@functools.lru_cache(maxsize=None)
def triton_version() -> str | None:
    """The installed Triton's version, or ``None`` when it cannot be imported (checked once)."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", "unknown")


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def kernels_interpreted(module: str) -> bool:
    """Whether ``gaugeopt.kernels.<module>``'s kernels were decorated under the interpreter."""
    mod = importlib.import_module(f"gaugeopt.kernels.{module}")
    return any(type(v).__name__ == "InterpretedFunction" for v in vars(mod).values())


def _blocker(device: torch.device, module: str, unsupported: Callable[[], str | None] | None) -> str | None:
    """Why the Triton kernel of ``module`` cannot run on ``device`` (``None`` when it can)."""
    if triton_version() is None:
        return f"triton is not importable; {_INSTALL_HINT}"
    if device.type == "cpu":
        if not interpreter_requested():
            return ("the tensors are on cpu and TRITON_INTERPRET=1 is not set; move them to a CUDA device, or set "
                    "TRITON_INTERPRET=1 before gaugeopt.kernels' Triton modules are imported (tests)")
        if not kernels_interpreted(module):
            return (f"the tensors are on cpu and gaugeopt.kernels.{module} was imported before TRITON_INTERPRET=1 was "
                    "set, so its kernels are compiled for a GPU; set the variable before the first import (e.g. in a "
                    "fresh process)")
    elif device.type != "cuda":
        return f"the tensors are on {device.type}; the Triton kernels are written for CUDA (and CPU via the interpreter)"
    if unsupported is not None:
        return unsupported()
    return None


def choose(
    op: str,
    device: torch.device,
    *,
    backend: str = "auto",
    module: str | None = None,
    unsupported: Callable[[], str | None] | None = None,
) -> Decision:
    """Decide which implementation runs ``op`` on tensors of ``device``; records the decision.

    Args:
        op: operation name (for the record and the messages).
        device: where the inputs live.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (``"auto"`` defers to ``GAUGEOPT_BACKEND``).
        module: the kernel module under ``gaugeopt.kernels`` (``"gaugefix.fused"``) whose kernels would run.
        unsupported: called only when Triton could run: the op's reason to refuse these inputs, or ``None``.

    Raises:
        GaugeError: Triton was forced and cannot run (the message says why and what to do).
    """
    want, source = requested_backend(backend)
    if want == "torch":
        d = Decision(op, "torch", want, source, f"the torch reference was requested ({source})")
    elif want == "auto" and device.type != "cuda":
        d = Decision(op, "torch", want, source, f"tensors on {device.type}: the Triton kernels run on CUDA tensors "
                     "(on CPU only when forced, through TRITON_INTERPRET=1)")
    else:
        why = _blocker(device, module or "", unsupported)
        if why is None:
            how = "forced" if want == "triton" else f"CUDA tensors and triton {triton_version()}"
            d = Decision(op, "triton", want, source, how if device.type == "cuda" else "forced, through the Triton interpreter")
        elif want == "triton":
            where = "backend='triton'" if source == "argument" else f"{ENV_VAR}=triton"
            raise GaugeError(f"{op}: {where} but the Triton kernel cannot run: {why}. "
                             f"Pass backend='torch' (or unset {ENV_VAR}) to use the torch reference")
        else:
            d = Decision(op, "torch", want, source, why)
    _LAST[op] = d
    return d


def remember(decision: Decision) -> None:
    """Record again a decision taken earlier and reused (a caller that caches its decisions), so that
    :func:`last_decision` names the path that ran."""
    _LAST[decision.op] = decision


def last_decision(op: str) -> Decision | None:
    """The most recent decision for ``op`` (``None`` before the first call)."""
    return _LAST.get(op)


def explain(op: str | None = None) -> str:
    """The last decision of ``op`` (or of every operation), one line each."""
    items = [_LAST[op]] if op is not None and op in _LAST else ([] if op is not None else list(_LAST.values()))
    if not items:
        return f"no dispatch decision yet{'' if op is None else f' for {op!r}'}"
    return "\n".join(str(d) for d in items)
